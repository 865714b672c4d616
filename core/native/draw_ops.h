// The sampler's per-step work over the vocabulary as single lazy MLX ops on the CPU, where MLX composes each of ~10-30
// small graph nodes: top-k (a partial sort of block maxima, then of the best blocks: ~0.6 ms of a decode step; here
// one pass with a k-slot heap) and the seeded draw's uniform numbers (two MurmurHash3 finalisers: ~30 nodes).
#pragma once

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// Along the last axis of float32 logits [..., V] with V > k: the positions (uint32 [..., k], ascending) of the k
// largest values. Of values tied with the k-th largest, the lowest positions are taken.
mx::array top_k_index(const mx::array& logits, int k);

// core/draw.py's uniform_at, bit for bit: for each uint32 id, h = fmix32(fmix32(id ^ words[0]) ^ words[1]) and
// ((h >> 9) + 0.5) / 2^23 as float32 (every step exact). words: uint32 [2].
mx::array uniform_at(const mx::array& ids, const mx::array& words);

}  // namespace mlxchat
