// The sampler's per-step work over the vocabulary as single lazy MLX ops on the CPU, where MLX composes each of ~10-30
// small graph nodes: top-k (a partial sort of block maxima, then of the best blocks: ~0.6 ms of a decode step; here
// one pass with a k-slot heap) and the seeded draw's uniform numbers (two MurmurHash3 finalisers: ~30 nodes).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// Along the last axis of float32 logits [..., V] with V > k: the positions (uint32 [..., k], ascending) of the k
// largest values. Of values tied with the k-th largest, the lowest positions are taken.
mx::array top_k_index(const mx::array& logits, int k);

// core/sampling/draw.py's uniform_at, bit for bit: for each uint32 id, h = fmix32(fmix32(id ^ words[0]) ^ words[1]) and
// ((h >> 9) + 0.5) / 2^23 as float32 (every step exact). words: uint32 [2]; or [rows, 2], one pair per row of a
// batch, with ids [n] (shared: the vocabulary) or [rows, n], giving [rows, n].
mx::array uniform_at(const mx::array& ids, const mx::array& words);

// core/sampling/draw.py's Gumbel-max draw along the last axis of float32 logits [..., n]: the position (uint32 [...]) of
// argmax(logit - log(-log(uniform_at(id, words)))), MLX's ops to the bit, with no noise made for -inf logits. ids:
// uint32 [n] (shared) or one row per logits row; words: [2] (shared) or one pair per row.
mx::array gumbel_argmax(const mx::array& logits, const mx::array& ids, const mx::array& words);

// DRY's sequence breakers on one vocabulary (llama.cpp's processed breakers): each head token maps to the token
// sequences that must follow it for the breaker to be complete (empty: the head alone is one). Built once per
// (tokenizer, breakers) by core/sampling/dry.py; shared by every op that uses it.
class DryBreakers {
 public:
  DryBreakers(const std::vector<int32_t>& heads, const std::vector<int32_t>& offsets,
              const std::vector<int32_t>& tails);
  using Map = std::unordered_multimap<int32_t, std::vector<int32_t>>;
  std::shared_ptr<const Map> map;
};

// llama.cpp's DRY sampler on float32 logits [V] after the history ids (int32 [n], oldest first, already cut to the
// window): a token that would extend a sequence of length L >= allowed_length repeated earlier in the history (and
// not crossing a sequence breaker) loses multiplier * base^(L - allowed_length). Bit for bit llama.cpp's arithmetic.
mx::array dry_penalty(const mx::array& logits, const mx::array& history, const DryBreakers& breakers,
                      float multiplier, float base, int allowed_length);

// core/sampling/chain.py's token penalties, bit for bit, as one op: float32 logits [V] where each id of the history
// (int32 [n], repeats allowed) with count c = counts[id] > 0 becomes (x > 0 ? x / repetition : x * repetition),
// then x - frequency * c, then x - (c > 0 ? presence : 0); other logits unchanged. (1, 0, 0) is no penalty.
mx::array penalties(const mx::array& logits, const mx::array& ids, const mx::array& counts, float repetition,
                    float frequency, float presence);

}  // namespace mlxchat
