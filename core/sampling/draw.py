"""The seeded draw: noise that belongs to (seed, position, token id).

A sampled step is a Gumbel-max draw whose noise is a function of (seed, position, token id) alone: the token is
``argmax(logit[i] + g(seed, position, i))`` over the final candidates, where ``g`` is Gumbel noise made by hashing
the token id with two words derived from the seed and the reply's position (``step_words``). The global MLX random
state is never touched. Because the noise belongs to the token id, not to its place in a candidate array, the draw
depends only on the final distribution: the same seed and the same final distribution at a step give the same token
whatever order the chain narrowed the candidates in, whether a no-op stage ran, and on which path the request came
(a chat's turn N, a fresh request, a batch row, the server, a traced run). Last-bit differences in the logits
between paths (a cached prefix vs a fresh prefill, a GEMM in a batch vs a GEMV alone) move the draw only where two
candidates' noisy scores tie to within that difference.
"""

from __future__ import annotations

import mlx.core as mx

from .. import native
from .candidates import Candidates

_MASK64 = (1 << 64) - 1
_FMIX1 = mx.array(0x85EBCA6B, mx.uint32)
_FMIX2 = mx.array(0xC2B2AE35, mx.uint32)


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a 64-bit word that looks random for each input (host side, per step)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_pair(seed: int, position: int, stream: int) -> list[int]:
    """`step_words` as host ints (a batch's rows make one array of them)."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (2 * position + stream))
    return [z & 0xFFFFFFFF, z >> 32]


def step_words(seed: int, position: int, stream: int) -> mx.array:
    """Two uint32 words that key the noise of one (seed, position, stream): stream 0 is the draw, 1 the transforms'
    own randomness (XTC). Made on the host from Python ints, so no key is threaded from step to step."""
    return mx.array(step_pair(seed, position, stream), mx.uint32)


def _fmix32(h: mx.array) -> mx.array:
    """MurmurHash3's finaliser: a bijection on uint32 in which every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * _FMIX1
    h = h ^ (h >> 13)
    h = h * _FMIX2
    return h ^ (h >> 16)


def uniform_at(ids: mx.array, words: mx.array) -> mx.array:
    """A uniform number in (0, 1) for each uint32 id, fixed by `words`: 2^23 levels strictly inside the interval (so
    the logs of a Gumbel draw stay finite), each exact in float32 (so every backend gives the same bits). On the CPU
    with the native extension, the same bits as one op (here ~30 graph nodes, each a dispatch in a decode step).
    Words [rows, 2] key each row of a batch apart: ids [n] (shared) or [rows, n] give [rows, n]."""
    if mx.default_device() == mx.cpu and native.available():
        return native.uniform_at(ids, words)
    w0, w1 = (words[0], words[1]) if words.ndim == 1 else (words[:, :1], words[:, 1:])
    h = _fmix32(_fmix32(ids ^ w0) ^ w1)
    return ((h >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_positions(logits: mx.array, ids: mx.array, words: mx.array) -> mx.array:
    """The positions of argmax(logit - log(-log(u))) along the last axis, u = `uniform_at(ids, words)` (words [2], or
    [rows, 2] for a batch's rows). On the CPU with the native extension, one op with the same bits that makes no noise
    for masked tokens (after a top-p, ~0.6 ms of hashing and logs over a 49k vocabulary, most of the chain's cost)."""
    if mx.default_device() == mx.cpu and native.available() and logits.dtype == mx.float32:
        return native.gumbel_argmax(logits, ids, words)
    return mx.argmax(logits - mx.log(-mx.log(uniform_at(ids, words))), axis=-1)


def gumbel_argmax(c: Candidates, words: mx.array, vocab_ids: mx.array) -> mx.array:
    """The Gumbel-max draw from softmax(c.logits): argmax(logit + Gumbel noise), the noise of each candidate taken
    from its token id, so the result does not depend on the candidates' order or on which stage narrowed them."""
    best = gumbel_positions(c.logits, vocab_ids if c.ids is None else c.ids.astype(mx.uint32), words)
    return best if c.ids is None else c.ids[best]
