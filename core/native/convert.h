// llama.cpp's quantized blocks, read from a GGUF file straight into the arrays the kernels take (one pass, on the
// pool's threads, a few rows at a time: the file's bytes are never held whole and never copied through NumPy).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// Where a tensor is: `type` ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K" or "Q6_K"), N rows of K values,
// its blocks at byte `offset` of the file; `packed`: wanted in pack_weights's tiles of 16 rows (N a multiple of 16),
// else in MLX's layout.
struct GgmlPlace {
  int64_t offset;
  std::string type;
  int N, K;
  bool packed;
  GgmlPlace(int64_t offset, std::string type, int N, int K, bool packed)
      : offset(offset), type(std::move(type)), N(N), K(K), packed(packed) {}
};

// Each place's tensor of the file at `path`, in order, as [w, scales, biases] in MLX's affine form, each value
// exactly llama.cpp's dequantization (gguf_tensors.py's table): w uint32 [N, K * bits / 32]; scales and biases
// float16 [N, K / 32], or for the K-quants kernel.h's compact form uint8 [N, K / 256 * (2 + 256 / group)].
// Q4_0/Q5_0/Q8_0's biases (-2^(bits - 1) times each scale) are native.symmetric_biases' stand-in, float16 [N, 0],
// unless some block's is not that product in float32 (an f16 overflow): then they are stored. Nothing where a
// K-quant's parameters do not fit the compact form (an fp16 d whose -32 d overflows fp16): the caller converts that
// tensor another way. All in one call: the loader lets go of the GIL for the whole file, so its tokenizer thread
// runs meanwhile (a call per tensor took the GIL back 270 times, each time waiting on that thread). Throws
// std::invalid_argument for an unknown type or shape, std::runtime_error for a read that fails or ends early, at
// the first tensor that does.
std::vector<std::optional<std::vector<mx::array>>> read_ggml_many(const std::string& path,
                                                                 const std::vector<GgmlPlace>& places);

}  // namespace mlxchat
