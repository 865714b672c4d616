"""The sampler chain: logits processors, then an ordered list of transforms, then one draw.

Each step works on the float32 logits of the last position::

    logits ─▶ processors ─▶ logprobs (log-softmax, reported)
                  │
                  └─▶ transforms, in order ─▶ draw (Gumbel-max, keyed by seed, position, id) ─▶ token

**Processors** always run first, in this fixed order: ``RepetitionPenalty`` (CTRL/HF: a positive logit ÷ r, a
negative one × r, once per distinct token in the window) → ``FrequencyPenalty`` (logit −= f × count) →
``PresencePenalty`` (logit −= p if count > 0) → ``LogitBias`` (logit += bias) → ``MinTokens`` (end-of-sequence ids
banned until N tokens were generated). Bias comes after the penalties so that a bias is never rescaled by them.
Penalties count generated tokens only, over the whole reply, unless the profile says otherwise
(``penalty_window``, ``penalize_prompt``).

**The constraint** (a profile's ``response_format``, core/sampling/constraint.py) runs between them: it sets every token
the format does not allow to -inf, so the transforms renormalise over allowed tokens and greedy or the draw picks one.
It prints first among the stages (``JsonSchema(person) → TopP(0.9) → sample``) and is traced as one.

**Transforms** run in the profile's ``sampler_order``; the default is
``top_k → typical_p → top_p → min_p → xtc → temperature`` (close to llama.cpp's; mlx-lm applies
top_p → min_p → xtc → top_k and shares only "temperature last" with it): filters cut the untempered distribution and
temperature reshapes only what survives, so changing the temperature never changes which tokens are allowed. (vLLM
and HF apply temperature first; ``sampler_order=["temperature", "top_k", ...]`` gives that.) Transforms whose setting is
neutral are left out, and ``Sampler.describe()`` prints what runs, e.g.
``RepetitionPenalty(1.1) → TopK(40) → TopP(0.9) → Temperature(0.8) → sample``. Temperature 0 is greedy: the
argmax of the processed logits (exactly ``mx.argmax``, as in mlx-lm), and no transform runs.

**No full sort of the vocabulary, and no host sync**: the candidate sets and the exact top-p/typical-p cuts are in
``core.sampling.candidates``. **Randomness** is a Gumbel-max draw keyed by (seed, position, token id)
(``core.sampling.draw``): the same seed and the same final distribution give the same token on every path. The global
MLX random state is never touched; with ``seed=None`` a fresh seed is drawn once per request and kept in
``Sampler.seed`` for reporting.

``Sampler.step`` is lazy: it builds MLX ops (including the penalty bookkeeping) and never waits on them, so the
engine can pipeline steps with ``mx.async_eval``. The logprobs it returns cost one exp over the vocabulary (~1 ms on
the 2-core CPU for 49k tokens); they are computed only if evaluated. ``mx.compile`` of the step body was measured
and is not used: ~20% faster for the full chain but slower for top-p alone on this CPU. What the full chain costs
is ops over the whole vocabulary (~0.05-0.1 ms each for 49k logits here), so it runs few of them: the penalties
change only the logits of ids in their window (one gather and one scatter, `TokenHistory.penalize`), min-tokens
scatters -inf at the end ids, and top-k partial-sorts block maxima first (`core.sampling.candidates.top_index`); the
full chain costs ~0.5 ms per step against ~0.1 ms for greedy (it was ~1.2 ms, +21..32 % TPOT in the bench).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import mlx.core as mx
import numpy as np

from .. import native
from . import dry
from .candidates import (CANDIDATES, NEG_INF, Candidates, accurate_sum, log_softmax, nucleus, top_candidates,
                         top_index)
from .constraint import Constraint
from .draw import gumbel_argmax, step_words, uniform_at
from .profile import PROCESSORS, STEPS, SamplingProfile

FLOAT_MAX = float(np.finfo(np.float32).max)
# The constraint's lazy order where it is exact (`Sampler.lazy`); off, every step masks the whole vocabulary (the
# tests' reference, and the bench's before).
LAZY_CONSTRAINT = True


# Each registry entry's implementation, by name: every ChainObject class adds itself (`__init_subclass__`).
BUILDERS: dict[str, type["ChainObject"]] = {}


class ChainObject:
    """A built chain step. It prints itself through its registry entry (``core.sampling.sampler_params.STEPS``), so a
    profile's printed chain and the built sampler's are the same text by construction. A subclass is what its entry
    builds, unless it says ``builds=False``: a base, or a variant another class's ``from_profile`` builds instead."""

    name: ClassVar[str]
    args: tuple = ()

    def __init_subclass__(cls, builds: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if builds:
            BUILDERS[cls.name] = cls

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> "ChainObject":
        return cls(*STEPS[cls.name].args(profile))

    def __repr__(self) -> str:
        return STEPS[self.name].label(*self.args)


# --- transforms: (candidates, the step's transform words) -> candidates -------------------------------------------

def _at(values: mx.array, c: Candidates, token: mx.array) -> mx.array:
    """`values` (aligned with `c`'s candidates) at token id `token` (0 when it is not a candidate)."""
    if c.ids is None:
        return values[token]
    return mx.sum(mx.where(c.ids == token, values, 0.0))


class TopNSigma(ChainObject):
    """Top-nσ (Tang et al. 2024, llama.cpp's top-n-sigma): keep the tokens whose logit is at least max − n·σ, σ the
    standard deviation of the live logits. A cut in logit space: scaling by a temperature scales max, σ and the
    distances alike, so it keeps the same tokens at any temperature."""

    name = "top_n_sigma"

    def __init__(self, n: float) -> None:
        self.args = (n,)
        self.n = n

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        live = c.logits > NEG_INF
        count = mx.sum(live).astype(mx.float32)
        mean = accurate_sum(mx.where(live, c.logits, 0.0)) / count
        sigma = mx.sqrt(accurate_sum(mx.where(live, mx.square(c.logits - mean), 0.0)) / count)
        # llama.cpp masks the cut tokens but keeps them in its array, which a dynamic temperature counts.
        present = count if c.present is None else c.present
        return Candidates(mx.where(c.logits >= mx.max(c.logits) - self.n * sigma, c.logits, NEG_INF), c.ids, present)


class TopK(ChainObject):
    name = "top_k"

    def __init__(self, k: int) -> None:
        self.args = (k,)
        self.k = k

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        out = top_candidates(c, self.k)
        if c.present is None:
            return out
        return Candidates(out.logits, out.ids, mx.minimum(c.present, self.k))



class TopP(ChainObject):
    name = "top_p"

    def __init__(self, p: float) -> None:
        self.args = (p,)
        self.p = p

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        return nucleus(c, self.p, typical=False)



class MinP(ChainObject):
    name = "min_p"

    def __init__(self, p: float) -> None:
        self.args = (p,)
        self.p = p
        self.log_p = math.log(p) if p > 0 else -math.inf

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        # prob ≥ p × max prob  ⇔  logit ≥ max logit + log p: no softmax needed.
        return Candidates(mx.where(c.logits >= mx.max(c.logits) + self.log_p, c.logits, NEG_INF), c.ids)



class TypicalP(ChainObject):
    """Locally typical sampling (Meister et al. 2022, HF's ``TypicalLogitsWarper``): keep the tokens whose surprisal
    is closest to the distribution's entropy, up to ``p`` of the probability."""

    name = "typical_p"

    def __init__(self, p: float) -> None:
        self.args = (p,)
        self.p = p

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        return nucleus(c, self.p, typical=True)



_XTC_ID = mx.array([0], mx.uint32)  # XTC's one coin per step, from the transform words


class XTC(ChainObject):
    """Exclude Top Choices (text-generation-webui / llama.cpp): with probability ``probability``, drop every token
    whose probability is at least ``threshold`` except the least likely of them."""

    name = "xtc"

    def __init__(self, threshold: float, probability: float) -> None:
        self.args = (threshold, probability)
        self.threshold = threshold
        self._log_t = math.log(threshold) if threshold > 0 else -math.inf
        self.probability = probability

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        # Compared in log space: probabilities of unlikely tokens underflow to 0 in float32 and would tie, so with
        # threshold 0 two of them were kept instead of the least likely. Masked tokens (-inf) never count.
        above = (log_softmax(c.logits) >= self._log_t) & (c.logits > NEG_INF)
        least = mx.min(mx.where(above, c.logits, math.inf))
        # Fewer than two tokens above the threshold: nothing is strictly more likely than the least, nothing drops.
        drop = above & (c.logits > least) & (uniform_at(_XTC_ID, key)[0] < self.probability)
        return Candidates(mx.where(drop, NEG_INF, c.logits), c.ids)



class Temperature(ChainObject):
    name = "temperature"

    def __init__(self, t: float) -> None:
        self.args = (t,)
        self.t = t
        self.scale = min(1 / t, 1e30)

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        logits = c.logits
        if self.scale > 1:
            # Temperature below 1: scaling raw logits can overflow to ±inf (-3e38 / 0.01 is -inf, masking a live
            # token; 0 × inf is NaN); measured from the maximum, the best token stays at 0 and the rest sink.
            logits = logits - mx.max(logits)
        return Candidates(logits * self.scale, c.ids)

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> ChainObject:
        t, spread, exponent = STEPS[cls.name].args(profile)
        return DynamicTemperature(t, spread, exponent) if spread > 0 else cls(t)

    def __repr__(self) -> str:
        return STEPS[self.name].label(self.t, 0.0, 1.0)


class DynamicTemperature(ChainObject, builds=False):
    """llama.cpp's temp-ext (Zhu et al. 2023's entropy-based dynamic temperature): the temperature runs from
    max(0, t − range) to t + range with the candidates' entropy over its maximum (log of their number), raised to
    ``exponent``: a flat distribution is sampled hotter, a peaked one colder. The candidates are the live tokens
    (llama.cpp's array size: its cuts remove what they cut, except top-nσ, `Candidates.present`)."""

    name = "temperature"

    def __init__(self, t: float, spread: float, exponent: float) -> None:
        self.args = (t, spread, exponent)
        self.low, self.high = max(0.0, t - spread), t + spread
        self.exponent = exponent

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        count = (mx.sum(c.logits > NEG_INF) if c.present is None else c.present).astype(mx.float32)
        shifted = c.logits - mx.max(c.logits)
        logprobs = shifted - mx.log(accurate_sum(mx.exp(shifted)))
        probs = mx.exp(logprobs)
        entropy = -accurate_sum(mx.where(probs > 0, probs * logprobs, 0.0))
        t = self.low + (self.high - self.low) * mx.power(entropy / mx.log(count), self.exponent)
        # A temperature of 0 (no entropy, low end 0) keeps the best token alone, as llama.cpp's temperature 0 does;
        # measured from the maximum, nothing overflows for a small one. One live token: nothing to scale.
        scaled = mx.where(t > 0, shifted / mx.maximum(t, 1e-30), mx.where(shifted == 0, 0.0, NEG_INF))
        return Candidates(mx.where(count > 1, scaled, c.logits), c.ids)


class AdaptiveP(ChainObject):
    """llama.cpp's adaptive-p (``llama_sampler_init_adaptive_p``): each candidate's new logit is
    5 − 10·d²/(1 + d), d = |p − target'| / 0.3, so tokens whose probability p is near the adapted target are
    favoured; target' = 2·target − the moving average (decay ``decay``) of the chosen tokens' probabilities before
    this stage, clamped to [0, 1], which steers that average to the target. Stateful: `update` learns from each
    drawn token."""

    name = "adaptive_p"
    _WIDTH, _PEAK, _SHARPNESS = 0.3, 5.0, 10.0

    def __init__(self, target: float, decay: float) -> None:
        self.args = (target, decay)
        self.target = min(max(target, 0.0), 1.0)
        self.decay = min(max(decay, 0.0), 0.99)
        # Primed as if the target had been met (llama.cpp's initial state), so the first steps are not skewed.
        self._weighted = mx.array(self.target / (1 - self.decay), mx.float32)
        self._total = mx.array(1 / (1 - self.decay), mx.float32)
        self._seen: tuple[mx.array, Candidates] | None = None

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        live = c.logits > NEG_INF
        shifted = c.logits - mx.max(c.logits)
        mass = mx.exp(shifted)
        probs = mass / accurate_sum(mass)
        adapted = mx.clip(2 * self.target - self._weighted / self._total, 0.0, 1.0)
        d = mx.abs(probs - adapted) * (1 / self._WIDTH)
        self._seen = (probs, c)
        return Candidates(mx.where(live, self._PEAK - self._SHARPNESS * d * d / (1 + d), NEG_INF), c.ids)

    def update(self, token: mx.array) -> None:
        """Fold the drawn token's probability (as this stage saw it) into the moving average."""
        if self._seen is None:
            return
        probs, c = self._seen
        self._weighted = _at(probs, c, token) + self.decay * self._weighted
        self._total = 1 + self.decay * self._total
        self._seen = None


_LN2 = math.log(2)


class Mirostat(ChainObject):
    """Mirostat (Basu et al. 2020, llama.cpp's mirostat and mirostat-v2): a cut that steers the chosen tokens'
    surprise (−log2 p) towards ``tau`` bits. v2 keeps the tokens whose surprise is at most μ (at least the best one);
    v1 estimates the distribution's Zipf exponent from its 100 likeliest tokens and keeps the k that a Zipf law
    predicts for surprise μ. After each draw μ −= eta × (the chosen token's surprise − tau), starting at 2·tau."""

    name = "mirostat"
    M = 100  # v1's tokens for the Zipf estimate (llama.cpp's common sampler passes 100)

    def __init__(self, version: int, tau: float, eta: float, vocab_size: int) -> None:
        self.args = (version, tau, eta)
        self.version, self.tau, self.eta, self.vocab_size = version, tau, eta, vocab_size
        self._mu = mx.array(2 * tau, mx.float32)
        self._kept: Candidates | None = None

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> "Mirostat":
        return cls(*STEPS[cls.name].args(profile), vocab_size)

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        logits = c.logits
        top = mx.max(logits)
        if self.version == 2:
            keep = (log_softmax(logits) * (-1 / _LN2) <= self._mu) | (logits == top)
        else:
            keep = logits >= self._kth(logits)
        kept = Candidates(mx.where(keep, logits, NEG_INF), c.ids)
        self._kept = kept
        return kept

    def _kth(self, logits: mx.array) -> mx.array:
        """v1's cut: the k-th largest logit, k from the Zipf estimate."""
        n = logits.size
        m = min(self.M, n)
        idx = top_index(logits, m)
        best = -mx.sort(-(logits if idx is None else logits[idx]))  # the m likeliest, best first
        lp = best - mx.max(logits) - mx.log(accurate_sum(mx.exp(logits - mx.max(logits))))
        pairs = min(m - 1, n - 1)
        t = np.log(np.arange(2, pairs + 2) / np.arange(1, pairs + 1)).astype(np.float32)
        live = mx.sum(logits > NEG_INF)
        use = mx.arange(pairs) < live - 1  # only pairs of live tokens (a banned token has p = 0)
        b = lp[:pairs] - lp[1:pairs + 1]
        t_mx = mx.array(t)
        s_hat = mx.sum(mx.where(use, t_mx * b, 0.0)) / mx.sum(mx.where(use, t_mx * t_mx, 0.0))
        eps = s_hat - 1
        k = mx.power((eps * mx.power(2.0, self._mu)) / (1 - mx.power(float(self.vocab_size), -eps)), 1 / s_hat)
        k = mx.clip(mx.nan_to_num(mx.floor(k), nan=1.0, posinf=float(n), neginf=1.0), 1, n).astype(mx.int32)
        return mx.sort(logits)[n - k]

    def update(self, token: mx.array) -> None:
        """μ −= eta × (surprise of the drawn token in the kept distribution − tau)."""
        if self._kept is None:
            return
        surprise = -_at(log_softmax(self._kept.logits), self._kept, token) / _LN2
        self._mu = self._mu - self.eta * (surprise - self.tau)
        self._kept = None


# --- processors: (logits over the vocabulary, history) -> logits --------------------------------------------------

class TokenHistory:
    """What the penalties look at: per-token counts over the window, kept as an MLX vector updated lazily, and the
    ids in the window (`ids`, oldest first, repeats included).

    The penalties change only the logits of ids in the window, so they are applied there alone (`penalize`: a gather
    and a scatter of a few hundred values) instead of over the vocabulary (~0.1 ms per op for 49k values on this
    CPU); every other logit is left as the dense formulas leave it (x - 0.0 is x). ``generated`` is a host-side
    count (known without waiting on the device)."""

    def __init__(self, vocab_size: int, window: int, seed_ids: list[int], track: bool) -> None:
        self.generated = 0
        self.track = track
        self.window = window
        if window:
            seed_ids = seed_ids[-window:]
        self.held = len(seed_ids)  # ids in the window, known on the host
        self.ids = mx.array(seed_ids, mx.int32) if track else None
        self.counts = mx.array(np.bincount(np.asarray(seed_ids, dtype=np.int64), minlength=vocab_size)
                               .astype(np.float32)) if track else None

    def accept(self, token: mx.array) -> None:
        self.generated += 1
        if not self.track:
            return
        token = token.reshape(1)
        if self.window and self.held == self.window:
            leaving = self.ids[:1]
            self.counts = self.counts.at[mx.concatenate([token, leaving])].add(mx.array([1.0, -1.0]))
            self.ids = mx.concatenate([self.ids[1:], token])
        else:
            self.counts = self.counts.at[token].add(1.0)
            self.ids = mx.concatenate([self.ids, token])
            self.held += 1

    def penalize(self, logits: mx.array, penalties: Sequence["_Penalty"]) -> mx.array:
        """`logits` with `penalties` applied in order, computed at the window's ids only (a repeated id gets the same
        value at each of its places). On the CPU, the native op does it in one node, the same bits (the graph below
        was ~20 nodes a step)."""
        if not self.held:
            return logits
        if logits.dtype == mx.float32 and mx.default_device() == mx.cpu and native.available():
            args = {type(p).name.removesuffix("_penalty"): p.args[0] for p in penalties}
            return native.penalties(logits, self.ids, self.counts, **args)
        values, counts = logits[self.ids], self.counts[self.ids]
        for p in penalties:
            values = p.shift(values, counts)
        return mx.put_along_axis(logits, self.ids, values, axis=0)


class _Penalty(ChainObject, builds=False):
    """A token penalty: `shift` moves the logits of the window's ids by their counts; `TokenHistory.penalize` applies
    the penalties together, at those ids only."""

    needs_history = True

    def __init__(self, value: float) -> None:
        self.args = (value,)
        self.value = value

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        raise NotImplementedError

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        return h.penalize(logits, [self])


class RepetitionPenalty(_Penalty):
    name = "repetition_penalty"

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        return mx.where(counts > 0, mx.where(logits > 0, logits / self.value, logits * self.value), logits)


class FrequencyPenalty(_Penalty):
    name = "frequency_penalty"

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        return logits - self.value * counts


class PresencePenalty(_Penalty):
    name = "presence_penalty"

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        return logits - mx.where(counts > 0, self.value, 0.0)


class DRY(ChainObject):
    """DRY (core/sampling/dry.py): lowers the logit of each token that would extend a sequence repeated in the history.
    Its own history of ids (the last ``last_n``, or all with -1) is kept on the device and read by the native op, so
    the pipelined decode does not wait for it."""

    name = "dry"

    def __init__(self, multiplier: float, base: float, allowed: int, last_n: int,
                 breakers: dry.Breakers = dry.NO_BREAKERS, seed_ids: Sequence[int] = ()) -> None:
        self.args = (multiplier, base, allowed, last_n)
        self.multiplier, self.base, self.allowed, self.last_n = multiplier, base, allowed, last_n
        self.breakers = breakers
        self._native_breakers = native.dry_breakers(*breakers.flat()) if native.available() else None
        seed = list(seed_ids)[-last_n:] if last_n > 0 else list(seed_ids)
        self.seed_ids = seed  # on the host, for the inspector's matched sequences
        self.held = len(seed)
        self.ids = mx.array(seed, mx.int32)

    def accept(self, token: mx.array) -> None:
        token = token.reshape(1).astype(mx.int32)
        if self.last_n > 0 and self.held == self.last_n:
            self.ids = mx.concatenate([self.ids[1:], token])
        else:
            self.ids = mx.concatenate([self.ids, token])
            self.held += 1

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        if self.held <= self.allowed:  # no repeat can be long enough yet (known on the host)
            return logits
        if self._native_breakers is not None and mx.default_device() == mx.cpu:
            return native.dry_penalty(logits, self.ids, self._native_breakers, multiplier=self.multiplier,
                                      base=self.base, allowed_length=self.allowed)
        # Without the extension: the same algorithm on the host, which waits for the history once per step.
        shifts = dry.penalties(np.asarray(self.ids).tolist(), self.breakers, self.multiplier, self.base, self.allowed)
        if not shifts:
            return logits
        ids = mx.array(list(shifts), mx.int32)
        return mx.put_along_axis(logits, ids, logits[ids] - mx.array(list(shifts.values()), mx.float32), axis=0)



class LogitBias(ChainObject):
    name = "logit_bias"

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        self.args = (bias,)
        dense = np.zeros(vocab_size, np.float32)
        dense[list(bias)] = list(bias.values())
        self.bias = bias
        self.dense_bias = mx.array(dense)

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> "LogitBias":
        return cls(profile.logit_bias, vocab_size)

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        return logits + self.dense_bias



class MinTokens(ChainObject):
    name = "min_tokens"

    def __init__(self, n: int, eos_ids: Iterable[int]) -> None:
        self.args = (n,)
        self.n = n
        # The end ids alone are set to -inf (a scatter of a few values, not a select over the vocabulary).
        self._eos = mx.array(sorted(set(eos_ids)), mx.int32)

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> "MinTokens":
        return cls(profile.min_tokens, eos_ids)

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        if h.generated >= self.n or not self._eos.size:
            return logits
        return mx.put_along_axis(logits, self._eos, mx.array(NEG_INF), axis=0)


# --- tracing: what each stage did, for the inspector (core/sampling/tracing.py turns it into
# core.sampling.trace.TokenTrace) --------

class StepRecord(NamedTuple):
    """One traced step, at M candidate token ids (lazy arrays; S transforms, P processors). The ids may repeat and
    number more than K: `core.sampling.tracing.Tracer` picks the K to show on the host, where it is cheap."""

    ids: mx.array  # (M,) token ids: the chosen one, the K likeliest, the K likeliest the last stage kept
    raw: mx.array  # (M,) the model's logits
    shifts: mx.array  # (P, M) how far each processor moved each logit (-inf: banned)
    logprobs: mx.array  # (M,) log-probability after the processors
    probs: mx.array  # (S, M) renormalised probability after each transform
    alive: mx.array  # (1 + S, M) kept after the processors, then after each transform
    entropy: mx.array  # (2,) nats, before the transforms and of the distribution sampled from
    rank: mx.array  # () how many tokens the processors made more likely than the chosen one
    dry_history: mx.array  # (n,) the ids DRY looked at this step (empty without DRY), for the matched sequences


def _normaliser(logits: mx.array) -> mx.array:
    """log Σ exp(logits): blocked like `log_softmax` over the vocabulary; one `logsumexp` over a narrowed set (at
    most CANDIDATES terms, where the sequential sum's error is negligible, and a tenth of the ops)."""
    if logits.size <= CANDIDATES:
        return mx.logsumexp(logits)
    top = mx.max(logits)
    return top + mx.log(accurate_sum(mx.exp(logits - top)))


def _stage_at(c: Candidates, ids: mx.array) -> tuple[mx.array, mx.array]:
    """A stage's renormalised probability and kept flag at token `ids`. A narrowed set is matched id by id (M x its
    size, small), so no stage is scattered back over the vocabulary."""
    if c.ids is None:
        x = c.logits[ids]
    else:
        x = mx.max(mx.where(c.ids[None, :] == ids[:, None], c.logits[None, :], NEG_INF), axis=1)
    return mx.exp(x - _normaliser(c.logits)), x > NEG_INF


def _entropy(logprobs: mx.array) -> mx.array:
    probs = mx.exp(logprobs)
    return -accurate_sum(mx.where(probs > 0, probs * logprobs, 0.0))


def _likeliest(c: Candidates, k: int) -> mx.array:
    """The token ids of (up to) the k likeliest candidates of `c` (transforms keep the order, so by processed logit)."""
    idx = top_index(c.logits, k)
    if idx is None:
        return mx.arange(c.logits.size) if c.ids is None else c.ids
    return idx if c.ids is None else c.ids[idx]


# --- the sampler ---------------------------------------------------------------------------------------------------

# One sampling step, `Sampler.step`'s signature (and `Tracer.step`'s): a position's logits in, its token and
# log-probabilities out. The decode loop (core/decode/generate.py) calls a reply's `Sample` for each row.
Sample = Callable[[mx.array], tuple[mx.array, mx.array]]


class Sampler:
    """One request's sampling state: the chain built from a profile, the penalty history and the random key.

    ``vocab_size`` is the length of the logits vector (the model's output size, which may exceed the tokenizer's);
    ``prompt_ids`` matter only with ``penalize_prompt``."""

    def __init__(self, profile: SamplingProfile, *, vocab_size: int, eos_ids: set[int] | frozenset[int],
                 prompt_ids: list[int] | None = None, constraint: Constraint | None = None,
                 dry_breakers: dry.Breakers = dry.NO_BREAKERS) -> None:
        for what, ids in (("logit_bias", profile.logit_bias), ("eos_ids", eos_ids), ("prompt_ids", prompt_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary (0..{vocab_size - 1})")
        self.profile = profile
        self.vocab_size = vocab_size
        self.seed: int = profile.seed if profile.seed is not None else secrets.randbits(64)
        self.vocab_ids = mx.arange(vocab_size, dtype=mx.uint32)

        p = profile
        seed_ids = list(prompt_ids or []) if p.penalize_prompt else []

        def build(name: str) -> Any:
            if name == "dry":  # the sequence breakers come from the model's tokenizer (core/sampling/dry.py)
                return DRY(*STEPS[name].args(p), dry_breakers, seed_ids)
            return BUILDERS[name].from_profile(p, vocab_size, eos_ids)

        self.processors: list[Any] = [build(n) for n in PROCESSORS if p.active(n)]
        self.transforms: list[Any] = [] if p.greedy else [build(t) for t in p.order() if p.active(t)]
        # Stages with state of their own: DRY keeps its history (`accept`, also for replayed tokens); Mirostat and
        # adaptive-p learn from each drawn token (`update`).
        self._accepting = [s for s in self.processors if hasattr(s, "accept")]
        self._updating = [s for s in self.transforms if hasattr(s, "update")]
        # The profile's response format, built on the model's tokenizer by the caller (core/sampling/constraint.py).
        self.constraint = constraint
        # The lazy order (llama.cpp's): draw without the mask, check the token, mask and draw again only when it is
        # not allowed. Exact where the masked chain's draw is the unmasked one's whenever that one is allowed: the
        # argmax, and the seeded Gumbel-max over logits scaled by a plain temperature >= 1 (no truncation, which
        # would cut a different set; no shift by the maximum, whose rounding differs with the mask). The check reads
        # the drawn token, waiting for the forward pass, so only where the host waits for it anyway: the CPU
        # backend (core/decode/generate.py's step); on a GPU the mask overlaps the forward pass.
        self.lazy = LAZY_CONSTRAINT and constraint is not None and mx.default_device() == mx.cpu and (
            p.greedy or all(type(t) is Temperature and t.scale <= 1 for t in self.transforms))
        track = any(getattr(proc, "needs_history", False) for proc in self.processors)
        # The penalties run first (core.sampling.profile.PROCESSORS' order): `_process` applies them in one scatter.
        self._penalties = next((i for i, proc in enumerate(self.processors)
                                if not getattr(proc, "needs_history", False)), len(self.processors))
        self.history = TokenHistory(vocab_size, p.penalty_window, seed_ids, track)

    def describe(self) -> str:
        """The chain as built, printed by its objects (equal to ``SamplingProfile.describe_chain()``)."""
        tail = "greedy" if self.profile.greedy else "sample"
        return " → ".join([repr(s) for s in self.processors + self.stages] + [tail])

    @property
    def stages(self) -> list[Any]:
        """What narrows the processed distribution, in order: the constraint, then the transforms."""
        return ([self.constraint] if self.constraint is not None else []) + self.transforms

    def step_keys(self) -> tuple[mx.array, mx.array]:
        """The next step's (draw words, transform words), from the seed and the reply's position (the tokens accepted
        so far) only: a step's noise does not depend on how the steps before it were drawn, so `step` and
        `traced_step`, a solo request and a batch row, a chat's turn and a fresh request draw alike."""
        position = self.history.generated
        return step_words(self.seed, position, 0), step_words(self.seed, position, 1)

    def replay(self, token_ids: Sequence[int]) -> None:
        """Account for tokens chosen before this sampler ran (a branch's kept and forced tokens) as if it had drawn
        them: the penalties count them and, when sampling, the position advances one step per token, so the tokens that
        follow are drawn with the noise the original reply used at those positions."""
        for token in token_ids:
            t = mx.array(token, mx.int32)
            self.history.accept(t)
            for s in self._accepting:
                s.accept(t)
        if self.constraint is not None:
            self.constraint.replay(token_ids)

    def step(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Choose the next token from the last position's logits (vocab,). Lazy: nothing is evaluated here."""
        token, logprobs, _ = self._chain(logits)
        return token, logprobs

    def scores(self, logits: mx.array) -> mx.array:
        """Every token's log-probability after the processors (penalties, bias, min-tokens, DRY) and the constraint's
        mask, lazily, with nothing drawn and no state changed: what beam search ranks continuations by
        (core/decode/beam.py)."""
        logits = mx.minimum(self._process(logits.astype(mx.float32)), FLOAT_MAX)
        if self.constraint is not None:
            logits = self.constraint(Candidates(logits, None)).logits
        return log_softmax(logits)

    def _process(self, logits: mx.array) -> mx.array:
        """The processors in order, the penalties (the first of them) in one gather and scatter: the same values as
        calling each in turn, as `traced_step` does to record each one's output."""
        penalties = self.processors[:self._penalties]
        if penalties:
            logits = self.history.penalize(logits, penalties)
        for proc in self.processors[self._penalties:]:
            logits = proc(logits, self.history)
        return logits

    def _distribution(self, logits: mx.array, outputs: list[mx.array] | None = None,
                      stages: list[Candidates] | None = None,
                      aux_words: mx.array | None = None,
                      constrain: bool = True) -> tuple[Candidates, mx.array, mx.array]:
        """The chain up to the draw: the last stage's candidates, the log-probabilities and the processed logits the
        transforms saw. Given lists, it also keeps the logits before and after each processor (`outputs`) and each
        transform's candidates (`stages`): references to arrays the chain builds anyway, no extra ops."""
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        if outputs is not None:
            outputs.append(logits)
            for proc in self.processors:
                logits = proc(logits, self.history)
                outputs.append(logits)
        else:
            logits = self._process(logits)
        # A penalty can push a logit past float32's maximum (e.g. repetition_penalty < 1); +inf would make every
        # normaliser NaN. The largest finite value keeps it the most likely token.
        logits = mx.minimum(logits, FLOAT_MAX)
        logprobs = log_softmax(logits)
        c = Candidates(logits, None)
        if self.constraint is not None and constrain:
            c = self.constraint(c)
            if stages is not None:
                stages.append(c)
        if not self.profile.greedy:
            aux_words = self.step_keys()[1] if aux_words is None else aux_words
            for transform in self.transforms:
                c = transform(c, aux_words)
                if stages is not None:
                    stages.append(c)
        return c, logprobs, logits

    def _chain(self, logits: mx.array, outputs: list[mx.array] | None = None,
               stages: list[Candidates] | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """The chain and the draw, for `step` and `traced_step` alike (so both draw the same token for a seed): the
        token, the log-probabilities and the processed logits the transforms saw (`_distribution`)."""
        if self.lazy and outputs is None and stages is None:
            token, logprobs, logits = self._lazy_draw(logits)
        elif self.profile.greedy:
            c, logprobs, logits = self._distribution(logits, outputs, stages)
            token = mx.argmax(c.logits)
        else:
            draw_words, aux_words = self.step_keys()
            c, logprobs, logits = self._distribution(logits, outputs, stages, aux_words)
            token = gumbel_argmax(c, draw_words, self.vocab_ids)
        token = token.astype(mx.int32)
        self._accept(token)
        return token, logprobs, logits

    def _lazy_draw(self, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The lazy order (see `lazy`): the unmasked chain's token when the constraint allows it, else the masked
        chain's. Same token as `_chain`'s masked path, always."""
        words = None if self.profile.greedy else self.step_keys()
        c, logprobs, logits = self._distribution(logits, aux_words=None if words is None else words[1],
                                                 constrain=False)
        token = self._draw(c, words)
        if not self.constraint.allows(token):
            c = self.constraint(Candidates(logits, None))
            for transform in self.transforms:
                c = transform(c, words[1])
            token = self._draw(c, words)
        return token, logprobs, logits

    def _draw(self, c: Candidates, words: tuple[mx.array, mx.array] | None) -> mx.array:
        return mx.argmax(c.logits) if words is None else gumbel_argmax(c, words[0], self.vocab_ids)

    def drawn(self, token: mx.array) -> None:
        """Take, as drawn, a token this sampler's chain drew outside `step` (a batch's rows,
        core/sampling/batch_sampling.py)."""
        self._accept(token)

    def _accept(self, token: mx.array) -> None:
        self.history.accept(token)
        for s in self._accepting:
            s.accept(token)
        for s in self._updating:
            s.update(token)
        if self.constraint is not None:
            self.constraint.accept(token)

    def traced_step(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array, StepRecord]:
        """`step`, also recording what every stage of the chain did to the `k` candidates worth showing.

        The chain is `step`'s own (`_chain`), so a seed gives the same tokens traced or not (tests/test_trace.py
        checks it). The extra work is one partial sort of the vocabulary (the likeliest tokens), the entropy before
        the chain, and per stage a normaliser (over the vocabulary only for a stage that has not narrowed it). Lazy,
        like `step`."""
        outputs: list[mx.array] = []  # before and after each processor
        stages: list[Candidates] = []
        dry_stage = next((p for p in self.processors if isinstance(p, DRY)), None)
        dry_ids = dry_stage.ids if dry_stage is not None else mx.zeros((0,), mx.int32)  # before this step's token
        token, logprobs, logits = self._chain(logits, outputs, stages)
        processed = Candidates(logits, None)
        final = stages[-1] if stages else processed
        ids = mx.concatenate([token[None], _likeliest(processed, k), *([_likeliest(final, k)] if stages else [])])
        at = [_stage_at(stage, ids) for stage in stages]
        rows = lambda xs: mx.stack(xs) if xs else mx.zeros((0, ids.size))  # noqa: E731
        seen = rows([o[ids] for o in outputs])  # gathered first: each shift is then an op on M values, not V
        moved = seen[1:] - seen[:-1]
        shifts = mx.where(seen[1:] == seen[:-1], 0.0, moved)  # a banned token's shift is -inf, not NaN
        final_logprobs = final.logits - _normaliser(final.logits) if stages else logprobs
        record = StepRecord(ids, seen[0], shifts, logprobs[ids], rows([p for p, _ in at]),
                            rows([logits[ids] > NEG_INF, *(a for _, a in at)]),
                            mx.stack([_entropy(logprobs), _entropy(final_logprobs)]), mx.sum(logits > logits[token]),
                            dry_ids)
        return token, logprobs, record

    @staticmethod
    def top_logprobs(logprobs: mx.array, token: mx.array | int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """Host side, after evaluation: the chosen token's logprob and the n most likely (id, logprob), best first."""
        lp = np.asarray(logprobs).reshape(-1)
        n = min(n, lp.size)
        best: list[tuple[int, float]] = []
        if n > 0:
            idx = np.argpartition(-lp, n - 1)[:n]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            best = [(int(i), float(lp[i])) for i in idx]
        return float(lp[int(token.item() if isinstance(token, mx.array) else token)]), best


def final_distribution(profile: SamplingProfile, logits: Any, history: Sequence[int] = (), *,
                       breakers: dry.Breakers = dry.NO_BREAKERS) -> np.ndarray:
    """The probabilities over the vocabulary after `profile`'s whole chain (0 for every token a stage cut), for
    `logits` (the model's, 1-D) after the reply's token ids `history` (what the penalties and DRY look at).

    For scripts and tests (tests/test_llama_samplers.py compares it with llama.cpp's samplers). Stateless stages
    only: Mirostat and adaptive-p learn from the tokens drawn before, which `history` does not say. A greedy profile
    gives its argmax probability 1. `breakers` are DRY's sequence breakers on the vocabulary
    (`core.sampling.dry.breakers_for` of the model's tokenizer); without them DRY runs with none."""
    if profile.mirostat or profile.active("adaptive_p"):
        raise ValueError("final_distribution covers stateless stages only: mirostat and adaptive_p depend on the "
                         "tokens drawn before (test them through seeded replies)")
    x = mx.array(np.asarray(logits, dtype=np.float32).reshape(-1))
    sampler = Sampler(profile, vocab_size=x.size, eos_ids=frozenset(), dry_breakers=breakers)
    sampler.replay(list(history))
    c, _, _ = sampler._distribution(x)
    if profile.greedy:
        out = np.zeros(x.size)
        out[int(mx.argmax(c.logits).item())] = 1.0
        return out
    shifted = c.logits - mx.max(c.logits)
    probs = np.asarray(mx.exp(shifted) / accurate_sum(mx.exp(shifted)), dtype=np.float64)
    out = np.zeros(x.size)
    if c.ids is None:
        out[:] = probs
    else:
        out[np.asarray(c.ids)] = probs
    return out


__all__ = [
    "AdaptiveP", "DRY", "DynamicTemperature", "Mirostat", "TopNSigma", "final_distribution",
    "FrequencyPenalty", "LogitBias", "MinP", "MinTokens", "PresencePenalty", "RepetitionPenalty", "Sample", "Sampler",
    "StepRecord", "Temperature", "TokenHistory", "TopK", "TopP", "TypicalP", "XTC",
]
