"""Speculative decoding: guess several tokens, check them in one forward pass, keep the ones the model agrees with.

Decode is serial: one forward pass per token. Here a *drafter* proposes the next k tokens and the model runs the
pending token and the k guesses as one pass of k + 1 rows; on the CPU's native kernel that costs far less than k + 1
passes (docs/architecture.md §15). Two drafters:

* `NgramDrafter` (prompt lookup, no second model): the last n tokens are looked up in the prompt and the reply so far,
  and what followed their latest earlier occurrence is the guess. Copying, rewriting, extracting and code edits
  repeat long runs of their input.
* `ModelDrafter`: a smaller model sharing the vocabulary proposes greedily; `self:N` is the first N layers of the
  model itself (sharing its KV cache, so nothing extra is prefilled or stored).

**Exactness: sample-and-compare.** At each verified row the request's own sampler draws the target's token exactly
as the plain path would at that position: the same processors over the same accepted history, and the same seeded
draw keyed by (seed, position, token id) (core/sampling/draw.py). The guess is kept only if it equals that token; the
first row that differs gives its own token (the correction), and a fully accepted guess gives the row after it (the
bonus). The sampler runs row by row and only past rows that matched, so every draw it makes is a token of the reply:
penalties count only accepted tokens and a trace has one record per token. Hence greedy text is identical with and
without speculation, and a seeded sampled reply is the same text, provided the verify pass computes each row's
logits bit for bit as a one-row step does. On the native CPU kernel it does up to `MAX_ROWS` rows (measured: rows of
a pass of up to 8 equal single steps exactly; from 9 rows attention takes the BLAS path and differs in the last
bits), so a draft is at most `MAX_ROWS - 1` tokens. On other backends (a GPU's quantized matmul picks kernels by row
count) the rows may differ in the last bits, and a draw moves only where two candidates tie to within that.

**Cache**: the verify pass writes all k + 1 rows; the rejected guesses are trimmed off (`KVCache.trim`), so the cache
and the ids it holds (`fed`) stay exact. A cache that cannot be trimmed (a rotating window) or whose attention differs
with the row count (quantized keys and values) does not speculate (`unavailable`).

The verify passes run in the one step loop (core/decode/generate.py `StepLoop`), for a row that has the model to itself;
this module holds the settings, the drafters and the governor.

**When (`Governor`)**: decode runs plain pipelined steps and peeks: a guess for the next token is
checked when the pipeline reads that token, so a wrong guess costs only the lookup; a confirmed one starts verified
steps, which go on while they keep guesses. `auto` also sizes the guess by acceptance and, when its verified steps
yield tokens more slowly than plain ones (both timed), stops peeking for a back-off that doubles each time, so
free-form chat is not slowed.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, get_args

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchRotatingKVCache, QuantizedKVCache, RotatingKVCache

from ..cache.kv_cache import ConversationCache, prefill
from ..model import loader
from ..model.native_blocks import WHOLE_ATTENTION_QUERIES

Mode = Literal["off", "ngram", "draft", "auto"]
MODES: tuple[str, ...] = get_args(Mode)
# Rows of one verify pass: up to here each row's logits equal a single step's bit for bit on the native kernel.
MAX_ROWS = WHOLE_ATTENTION_QUERIES


@dataclass(frozen=True)
class Speculation:
    """How a request speculates: `mode`, the longest n-gram looked up (`ngram`, down to `min_ngram`) and the most
    tokens guessed per step (`draft_tokens`, 1..MAX_ROWS - 1)."""

    mode: Mode = "off"
    ngram: int = 3
    min_ngram: int = 2
    draft_tokens: int = 5

    @classmethod
    def make(cls, value: "str | Speculation | None") -> "Speculation":
        """A validated Speculation from a mode name (or None: off); bad values raise one line naming the field."""
        spec = value if isinstance(value, Speculation) else cls(value or "off")  # type: ignore[arg-type]
        if spec.mode not in MODES:
            raise ValueError(f"speculative must be one of {', '.join(MODES)}, got {spec.mode!r}")
        if not 1 <= spec.min_ngram <= spec.ngram <= 16:
            raise ValueError(f"speculative ngram sizes must satisfy 1 <= min_ngram <= ngram <= 16, got "
                             f"{spec.min_ngram}..{spec.ngram}")
        if not 1 <= spec.draft_tokens < MAX_ROWS:
            raise ValueError(f"speculative draft_tokens must be between 1 and {MAX_ROWS - 1} (one verify pass of at "
                             f"most {MAX_ROWS} rows stays exact), got {spec.draft_tokens}")
        return spec

    @property
    def on(self) -> bool:
        return self.mode != "off"


@dataclass
class SpeculationStats:
    """What speculation did in one reply, for `Metrics`: tokens guessed, guesses kept, decode forward passes."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0


def unavailable(rotating: bool, quantized: bool) -> str | None:
    """Why a KV cache of this kind cannot speculate, or None when it can."""
    if rotating:
        return "a rotating KV window cannot be trimmed once it wraps"
    if quantized:
        return "quantized keys and values attend differently with several rows, so the text would not be exact"
    return None


def check(spec: Speculation, *, rotating: bool = False, quantized: bool = False, draft: bool = True) -> None:
    """Refuse, in one line, a mode asked for by name that cannot run here ("auto" falls back to plain decode)."""
    if spec.mode in ("ngram", "draft") and (why := unavailable(rotating, quantized)):
        raise ValueError(f"speculative={spec.mode!r} cannot run here: {why}; use speculative='auto' or 'off'")
    if spec.mode == "draft" and not draft:
        raise ValueError("speculative='draft' needs a draft model: Engine.load(..., draft_model=SPEC) or "
                         "--draft-model SPEC")


# --- drafters -----------------------------------------------------------------------------------------------------

class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to `k` guesses of the ids that follow `context` (the prompt and the reply so far; it only grows
        between calls, and its last id is not in the model's cache yet)."""


class NgramDrafter:
    """Prompt lookup: what followed the latest earlier occurrence of the context's last n ids (n from `max_n` down to
    `min_n`). The index maps each n-gram to where its latest continuation starts; it is extended as the context
    grows, so a lookup costs O(max_n), not a scan."""

    def __init__(self, max_n: int = 3, min_n: int = 2) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}
        self._seen = 0

    def _extend(self, context: Sequence[int]) -> None:
        for i in range(max(self._seen, 1), len(context)):
            for n in self.sizes:
                if i >= n:
                    self._index[tuple(context[i - n:i])] = i
        self._seen = len(context)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self._extend(context)
        for n in self.sizes:
            if len(context) > n and (start := self._index.get(tuple(context[-n:]))) is not None:
                return list(context[start:start + k])
        return []


class EarlyExit(nn.Module):
    """The first `n` layers of a llama-style model, then its final norm and output head: a draft that shares the
    model's weights and the first `n` layers of its KV cache (self-speculation)."""

    def __init__(self, model: nn.Module, n: int) -> None:
        super().__init__()
        inner = getattr(model, "model", None)
        if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
            raise ValueError("draft_model 'self:N' needs a llama-style model (embed_tokens, layers, norm)")
        if not 1 <= n <= len(inner.layers):
            raise ValueError(f"draft_model 'self:N' needs 1 <= N <= {len(inner.layers)} (the model's layers), got {n}")
        self.full, self.n = model, n

    @property
    def layers(self) -> list:
        return self.full.model.layers[:self.n]

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        inner = self.full.model
        h = inner.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        h = inner.norm(h)
        if getattr(self.full, "lm_head", None) is not None:
            return self.full.lm_head(h)
        return inner.embed_tokens.as_linear(h)


class ModelDrafter:
    """Greedy guesses from a draft model. With `cache` (its own, for a separate model) the draft keeps the context
    in it; without, it runs on the first layers of the target's cache (`layers`, an `EarlyExit`) and trims what it
    wrote there, so the target's cache is as it was."""

    def __init__(self, model: nn.Module, layers: list, cache: ConversationCache | None = None) -> None:
        self.model, self.layers, self.cache = model, layers, cache

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k < 1:
            return []
        if self.cache is None:
            feed, layers = list(context[-1:]), self.layers
        else:
            reused = self.cache.reuse(context)
            for chunk in prefill(self.model, self.cache.layers, context[reused:-1], 512):
                self.cache.tokens.extend(chunk)
            feed, layers = list(context[-1:]), self.cache.layers
        x, guesses = mx.array(feed), []
        for _ in range(k):
            x = mx.argmax(self.model(x[None], cache=layers)[0, -1:], axis=-1)
            guesses.append(x)
        ids = mx.concatenate(guesses).tolist() if guesses else []
        if self.cache is None:
            for c in layers[:len(self.model.layers)]:
                c.trim(k)
        else:
            self.cache.tokens.extend([*feed, *ids[:-1]])
        return ids


@dataclass
class DraftModel:
    """A loaded draft model (`Engine.load(..., draft_model=SPEC)`): its model, its name, and whether it runs on the
    target's KV cache (`self:N`) or keeps one of its own next to each of the target's caches."""

    model: nn.Module
    name: str
    shares_cache: bool
    _caches: "weakref.WeakKeyDictionary[ConversationCache, ConversationCache]" = field(
        default_factory=weakref.WeakKeyDictionary)

    def drafter(self, cache: ConversationCache) -> ModelDrafter:
        """The drafter for a reply into `cache`; a separate draft model's own cache lives as long as `cache`, so a
        chat's next turn prefills the draft only with what is new."""
        if self.shares_cache:
            return ModelDrafter(self.model, cache.layers)
        own = self._caches.get(cache)
        if own is None:
            own = self._caches[cache] = ConversationCache(self.model)
        return ModelDrafter(self.model, cache.layers, own)


def load_draft(spec: str | Path, target: loader.LoadedModel, weights: loader.WeightPolicy | None = None) -> DraftModel:
    """`self` (the model itself: every guess is accepted greedily; for tests), `self:N` (its first N layers), or
    any model spec `loader.load` takes, whose tokenizer must have the target's vocabulary."""
    text = str(spec)
    if text == "self" or text.startswith("self:"):
        m = re.fullmatch(r"self(?::(\d+))?", text)
        if m is None:
            raise ValueError(f"draft_model must be self, self:N (the first N layers) or a model, got {text!r}")
        n = int(m[1]) if m[1] else target.num_layers
        return DraftModel(EarlyExit(target.model, n), f"{target.name} (first {n} layers)", True)
    draft = loader.load(spec, weights)
    if draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
        raise ValueError(f"draft_model {draft.name} does not share the vocabulary of {target.name}: pick a model "
                         "with the same tokenizer (the same family)")
    return DraftModel(draft.model, draft.name, False)


# --- the governor -------------------------------------------------------------------------------------------------

class Governor:
    """When to verify and how much to guess.

    Decode runs plainly (pipelined) and *peeks*: after each token it asks the drafter for a guess of the next one
    and compares it with that token when the pipeline reads it. Only a confirmed guess starts verified steps, so a
    wrong guess costs nothing but the lookup, never a pass of several rows. Verified steps go on while their guesses are
    accepted; one that keeps none returns to plain decode. A draft model ("draft") verifies every step instead: its
    guesses are not free. Prompt lookup (ngram, auto) sizes the guess by acceptance (2 at first, longer after a
    fully accepted one, shorter after a rejection); `adaptive` (auto) also stops peeking for a while that doubles
    each time when verified steps yield tokens more slowly than plain ones."""

    MAX_COOLDOWN = 512

    def __init__(self, spec: Speculation, adaptive: bool) -> None:
        self.max_k, self.adaptive, self.always = spec.draft_tokens, adaptive, spec.mode == "draft"
        # Prompt lookup's guesses (ngram and auto) are sized by acceptance, up to draft_tokens: a verify pass costs
        # more with each row (measured here under load: M=3 1.3x a one-row step, M=6 2.1x), so a long guess pays
        # only inside a long run of accepted ones. A draft model's guesses keep their length (each costs a draft pass).
        self.sized = spec.mode in ("ngram", "auto")
        self.k = min(2, spec.draft_tokens) if self.sized else spec.draft_tokens
        self.plain_s: float | None = None  # seconds per token, plain pipelined decode
        self.spec_s: float | None = None  # seconds per token, verified steps
        self.cooldown, self.backoff = 0, 16

    def peek(self) -> bool:
        """Whether plain decode should look for a guess after this token."""
        if self.cooldown:
            self.cooldown -= 1
            return False
        return True


    def verified(self, k: int, accepted: int, seconds: float) -> None:
        """One verified step of `k` guesses, `accepted` kept, in `seconds` (emitting accepted + 1 tokens)."""
        if self.sized:
            self.k = min(self.max_k, self.k + 1 if accepted == k else max(1, accepted + 1))
        self.spec_s = _ema(self.spec_s, seconds / (accepted + 1))

    def plain(self, seconds: float) -> None:
        """One plain token took `seconds`."""
        self.plain_s = _ema(self.plain_s, seconds, 0.1)

    def episode_done(self) -> None:
        """Verified steps ended: if they were slower per token than plain decode, stop peeking for a while."""
        if self.adaptive and self.spec_s is not None and self.plain_s is not None and self.spec_s > self.plain_s:
            self.cooldown, self.backoff = self.backoff, min(self.MAX_COOLDOWN, 2 * self.backoff)
        self.spec_s = None


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def plan(spec: Speculation, layers: Sequence, draft: Callable[[], Drafter] | None = None, *,
         strict: bool = True) -> tuple[str, Drafter | None]:
    """Whether and how a reply into the KV cache `layers` speculates, for every path (the solo path, chat turns, the
    batch): ("off", None), or the mode and its drafter. The cache's kind is read from its layers' classes, so a
    model's own sliding-window layers count as rotating. `draft` makes the draft model's drafter (None: no draft
    model). `strict`: a mode asked for by name that cannot run raises (`check`); otherwise (the server's batch, which
    has accepted the request) it decodes plainly, as "auto" always does where speculation cannot run. "auto" is
    prompt lookup: its guesses are free to check, a draft model's are not."""
    rotating = any(isinstance(c, (RotatingKVCache, BatchRotatingKVCache)) for c in layers)
    quantized = any(isinstance(c, QuantizedKVCache) for c in layers)
    if strict:
        check(spec, rotating=rotating, quantized=quantized, draft=draft is not None)
    if not spec.on or unavailable(rotating, quantized) or (spec.mode == "draft" and draft is None):
        return "off", None
    if spec.mode == "draft":
        return spec.mode, draft()
    return spec.mode, NgramDrafter(spec.ngram, spec.min_ngram)


__all__ = ["MAX_ROWS", "MODES", "DraftModel", "Drafter", "EarlyExit", "Governor", "Mode", "ModelDrafter",
           "NgramDrafter", "Speculation", "SpeculationStats", "check", "load_draft", "plan", "unavailable"]
