// The quantized matmul and a decode step's attention with AVX-512 (16 floats a vector), for CPUs that have it. Same exact fp32 math as the AVX2
// kernel (weights expanded to fp32, per group scale * sum(x q) + bias * sum(x)); only the summation order differs,
// and it is the same for every row count, so a row's result does not depend on how many rows are computed with it
// (speculative verification and the server's batch rely on that). A 512-bit FMA does the work of two 256-bit ones
// for one instruction, which matters once several rows share each expanded block: the AVX2 kernel's M=4..8 tiles
// were bound by instruction throughput, not by the FMA units.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel.h"

namespace mlxchat {
namespace {

template <ScaleType ST>
inline float param(const void* base, size_t i) {
  if constexpr (ST == ScaleType::f32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (ST == ScaleType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
  } else {
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(base)[i]) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(float));
    return out;
  }
}

template <ScaleType ST>
inline __m512 param16(const void* base, size_t i) {
  if constexpr (ST == ScaleType::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (ST == ScaleType::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// 32 weights of one block as two vectors of 16 floats. 4 bits: the low nibbles (the even indices) then the high ones
// (the odd indices), which is how x is reordered for the AVX2 kernel too (evens of the block, then odds).
template <int BITS>
inline void expand_block(const uint8_t* p, __m512& lo, __m512& hi) {
  if constexpr (BITS == 4) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
}

constexpr int kAhead = 8;  // rows fetched ahead, as in the AVX2 kernel

// MT rows of x (m0 .. m0+MT-1) against weight rows [n0, n1): each weight block is expanded once and used MT times.
template <int BITS, int MT, ScaleType ST>
void rows_tile(const QMatmulArgs& a, int n0, int n1, int m0) {
  const int K = a.K, G = K / a.group_size, blocks_per_group = a.group_size / 32;
  const size_t row_bytes = size_t(K) * BITS / 8;
  constexpr int block_bytes = 32 * BITS / 8;
  constexpr size_t param_bytes = ST == ScaleType::f32 ? 4 : 2;
  const float* xr[MT];
  const float* xs[MT];
  for (int i = 0; i < MT; ++i) {
    xr[i] = a.xq + size_t(m0 + i) * K;
    xs[i] = a.xsum + size_t(m0 + i) * G;
  }
  for (int n = n0; n < n1; ++n) {
    const size_t p0 = size_t(n) * G;
    const uint8_t* wr = a.w + size_t(n) * row_bytes;
    if (n + kAhead < a.N) {
      for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + kAhead * row_bytes + off), _MM_HINT_T0);
      const size_t p_off = (size_t(n) + kAhead) * G * param_bytes;
      _mm_prefetch(static_cast<const char*>(a.scales) + p_off, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(a.biases) + p_off, _MM_HINT_T0);
    }
    __m512 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g) {
      __m512 t[MT];
      for (int i = 0; i < MT; ++i) t[i] = _mm512_setzero_ps();
      for (int b = 0; b < blocks_per_group; ++b) {
        const int blk = g * blocks_per_group + b;
        __m512 lo, hi;
        expand_block<BITS>(wr + size_t(blk) * block_bytes, lo, hi);
        for (int i = 0; i < MT; ++i) {
          const float* xp = xr[i] + size_t(blk) * 32;
          t[i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp), t[i]);
          t[i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + 16), t[i]);
        }
      }
      const __m512 s = _mm512_set1_ps(param<ST>(a.scales, p0 + g));
      for (int i = 0; i < MT; ++i) acc[i] = _mm512_fmadd_ps(t[i], s, acc[i]);
    }
    for (int i = 0; i < MT; ++i) {
      __m512 bv = _mm512_setzero_ps();
      int g = 0;
      for (; g + 16 <= G; g += 16) bv = _mm512_fmadd_ps(param16<ST>(a.biases, p0 + g), _mm512_loadu_ps(xs[i] + g), bv);
      float bias_term = _mm512_reduce_add_ps(bv);
      for (; g < G; ++g) bias_term += param<ST>(a.biases, p0 + g) * xs[i][g];
      a.y[size_t(m0 + i) * a.N + n] = _mm512_reduce_add_ps(acc[i]) + bias_term;
    }
  }
}

template <int BITS, ScaleType ST>
void rows(const QMatmulArgs& a, int n0, int n1) {
  // Row chunks are outermost so that one chunk of weights stays in cache across the tiles of x.
  constexpr int chunk = 16;
  for (int c0 = n0; c0 < n1; c0 += chunk) {
    const int c1 = c0 + chunk < n1 ? c0 + chunk : n1;
    int m = 0;
    for (; a.M - m > 6; m += 4) rows_tile<BITS, 4, ST>(a, c0, c1, m);
    switch (a.M - m) {
      case 6: rows_tile<BITS, 6, ST>(a, c0, c1, m); break;
      case 5: rows_tile<BITS, 5, ST>(a, c0, c1, m); break;
      case 4: rows_tile<BITS, 4, ST>(a, c0, c1, m); break;
      case 3: rows_tile<BITS, 3, ST>(a, c0, c1, m); break;
      case 2: rows_tile<BITS, 2, ST>(a, c0, c1, m); break;
      case 1: rows_tile<BITS, 1, ST>(a, c0, c1, m); break;
      default: break;
    }
  }
}

template <int BITS>
void rows_of_type(const QMatmulArgs& a, int n0, int n1) {
  switch (a.scale_type) {
    case ScaleType::f32: rows<BITS, ScaleType::f32>(a, n0, n1); break;
    case ScaleType::f16: rows<BITS, ScaleType::f16>(a, n0, n1); break;
    case ScaleType::bf16: rows<BITS, ScaleType::bf16>(a, n0, n1); break;
  }
}

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
  if (a.bits == 4) {
    rows_of_type<4>(a, n0, n1);
  } else {
    rows_of_type<8>(a, n0, n1);
  }
}

}  // namespace mlxchat
