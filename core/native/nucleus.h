// Top-p and typical-p as one lazy MLX op on the CPU: the sampler's nucleus cut with no host sync and no full sort of
// the vocabulary in the common case, exact in every case.
#pragma once

#include <vector>

#include "mlx/array.h"

namespace mlxchat {

namespace mx = mlx::core;

// Along the last axis of float32 logits [..., V]: the logits of the kept tokens, -inf elsewhere. Kept: the smallest
// set of best-ranked finite tokens whose probability reaches p (at least one token; tokens ranked equal to the last
// kept one are kept too). Ranked by logit (top-p), or with `typical` by |surprisal - entropy| (typical-p). `p`: one
// for every row, or one per row (a batch's rows, each with its own request's p).
mx::array nucleus(const mx::array& logits, const std::vector<double>& p, bool typical);

}  // namespace mlxchat
