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

**The constraint** (a profile's ``response_format``, core/constraint.py) runs between them: it sets every token the
format does not allow to -inf, so the transforms renormalise over allowed tokens and greedy or the draw picks one.
It prints first among the stages (``JsonSchema(person) → TopP(0.9) → sample``) and is traced as one.

**Transforms** run in the profile's ``sampler_order``; the default is
``top_k → typical_p → top_p → min_p → xtc → temperature`` (close to llama.cpp's; mlx-lm applies
top_p → min_p → xtc → top_k and shares only "temperature last" with it): filters cut the untempered distribution and temperature
reshapes only what survives, so changing the temperature never changes which tokens are allowed. (vLLM and HF apply
temperature first; ``sampler_order=["temperature", "top_k", ...]`` gives that.) Transforms whose setting is
neutral are left out, and ``Sampler.describe()`` prints what runs, e.g.
``RepetitionPenalty(1.1) → TopK(40) → TopP(0.9) → Temperature(0.8) → sample``. Temperature 0 is greedy: the
argmax of the processed logits (exactly ``mx.argmax``, as in mlx-lm), and no transform runs.

**No full sort of the vocabulary, and no host sync**: the candidate sets and the exact top-p/typical-p cuts are in
``core.candidates``. **Randomness** is a Gumbel-max draw keyed by (seed, position, token id) (``core.draw``): the
same seed and the same final distribution give the same token on every path. The global MLX random state is never
touched; with ``seed=None`` a fresh seed is drawn once per request and kept in ``Sampler.seed`` for reporting.

``Sampler.step`` is lazy: it builds MLX ops (including the penalty bookkeeping) and never waits on them, so the
engine can pipeline steps with ``mx.async_eval``. The logprobs it returns cost one exp over the vocabulary (~1 ms on
the 2-core CPU for 49k tokens); they are computed only if evaluated. ``mx.compile`` of the step body was measured
and is not used: ~20% faster for the full chain but slower for top-p alone on this CPU. What the full chain costs
is ops over the whole vocabulary (~0.05-0.1 ms each for 49k logits here), so it runs few of them: the penalties
change only the logits of ids in their window (one gather and one scatter, `TokenHistory.penalize`), min-tokens
scatters -inf at the end ids, and top-k partial-sorts block maxima first (`core.candidates.top_index`); the full
chain costs ~0.5 ms per step against ~0.1 ms for greedy (it was ~1.2 ms, +21..32 % TPOT in the bench).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import mlx.core as mx
import numpy as np

from .candidates import (CANDIDATES, NEG_INF, Candidates, accurate_sum, log_softmax, nucleus, top_candidates,
                         top_index)
from .constraint import Constraint
from .draw import gumbel_argmax, step_words, uniform_at
from .profile import PROCESSORS, STEPS, SamplingProfile

FLOAT_MAX = float(np.finfo(np.float32).max)


class ChainObject:
    """A built chain step. It prints itself through its registry entry (``core.profile.STEPS``), so a profile's
    printed chain and the built sampler's are the same text by construction."""

    name: ClassVar[str]
    args: tuple = ()

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> "ChainObject":
        return cls(*STEPS[cls.name].args(profile))

    def __repr__(self) -> str:
        return STEPS[self.name].label(*self.args)


# --- transforms: (candidates, the step's transform words) -> candidates -------------------------------------------

class TopK(ChainObject):
    name = "top_k"

    def __init__(self, k: int) -> None:
        self.args = (k,)
        self.k = k

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        return top_candidates(c, self.k)



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
        self._log_p = math.log(p) if p > 0 else -math.inf

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        # prob ≥ p × max prob  ⇔  logit ≥ max logit + log p: no softmax needed.
        return Candidates(mx.where(c.logits >= mx.max(c.logits) + self._log_p, c.logits, NEG_INF), c.ids)



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
        self._scale = min(1 / t, 1e30)

    def __call__(self, c: Candidates, key: mx.array) -> Candidates:
        logits = c.logits
        if self._scale > 1:
            # Temperature below 1: scaling raw logits can overflow to ±inf (-3e38 / 0.01 is -inf, masking a live
            # token; 0 × inf is NaN); measured from the maximum, the best token stays at 0 and the rest sink.
            logits = logits - mx.max(logits)
        return Candidates(logits * self._scale, c.ids)



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

    def penalize(self, logits: mx.array, penalties: Sequence["RepetitionPenalty | FrequencyPenalty | PresencePenalty"]
                 ) -> mx.array:
        """`logits` with `penalties` applied in order, computed at the window's ids only (a repeated id gets the same
        value at each of its places)."""
        if not self.held:
            return logits
        values, counts = logits[self.ids], self.counts[self.ids]
        for p in penalties:
            values = p.shift(values, counts)
        return mx.put_along_axis(logits, self.ids, values, axis=0)


class RepetitionPenalty(ChainObject):
    name = "repetition_penalty"
    needs_history = True

    def __init__(self, r: float) -> None:
        self.args = (r,)
        self.r = r

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        return mx.where(counts > 0, mx.where(logits > 0, logits / self.r, logits * self.r), logits)

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        return h.penalize(logits, [self])



class FrequencyPenalty(ChainObject):
    name = "frequency_penalty"
    needs_history = True

    def __init__(self, f: float) -> None:
        self.args = (f,)
        self.f = f

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        return logits - self.f * counts

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        return h.penalize(logits, [self])



class PresencePenalty(ChainObject):
    name = "presence_penalty"
    needs_history = True

    def __init__(self, p: float) -> None:
        self.args = (p,)
        self.p = p

    def shift(self, logits: mx.array, counts: mx.array) -> mx.array:
        return logits - mx.where(counts > 0, self.p, 0.0)

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        return h.penalize(logits, [self])



class LogitBias(ChainObject):
    name = "logit_bias"

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        self.args = (bias,)
        dense = np.zeros(vocab_size, np.float32)
        dense[list(bias)] = list(bias.values())
        self.bias = bias
        self._dense = mx.array(dense)

    @classmethod
    def from_profile(cls, profile: SamplingProfile, vocab_size: int, eos_ids: Iterable[int]) -> "LogitBias":
        return cls(profile.logit_bias, vocab_size)

    def __call__(self, logits: mx.array, h: TokenHistory) -> mx.array:
        return logits + self._dense



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



IMPLEMENTATIONS: dict[str, type[ChainObject]] = {cls.name: cls for cls in (
    RepetitionPenalty, FrequencyPenalty, PresencePenalty, LogitBias, MinTokens,
    TopK, TypicalP, TopP, MinP, XTC, Temperature)}
assert set(IMPLEMENTATIONS) == set(STEPS), "every registry entry needs its implementation"


# --- tracing: what each stage did, for the inspector (core/tracing.py turns it into core.trace.TokenTrace) --------

class StepRecord(NamedTuple):
    """One traced step, at M candidate token ids (lazy arrays; S transforms, P processors). The ids may repeat and
    number more than K: `core.tracing.Tracer` picks the K to show on the host, where it is cheap."""

    ids: mx.array  # (M,) token ids: the chosen one, the K likeliest, the K likeliest the last stage kept
    raw: mx.array  # (M,) the model's logits
    shifts: mx.array  # (P, M) how far each processor moved each logit (-inf: banned)
    logprobs: mx.array  # (M,) log-probability after the processors
    probs: mx.array  # (S, M) renormalised probability after each transform
    alive: mx.array  # (1 + S, M) kept after the processors, then after each transform
    entropy: mx.array  # (2,) nats, before the transforms and of the distribution sampled from
    rank: mx.array  # () how many tokens the processors made more likely than the chosen one


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

class Sampler:
    """One request's sampling state: the chain built from a profile, the penalty history and the random key.

    ``vocab_size`` is the length of the logits vector (the model's output size, which may exceed the tokenizer's);
    ``prompt_ids`` matter only with ``penalize_prompt``."""

    def __init__(self, profile: SamplingProfile, *, vocab_size: int, eos_ids: set[int] | frozenset[int],
                 prompt_ids: list[int] | None = None, constraint: Constraint | None = None) -> None:
        for what, ids in (("logit_bias", profile.logit_bias), ("eos_ids", eos_ids), ("prompt_ids", prompt_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary (0..{vocab_size - 1})")
        self.profile = profile
        self.vocab_size = vocab_size
        self.seed: int = profile.seed if profile.seed is not None else secrets.randbits(64)
        self._vocab_ids = mx.arange(vocab_size, dtype=mx.uint32)

        p = profile
        build = lambda name: IMPLEMENTATIONS[name].from_profile(p, vocab_size, eos_ids)  # noqa: E731
        self.processors: list[Any] = [build(n) for n in PROCESSORS if p.active(n)]
        self.transforms: list[Any] = [] if p.greedy else [build(t) for t in p.order() if p.active(t)]
        # The profile's response format, built on the model's tokenizer by the caller (core/constraint.py).
        self.constraint = constraint
        track = any(getattr(proc, "needs_history", False) for proc in self.processors)
        # The penalties run first (core.profile.PROCESSORS' order): `_process` applies them in one scatter.
        self._penalties = next((i for i, proc in enumerate(self.processors)
                                if not getattr(proc, "needs_history", False)), len(self.processors))
        self.history = TokenHistory(vocab_size, p.penalty_window, list(prompt_ids or []) if p.penalize_prompt else [],
                                    track)

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
            self.history.accept(mx.array(token, mx.int32))
        if self.constraint is not None:
            self.constraint.replay(token_ids)

    def step(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Choose the next token from the last position's logits (vocab,). Lazy: nothing is evaluated here."""
        token, logprobs, _ = self._chain(logits)
        return token, logprobs

    def _process(self, logits: mx.array) -> mx.array:
        """The processors in order, the penalties (the first of them) in one gather and scatter: the same values as
        calling each in turn, as `traced_step` does to record each one's output."""
        penalties = self.processors[:self._penalties]
        if penalties:
            logits = self.history.penalize(logits, penalties)
        for proc in self.processors[self._penalties:]:
            logits = proc(logits, self.history)
        return logits

    def _chain(self, logits: mx.array, outputs: list[mx.array] | None = None,
               stages: list[Candidates] | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """The chain itself, for `step` and `traced_step` alike (so both draw the same token for a seed): the token,
        the log-probabilities and the processed logits the transforms saw. Given
        lists, it also keeps the logits before and after each processor (`outputs`) and each transform's candidates
        (`stages`): references to arrays the chain builds anyway, no extra ops."""
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
        if self.constraint is not None:
            c = self.constraint(c)
            if stages is not None:
                stages.append(c)
        if self.profile.greedy:
            token = mx.argmax(c.logits)
        else:
            draw_words, aux_words = self.step_keys()
            for transform in self.transforms:
                c = transform(c, aux_words)
                if stages is not None:
                    stages.append(c)
            token = gumbel_argmax(c, draw_words, self._vocab_ids)
        token = token.astype(mx.int32)
        self.history.accept(token)
        if self.constraint is not None:
            self.constraint.accept(token)
        return token, logprobs, logits

    def traced_step(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array, StepRecord]:
        """`step`, also recording what every stage of the chain did to the `k` candidates worth showing.

        The chain is `step`'s own (`_chain`), so a seed gives the same tokens traced or not (tests/test_trace.py
        checks it). The extra work is one partial sort of the vocabulary (the likeliest tokens), the entropy before
        the chain, and per stage a normaliser (over the vocabulary only for a stage that has not narrowed it). Lazy,
        like `step`."""
        outputs: list[mx.array] = []  # before and after each processor
        stages: list[Candidates] = []
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
                            mx.stack([_entropy(logprobs), _entropy(final_logprobs)]), mx.sum(logits > logits[token]))
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


__all__ = [
    "FrequencyPenalty", "LogitBias", "MinP", "MinTokens", "PresencePenalty", "RepetitionPenalty", "Sampler",
    "StepRecord", "Temperature", "TokenHistory", "TopK", "TopP", "TypicalP", "XTC",
]
