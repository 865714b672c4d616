// AVX2/FMA/F16C kernels: the quantized matmul (its row loop in kernel_rows.h), the int8-activation one on packed
// weights, dequantization, softmax, attention, SwiGLU and the nucleus passes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel.h"
#include "kernel_rows.h"

namespace mlxchat {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row of per-group scales or biases as fp32.
void load_params(ScaleType type, const void* base, size_t offset, int count, float* out) {
  if (type == ScaleType::f32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, count * sizeof(float));
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
  int i = 0;
  if (type == ScaleType::f16) {
    for (; i + 8 <= count; i += 8) {
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    }
    for (; i < count; ++i) out[i] = _cvtsh_ss(p[i]);
  } else {
    for (; i < count; ++i) {
      uint32_t bits = uint32_t(p[i]) << 16;
      std::memcpy(out + i, &bits, sizeof(float));
    }
  }
}

// 32 weights of one block as four vectors of 8 floats. 4 bits: 16 bytes, low nibbles hold the even indices and high
// nibbles the odd ones, so the vectors come out as k = {0,2..14}, {16..30}, {1..15}, {17..31} (x is reordered to
// match once per call); with G16, {0,2..14}, {1..15}, {16..30}, {17..31} (the first group's in the first two).
// 5 and 6 bits: MLX's bit stream, unpacked with a shuffle and per-lane shifts (kernel_rows.h), in natural order.
// 8 bits: 32 bytes in natural order.
template <int BITS, bool G16 = false>
inline void expand_block(const uint8_t* p, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  if constexpr (BITS == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    const __m256 d = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
    w0 = a, w1 = G16 ? c : b, w2 = G16 ? b : c, w3 = d;
  } else if constexpr (BITS == 8) {
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
    w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16))));
    w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 24))));
  } else {
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * BITS - 16)));
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    auto eight = [&](auto v) {  // codes 8v .. 8v + 7
      constexpr int first = 8 * decltype(v)::value;
      constexpr bool from_hi = reads_hi<BITS>(first, 8);
      static constexpr Shuffle<BITS, 4> shuffle(first, from_hi ? 4 * BITS - 16 : 0);
      const __m256i pairs = _mm256_shuffle_epi8(from_hi ? hi : lo,
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(shuffle.control)));
      const __m256i shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(shuffle.shifts));
      return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(pairs, shifts), mask));
    };
    w0 = eight(std::integral_constant<int, 0>{});
    w1 = eight(std::integral_constant<int, 1>{});
    w2 = eight(std::integral_constant<int, 2>{});
    w3 = eight(std::integral_constant<int, 3>{});
  }
}

// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, 2^n built in the
// exponent bits); about 1 ulp over the range softmax and silu use. MLX's own CPU exp is scalar on x86 (~16 ns per
// element here), which made attention's softmax and the MLP's silu most of a long prompt's prefill.
inline __m256 exp256(__m256 x) {
  // Below this, 2^n leaves the normal range: the result is 0 (as it all but is), not a denormal near 2^-126.
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447504019f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504019f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Lanes [0, count) of an 8-float tail, as a mask for maskload/maskstore.
inline __m256i tail_mask(int count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

void softmax_row(const float* x, float* out, int S, int valid, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int j = 0;
  for (; j + 8 <= valid; j += 8) mv = _mm256_max_ps(mv, _mm256_mul_ps(_mm256_loadu_ps(x + j), sv));
  float m = hmax(mv);
  for (; j < valid; ++j) m = std::max(m, x[j] * scale);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= valid; j += 8) {
    const __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), sv, mb));
    _mm256_storeu_ps(out + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < valid) {
    const __m256i tm = tail_mask(valid - j);
    const __m256 e = _mm256_and_ps(exp256(_mm256_fmsub_ps(_mm256_maskload_ps(x + j, tm), sv, mb)),
                                   _mm256_castsi256_ps(tm));
    _mm256_maskstore_ps(out + j, tm, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  j = 0;
  for (; j + 8 <= valid; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), inv));
  for (; j < valid; ++j) out[j] *= _mm256_cvtss_f32(inv);
  for (j = std::max(valid, 0); j < S; ++j) out[j] = 0.0f;
}

float dot(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  for (; d + 8 <= n; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// y += w * x over n floats.
void axpy(float w, const float* x, float* y, int n) {
  const __m256 wv = _mm256_set1_ps(w);
  int d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < n; ++d) y[d] += w * x[d];
}

// The row loop's vector operations on 8 floats (kernel_rows.h).
struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8, kParts = 4, kMaxTile = 4;  // 4 rows: t, acc and the block fill 12 of 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) { return hsum(v); }
  template <int BITS, bool G16>
  static void expand(const uint8_t* p, V (&w)[kParts]) { expand_block<BITS, G16>(p, w[0], w[1], w[2], w[3]); }
  template <ScaleType ST>
  static V params(const void* base, size_t i) {
    if constexpr (ST == ScaleType::f32) {
      return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (ST == ScaleType::f16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
};

// The int8-activation matmul on packed weights (kernel.h) for CPUs without VNNI: VPMADDUBSW + VPMADDWD do what one
// VPDPBUSD does, on 8 rows at a time (each 16-row tile in two halves). Codes are split in nibbles so that no pair of
// products can saturate VPMADDUBSW's int16 (2 * 15 * 127 < 32767; a whole 8-bit code would not fit).
inline __m256i dot4(__m256i acc, __m256i w, const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(v));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// 5 and 6 bits: the packed layout's plane of high bits (kernel.h) for 8 rows (one half of a 16-row run), placed
// at bits 4 (and 5) of each byte of k-step u, the rest 0: ORed into the low nibbles, the whole codes.
template <int BITS>
inline __m256i high_bits(const uint8_t* plane, int u) {
  const int at = BITS == 5 ? u : 2 * (u % 4);  // where step u's bits are in its plane's bytes
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + (BITS == 6 ? 64 * (u / 4) : 0)));
  const __m256i placed = at <= 4 ? _mm256_slli_epi16(h, 4 - at) : _mm256_srli_epi16(h, at - 4);
  return _mm256_and_si256(placed, _mm256_set1_epi8(BITS == 5 ? 0x10 : 0x30));
}

// Integer sums per half block (k 0..15 and 16..31) where groups are 16, else per block: exact, so any order gives
// the same result. Whole 4-6-bit codes fit VPMADDUBSW (2 * 63 * 127 < 32767); 8-bit ones go in nibbles.
template <int BITS, int MT, ScaleType ST, bool G16>
void packed_tile(const PackedMatmulArgs& a, int t0, int t1, int m0) {
  const int K = a.K, G = K / a.group_size, blocks_per_group = G16 ? 1 : a.group_size / 32;
  constexpr int block_bytes = kPackedTile * 32 * BITS / 8, H = G16 ? 2 : 1;
  const size_t tile_bytes = size_t(K / 32) * block_bytes;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int steps = G16 ? K / 32 : G;  // blocks (each two groups), or groups
  for (int t = t0; t < t1; ++t) {
    for (int half = 0; half < 2; ++half) {  // rows 0-7 of the tile are the first 32 bytes of each run of 64
      const uint8_t* wt = a.w + size_t(t) * tile_bytes + 32 * half;
      __m256 out[MT];
      for (int i = 0; i < MT; ++i) out[i] = _mm256_setzero_ps();
      for (int g = 0; g < steps; ++g) {
        __m256 group[MT][H];
        for (int b = 0; b < blocks_per_group; ++b) {
          const int blk = g * blocks_per_group + b;
          const uint8_t* wb = wt + size_t(blk) * block_bytes;
          __m256i lo[MT][H], hi[MT][H];  // hi: 8-bit codes' high nibbles
          for (int i = 0; i < MT; ++i) {
            for (int h = 0; h < H; ++h) lo[i][h] = hi[i][h] = _mm256_setzero_si256();
          }
          for (int u = 0; u < 8; ++u) {  // k-step u: k = 4u .. 4u + 3 of the 8 rows
            const int h = G16 ? u / 4 : 0;
            __m256i codes, high_nibbles = _mm256_setzero_si256();
            if constexpr (BITS == 8) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * u));
              codes = _mm256_and_si256(v, nibble);
              high_nibbles = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            } else {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * (u % 4)));
              codes = _mm256_and_si256(u < 4 ? v : _mm256_srli_epi16(v, 4), nibble);
              if constexpr (BITS != 4) codes = _mm256_or_si256(codes, high_bits<BITS>(wb + 256, u));
            }
            for (int i = 0; i < MT; ++i) {
              const int8_t* xp = a.xq + size_t(m0 + i) * K + size_t(blk) * 32 + 4 * u;
              lo[i][h] = dot4(lo[i][h], codes, xp);
              if constexpr (BITS == 8) hi[i][h] = dot4(hi[i][h], high_nibbles, xp);
            }
          }
          for (int i = 0; i < MT; ++i) {
            const __m256 d = _mm256_set1_ps(a.xd[size_t(m0 + i) * (K / 32) + blk]);
            for (int h = 0; h < H; ++h) {
              const __m256i sum = BITS == 8 ? _mm256_add_epi32(lo[i][h], _mm256_slli_epi32(hi[i][h], 4)) : lo[i][h];
              const __m256 f = _mm256_cvtepi32_ps(sum);
              group[i][h] = b == 0 ? _mm256_mul_ps(f, d) : _mm256_fmadd_ps(f, d, group[i][h]);
            }
          }
        }
        for (int h = 0; h < H; ++h) {
          const int gg = H * g + h;  // the group
          const size_t p = packed_param(G, t * kPackedTile + 8 * half, gg);
          const __m256 sv = Avx2::params<ST>(a.scales, p), bv = Avx2::params<ST>(a.biases, p);
          for (int i = 0; i < MT; ++i) {
            out[i] = _mm256_fmadd_ps(group[i][h], sv, out[i]);
            out[i] = _mm256_fmadd_ps(bv, _mm256_set1_ps(a.xsum[size_t(m0 + i) * G + gg]), out[i]);
          }
        }
      }
      for (int i = 0; i < MT; ++i) {
        _mm256_storeu_ps(a.y + size_t(m0 + i) * a.N + size_t(t) * kPackedTile + 8 * half, out[i]);
      }
    }
  }
}

template <int BITS, ScaleType ST, bool G16>
void packed_rows(const PackedMatmulArgs& a, int t0, int t1) {
  constexpr int chunk = 2;  // tiles that stay in L1 while every pair of rows of x passes over them
  for (int c0 = t0; c0 < t1; c0 += chunk) {
    const int c1 = std::min(c0 + chunk, t1);
    int m = 0;
    for (; a.M - m >= 2; m += 2) packed_tile<BITS, 2, ST, G16>(a, c0, c1, m);
    if (m < a.M) packed_tile<BITS, 1, ST, G16>(a, c0, c1, m);
  }
}

template <int BITS>
void dequant(const DequantArgs& a, int n0, int n1) {
  thread_local std::vector<float> params;
  const int K = a.K, G = K / a.group_size;
  params.resize(2 * size_t(G));
  float* sc = params.data();
  float* bi = sc + G;
  const size_t row_bytes = size_t(K) * BITS / 8;
  constexpr int block_bytes = 32 * BITS / 8;
  for (int n = n0; n < n1; ++n) {
    load_params(a.scale_type, a.scales, size_t(n) * G, G, sc);
    load_params(a.scale_type, a.biases, size_t(n) * G, G, bi);
    const uint8_t* wr = a.w + size_t(n) * row_bytes;
    float* out = a.out + size_t(n) * K;
    for (int blk = 0; blk < K / 32; ++blk) {
      __m256 w[4];
      expand_block<BITS>(wr + size_t(blk) * block_bytes, w[0], w[1], w[2], w[3]);
      if constexpr (BITS == 4) {
        // Undo the even/odd split: interleave {0,2..14} with {1..15} and {16..30} with {17..31}.
        const __m256 e0 = w[0], e1 = w[1], o0 = w[2], o1 = w[3];
        w[0] = _mm256_permute2f128_ps(_mm256_unpacklo_ps(e0, o0), _mm256_unpackhi_ps(e0, o0), 0x20);
        w[1] = _mm256_permute2f128_ps(_mm256_unpacklo_ps(e0, o0), _mm256_unpackhi_ps(e0, o0), 0x31);
        w[2] = _mm256_permute2f128_ps(_mm256_unpacklo_ps(e1, o1), _mm256_unpackhi_ps(e1, o1), 0x20);
        w[3] = _mm256_permute2f128_ps(_mm256_unpacklo_ps(e1, o1), _mm256_unpackhi_ps(e1, o1), 0x31);
      }
      float* o = out + size_t(blk) * 32;
      for (int j = 0; j < 4; ++j) {
        // scale * q, then + bias: two roundings, as mx.dequantize (and gguf-py's reference) computes it, so the
        // weights equal theirs bit for bit (one FMA would differ in the last bit for float32 parameters).
        const int g = (32 * blk + 8 * j) / a.group_size;
        _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(w[j], _mm256_broadcast_ss(sc + g)),
                                                  _mm256_broadcast_ss(bi + g)));
      }
    }
  }
}

// Adds the 8 floats of v, widened to double, to two accumulators of 4 (lanes 0-3 to lo, 4-7 to hi).
inline void add_pd(__m256 v, __m256d& lo, __m256d& hi) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

inline double hsum_pd(__m256d lo, __m256d hi) {
  const __m256d v = _mm256_add_pd(lo, hi);
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

}  // namespace

void qmm_rows_avx2(const QMatmulArgs& a, int n0, int n1) {
  matmul_rows<Avx2>(a, n0, n1);
}

void qmm_packed_rows_avx2(const PackedMatmulArgs& a, int t0, int t1) {
  with_format(a.bits, a.scale_type, a.group_size == 16,
              [&](auto bits, auto st, auto g16) { packed_rows<bits(), st(), g16()>(a, t0, t1); });
}

void dequant_rows_avx2(const DequantArgs& a, int n0, int n1) {
  switch (a.bits) {
    case 4: dequant<4>(a, n0, n1); break;
    case 5: dequant<5>(a, n0, n1); break;
    case 6: dequant<6>(a, n0, n1); break;
    default: dequant<8>(a, n0, n1); break;
  }
}

void expand_compact_avx2(const uint8_t* c, int K, int group_size, bool packed, int u0, int u1, float* out) {
  const int S = K / 256, P = compact_groups(group_size), B = compact_bytes(group_size), G = S * P;
  // 8 multipliers times D (float(D) * q is exact: the parameter the compact form was made from).
  auto eight = [](const uint8_t* q, __m256 d, float* o) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d));
  };
  for (int u = u0; u < u1; ++u) {
    for (int s = 0; s < S; ++s) {
      if (!packed) {
        const uint8_t* sb = c + (size_t(u) * S + s) * B;
        uint16_t h;
        std::memcpy(&h, sb, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        for (int g = 0; g < P; g += 8) eight(sb + 2 + g, d, out + size_t(u - u0) * G + s * P + g);
      } else {
        const uint8_t* sb = c + (size_t(u) * S + s) * kPackedTile * B;  // 16 D's, then each group's 16 q's
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16)));
        for (int g = 0; g < P; ++g) {
          float* o = out + (size_t(u - u0) * G + s * P + g) * kPackedTile;
          eight(sb + 2 * kPackedTile + g * kPackedTile, d0, o);
          eight(sb + 2 * kPackedTile + g * kPackedTile + 8, d1, o + 8);
        }
      }
    }
  }
}

bool biases_symmetric_avx2(const uint16_t* scales, const uint16_t* biases, size_t count, int bits) {
  const __m256 factor = _mm256_set1_ps(symmetric_bias_factor(bits));
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + i)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(biases + i)));
    const __m256i same = _mm256_cmpeq_epi32(_mm256_castps_si256(b), _mm256_castps_si256(_mm256_mul_ps(s, factor)));
    if (_mm256_movemask_epi8(same) != -1) return false;
  }
  for (; i < count; ++i) {
    const float b = _cvtsh_ss(biases[i]), want = _cvtsh_ss(scales[i]) * symmetric_bias_factor(bits);
    if (std::memcmp(&b, &want, sizeof(float)) != 0) return false;
  }
  return true;
}

void expand_symmetric_avx2(const uint16_t* scales, size_t count, int bits, float* scales_out, float* biases_out) {
  const __m256 factor = _mm256_set1_ps(symmetric_bias_factor(bits));
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + i)));
    _mm256_storeu_ps(scales_out + i, s);
    _mm256_storeu_ps(biases_out + i, _mm256_mul_ps(s, factor));
  }
  for (; i < count; ++i) {
    scales_out[i] = _cvtsh_ss(scales[i]);
    biases_out[i] = scales_out[i] * symmetric_bias_factor(bits);
  }
}

void softmax_rows_avx2(const float* x, float* out, size_t rows, int S, int L, float scale, bool causal) {
  for (size_t r = 0; r < rows; ++r) {
    const int valid = causal ? std::min(S, S - L + int(r % size_t(L)) + 1) : S;
    softmax_row(x + r * S, out + r * S, S, valid, scale);
  }
}

void attention_avx2(const AttentionArgs& a) {
  const int rep = a.H / a.KVH, R = rep * a.L;  // the query rows that share one key/value head
  thread_local std::vector<float> scores;
  scores.resize(size_t(R) * a.S);
  for (int b = 0; b < a.B; ++b) {
    for (int g = 0; g < a.KVH; ++g) {
      const float* kb = a.k + b * a.k_stride[0] + g * a.k_stride[1];
      const float* vb = a.v + b * a.v_stride[0] + g * a.v_stride[1];
      auto query = [&](int r) { return a.q + b * a.q_stride[0] + (g * rep + r / a.L) * a.q_stride[1] + (r % a.L) * a.q_stride[2]; };
      auto output = [&](int r) { return a.out + ((size_t(b) * a.H + g * rep + r / a.L) * a.L + r % a.L) * a.D; };
      auto visible = [&](int r) { return a.causal ? a.S - a.L + r % a.L + 1 : a.S; };
      // Keys outermost, so each key row is read once for all the rows of its group.
      for (int j = 0; j < a.S; ++j) {
        const float* kr = kb + j * a.k_stride[2];
        for (int r = 0; r < R; ++r) {
          if (j < visible(r)) scores[size_t(r) * a.S + j] = dot(query(r), kr, a.D);
        }
      }
      for (int r = 0; r < R; ++r) {
        float* p = scores.data() + size_t(r) * a.S;
        softmax_row(p, p, a.S, visible(r), a.scale);
        std::fill(output(r), output(r) + a.D, 0.0f);
      }
      for (int j = 0; j < a.S; ++j) {
        const float* vr = vb + j * a.v_stride[2];
        for (int r = 0; r < R; ++r) {
          if (j < visible(r)) axpy(scores[size_t(r) * a.S + j], vr, output(r), a.D);
        }
      }
    }
  }
}

void swiglu_avx2(const float* gate, const float* up, float* out, size_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_div_ps(_mm256_mul_ps(g, _mm256_loadu_ps(up + i)), _mm256_add_ps(one, e)));
  }
  if (i < n) {
    const __m256i tm = tail_mask(int(n - i));
    const __m256 g = _mm256_maskload_ps(gate + i, tm);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_maskstore_ps(out + i, tm,
                        _mm256_div_ps(_mm256_mul_ps(g, _mm256_maskload_ps(up + i, tm)), _mm256_add_ps(one, e)));
  }
}

ExpRow exp_row_avx2(const float* x, float* e, size_t n, bool weighted) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  const __m256 neg_inf = _mm256_set1_ps(-inf), pos_inf = _mm256_set1_ps(inf);
  __m256 mx_v = neg_inf, mn_v = pos_inf;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx_v = _mm256_max_ps(mx_v, v);
    mn_v = _mm256_min_ps(mn_v, _mm256_blendv_ps(pos_inf, v, _mm256_cmp_ps(v, neg_inf, _CMP_GT_OQ)));
  }
  float m = hmax(mx_v), lo = -hmax(_mm256_sub_ps(_mm256_setzero_ps(), mn_v));
  for (; i < n; ++i) {
    m = std::max(m, x[i]);
    if (x[i] > -inf) lo = std::min(lo, x[i]);
  }
  ExpRow r{m, lo, 0.0, 0.0};
  if (!(m > -inf)) {  // nothing finite: no mass
    std::fill(e, e + n, 0.0f);
    return r;
  }
  const __m256 mb = _mm256_set1_ps(m), zero = _mm256_setzero_ps();
  __m256d s_lo = _mm256_setzero_pd(), s_hi = s_lo, w_lo = s_lo, w_hi = s_lo;
  // One block of 8: e, and (when asked) e * (x - max) where e > 0 (a -inf entry's 0 * -inf would be NaN).
  auto block = [&](__m256 xv, __m256 lanes) {
    const __m256 s = _mm256_sub_ps(xv, mb);
    const __m256 ev = _mm256_and_ps(exp256(s), lanes);
    add_pd(ev, s_lo, s_hi);
    if (weighted) add_pd(_mm256_and_ps(_mm256_mul_ps(ev, s), _mm256_cmp_ps(ev, zero, _CMP_GT_OQ)), w_lo, w_hi);
    return ev;
  };
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(e + i, block(_mm256_loadu_ps(x + i), all));
  if (i < n) {
    const __m256i tm = tail_mask(int(n - i));
    _mm256_maskstore_ps(e + i, tm, block(_mm256_maskload_ps(x + i, tm), _mm256_castsi256_ps(tm)));
  }
  r.sum = hsum_pd(s_lo, s_hi);
  r.weighted = hsum_pd(w_lo, w_hi);
  return r;
}

void bucket_row_avx2(const float* x, size_t n, bool typical, double center, double scale, int buckets,
                     uint16_t* bucket) {
  const __m256d c = _mm256_set1_pd(center), sv = _mm256_set1_pd(scale), sign = _mm256_set1_pd(-0.0);
  const __m128i top = _mm_set1_epi32(buckets - 1), none = _mm_set1_epi32(buckets);
  const __m128 neg_inf = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 xv = _mm_loadu_ps(x + i);
    const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(xv), c);
    const __m256d key = typical ? _mm256_andnot_pd(sign, d) : _mm256_xor_pd(sign, d);
    __m128i b = _mm_min_epi32(_mm256_cvttpd_epi32(_mm256_mul_pd(key, sv)), top);
    b = _mm_blendv_epi8(none, b, _mm_castps_si128(_mm_cmpgt_ps(xv, neg_inf)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(bucket + i), _mm_packus_epi32(b, b));
  }
  for (; i < n; ++i) {
    const double d = double(x[i]) - center, key = typical ? std::abs(d) : -d;
    bucket[i] = x[i] > -std::numeric_limits<float>::infinity()
                    ? uint16_t(std::min<int64_t>(buckets - 1, int64_t(key * scale))) : uint16_t(buckets);
  }
}

void keep_below_avx2(const float* x, const uint16_t* bucket, int b, float* out, size_t n) {
  const __m256i bv = _mm256_set1_epi32(b);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bucket + i)));
    const __m256 below = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bv, bi));
    _mm256_storeu_ps(out + i, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(x + i), below));
  }
  for (; i < n; ++i) out[i] = bucket[i] < b ? x[i] : -std::numeric_limits<float>::infinity();
}

}  // namespace mlxchat
