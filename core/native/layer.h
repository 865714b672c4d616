// A whole llama-style decoder layer for a few rows (decode, speculative verification) as one MLX primitive: on the CPU
// backend each MLX op costs ~20-40 us of dispatch, and a layer in MLX ops (RMSNorm and RoPE as MLX composes them on
// the CPU, the cache update, the projections) is ~110 graph nodes: about half of a decode step of the embedded model.
#pragma once

#include <memory>
#include <vector>

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

struct LayerShape {
  int n_heads, n_kv_heads, head_dim;
  float norm_eps;    // both RMSNorms
  int rope_dims;     // RoPE over the first rope_dims of each head
  bool rope_traditional;
  float rope_scale;  // positions are multiplied by it (mx.fast.rope's scale)
  float attention_scale;
  bool qk_norm = false;  // per-head RMSNorm of q and k before RoPE (qwen3), eps norm_eps
};

// mx.fast.rope's frequencies [dims / 2] for `base`, by the very ops its CPU fallback composes (so they are equal).
mx::array rope_inv_freqs(int dims, float base);

// A layer's parameters, checked and made dense once, for every call of decoder_layer: a decode step passes only its
// rows (converting and checking 24 arrays on every call was ~7 us of Python a layer, ~0.2 ms a step).
// weights: input_layernorm, post_attention_layernorm, inv_freqs [rope_dims / 2] (as mx.fast.rope computes them), then
// (w, scales, biases) of q, k, v, o, gate, up, down, then optionally the float32 biases of q, k and v (qwen2), then
// when shape.qk_norm the float32 q_norm and k_norm weights [head_dim] (qwen3);
// group_sizes / bits / packed: the 7 projections' (packed: pack_weights's layout, x taken as integers); int8: the
// packed ones take x rounded to int8 (weights="native-int8"), else as fixed24.
struct LayerData {
  std::vector<mx::array> arrays;
  std::vector<int> group_sizes, bits, packed;
  bool int8;
  LayerShape shape;
};
// The handle Python keeps. The op shares its data, never the Python object: a shared_ptr made from a Python object
// takes the GIL when its last copy goes, which MLX's worker thread would then do after each step (and at exit, where
// that aborts the process).
struct LayerWeights {
  std::shared_ptr<const LayerData> data;
};
LayerWeights layer_weights(const std::vector<mx::array>& weights, const std::vector<int>& group_sizes,
                           const std::vector<int>& bits, const std::vector<int>& packed, bool int8,
                           const LayerShape& shape);

// h [B, L, D] float32 -> (h_out [B, L, D], keys_out, values_out). keys/values [B, H_kv, C, head_dim] are the layer's
// KV cache buffer with `offset` positions written and room for L more (C >= offset + L); the outputs are that buffer
// with this step's rotated keys and values written at offset .. offset + L - 1, in place when nothing else holds it.
// left_padding (int32 [B]): each row's first real position, as mlx-lm's BatchKVCache left-pads rows (0 for one
// sequence): row r's tokens sit at RoPE positions offset - left_padding[r] + i and attend to its positions from
// left_padding[r] on.
// Computes what mlx-lm's llama, qwen2 and qwen3 TransformerBlocks compute, in fp32, with the native matmul, attention
// and SwiGLU kernels; `causal` as MLX's "causal" mask (query i sees keys 0 .. offset + i).
std::vector<mx::array> decoder_layer(const mx::array& h, const mx::array& keys, const mx::array& values,
                                     const LayerWeights& layer, int offset, bool causal,
                                     const mx::array& left_padding);

}  // namespace mlxchat
