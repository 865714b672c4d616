// The quantized matmul's row loop, written once for the AVX2 and the AVX-512 kernel: each kernel file includes it
// with its own vector operations (`Ops`). Everything here has internal linkage, so each file gets its own copy built
// with its own instruction set (a shared inline function could be linked from the AVX-512 file into the AVX2 path).
//
// Exact fp32 math: weights are expanded to fp32 and multiplied with fp32 activations; per group, scale * sum(x * q) +
// bias * sum(x). Each row of x is summed the same way whatever the tile it is in, so a row's result does not depend
// on the rows computed with it.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel.h"

namespace mlxchat {
namespace {

// One per-group scale or bias as fp32, read in place: the matmul's rows are short (18 groups at K=576), and
// converting each row's parameters into a buffer first was ~10% of the kernel's time.
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

#ifdef __AVX512F__
// 16 consecutive scales or biases as fp32 (the AVX-512 kernel's Ops, and the int8 kernel's tile of 16 rows).
template <ScaleType ST>
inline __m512 params16(const void* base, size_t i) {
  if constexpr (ST == ScaleType::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (ST == ScaleType::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#endif

constexpr int kAhead = 8;  // weight rows fetched ahead of the one being read

// MT rows of x (m0 .. m0+MT-1) against weight rows [n0, n1): each weight block is expanded once and used MT times.
// Ops: V (a vector of Ops::kLanes floats), kParts = 32 / kLanes vectors a block, and static zero, load, set1, fma,
// sum (of the lanes), expand<BITS>(block, V[kParts]) and params<ST>(base, i) (kLanes scales or biases as fp32).
template <typename Ops, int BITS, int MT, ScaleType ST>
void rows_tile(const QMatmulArgs& a, int n0, int n1, int m0) {
  using V = typename Ops::V;
  constexpr int parts = Ops::kParts, lanes = Ops::kLanes;
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
    const size_t p0 = size_t(n) * G;  // this row's first scale and bias
    const uint8_t* wr = a.w + size_t(n) * row_bytes;
    // Fetch a few rows ahead: rows are short (288 bytes at K=576, 4 bits) and the hardware prefetcher alone left
    // this loop waiting on memory (measured: ~3x slower than the same rows in cache).
    if (n + kAhead < a.N) {
      for (size_t off = 0; off < row_bytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + kAhead * row_bytes + off), _MM_HINT_T0);
      }
      const size_t p_off = (size_t(n) + kAhead) * G * param_bytes;
      _mm_prefetch(static_cast<const char*>(a.scales) + p_off, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(a.biases) + p_off, _MM_HINT_T0);
    }
    V acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = Ops::zero();
    for (int g = 0; g < G; ++g) {
      V t[MT];
      for (int i = 0; i < MT; ++i) t[i] = Ops::zero();
      for (int b = 0; b < blocks_per_group; ++b) {
        const int blk = g * blocks_per_group + b;
        V w[parts];
        Ops::template expand<BITS>(wr + size_t(blk) * block_bytes, w);
        for (int i = 0; i < MT; ++i) {
          const float* xp = xr[i] + size_t(blk) * 32;
          for (int p = 0; p < parts; ++p) t[i] = Ops::fma(w[p], Ops::load(xp + p * lanes), t[i]);
        }
      }
      const V s = Ops::set1(param<ST>(a.scales, p0 + g));
      for (int i = 0; i < MT; ++i) acc[i] = Ops::fma(t[i], s, acc[i]);
    }
    for (int i = 0; i < MT; ++i) {
      // The bias term, sum over groups of bias * sum(x), vectorised (a scalar loop is a chain of G dependent FMAs).
      V bv = Ops::zero();
      int g = 0;
      for (; g + lanes <= G; g += lanes) {
        bv = Ops::fma(Ops::template params<ST>(a.biases, p0 + g), Ops::load(xs[i] + g), bv);
      }
      float bias_term = Ops::sum(bv);
      for (; g < G; ++g) bias_term += param<ST>(a.biases, p0 + g) * xs[i][g];
      a.y[size_t(m0 + i) * a.N + n] = Ops::sum(acc[i]) + bias_term;
    }
  }
}

// A tile of MT rows where the kernel's registers allow it (Ops::kMaxTile).
template <typename Ops, int BITS, int MT, ScaleType ST>
inline void tile(const QMatmulArgs& a, int c0, int c1, int m) {
  if constexpr (MT <= Ops::kMaxTile) rows_tile<Ops, BITS, MT, ST>(a, c0, c1, m);
}

template <typename Ops, int BITS, ScaleType ST>
void rows(const QMatmulArgs& a, int n0, int n1) {
  // Row chunks are outermost so that one chunk of weights stays in cache across the tiles of x. Tiles of 4 rows,
  // and the rest (up to kMaxTile) as one: a 5-row verify pass expands each weight block once, not twice.
  constexpr int chunk = 16;
  for (int c0 = n0; c0 < n1; c0 += chunk) {
    const int c1 = c0 + chunk < n1 ? c0 + chunk : n1;
    int m = 0;
    for (; a.M - m > Ops::kMaxTile; m += 4) rows_tile<Ops, BITS, 4, ST>(a, c0, c1, m);
    switch (a.M - m) {
      case 6: tile<Ops, BITS, 6, ST>(a, c0, c1, m); break;
      case 5: tile<Ops, BITS, 5, ST>(a, c0, c1, m); break;
      case 4: tile<Ops, BITS, 4, ST>(a, c0, c1, m); break;
      case 3: tile<Ops, BITS, 3, ST>(a, c0, c1, m); break;
      case 2: tile<Ops, BITS, 2, ST>(a, c0, c1, m); break;
      case 1: tile<Ops, BITS, 1, ST>(a, c0, c1, m); break;
      default: break;
    }
  }
}

// fn(bits, scale type) with both as compile-time constants (std::integral_constant), for the format's 4 or 8 bits
// and its scales' type: the matmul kernels instantiate their loops per format, and each picks its instance here.
template <typename F>
void with_format(int bits, ScaleType scale_type, F&& fn) {
  auto of_type = [&](auto b) {
    switch (scale_type) {
      case ScaleType::f32: fn(b, std::integral_constant<ScaleType, ScaleType::f32>{}); break;
      case ScaleType::f16: fn(b, std::integral_constant<ScaleType, ScaleType::f16>{}); break;
      case ScaleType::bf16: fn(b, std::integral_constant<ScaleType, ScaleType::bf16>{}); break;
    }
  };
  if (bits == 4) {
    of_type(std::integral_constant<int, 4>{});
  } else {
    of_type(std::integral_constant<int, 8>{});
  }
}

// Rows [n0, n1) of y for every row of x, on the kernel's Ops.
template <typename Ops>
void matmul_rows(const QMatmulArgs& a, int n0, int n1) {
  with_format(a.bits, a.scale_type, [&](auto bits, auto st) { rows<Ops, bits(), st()>(a, n0, n1); });
}

}  // namespace
}  // namespace mlxchat
