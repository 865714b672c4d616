// The quantized matmul with AVX-512 (16 floats a vector), for CPUs that have it. Same exact fp32 math as the AVX2
// kernel (weights expanded to fp32, per group scale * sum(x q) + bias * sum(x)); only the summation order differs,
// and it is the same for every row count, so a row's result does not depend on how many rows are computed with it
// (speculative verification and the server's batch rely on that). A 512-bit FMA does the work of two 256-bit ones
// for one instruction, which matters once several rows share each expanded block: the AVX2 kernel's M=4..8 tiles
// were bound by instruction throughput, not by the FMA units.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

}  // namespace

void qmm_rows_avx512(const QMatmulArgs& a, int n0, int n1) {
  if (a.bits == 4) {
    rows_of_type<4>(a, n0, n1);
  } else {
    rows_of_type<8>(a, n0, n1);
  }
}

}  // namespace mlxchat
