// Attention's softmax and the MLP's SwiGLU as MLX operations on the CPU, with a vectorised exp: MLX's own CPU exp is
// scalar on x86, which made these two most of a long prompt's prefill. Lazy graph nodes like any MLX op.
#pragma once

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// softmax(scale * x) along the last axis of float32 x [..., L, S]. With `causal`, query i of the L (the second-last
// axis) sees keys 0 .. S - L + i, MLX's lower-right "causal" mask; masked entries are 0.
mx::array softmax(const mx::array& x, float scale, bool causal);

// silu(gate) * up for float32 arrays of the same shape.
mx::array swiglu(const mx::array& gate, const mx::array& up);

}  // namespace mlxchat
