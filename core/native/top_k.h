// Top-k as one lazy MLX op on the CPU: the sampler's TopK was ~10 graph nodes (a partial sort of block maxima, then of
// the best blocks) and ~0.6 ms of a decode step; one pass with a k-slot heap is one node.
#pragma once

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// Along the last axis of float32 logits [..., V] with V > k: the positions (uint32 [..., k], ascending) of the k
// largest values. Of values tied with the k-th largest, the lowest positions are taken.
mx::array top_k_index(const mx::array& logits, int k);

}  // namespace mlxchat
