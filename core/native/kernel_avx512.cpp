// The quantized matmul (its row loop in kernel_rows.h) and a decode step's attention with AVX-512 (16 floats a
// vector), for CPUs that have it. The matmul sums each row the same way whatever the rows beside it, so speculative
// verification and the server's batch still get a single step's values. A 512-bit FMA does two 256-bit ones' work in
// one instruction, which matters once several rows share each expanded block.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel.h"
#include "kernel_rows.h"

namespace mlxchat {
namespace {

// 32 weights of one block as two vectors of 16 floats. 4 bits: the low nibbles (the even indices) then the high ones
// (the odd indices), which is how x is reordered for the AVX2 kernel too (evens of the block, then odds); with G16
// per half block ({0,2..14,1..15}, then {16..30,17..31}), so each vector is one group. 5 and 6 bits: MLX's bit
// stream in natural order, each code's two bytes shuffled into a 16-bit lane (AVX2's shuffle: AVX-512F alone has no
// byte shuffle), widened, shifted and masked (kernel_rows.h). 8 bits: natural order.
template <int BITS, bool G16>
inline void expand_block(const uint8_t* p, __m512& lo, __m512& hi) {
  if constexpr (BITS == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i a = _mm_and_si128(v, mask), b = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    if constexpr (G16) {
      const __m128i evens = a;
      a = _mm_unpacklo_epi64(evens, b);
      b = _mm_unpackhi_epi64(evens, b);
    }
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  } else if constexpr (BITS == 8) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  } else {
    const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
    auto sixteen = [&](auto v) {  // codes 16v .. 16v + 15
      constexpr int first = 16 * decltype(v)::value, base = reads_hi<BITS>(first, 16) ? 4 * BITS - 16 : 0;
      static constexpr Shuffle<BITS, 2> shuffle(first, base);
      const __m256i src = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + base)));
      const __m256i pairs =
          _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(shuffle.control)));
      const __m512i shifted = _mm512_srlv_epi32(_mm512_cvtepu16_epi32(pairs), _mm512_load_si512(shuffle.shifts));
      return _mm512_cvtepi32_ps(_mm512_and_si512(shifted, mask));
    };
    lo = sixteen(std::integral_constant<int, 0>{});
    hi = sixteen(std::integral_constant<int, 1>{});
  }
}

// The row loop's vector operations on 16 floats (kernel_rows.h).
struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16, kParts = 2, kMaxTile = 6;  // 32 registers: 6-row tiles (8 measured slower)
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  template <int BITS, bool G16>
  static void expand(const uint8_t* p, V (&w)[kParts]) { expand_block<BITS, G16>(p, w[0], w[1]); }
  template <ScaleType ST>
  static V params(const void* base, size_t i) { return params16<ST>(base, i); }
};

// scores[j] = q . k_j for the keys j < visible, each dot over D in one accumulator of 16 lanes.
inline void scores_row(const float* q, const float* k, int64_t k_stride, int visible, int D, float* scores) {
  __m512 qv[8];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j = 0; j < visible; ++j) {
    const float* kr = k + j * k_stride;
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
    scores[j] = _mm512_reduce_add_ps(acc);
  }
}

// out = sum over j < visible of p[j] * v_j, accumulated in registers in key order.
inline void weighted_row(const float* p, const float* v, int64_t v_stride, int visible, int D, float* out) {
  __m512 acc[8];
  for (int c = 0; c < D / 16; ++c) acc[c] = _mm512_setzero_ps();
  for (int j = 0; j < visible; ++j) {
    const __m512 w = _mm512_set1_ps(p[j]);
    const float* vr = v + j * v_stride;
    for (int c = 0; c < D / 16; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), acc[c]);
  }
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

}  // namespace

bool attention_avx512_fits(const AttentionArgs& a) {
  return a.D % 16 == 0 && a.D <= 128;
}

void attention_avx512(const AttentionArgs& a) {
  thread_local std::vector<float> scores;
  scores.resize(size_t(a.S));
  const int rep = a.H / a.KVH;
  for (int b = 0; b < a.B; ++b) {
    for (int h = 0; h < a.H; ++h) {
      const int g = h / rep;
      const float* kb = a.k + b * a.k_stride[0] + g * a.k_stride[1];
      const float* vb = a.v + b * a.v_stride[0] + g * a.v_stride[1];
      for (int i = 0; i < a.L; ++i) {
        // Each query row on its own, the same way for any L: a verify pass's rows equal single steps.
        const int visible = a.causal ? a.S - a.L + i + 1 : a.S;
        const float* q = a.q + b * a.q_stride[0] + h * a.q_stride[1] + i * a.q_stride[2];
        scores_row(q, kb, a.k_stride[2], visible, a.D, scores.data());
        softmax_rows_avx2(scores.data(), scores.data(), 1, visible, 1, a.scale, false);
        weighted_row(scores.data(), vb, a.v_stride[2], visible, a.D, a.out + ((size_t(b) * a.H + h) * a.L + i) * a.D);
      }
    }
  }
}

void qmm_rows_avx512(const QMatmulArgs& a, int n0, int n1) {
  matmul_rows<Avx512>(a, n0, n1);
}

}  // namespace mlxchat
