"""The candidate set a sampler's transforms narrow, and the exact mass cuts over it (top-p, typical-p).

Each transform of ``core.sampling.chain`` sees a candidate set (values and their token ids), initially the whole
vocabulary. ``TopK`` shrinks it (`top_index`: the native extension's one-pass op on the CPU, else ``mx.argpartition``
over the maxima of blocks first). ``TopP`` and ``TypicalP``
keep the smallest set of the best-ranked tokens (most likely for top-p; for typical-p, closest to the entropy by
surprisal, which is ``|logit - max - E[logit - max]|``, no log needed) whose probability reaches ``p``, ties with the
last kept one kept too; the same set (up to rounding right at the cut) on each of three paths (``nucleus_path()``). On
the CPU, the native extension's ``nucleus`` op (core/native) cuts lazily in ~0.1 ms for 49k tokens: one vectorised exp
with sums in double, a histogram of the mass over the rank that locates the cut in one bucket, and a sort of that
bucket's few tokens. On a GPU, a lazy full ``mx.argsort`` (cheap there). On the CPU without the extension, the
``CANDIDATES`` (1024) best-ranked tokens are found with ``mx.argpartition`` and sorted, with a check that the cut lies
among them, else the whole set is sorted; that check is one host sync per step, so there the pipelined decode waits
for each step's forward pass before building the next. Each path takes one exp over the candidates. Sums over the
vocabulary are blocked (``accurate_sum``) or in double: MLX's sequential float32 sum moved the cut by ~1e-4 of the
mass. ``MinP`` and ``XTC`` are thresholds and need no order. The draw (``core.sampling.draw``) hashes noise for every
candidate left: after a top-k that is nothing measurable; after a top-p over the whole vocabulary (a masked set of 49k)
it was ~0.65 ms here, most of that chain's cost, until the native draw skipped the masked tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .. import native

CANDIDATES = 1024
BLOCK = 256
TOP_BLOCK = 64  # values per block of `top_index`'s first pass
NEG_INF = float("-inf")


class Candidates(NamedTuple):
    """The tokens still in play: their logits (-inf = masked) and token ids (None = the vocabulary, in order).

    ``present``: how many tokens llama.cpp's candidate array would still hold, where that is not the live count:
    its top-nσ masks tokens to -inf without removing them, and its dynamic temperature divides by the log of the
    array's size (None: the live tokens, which is what every other cut leaves)."""

    logits: mx.array
    ids: mx.array | None
    present: mx.array | None = None

    def take(self, idx: mx.array) -> Candidates:
        return Candidates(self.logits[idx], idx if self.ids is None else self.ids[idx])


def top_index(logits: mx.array, k: int) -> mx.array | None:
    """Positions of the k largest values; None when there are no more than k.

    On the CPU with the native extension, one op (`native.top_k_index`, one pass with a k-slot heap; ties to the
    k-th value go to the lowest positions): the partial sorts below were ~10 graph nodes and, in a decode step,
    ~0.6 ms of the full sampler chain's ~1 ms over greedy. Elsewhere, by partial sort.

    A partial sort of the whole vocabulary costs ~0.6 ms on this CPU (49k values). When k is small against it, the
    k largest values lie in the k blocks of TOP_BLOCK values whose maxima are largest (each block holding one of
    them has a maximum at least that large, and fewer than k blocks can have a larger one), so the partial sort runs
    over those blocks' maxima and then over their k x TOP_BLOCK values: ~0.07 ms, the same set (ties broken
    arbitrarily, as by one partial sort)."""
    n = logits.size
    if k >= n:
        return None
    if logits.dtype == mx.float32 and mx.default_device() == mx.cpu and native.available():
        return native.top_k_index(logits, k)
    blocks = n // TOP_BLOCK
    if blocks < 4 * k:
        return mx.argpartition(logits, n - k)[n - k:]
    whole = blocks * TOP_BLOCK
    grid = logits[:whole].reshape(blocks, TOP_BLOCK)
    best = mx.argpartition(mx.max(grid, axis=1), blocks - k)[blocks - k:]
    pool = grid[best].reshape(-1)
    if whole < n:  # the tail past the last whole block is always in the pool
        pool = mx.concatenate([pool, logits[whole:]])
    pick = mx.argpartition(pool, pool.size - k)[pool.size - k:]
    in_blocks = best[pick // TOP_BLOCK] * TOP_BLOCK + pick % TOP_BLOCK
    return in_blocks if whole == n else mx.where(pick < k * TOP_BLOCK, in_blocks, pick - k * TOP_BLOCK + whole)


def _narrow(idx: mx.array | None, rank: mx.array, mass: mx.array, target: mx.array) -> mx.array | None:
    """`idx` (the CANDIDATES best-ranked tokens) if the cut lies among them, else None: the cut then needs the whole
    vocabulary sorted. The cut lies among them when their tokens ranked strictly ahead of their worst hold `target` of
    the (unnormalised) `mass`: then every token tied with the last kept one is among them too. A lazy graph cannot
    branch on data, so this one check waits on the device (a host sync per step, on the CPU without the native
    extension only); it keeps the common case at a partial sort and the rare flat distribution exact."""
    if idx is None:
        return None
    rank, mass = rank[idx], mass[idx]
    if (accurate_sum(mx.where(rank < mx.max(rank), mass, 0.0)) >= target).item():
        return idx
    return None


def top_candidates(c: Candidates, k: int) -> Candidates:
    """The k most likely candidates (all of them when there are no more than k)."""
    idx = top_index(c.logits, k)
    return c if idx is None else c.take(idx)


def accurate_sum(x: mx.array, axis: int | None = None) -> mx.array:
    """Sum of a float32 vector in blocks of BLOCK, then over the block totals.

    MLX's CPU reduction adds sequentially, so its rounding error grows with the length: over a 49k vocabulary
    ``mx.logsumexp`` was off by ~1e-4 relative, enough to move a top-p cut. Two levels keep the error near float32
    rounding for the cost of one reshape (measured in the report of issue #12, item 18)."""
    n = x.size
    pad = (-n) % BLOCK
    if pad:
        x = mx.concatenate([x, mx.zeros(pad, x.dtype)])
    return mx.sum(mx.sum(x.reshape(-1, BLOCK), axis=1))


def accurate_cumsum(x: mx.array) -> mx.array:
    """Running sum of a float32 vector, blocked like `accurate_sum` (the last terms of a sequential cumsum over the
    vocabulary carry the same error)."""
    n = x.size
    if n <= BLOCK:
        return mx.cumsum(x)
    pad = (-n) % BLOCK
    if pad:
        x = mx.concatenate([x, mx.zeros(pad, x.dtype)])
    blocks = mx.cumsum(x.reshape(-1, BLOCK), axis=1)
    offsets = mx.cumsum(blocks[:, -1]) - blocks[:, -1]
    return (blocks + offsets[:, None]).reshape(-1)[:n]


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities: shifted by the maximum first (near float32's maximum, ``x - logsumexp(x)`` loses the
    normaliser or gives NaN), normalised with `accurate_sum`."""
    shifted = logits - mx.max(logits)
    return shifted - mx.log(accurate_sum(mx.exp(shifted)))


def _mass_cut(c: Candidates, rank: mx.array, mass: mx.array, target: mx.array) -> Candidates:
    """Keep the smallest prefix, in ascending ``rank``, whose (unnormalised) ``mass`` reaches ``target`` (always ≥ 1
    token). Ties with the last kept rank are kept too. A full sort of ``c``: cheap on a GPU, or when ``c`` is small."""
    order = mx.argsort(rank)
    sorted_rank, sorted_mass = rank[order], mass[order]
    before = accurate_cumsum(sorted_mass) - sorted_mass  # mass strictly ahead of each token
    last = mx.sum(before < target) - 1                    # before[0] == 0 < target: at least one token
    return Candidates(mx.where(rank <= sorted_rank[last], c.logits, NEG_INF), c.ids)


def _ranked(logits: mx.array, typical: bool) -> tuple[mx.array, mx.array, mx.array]:
    """(rank, mass, total) for the MLX paths: ascending rank (by logit for top-p, by |surprisal - entropy| for
    typical-p), unnormalised mass exp(logit - max) and its blocked total, for one exp over the candidates. With
    s = logit - max and Z = total: surprisal = log Z - s and entropy = log Z - E[s], so the typical rank is
    |s - E[s]|, with no log and no second exp (the same identity as the native op's)."""
    shifted = logits - mx.max(logits)
    mass = mx.exp(shifted)
    total = accurate_sum(mass)
    if not typical:
        return -logits, mass, total
    mean = accurate_sum(mx.where(mass > 0, mass * shifted, 0.0)) / total  # a masked token's 0 × -inf is NaN
    return mx.abs(shifted - mean), mass, total


def nucleus_path() -> str:
    """How top-p and typical-p cut here: "native" (the extension's op, on the CPU), "sort" (a full sort, on a GPU,
    where sorts are cheap) or "narrow" (the CPU without the extension: a partial sort and one host sync per step)."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return "sort"
    return "native" if native.available() else "narrow"


def nucleus(c: Candidates, p: float, *, typical: bool, path: str | None = None) -> Candidates:
    """Top-p (or typical-p) of the candidates, the same set on every path (`nucleus_path()` unless given): lazy on
    the "native" and "sort" paths; "narrow" waits on the device once (`_narrow`)."""
    path = path or nucleus_path()
    if path == "native":
        return Candidates(native.nucleus(c.logits, p, typical=typical), c.ids)
    rank, mass, total = _ranked(c.logits, typical)
    target = p * total
    if path == "narrow":
        # The most typical tokens, for typical-p, not the most likely: the typical set can lie outside the top.
        idx = _narrow(top_index(-rank, CANDIDATES), rank, mass, target)
        if idx is not None:
            c, rank, mass = c.take(idx), rank[idx], mass[idx]
    return _mass_cut(c, rank, mass, target)
