// The ops of attention and the MLP as MLX operations on the CPU, with a vectorised exp: MLX's own CPU exp is scalar on
// x86, which made softmax and SwiGLU most of a long prompt's prefill; and a whole attention for a few queries, which
// in MLX ops is a dozen nodes and two batched BLAS calls per layer for a decode step. Lazy graph nodes like any op.
#pragma once

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// softmax(scale * x) along the last axis of float32 x [..., L, S]. With `causal`, query i of the L (the second-last
// axis) sees keys 0 .. S - L + i, MLX's lower-right "causal" mask; masked entries are 0.
mx::array softmax(const mx::array& x, float scale, bool causal);

// Attention of float32 q [B, H, L, D] over k, v [B, H_kv, S, D] (H a multiple of H_kv) in one op, for small L: each key
// and value row is read once per group of heads. Rows need only be contiguous along D (a KV cache's slice is fine).
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal);

// silu(gate) * up for float32 arrays of the same shape.
mx::array swiglu(const mx::array& gate, const mx::array& up);

}  // namespace mlxchat
