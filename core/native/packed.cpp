// The int8-activation matmul's data preparation (plain C++: it runs once at load, or once per call over M * K
// values): the weights' repacking and x's quantization. The kernels are kernel_vnni.cpp and kernel_avx2.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel.h"

namespace mlxchat {

namespace {

// MLX's layout <-> the packed one, code by code (this runs once a matrix, at load): `pack` says which way.
void repack(const uint8_t* w, const void* scales, const void* biases, size_t param_bytes, int N, int K,
            int group_size, int bits, uint8_t* w_out, void* scales_out, void* biases_out, bool pack) {
  const size_t row_bytes = size_t(K) * bits / 8;
  std::memset(w_out, 0, size_t(N) * row_bytes);  // codes are ORed in
  for (int n = 0; n < N; ++n) {
    uint8_t* plain_row = w_out + size_t(n) * row_bytes;
    for (int k = 0; k < K; ++k) {
      const uint32_t code = pack ? plain_code(w + size_t(n) * row_bytes, k, bits) : packed_code(w, K, bits, n, k);
      if (pack) {
        const PackedPlace p = packed_place(K, bits, n, k);
        w_out[p.byte] |= uint8_t((bits == 8 ? code : code & 0x0F) << p.shift);
        if (bits == 5 || bits == 6) w_out[p.high] |= uint8_t((code >> 4) << p.high_shift);
      } else {
        // The code's bits [k * bits, (k + 1) * bits) of the row's stream, in at most two bytes.
        const size_t bit = size_t(k) * bits;
        const uint32_t placed = code << (bit % 8);
        plain_row[bit / 8] |= uint8_t(placed);
        if (placed >> 8) plain_row[bit / 8 + 1] |= uint8_t(placed >> 8);
      }
    }
  }
  if (param_bytes == 0) {  // compact: per super-block, its D and its groups' multipliers
    const int S = K / 256, B = compact_bytes(group_size);
    for (int n = 0; n < N; ++n) {
      for (int s = 0; s < S; ++s) {
        for (int i = 0; i < B; ++i) {
          const size_t plain = compact_place(K, group_size, n, s, i, false);
          const size_t packed = compact_place(K, group_size, n, s, i, true);
          const size_t from = pack ? plain : packed, to = pack ? packed : plain;
          static_cast<uint8_t*>(scales_out)[to] = static_cast<const uint8_t*>(scales)[from];
          static_cast<uint8_t*>(biases_out)[to] = static_cast<const uint8_t*>(biases)[from];
        }
      }
    }
    return;
  }
  const int G = K / group_size;
  for (int n = 0; n < N; ++n) {
    for (int g = 0; g < G; ++g) {
      const size_t plain = (size_t(n) * G + g) * param_bytes, packed = packed_param(G, n, g) * param_bytes;
      const size_t from = pack ? plain : packed, to = pack ? packed : plain;
      std::memcpy(static_cast<char*>(scales_out) + to, static_cast<const char*>(scales) + from, param_bytes);
      if (biases_out) {
        std::memcpy(static_cast<char*>(biases_out) + to, static_cast<const char*>(biases) + from, param_bytes);
      }
    }
  }
}

}  // namespace

void pack_weights(const uint8_t* w, const void* scales, const void* biases, size_t param_bytes, int N, int K,
                  int group_size, int bits, uint8_t* w_out, void* scales_out, void* biases_out) {
  repack(w, scales, biases, param_bytes, N, K, group_size, bits, w_out, scales_out, biases_out, true);
}

void unpack_weights(const uint8_t* w, const void* scales, const void* biases, size_t param_bytes, int N, int K,
                    int group_size, int bits, uint8_t* w_out, void* scales_out, void* biases_out) {
  repack(w, scales, biases, param_bytes, N, K, group_size, bits, w_out, scales_out, biases_out, false);
}

namespace {

// The block's max |x|, or NaN where any value is NaN (std::max would skip it).
float block_amax(const float* xb) {
  float amax = 0.0f;
  bool nan = false;
  for (int k = 0; k < 32; ++k) {
    amax = std::max(amax, std::abs(xb[k]));
    nan |= std::isnan(xb[k]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// int8: round(x / d) with d = max|x| / 127 (amax: the block's, finite). Sets the sums of the two halves' integers
// (the rounded x is d times them).
void int8_block(const float* xb, float amax, int8_t* q, float& d, int64_t (&half_sums)[2]) {
  d = amax / 127.0f;
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  half_sums[0] = half_sums[1] = 0;
  for (int k = 0; k < 32; ++k) {
    q[k] = int8_t(std::nearbyint(xb[k] * inv));
    half_sums[k / 16] += q[k];
  }
}

}  // namespace

void quantize_rows(const float* x, int M, int K, int group_size, XForm form, int8_t* xq, float* xd, float* xsum) {
  const int blocks = K / 32, digits = digits_of(form);
  // The rounded x's sum over each block, or over each half block where groups are 16 (Q6_K's): the bias term's.
  const bool halves = group_size == 16;
  const int parts_per_group = halves ? 1 : group_size / 32;
  std::vector<double> parts(halves ? 2 * blocks : blocks);
  for (int m = 0; m < M; ++m) {
    const float* xr = x + size_t(m) * K;
    for (int b = 0; b < blocks; ++b) {
      int8_t* q = xq + size_t(m) * x_row_bytes(K, form) + size_t(b) * 32 * digits;
      float& d = xd[size_t(m) * blocks + b];
      int64_t h[2] = {0, 0};
      if (form != XForm::int8) {
        // fixed24 runs only where the VNNI kernel does (qmm.cpp's fixed24_runs), so its AVX-512 block can.
        d = fixed24_block_vnni(xr + 32 * b, q, h, form == XForm::fixed24_nibbles);
      } else if (const float amax = block_amax(xr + 32 * b); !std::isfinite(amax)) {
        // NaN or inf in: a NaN scale, so NaN out (as the fp32 kernel's sums give)
        std::memset(q, 0, 32);
        d = std::numeric_limits<float>::quiet_NaN();
      } else {
        int8_block(xr + 32 * b, amax, q, d, h);
      }
      // The rounded x is d times the integers: int8 rounds that product to float (d * sum, as llama.cpp does),
      // fixed24's is exact in double (d is a power of two).
      auto value = [&](int64_t sum) {
        return form == XForm::int8 ? double(d * float(sum)) : double(sum) * double(d);
      };
      if (halves) {
        parts[2 * b] = value(h[0]);
        parts[2 * b + 1] = value(h[1]);
      } else {
        parts[b] = value(h[0] + h[1]);
      }
    }
    for (int g = 0; g < K / group_size; ++g) {
      // The bias term takes the sum of the rounded x, not of x: then a group's error is sum((scale * q + bias) *
      // (x_rounded - x)), over centred weights. With the exact sum it was sum(scale * q * (x_rounded - x)) over
      // codes 0..15 that all share a sign, which did not cancel. Measured on the embedded model (4 chat questions,
      // 192 reply positions, KL from the exact path): 0.014 nats with the exact sum, 0.0027 with this one;
      // llama.cpp, which rounds x the same way, 0.0030.
      double sum = 0.0;
      for (int i = g * parts_per_group; i < (g + 1) * parts_per_group; ++i) sum += parts[i];
      xsum[size_t(m) * (K / group_size) + g] = float(sum);
    }
  }
}

}  // namespace mlxchat
