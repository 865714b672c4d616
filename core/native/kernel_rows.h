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
// sum (of the lanes), expand<BITS, G16>(block, V[kParts]) and params<ST>(base, i) (kLanes scales or biases as fp32).
// G16 (groups of 16, Q6_K's sub-blocks): expand puts the block's first 16 values in its first kParts / 2 vectors,
// and each half block is scaled as its own group.
template <typename Ops, int BITS, int MT, ScaleType ST, bool G16>
void rows_tile(const QMatmulArgs& a, int n0, int n1, int m0) {
  using V = typename Ops::V;
  constexpr int parts = Ops::kParts, lanes = Ops::kLanes;
  const int K = a.K, G = K / a.group_size, blocks_per_group = G16 ? 1 : a.group_size / 32;
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
      for (size_t off = 0; off < G * param_bytes; off += 64) {
        _mm_prefetch(static_cast<const char*>(a.scales) + p_off + off, _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(a.biases) + p_off + off, _MM_HINT_T0);
        if (!G16) break;  // a row's parameters are at most ~2 lines but for groups of 16 (8 bytes each 32 weights)
      }
    }
    V acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = Ops::zero();
    const int steps = G16 ? K / 32 : G;  // blocks (each two groups), or groups
    for (int g = 0; g < steps; ++g) {
      V t[MT][G16 ? 2 : 1];
      for (int i = 0; i < MT; ++i) {
        for (auto& th : t[i]) th = Ops::zero();
      }
      for (int b = 0; b < blocks_per_group; ++b) {
        const int blk = g * blocks_per_group + b;
        V w[parts];
        Ops::template expand<BITS, G16>(wr + size_t(blk) * block_bytes, w);
        for (int i = 0; i < MT; ++i) {
          const float* xp = xr[i] + size_t(blk) * 32;
          for (int p = 0; p < parts; ++p) {
            V& th = t[i][G16 && p >= parts / 2 ? 1 : 0];
            th = Ops::fma(w[p], Ops::load(xp + p * lanes), th);
          }
        }
      }
      if constexpr (G16) {
        const V s0 = Ops::set1(param<ST>(a.scales, p0 + 2 * g)), s1 = Ops::set1(param<ST>(a.scales, p0 + 2 * g + 1));
        for (int i = 0; i < MT; ++i) acc[i] = Ops::fma(t[i][1], s1, Ops::fma(t[i][0], s0, acc[i]));
      } else {
        const V s = Ops::set1(param<ST>(a.scales, p0 + g));
        for (int i = 0; i < MT; ++i) acc[i] = Ops::fma(t[i][0], s, acc[i]);
      }
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
template <typename Ops, int BITS, int MT, ScaleType ST, bool G16>
inline void tile(const QMatmulArgs& a, int c0, int c1, int m) {
  if constexpr (MT <= Ops::kMaxTile) rows_tile<Ops, BITS, MT, ST, G16>(a, c0, c1, m);
}

template <typename Ops, int BITS, ScaleType ST, bool G16>
void rows(const QMatmulArgs& a, int n0, int n1) {
  // Row chunks are outermost so that one chunk of weights stays in cache across the tiles of x. Tiles of 4 rows,
  // and the rest (up to kMaxTile) as one: a 5-row verify pass expands each weight block once, not twice.
  constexpr int chunk = 16;
  for (int c0 = n0; c0 < n1; c0 += chunk) {
    const int c1 = c0 + chunk < n1 ? c0 + chunk : n1;
    int m = 0;
    for (; a.M - m > Ops::kMaxTile; m += 4) rows_tile<Ops, BITS, 4, ST, G16>(a, c0, c1, m);
    switch (a.M - m) {
      case 6: tile<Ops, BITS, 6, ST, G16>(a, c0, c1, m); break;
      case 5: tile<Ops, BITS, 5, ST, G16>(a, c0, c1, m); break;
      case 4: tile<Ops, BITS, 4, ST, G16>(a, c0, c1, m); break;
      case 3: tile<Ops, BITS, 3, ST, G16>(a, c0, c1, m); break;
      case 2: tile<Ops, BITS, 2, ST, G16>(a, c0, c1, m); break;
      case 1: tile<Ops, BITS, 1, ST, G16>(a, c0, c1, m); break;
      default: break;
    }
  }
}

// fn(bits, scale type, g16) as compile-time constants (std::integral_constant), for the format's 4, 5, 6 or 8 bits,
// its scales' type and whether its groups are 16 values: the kernels instantiate their loops per format, and each
// picks its instance here.
template <typename F>
void with_format(int bits, ScaleType scale_type, bool g16, F&& fn) {
  auto of_group = [&](auto b, auto st) {
    if (g16) {
      fn(b, st, std::true_type{});
    } else {
      fn(b, st, std::false_type{});
    }
  };
  auto of_type = [&](auto b) {
    switch (scale_type) {
      case ScaleType::f32: of_group(b, std::integral_constant<ScaleType, ScaleType::f32>{}); break;
      case ScaleType::f16: of_group(b, std::integral_constant<ScaleType, ScaleType::f16>{}); break;
      case ScaleType::bf16: of_group(b, std::integral_constant<ScaleType, ScaleType::bf16>{}); break;
    }
  };
  switch (bits) {
    case 4: of_type(std::integral_constant<int, 4>{}); break;
    case 5: of_type(std::integral_constant<int, 5>{}); break;
    case 6: of_type(std::integral_constant<int, 6>{}); break;
    default: of_type(std::integral_constant<int, 8>{}); break;
  }
}

// 5 and 6 bits: MLX's bit stream read with byte shuffles. Code i of a block (4 * BITS bytes) is bits
// [i * BITS, (i + 1) * BITS): the two bytes from byte i * BITS / 8, shifted right by (i * BITS) % 8. A shuffle
// reads 16 bytes: the block's first 16 (`lo`) or its last 16 (`hi`, from byte 4 * BITS - 16), never past the block.
// shuffle_pairs<BITS, WIDTH>(first, base): for codes first, first + 1, ... in lanes of WIDTH bytes (4: int32 lanes,
// 2: int16 lanes) of a 32-byte shuffle control whose two 16-byte halves each index the same 16 source bytes (read
// from byte `base` of the block), each lane's two bytes; and the matching right shifts, one per lane (int32).
// Whether codes first .. first + count - 1 are read from `hi`: where any of them reaches past the first 16 bytes.
template <int BITS>
constexpr bool reads_hi(int first, int count) {
  return ((first + count - 1) * BITS) / 8 + 1 >= 16;
}
template <int BITS, int WIDTH>
struct Shuffle {
  alignas(32) uint8_t control[32];
  alignas(64) int32_t shifts[16];
  constexpr Shuffle(int first, int base) : control{}, shifts{} {
    for (int lane = 0; lane < 32 / WIDTH; ++lane) {
      const int i = first + lane, byte = (i * BITS) / 8 - base;
      if (byte < 0 || byte >= 16) throw "a code outside the 16 bytes read";  // fails the constant evaluation
      for (int j = 0; j < WIDTH; ++j) {
        // The second byte only where the code reaches it (it may lie past the 16 read).
        const bool used = j == 0 || (j == 1 && (i * BITS) % 8 + BITS > 8);
        control[lane * WIDTH + j] = used ? uint8_t(byte + j) : uint8_t(0x80);
      }
      shifts[lane] = (i * BITS) % 8;
    }
  }
};

// Rows [n0, n1) of y for every row of x, on the kernel's Ops.
template <typename Ops>
void matmul_rows(const QMatmulArgs& a, int n0, int n1) {
  with_format(a.bits, a.scale_type, a.group_size == 16,
              [&](auto bits, auto st, auto g16) { rows<Ops, bits(), st(), g16()>(a, n0, n1); });
}

}  // namespace
}  // namespace mlxchat
