// The packed matmul with AVX-512 VNNI: the 4/8-bit weights repacked so that one VPDPBUSD multiplies 4 weights of 16
// output rows by the same 4 bytes of x, and x as integers per block of 32: one byte a value (int8, the opt-in
// weights="native-int8") or three (fixed24, the native path's default: fp32's precision, see kernel.h).
//
// Why the repacking: with MLX's row-major layout each 32-weight block of each output row ends in its own integer
// sum that has to be converted and scaled (as many instructions per row as the fp32 kernel's FMAs, measured no
// faster). Across 16 rows, one conversion and one scale serve 16 outputs, and a block costs each row of x 8
// VPDPBUSD a digit + a few float ops for 512 weights, against 32 FMAs (and 32 conversions) in fp32. llama.cpp's
// "repack" CPU kernels do the same.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef MLXCHAT_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernel.h"
#include "kernel_rows.h"

namespace mlxchat {
namespace {

inline __m512i x4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A tile's 16 parameters (scales or biases) of group gg. Compact ones (kernel.h) are read as they lie, float(D) * q
// for the super-block's D and the group's multipliers: exact, so the float32 values they were made from, with a
// third of their bytes (a decode step at one row of x moves its weights at the core's bandwidth, and expanding
// them to float32 before each piece cost Q4_K 0.34 ms for a 5632 x 2048 matrix against 0.26 read this way).
template <ScaleType ST>
inline __m512 tile_params(const void* base, int G, int group_size, int t, int gg) {
  if constexpr (ST == ScaleType::symmetric) {
    return params16<ScaleType::f16>(base, packed_param(G, t * kPackedTile, gg));
  } else if constexpr (ST == ScaleType::compact) {
    const int P = compact_groups(group_size);
    const uint8_t* sb = static_cast<const uint8_t*>(base) + (size_t(t) * (G / P) + gg / P) * kPackedTile * (2 + P);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 2 * kPackedTile + kPackedTile * (gg % P)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
  } else {
    return params16<ST>(base, packed_param(G, t * kPackedTile, gg));
  }
}

// And a tile's 16 biases of group gg, given its scales sv (a symmetric format's are -2^(BITS - 1) sv, exact).
template <int BITS, ScaleType ST>
inline __m512 tile_biases(const void* base, int G, int group_size, int t, int gg, __m512 sv) {
  if constexpr (ST == ScaleType::symmetric) {
    return _mm512_mul_ps(sv, _mm512_set1_ps(symmetric_bias_factor(BITS)));
  } else {
    return tile_params<ST>(base, G, group_size, t, gg);
  }
}

// with_format, and compact and symmetric parameters (which only the packed kernels read as they lie).
template <typename F>
void with_packed_format(const PackedMatmulArgs& a, F&& fn) {
  if (a.scale_type == ScaleType::compact || a.scale_type == ScaleType::symmetric) {
    with_format(a.bits, ScaleType::f32, a.group_size == 16, [&](auto bits, auto, auto g16) {
      if (a.scale_type == ScaleType::compact) {
        fn(bits, std::integral_constant<ScaleType, ScaleType::compact>{}, g16);
      } else {
        fn(bits, std::integral_constant<ScaleType, ScaleType::symmetric>{}, g16);
      }
    });
  } else {
    with_format(a.bits, a.scale_type, a.group_size == 16, fn);
  }
}

// 5 and 6 bits: the packed layout's plane of high bits (kernel.h) placed at bits 4 (and 5) of each byte of k-step u,
// the rest 0. `plane`: the block's high-bit plane (its byte 256).
template <int BITS>
inline __m512i high_bits(const uint8_t* plane, int u) {
  const int at = BITS == 5 ? u : 2 * (u % 4);  // where step u's bits are in its plane's bytes
  const __m512i h = _mm512_loadu_si512(plane + (BITS == 6 ? 64 * (u / 4) : 0));
  return at <= 4 ? _mm512_slli_epi16(h, 4 - at) : _mm512_srli_epi16(h, at - 4);
}

// The codes of k-steps s and s + 4 (s < 4) of a block's 16 rows, one byte each (4 k of each row, row-major).
template <int BITS>
inline void step_codes(const uint8_t* wb, int s, __m512i& wl, __m512i& wh) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if constexpr (BITS == 8) {
    wl = _mm512_loadu_si512(wb + 64 * s);
    wh = _mm512_loadu_si512(wb + 256 + 64 * s);
  } else {
    // 64 bytes hold k-step s (4 k of 16 rows) in the low nibbles and k-step s + 4 in the high ones.
    const __m512i v = _mm512_loadu_si512(wb + 64 * s);
    wl = _mm512_and_si512(v, nibble);
    wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if constexpr (BITS != 4) {
      // codes | (high bits & mask) in one ternary-logic op each (0xF8: A | (B & C)).
      const __m512i mask = _mm512_set1_epi8(BITS == 5 ? 0x10 : 0x30);
      wl = _mm512_ternarylogic_epi32(wl, high_bits<BITS>(wb + 256, s), mask, 0xF8);
      wh = _mm512_ternarylogic_epi32(wh, high_bits<BITS>(wb + 256, s + 4), mask, 0xF8);
    }
  }
}

// Tiles [t0, t1) of 16 output rows for MT rows of x from m0, x in DIGITS bytes a value. Each row of x is summed the
// same way whatever the tile it is in (integer sums are exact; the float steps are per row), so a verify pass's rows
// equal single steps. G16 (groups of 16): the block's two halves (its lo and hi sums) are two groups.
template <int BITS, int MT, ScaleType ST, int DIGITS, bool G16>
void packed_tile(const PackedMatmulArgs& a, int t0, int t1, int m0) {
  const int K = a.K, G = K / a.group_size, blocks_per_group = G16 ? 1 : a.group_size / 32;
  constexpr int block_bytes = kPackedTile * 32 * BITS / 8, H = G16 ? 2 : 1;
  const size_t tile_bytes = size_t(K / 32) * block_bytes;
  const int steps = G16 ? K / 32 : G;  // blocks (each two groups), or groups
  const int8_t* xr[MT];
  const float* xd[MT];
  const float* xs[MT];
  for (int i = 0; i < MT; ++i) {
    xr[i] = a.xq + size_t(m0 + i) * K * DIGITS;
    xd[i] = a.xd + size_t(m0 + i) * (K / 32);
    xs[i] = a.xsum + size_t(m0 + i) * G;
  }
  for (int t = t0; t < t1; ++t) {
    const uint8_t* wt = a.w + size_t(t) * tile_bytes;
    __m512 out[MT];
    for (int i = 0; i < MT; ++i) out[i] = _mm512_setzero_ps();
    for (int g = 0; g < steps; ++g) {
      __m512 group[MT][H];
      for (int b = 0; b < blocks_per_group; ++b) {
        const int blk = g * blocks_per_group + b;
        const uint8_t* wb = wt + size_t(blk) * block_bytes;
        // Two accumulators a row and digit (the first and second half of the block's k): half the dependency chain.
        __m512i lo[MT][DIGITS], hi[MT][DIGITS];
        for (int i = 0; i < MT; ++i) {
          for (int d = 0; d < DIGITS; ++d) lo[i][d] = hi[i][d] = _mm512_setzero_si512();
        }
        for (int s = 0; s < 4; ++s) {
          // k-step s: 4 k of the 16 rows (wl) and the 4 k 16 further on (wh), against those k of each digit of x.
          for (int line = 0; line < (block_bytes + 255) / 256; ++line) {  // 4 blocks ahead
            _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * block_bytes + 256 * line + 64 * s), _MM_HINT_T0);
          }
          __m512i wl, wh;
          step_codes<BITS>(wb, s, wl, wh);
          for (int i = 0; i < MT; ++i) {
            const int8_t* xp = xr[i] + size_t(blk) * 32 * DIGITS;
            for (int d = 0; d < DIGITS; ++d) {
              lo[i][d] = _mm512_dpbusd_epi32(lo[i][d], wl, x4(xp + 32 * d + 4 * s));
              hi[i][d] = _mm512_dpbusd_epi32(hi[i][d], wh, x4(xp + 32 * d + 16 + 4 * s));
            }
          }
        }
        // The block's integer sums as floats: one (lo + hi), or one per half block for groups of 16.
        auto to_float = [&](const __m512i (&sum)[DIGITS]) {
          if constexpr (DIGITS == 1) {
            return _mm512_cvtepi32_ps(sum[0]);
          } else {
            // d0 + 256 d1 is exact in int32 (|sum| < 2^28) and in the float when below 2^24; 65536 * d2's sum is
            // exact; the one FMA rounds once, as the fp32 kernel's own sums do.
            const __m512i low = _mm512_add_epi32(sum[0], _mm512_slli_epi32(sum[1], 8));
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[2]), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(low));
          }
        };
        for (int i = 0; i < MT; ++i) {
          __m512 f[H];
          if constexpr (G16) {
            f[0] = to_float(lo[i]);
            f[1] = to_float(hi[i]);
          } else {
            __m512i both[DIGITS];
            for (int d = 0; d < DIGITS; ++d) both[d] = _mm512_add_epi32(lo[i][d], hi[i][d]);
            f[0] = to_float(both);
          }
          const __m512 d = _mm512_set1_ps(xd[i][blk]);
          for (int h = 0; h < H; ++h) {
            group[i][h] = b == 0 ? _mm512_mul_ps(f[h], d) : _mm512_fmadd_ps(f[h], d, group[i][h]);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const int gg = H * g + h;  // the group
        const __m512 sv = tile_params<ST>(a.scales, G, a.group_size, t, gg);
        const __m512 bv = tile_biases<BITS, ST>(a.biases, G, a.group_size, t, gg, sv);
        for (int i = 0; i < MT; ++i) {
          out[i] = _mm512_fmadd_ps(group[i][h], sv, out[i]);
          out[i] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xs[i][gg]), out[i]);
        }
      }
    }
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(a.y + size_t(m0 + i) * a.N + size_t(t) * kPackedTile, out[i]);
  }
}

// Rows of x a tile: 2 * DIGITS + 2 registers a row (the digits' two sums, the group's and the output's) besides the
// weights, of 32.
template <int DIGITS>
constexpr int kMaxTile = DIGITS == 1 ? 6 : 3;

template <int BITS, ScaleType ST, int DIGITS, bool G16>
void packed_rows(const PackedMatmulArgs& a, int t0, int t1) {
  // Tiles of weights outermost in chunks that stay in L1 (a 16-row tile is 16 * K * bits / 8 bytes: 4.6 KB at K=576,
  // 4 bits) while every group of rows of x passes over them: a long prompt reads the weights once.
  constexpr int chunk = 2, most = kMaxTile<DIGITS>;
  for (int c0 = t0; c0 < t1; c0 += chunk) {
    const int c1 = c0 + chunk < t1 ? c0 + chunk : t1;
    int m = 0;
    for (; a.M - m >= most; m += most) packed_tile<BITS, most, ST, DIGITS, G16>(a, c0, c1, m);
    switch (a.M - m) {
      case 5: if constexpr (most > 5) packed_tile<BITS, 5, ST, DIGITS, G16>(a, c0, c1, m); break;
      case 4: if constexpr (most > 4) packed_tile<BITS, 4, ST, DIGITS, G16>(a, c0, c1, m); break;
      case 3: if constexpr (most > 3) packed_tile<BITS, 3, ST, DIGITS, G16>(a, c0, c1, m); break;
      case 2: packed_tile<BITS, 2, ST, DIGITS, G16>(a, c0, c1, m); break;
      case 1: packed_tile<BITS, 1, ST, DIGITS, G16>(a, c0, c1, m); break;
      default: break;
    }
  }
}

// scale * q, then + bias (two roundings, as mx.dequantize and the fp32 dequantize compute it) for 16 rows' codes of
// 4 k, stored to each row's 4 places k0 .. k0 + 3. `codes`: 64 bytes, 4 consecutive k of each of the 16 rows
// (row-major); sv/bv: the rows' parameters.
inline void dequant_step(__m512i codes, __m512 sv, __m512 bv, float* out, size_t K, int k0) {
  alignas(64) uint8_t bytes[64];
  _mm512_store_si512(bytes, codes);
  for (int q = 0; q < 4; ++q) {  // rows 4q .. 4q + 3: 16 codes, each row's parameters in its 4 lanes
    const __m512i rows = _mm512_add_epi32(_mm512_set1_epi32(4 * q),
                                          _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
    const __m128i part = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * q));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part)),
                                                 _mm512_permutexvar_ps(rows, sv)),
                                   _mm512_permutexvar_ps(rows, bv));
    float* o = out + size_t(4 * q) * K + k0;
    _mm_storeu_ps(o, _mm512_castps512_ps128(v));
    _mm_storeu_ps(o + K, _mm512_extractf32x4_ps(v, 1));
    _mm_storeu_ps(o + 2 * K, _mm512_extractf32x4_ps(v, 2));
    _mm_storeu_ps(o + 3 * K, _mm512_extractf32x4_ps(v, 3));
  }
}

// fn(t, codes, k0, sv, bv) for every k-step of tiles [t0, t1): `codes` 4 k (k0 .. k0 + 3) of each of tile t's 16
// rows, one dword a row (step_codes), and those rows' scales and biases for k0's group, as fp32 lanes.
template <int BITS, ScaleType ST, typename F>
inline void each_step(const DequantArgs& a, int t0, int t1, F&& fn) {
  const int K = a.K, G = K / a.group_size;
  constexpr int block_bytes = kPackedTile * 32 * BITS / 8;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* wt = a.w + size_t(t) * (K / 32) * block_bytes;
    for (int blk = 0; blk < K / 32; ++blk) {
      const uint8_t* wb = wt + size_t(blk) * block_bytes;
      for (int s = 0; s < 4; ++s) {
        __m512i wl, wh;
        step_codes<BITS>(wb, s, wl, wh);
        // k-steps s and s + 4: k 32 blk + 4 s and 16 further on, each in its own group where groups are 16.
        for (const auto& [codes, k0] : {std::pair{wl, 32 * blk + 4 * s}, std::pair{wh, 32 * blk + 16 + 4 * s}}) {
          const size_t p = packed_param(G, t * kPackedTile, k0 / a.group_size);
          fn(t, codes, k0, params16<ST>(a.scales, p), params16<ST>(a.biases, p));
        }
      }
    }
  }
}

template <int BITS, ScaleType ST>
void dequant_packed(const DequantArgs& a, int t0, int t1) {
  each_step<BITS, ST>(a, t0, t1, [&](int t, __m512i codes, int k0, __m512 sv, __m512 bv) {
    dequant_step(codes, sv, bv, a.out + size_t(t) * kPackedTile * a.K, a.K, k0);
  });
}

// Tiles [t0, t1) dequantized into the transposed weight: wt[k][16 (t - t0) + j] for row 16 t + j (ld floats a k).
// A k-step's 64 bytes are 4 k of each of the 16 rows, one dword a row: byte kk of every dword is column k0 + kk of
// the 16 rows, in the lanes their parameters are in, so each k is one shift, mask, conversion, multiply, add and a
// 64-byte store (against dequant_step's shuffles and 16-byte stores to 4 rows).
template <int BITS, ScaleType ST>
void dequant_packed_t(const DequantArgs& a, int t0, int t1, float* wt, size_t ld) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  each_step<BITS, ST>(a, t0, t1, [&](int t, __m512i codes, int k0, __m512 sv, __m512 bv) {
    float* col = wt + size_t(t - t0) * kPackedTile;
    for (int kk = 0; kk < 4; ++kk) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * kk), byte));
      // scale * q, then + bias: dequantize's two roundings (the same fp32 weight)
      _mm512_storeu_ps(col + size_t(k0 + kk) * ld, _mm512_add_ps(_mm512_mul_ps(q, sv), bv));
    }
  });
}

}  // namespace

namespace {

// The largest integer a fixed24 block holds: three signed bytes m = d0 + 256 d1 + 65536 d2, d0 and d1 balanced
// remainders in [-128, 127], reach 127 * 65536 + 127 * 256 + 127 at most (the top digit would be 128 above it).
constexpr double kFixed24Max = 127.0 * 65536 + 127 * 256 + 127;

// e of 2^e for a block whose max |x| is amax (finite, not 0).
int fixed24_exponent(float amax) {
  int e2;
  std::frexp(amax, &e2);  // amax = f * 2^e2, f in [0.5, 1)
  const int e = e2 - 23;
  return std::ldexp(double(amax), -e) > kFixed24Max ? e + 1 : e;
}

}  // namespace

float fixed24_block_vnni(const float* xb, int8_t* q, int64_t (&half_sums)[2], bool nibbles) {
  half_sums[0] = half_sums[1] = 0;
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
  if (nan || !std::isfinite(amax) || amax == 0.0f) {
    std::memset(q, 0, nibbles ? 128 : 96);
    return amax == 0.0f && !nan ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const int e = fixed24_exponent(amax);
  // m = round(x / 2^e), ties to even as nearbyint: x * 2^-e is exact in float (|m| < 2^23, and a value that would
  // be subnormal rounds to 0 either way), so this is a product in double rounded, bit for bit.
  const __m512 scale = _mm512_set1_ps(float(-e));
  const __m512i bias = _mm512_set1_epi32(128), low = _mm512_set1_epi32(255);
  for (int h = 0; h < 2; ++h) {
    const __m512i m = _mm512_cvt_roundps_epi32(_mm512_scalef_ps(h == 0 ? x0 : x1, scale),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (nibbles) {
      // m = e0 + 16 (e1 + 256 r2), r2 = e2 + 16 e3: e0 = m mod 16 and e2 = r2 mod 16 in [0, 15], e1 balanced in
      // [-128, 127], e3 the floor of r2 / 16 (|r2| <= 2041 since |m| <= kFixed24Max: within [-128, 127]).
      const __m512i nib = _mm512_set1_epi32(15);
      const __m512i e0 = _mm512_and_si512(m, nib), r = _mm512_srai_epi32(m, 4);
      const __m512i e1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, bias), low), bias);
      const __m512i r2 = _mm512_srai_epi32(_mm512_sub_epi32(r, e1), 8);
      const __m512i e2 = _mm512_and_si512(r2, nib), e3 = _mm512_srai_epi32(r2, 4);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(e0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 + 16 * h), _mm512_cvtepi32_epi8(e1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 64 + 16 * h), _mm512_cvtepi32_epi8(e2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 96 + 16 * h), _mm512_cvtepi32_epi8(e3));
      half_sums[h] = _mm512_reduce_add_epi32(m);
      continue;
    }
    // Balanced base-256 digits: d0, d1 in [-128, 127], then the rest (arithmetic shifts, as the reference).
    const __m512i d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(m, bias), low), bias);
    const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(m, d0), 8);
    const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, bias), low), bias);
    const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(r, d1), 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(d0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 + 16 * h), _mm512_cvtepi32_epi8(d1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 64 + 16 * h), _mm512_cvtepi32_epi8(d2));
    half_sums[h] = _mm512_reduce_add_epi32(m);  // |m| <= 2^23, 16 of them: exact in int32
  }
  return float(std::ldexp(1.0, e));
}

void dequant_packed_t_vnni(const DequantArgs& a, int t0, int t1, float* wt, size_t ld) {
  with_format(a.bits, a.scale_type, false,
              [&](auto bits, auto st, auto) { dequant_packed_t<bits(), st()>(a, t0, t1, wt, ld); });
}

void dequant_packed_vnni(const DequantArgs& a, int t0, int t1) {
  with_format(a.bits, a.scale_type, false, [&](auto bits, auto st, auto) { dequant_packed<bits(), st()>(a, t0, t1); });
}

void qmm_packed_rows_vnni(const PackedMatmulArgs& a, int t0, int t1) {
  with_packed_format(a, [&](auto bits, auto st, auto g16) {
    if (a.xform == XForm::int8) {
      packed_rows<bits(), st(), 1, g16()>(a, t0, t1);
    } else {
      packed_rows<bits(), st(), 3, g16()>(a, t0, t1);
    }
  });
}

#ifdef MLXCHAT_AMX
// ---- AMX: the packed matmul for many rows of x (prompts) ----------------------------------------------------------
// A k-step of the packed layout (4 k of 16 output rows, one dword a row) is exactly a row of an AMX B tile, so a
// block's 8 k-steps (its codes made whole by step_codes) are the B tile of 32 k, and the rows of x's digits (32 bytes
// a block, a row of x every K * DIGITS bytes) are an A tile as they lie. One TDPBSUD (signed x bytes times unsigned
// codes) then makes the integer sums of 16 rows of x by 16 output rows over a block, which the VNNI kernel makes
// with 16 rows * 8 VPDPBUSD a digit. The sums are the same integers, and the float steps after them (to_float, the
// block scale, the group scale and bias term) are packed_tile's, in its order: every row's result is bit for bit the
// VNNI kernel's, so prompts, verify passes and single steps agree whichever kernel ran them.

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..2 and 3..5: two sets of the digits' sums C [r rows of x][16 output rows] int32, used in turn so that one
// product's sums are stored while the next one runs; 6: a digit of x A [r][KX bytes]; 7: the codes B [KX / 4
// k-steps][16 rows * 4 bytes]. KX: the k of one product (32, or 16 for groups of 16: a block's halves are two groups
// and need their own sums).
void configure_tiles(int r, int kx) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = uint8_t(r);
    c.colsb[t] = 64;
  }
  c.rows[6] = uint8_t(r);
  c.colsb[6] = uint16_t(kx);
  c.rows[7] = uint8_t(kx / 4);
  c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

// The DIGITS products of one block (or half block) into sum set SET (tiles 3 SET .. 3 SET + 2), stored to `sums`
// [DIGITS][16][16]. (The tile intrinsics take their registers as literals.)
#define MLXCHAT_TILE_PRODUCTS(C0, C1, C2)                 \
  _tile_loadd(7, codes, 64);                              \
  _tile_zero(C0);                                         \
  _tile_loadd(6, x, x_stride);                            \
  _tile_dpbsud(C0, 6, 7);                                 \
  if constexpr (DIGITS == 3) {                            \
    _tile_zero(C1);                                       \
    _tile_loadd(6, x + 32, x_stride);                     \
    _tile_dpbsud(C1, 6, 7);                               \
    _tile_zero(C2);                                       \
    _tile_loadd(6, x + 64, x_stride);                     \
    _tile_dpbsud(C2, 6, 7);                               \
  }                                                       \
  _tile_stored(C0, sums[0], 64);                          \
  if constexpr (DIGITS == 3) {                            \
    _tile_stored(C1, sums[1], 64);                        \
    _tile_stored(C2, sums[2], 64);                        \
  }
// fixed24_nibbles on 4-bit codes: two products of 64 k, x's (e0, e1) and (e2, e3) against the block's codes beside
// the codes times 16 (B: 16 k-steps), into sums 0 and 1; the second digit pair in its own A tile (2, or 5).
#define MLXCHAT_TILE_PAIRS(C0, C1, A1)                    \
  _tile_loadd(7, codes, 64);                              \
  _tile_zero(C0);                                         \
  _tile_loadd(6, x, x_stride);                            \
  _tile_dpbsud(C0, 6, 7);                                 \
  _tile_zero(C1);                                         \
  _tile_loadd(A1, x + 64, x_stride);                      \
  _tile_dpbsud(C1, A1, 7);                                \
  _tile_stored(C0, sums[0], 64);                          \
  _tile_stored(C1, sums[1], 64);
template <int SET, int DIGITS>
inline void tile_products(const int8_t* x, size_t x_stride, const uint8_t* codes, int32_t (*sums)[16][16]) {
  if constexpr (DIGITS == 4) {
    if constexpr (SET == 0) {
      MLXCHAT_TILE_PAIRS(0, 1, 2)
    } else {
      MLXCHAT_TILE_PAIRS(3, 4, 5)
    }
  } else if constexpr (SET == 0) {
    MLXCHAT_TILE_PRODUCTS(0, 1, 2)
  } else {
    MLXCHAT_TILE_PRODUCTS(3, 4, 5)
  }
}
#undef MLXCHAT_TILE_PRODUCTS
#undef MLXCHAT_TILE_PAIRS

// Bytes of whole codes a block (amx_rows): its 8 k-steps, and for fixed24_nibbles the same times 16 after them.
template <int DIGITS>
constexpr int kBlockCodes = DIGITS == 4 ? 1024 : 512;

// Rows m0 .. m0 + r - 1 of x (R = r, or 0 for a count known at run time) against tiles [t0, t1), whose codes are
// `codes` and parameters `params` (amx_rows). Each product's sums become floats while the next product runs on the
// tiles.
template <int BITS, int DIGITS, bool G16, int R>
void amx_chunk(const PackedMatmulArgs& a, int t0, int t1, int m0, int r, const uint8_t* codes, const float* params) {
  const int rows = R ? R : r;
  const int K = a.K, G = K / a.group_size, blocks = K / 32, blocks_per_group = G16 ? 1 : a.group_size / 32;
  constexpr int H = G16 ? 2 : 1, KX = 32 / H;
  const size_t x_stride =
      x_row_bytes(K, DIGITS == 4 ? XForm::fixed24_nibbles : DIGITS == 3 ? XForm::fixed24 : XForm::int8);
  const int units = blocks * H;  // products a tile: unit u is block u / H, half u % H
  constexpr int block_codes = kBlockCodes<DIGITS>;
  alignas(64) int32_t sums[2][3][16][16];
  const int8_t* x = a.xq + size_t(m0) * x_stride;
  const float* xd = a.xd + size_t(m0) * blocks;
  const float* xs = a.xsum + size_t(m0) * G;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile_codes = codes + size_t(t - t0) * blocks * block_codes;
    auto issue = [&](int u) {
      const int blk = u / H, h = u % H;
      const int8_t* xb = x + size_t(blk) * 32 * DIGITS + KX * h;
      const uint8_t* cb = tile_codes + size_t(blk) * block_codes + 16 * KX * h;
      if (u % 2 == 0) {
        tile_products<0, DIGITS>(xb, x_stride, cb, sums[0]);
      } else {
        tile_products<1, DIGITS>(xb, x_stride, cb, sums[1]);
      }
    };
    __m512 out[16], group[16];
    for (int i = 0; i < rows; ++i) out[i] = _mm512_setzero_ps();
    issue(0);
    for (int u = 0; u < units; ++u) {
      if (u + 1 < units) issue(u + 1);
      const int blk = u / H, h = u % H, b = blk % blocks_per_group;
      int32_t (*s)[16][16] = sums[u % 2];
      // packed_tile's float steps, in its order: to_float, the block scale, and once the group is whole its scale
      // and bias terms (groups of 16: each half block is a group, added to out in turn as packed_tile does).
      const bool whole = b == blocks_per_group - 1;
      const int gg = G16 ? 2 * blk + h : blk / blocks_per_group;
      __m512 sv = _mm512_setzero_ps(), bv = sv;
      if (whole) {
        const float* p = params + (size_t(t - t0) * G + gg) * 2 * kPackedTile;
        sv = _mm512_loadu_ps(p);
        bv = _mm512_loadu_ps(p + kPackedTile);
      }
#pragma GCC unroll 16
      for (int i = 0; i < rows; ++i) {
        __m512 f;
        if constexpr (DIGITS == 1) {
          f = _mm512_cvtepi32_ps(_mm512_load_si512(s[0][i]));
        } else if constexpr (DIGITS == 4) {
          // m's sum is s0 + 4096 s1, both exact as floats (|s| < 2^21): one FMA rounds it once. The three digits'
          // (S0 + 256 S1) + 65536 S2 is the same integer and, for 4-bit codes, S0 + 256 S1 < 2^24 is exact too,
          // so both kernels round the same exact sum once: the same float.
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s[1][i])), _mm512_set1_ps(4096.0f),
                              _mm512_cvtepi32_ps(_mm512_load_si512(s[0][i])));
        } else {
          const __m512i low = _mm512_add_epi32(_mm512_load_si512(s[0][i]),
                                               _mm512_slli_epi32(_mm512_load_si512(s[1][i]), 8));
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s[2][i])), _mm512_set1_ps(65536.0f),
                              _mm512_cvtepi32_ps(low));
        }
        const __m512 d = _mm512_set1_ps(xd[size_t(i) * blocks + blk]);
        group[i] = b == 0 ? _mm512_mul_ps(f, d) : _mm512_fmadd_ps(f, d, group[i]);
        if (whole) {
          out[i] = _mm512_fmadd_ps(group[i], sv, out[i]);
          out[i] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xs[size_t(i) * G + gg]), out[i]);
        }
      }
    }
    for (int i = 0; i < rows; ++i) _mm512_storeu_ps(a.y + size_t(m0 + i) * a.N + size_t(t) * kPackedTile, out[i]);
  }
}

template <int BITS, ScaleType ST, int DIGITS, bool G16>
void amx_rows(const PackedMatmulArgs& a, int t0, int t1) {
  const int blocks = a.K / 32;
  static_assert(DIGITS != 4 || (BITS == 4 && !G16), "fixed24_nibbles: 4-bit codes in groups of 32 or more");
  constexpr int block_bytes = kPackedTile * 32 * BITS / 8, KX = DIGITS == 4 ? 64 : G16 ? 16 : 32;
  constexpr int block_codes = kBlockCodes<DIGITS>;
  const size_t tile_bytes = size_t(blocks) * block_bytes;
  // The codes of tiles [t0, t1), whole (one byte each, a block's 8 k-steps in order: 512 bytes, and for
  // fixed24_nibbles the same times 16 after them): made once, then read from cache by every row of x.
  thread_local std::vector<uint8_t> codes;
  codes.resize(size_t(t1 - t0) * blocks * block_codes);
  for (int t = t0; t < t1; ++t) {
    for (int blk = 0; blk < blocks; ++blk) {
      const uint8_t* wb = a.w + size_t(t) * tile_bytes + size_t(blk) * block_bytes;
      uint8_t* out = codes.data() + (size_t(t - t0) * blocks + blk) * block_codes;
      for (int s = 0; s < 4; ++s) {
        __m512i wl, wh;
        step_codes<BITS>(wb, s, wl, wh);
        _mm512_storeu_si512(out + 64 * s, wl);
        _mm512_storeu_si512(out + 256 + 64 * s, wh);
        if constexpr (DIGITS == 4) {  // codes <= 15: times 16 stays in each byte
          _mm512_storeu_si512(out + 512 + 64 * s, _mm512_slli_epi16(wl, 4));
          _mm512_storeu_si512(out + 768 + 64 * s, _mm512_slli_epi16(wh, 4));
        }
      }
    }
  }
  // And their parameters as fp32, [tile][group][scales, then biases][16]: each chunk of 16 rows of x reads them
  // again, and made in place (an fp16 conversion; compact's D times q) they were 5% of a Q4_K matmul at 512 rows.
  const int G = a.K / a.group_size;
  thread_local std::vector<float> params;
  params.resize(size_t(t1 - t0) * G * 2 * kPackedTile);
  for (int t = t0; t < t1; ++t) {
    for (int gg = 0; gg < G; ++gg) {
      float* p = params.data() + (size_t(t - t0) * G + gg) * 2 * kPackedTile;
      const __m512 sv = tile_params<ST>(a.scales, G, a.group_size, t, gg);
      _mm512_storeu_ps(p, sv);
      _mm512_storeu_ps(p + kPackedTile, tile_biases<BITS, ST>(a.biases, G, a.group_size, t, gg, sv));
    }
  }
  int configured = 0;
  for (int m0 = 0; m0 < a.M; m0 += 16) {
    const int r = a.M - m0 < 16 ? a.M - m0 : 16;
    if (r != configured) {
      configure_tiles(r, KX);
      configured = r;
    }
    // Whole chunks of 16 rows with the row count known, so that the rows' accumulators stay in registers.
    if (r == 16) {
      amx_chunk<BITS, DIGITS, G16, 16>(a, t0, t1, m0, 16, codes.data(), params.data());
    } else {
      amx_chunk<BITS, DIGITS, G16, 0>(a, t0, t1, m0, r, codes.data(), params.data());
    }
  }
  _tile_release();  // no tile state kept between calls: a thread switch then has none to save
}

}  // namespace

bool amx_ready() {
  // Linux hands out AMX's tile data (8 KB of state a thread) only to processes that ask for it, once.
  static const bool ready = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("amx-tile")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

void qmm_packed_rows_amx(const PackedMatmulArgs& a, int t0, int t1) {
  with_packed_format(a, [&](auto bits, auto st, auto g16) {
    if (a.xform == XForm::int8) {
      amx_rows<bits(), st(), 1, g16()>(a, t0, t1);
    } else if (a.xform == XForm::fixed24_nibbles) {
      if constexpr (bits() == 4 && !g16()) amx_rows<bits(), st(), 4, false>(a, t0, t1);
    } else {
      amx_rows<bits(), st(), 3, g16()>(a, t0, t1);
    }
  });
}
#else
bool amx_ready() { return false; }
void qmm_packed_rows_amx(const PackedMatmulArgs&, int, int) {}
#endif

}  // namespace mlxchat
