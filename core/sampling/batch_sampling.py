"""A batch's rows sampled together: one set of ops over [rows, V] for the rows whose chains allow it.

The step loop (core/decode/generate.py) samples each row with its own `Sampler.step`: per row a slice of the logits and
the chain's ops over its vocabulary, each a graph node that MLX's CPU backend dispatches one by one. Rows whose chains
have the same steps run them here once over all their rows, each row with its own values (temperature, top-p, min-p,
its seed and position for the draw), so that every row's token is the one its own `Sampler.step` draws (greedy: the
same argmax; sampled: the same Gumbel-max noise per (seed, position, token id) over the same final logits; each op
below is the per-row op along the last axis, value for value). tests/test_batch_sampling.py holds them to that.

Batched (`chain_key`): no processor but a logit bias, no constraint, and transforms among temperature, top-k (rows
with the same k: the candidate sets must line up), top-p and min-p, in any order. Every other row keeps its own
`Sampler.step`: the penalties and DRY keep per-row histories, a constraint masks per row on the host, and the other
transforms (typical-p, XTC, top-nσ, dynamic temperature, Mirostat, adaptive-p) were not worth their batched forms
yet; nor are traced rows or rows whose reasoning budget may force tokens (`Reply.batch_sampler`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .. import native
from .candidates import NEG_INF, nucleus_path
from .chain import FLOAT_MAX, LogitBias, MinP, Sampler, Temperature, TopK, TopP
from .draw import gumbel_positions, step_pair

_BATCHED = (Temperature, TopK, TopP, MinP)  # exactly these classes: DynamicTemperature is another chain


def chain_key(s: Sampler) -> tuple | None:
    """What rows must share to be sampled together (their chain's steps, and top-k's k), or None: this row samples
    alone. Top-k and top-p batch only where their per-row ops are one native op each (else the fallbacks select by
    partial sorts that need not break ties alike, or wait on the device)."""
    if s.constraint is not None or any(type(p) is not LogitBias for p in s.processors):
        return None
    if any(type(t) not in _BATCHED for t in s.transforms):
        return None
    native_cuts = mx.default_device() == mx.cpu and native.available() and nucleus_path() == "native"
    if not native_cuts and any(type(t) in (TopK, TopP) for t in s.transforms):
        return None
    return s.profile.greedy, tuple((t.name, t.k if type(t) is TopK else None) for t in s.transforms)


def _column(values: Sequence[float]) -> mx.array:
    """Per-row float32 values as a [rows, 1] column (a Python float meets float32 logits as float32 too)."""
    return mx.array(values, mx.float32)[:, None]


def _bias(samplers: Sequence[Sampler], vocab: int) -> mx.array | None:
    """The rows' logit biases as [rows, V] (zeros for a row without one), or None when no row has one."""
    dense = [next((p.dense_bias for p in s.processors), None) for s in samplers]
    if all(d is None for d in dense):
        return None
    zeros = mx.zeros((vocab,), mx.float32)
    return mx.stack([zeros if d is None else d for d in dense])


def apply_temperature(logits: mx.array, ts: Sequence[Temperature]) -> mx.array:
    """`Temperature` per row: below 1, measured from the row's maximum first (see there), then scaled."""
    shift = [t.scale > 1 for t in ts]
    if any(shift):  # (a select only for a mix: each op over [rows, V] is ~0.1 ms here)
        shifted = logits - mx.max(logits, axis=-1, keepdims=True)
        logits = shifted if all(shift) else mx.where(mx.array(shift)[:, None], shifted, logits)
    return logits * _column([t.scale for t in ts])


def apply_min_p(logits: mx.array, ts: Sequence[MinP]) -> mx.array:
    """`MinP` per row: keep logit >= the row's max + log p."""
    cut = mx.max(logits, axis=-1, keepdims=True) + _column([t.log_p for t in ts])
    return mx.where(logits >= cut, logits, NEG_INF)


def apply_top_p(logits: mx.array, ts: Sequence[TopP]) -> mx.array:
    """`TopP` per row: the native nucleus op with one p per row."""
    return native.nucleus(logits, [t.p for t in ts])


def apply_top_k(logits: mx.array, ids: mx.array | None, k: int) -> tuple[mx.array, mx.array | None]:
    """`TopK` (one k for the rows): each row's k best, as (logits, token ids) [rows, k], ids ascending as the native op
    gives them to a row alone."""
    if k >= logits.shape[-1]:
        return logits, ids
    idx = native.top_k_index(logits, k)
    return mx.take_along_axis(logits, idx, axis=-1), idx if ids is None else mx.take_along_axis(ids, idx, axis=-1)


def gumbel_argmax_rows(logits: mx.array, ids: mx.array | None, words: mx.array, vocab_ids: mx.array) -> mx.array:
    """`core.sampling.draw.gumbel_argmax` per row, each row keyed by its own words ([rows, 2]): token ids [rows]."""
    best = gumbel_positions(logits, vocab_ids if ids is None else ids.astype(mx.uint32), words)
    return best if ids is None else mx.take_along_axis(ids, best[:, None], axis=-1)[:, 0]


def processed(samplers: Sequence[Sampler], logits: mx.array) -> mx.array:
    """The logits [rows, V] after the rows' processors (a logit bias at most), as `Sampler._distribution` leaves them
    for the transforms (and for the reported log-probabilities)."""
    if logits.dtype != mx.float32:
        logits = logits.astype(mx.float32)
    bias = _bias(samplers, logits.shape[-1])
    if bias is not None:
        logits = logits + bias
    return mx.minimum(logits, FLOAT_MAX)


def sample_rows(samplers: Sequence[Sampler], logits: mx.array) -> tuple[mx.array, mx.array]:
    """The next token (int32 [rows]) of each sampler in `samplers` (all with the same `chain_key`) from its row of
    `logits` [rows, V], the token its own `step` would draw; each sampler takes it as drawn. Also the processed logits
    [rows, V], whose row's `log_softmax` is the log-probabilities that row's `step` reports. Lazy."""
    s0 = samplers[0]
    x = before = processed(samplers, logits)
    if s0.profile.greedy:
        tokens = mx.argmax(x, axis=-1)
    else:
        # The draw's words before the position advances (`Sampler.step_keys`'s stream 0).
        words = mx.array([step_pair(s.seed, s.history.generated, 0) for s in samplers], mx.uint32)
        ids = None
        for j, t in enumerate(s0.transforms):
            column = [s.transforms[j] for s in samplers]
            if type(t) is TopK:
                x, ids = apply_top_k(x, ids, t.k)
            elif type(t) is TopP:
                x = apply_top_p(x, column)
            elif type(t) is MinP:
                x = apply_min_p(x, column)
            else:
                x = apply_temperature(x, column)
        tokens = gumbel_argmax_rows(x, ids, words, s0.vocab_ids)
    tokens = tokens.astype(mx.int32)
    for i, s in enumerate(samplers):
        s.drawn(tokens[i])
    return tokens, before


__all__ = ["apply_min_p", "apply_temperature", "apply_top_k", "apply_top_p", "chain_key", "gumbel_argmax_rows",
           "processed", "sample_rows"]
