"""Constrained decoding: the sampler chain's stage that masks every token a response format does not allow.

A `Constraint` holds one llguidance matcher (the compiled grammar of a `core.sampling.response_format.ResponseFormat`)
over the llguidance tokenizer built from the model's own (`llg_tokenizer`: the GGUF vocabulary or the HF tokenizer, both
a fast HF tokenizer in `ChatTokenizer.hf`). In the chain it runs after the processors and before the transforms::

    logits ─▶ processors ─▶ Constraint (disallowed ─▶ -inf) ─▶ transforms (top-p ... renormalise over allowed) ─▶ draw

so the filters and the draw (greedy argmax or the seeded Gumbel-max of core/sampling/draw.py) only ever see allowed
tokens. End-of-turn ids are allowed only where the grammar may end, and once it has ended (a closed JSON object) they
are the only tokens allowed; a reply cut by ``max_tokens`` before that ends with "length", never as if it were complete.

**The mask needs the previous token, and decode is pipelined** (core/decode/generate.py: step n+1 is queued before token
n is read). The stage keeps step n's token as the lazy array the chain drew (`accept`), and reads it only when step
n+1 needs its mask: it first queues step n+1's forward pass (`mx.async_eval` of the logits it was given), then waits
for token n (already computed: it is the forward pass's input), advances the matcher and computes the mask on the
host while the device runs the forward pass. `mask_s` is that host time, reported as `Metrics.constraint_mask_s`.
Where the sampler's lazy order is exact (core/sampling/chain.py, `Sampler.lazy`) the chain draws first and the stage
only checks the token (`allows`); a batch's rows that mask every step get their masks from one call (`fill_masks`).

**Compiled off the inference thread.** `prepare` compiles a format's grammar on a small pool of its own (llguidance
drops the GIL while it compiles) and caches it per model tokenizer by the grammar's text (`GRAMMAR_CACHE` most
recently used); each request's `Constraint` takes a deep copy of the cached matcher. The batch scheduler admits a
constrained request only once its grammar has compiled, so the rows decoding never wait for it. The llguidance
tokenizer is the one slow part (~0.5 s for 49k tokens, with the GIL held all along): the server builds it as it
starts (`warm`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from ..model.tokenizer import ChatTokenizer
from .candidates import NEG_INF, Candidates
from .response_format import ResponseFormat

# Grammars compile here, never on the inference thread: a small pool of its own. Compiling (`LLMatcher(...)`) drops
# the GIL, so a batch decodes on while a newcomer's grammar compiles.
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxchat-grammar")
# Compiled grammars kept per model tokenizer (least recently used out): a server's clients resend the same schemas.
GRAMMAR_CACHE = 64


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled on a model's tokenizer: a pristine matcher (each request takes a `deep_copy`, ~1 µs) and
    how long the compile took, or llguidance's error for a grammar that does not compile on this tokenizer."""

    matcher: LLMatcher | None
    error: str
    compile_s: float


class _ModelGrammars:
    """One model tokenizer's llguidance state: its LLTokenizer (built once) and its compiled grammars (an LRU)."""

    def __init__(self) -> None:
        self.build_lock = threading.Lock()  # held while the tokenizer builds (~0.5 s)
        self.tokenizer: LLTokenizer | None = None
        self.lock = threading.Lock()  # the grammar cache's
        self.grammars: OrderedDict[tuple[int, str], Future[Compiled]] = OrderedDict()


_MODELS: weakref.WeakKeyDictionary[ChatTokenizer, _ModelGrammars] = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


def _state(tokenizer: ChatTokenizer) -> _ModelGrammars:
    with _MODELS_LOCK:
        state = _MODELS.get(tokenizer)
        if state is None:
            state = _MODELS[tokenizer] = _ModelGrammars()
        return state


def llg_tokenizer(tokenizer: ChatTokenizer, vocab_size: int) -> LLTokenizer:
    """The llguidance tokenizer of a model's tokenizer, masks `vocab_size` long (the logits' length), with every
    end-of-turn id as an end of sequence. Built once per tokenizer (any thread; the others wait for it).

    Building it walks the whole vocabulary (~0.5 s for 49k tokens) and holds the GIL all along (tokenizers'
    `to_str` ~0.12 s, `LLTokenizer(...)` ~0.36 s, measured): built on another thread it still stalls the inference
    thread's Python, so the server builds it when it starts (`warm`), before any request decodes."""
    state = _state(tokenizer)
    with state.build_lock:
        cached = state.tokenizer
        if cached is None or cached.vocab_size != vocab_size:
            try:
                cached = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size,
                                                      eos_token=sorted(tokenizer.eos_ids))
            except ValueError as e:  # a slow (Python) tokenizer: llguidance reads the fast one's vocabulary
                raise ValueError(f"response_format needs a fast Hugging Face tokenizer: {e}") from None
            state.tokenizer = cached
        return cached


def warm(tokenizer: ChatTokenizer, vocab_size: int) -> Future[LLTokenizer]:
    """Build the model's llguidance tokenizer on the grammar pool now (a server calls it as it starts), so that no
    constrained request waits for it later."""
    return _POOL.submit(llg_tokenizer, tokenizer, vocab_size)


def _compile(tokenizer: ChatTokenizer, vocab_size: int, grammar: str) -> Compiled:
    llt = llg_tokenizer(tokenizer, vocab_size)
    started = time.perf_counter()
    matcher = LLMatcher(llt, grammar, log_level=0)  # errors are kept, not logged
    took = time.perf_counter() - started
    if matcher.is_error():  # the profile validated it; a tokenizer-specific failure lands here
        return Compiled(None, matcher.get_error(), took)
    return Compiled(matcher, "", took)


def prepare(fmt: ResponseFormat, tokenizer: ChatTokenizer, vocab_size: int) -> Future[Compiled]:
    """`fmt`'s grammar compiled on this model, on the grammar pool (the llguidance tokenizer first if it is not
    built yet): a future, done at once when the same grammar was compiled before (cached per tokenizer and logits'
    length, the `GRAMMAR_CACHE` most recently used). Never blocks the caller on the compile."""
    state, key = _state(tokenizer), (vocab_size, fmt.llg_grammar())
    with state.lock:
        future = state.grammars.get(key)
        if future is not None:
            state.grammars.move_to_end(key)
            return future
        future = state.grammars[key] = _POOL.submit(_compile, tokenizer, vocab_size, key[1])
        while len(state.grammars) > GRAMMAR_CACHE:
            state.grammars.popitem(last=False)
        return future


class Constraint:
    """One request's constraint stage: call it on the processed logits (over the whole vocabulary) to mask them;
    tell it each drawn token (`accept`, lazily) or forced token (`replay`)."""

    def __init__(self, fmt: ResponseFormat, tokenizer: LLTokenizer, eos_ids: Iterable[int],
                 ends: Callable[[bytes], bool] | None = None, compiled: Compiled | None = None) -> None:
        """`ends`, given each taken token's bytes, may end the reply where the grammar would go on (True: only an
        end-of-turn id is allowed from then on): the rule a grammar cannot say, e.g. core/decode/tools.py's "no call
        twice". `compiled`: the grammar already compiled on `tokenizer` (`prepare`); without it, it compiles here.
        `compile_s` is the compile's own time, wherever and whenever it ran (a cached grammar reports its first)."""
        if compiled is None:
            started = time.perf_counter()
            matcher = LLMatcher(tokenizer, fmt.llg_grammar(), log_level=0)
            took = time.perf_counter() - started
            error = matcher.get_error() if matcher.is_error() else ""
            compiled = Compiled(None if error else matcher, error, took)
        if compiled.matcher is None:
            raise ValueError(f"{fmt.field_name()}: {compiled.error}")
        self._matcher = compiled.matcher.deep_copy()  # the cached one stays pristine
        self.compile_s = compiled.compile_s
        self._label = fmt.label()
        self._tokenizer, self._ends = tokenizer, ends
        self._vocab = tokenizer.vocab_size
        self._bits = allocate_token_bitmask(1, self._vocab)
        self._eos = frozenset(eos_ids)
        # Once the grammar has ended the reply must end: the end-of-turn ids are all there is, whatever a processor
        # did to their logits (min_tokens bans them; it cannot keep a finished JSON object going).
        ended = np.full(self._vocab, -np.inf, np.float32)
        ended[sorted(self._eos)] = 0.0
        self._ended_logits = mx.array(ended)
        self._ended = False  # an end-of-turn id was drawn, or `ends` ended the reply: nothing follows
        self._pending: mx.array | None = None  # the last drawn token, not yet read back
        self._ready: np.ndarray | None = None  # this step's mask, filled with the batch's (`fill_masks`)
        self.mask_s = 0.0
        self.masks = 0  # steps the stage decided (a full mask, or a check of the drawn token)
        self.checks = 0  # of those, decided by the check alone (`allows`)

    def __repr__(self) -> str:
        return self._label

    def __call__(self, c: Candidates) -> Candidates:
        if c.ids is not None:
            raise ValueError("the constraint stage masks the whole vocabulary: it must run before any transform")
        mx.async_eval(c.logits)  # this step's forward pass runs while the host reads the last token and masks
        allowed = self._next_mask()
        if allowed is None:
            return Candidates(self._ended_logits, None)
        return Candidates(mx.where(mx.array(allowed), c.logits, NEG_INF), None)

    def accept(self, token: mx.array) -> None:
        """The chain drew `token` (lazy): the matcher takes it when the next mask is computed."""
        self._take_pending()
        self._pending = token

    def allows(self, token: mx.array) -> bool:
        """The lazy order: whether `token`, drawn from the chain without the mask, is allowed, in which case it is
        also what the masked chain draws (`core.sampling.chain.Sampler` uses this only where that holds: greedy, or a
        plain temperature >= 1 and the seeded draw). Reads the token, so this step's forward pass is waited for. False
        means "mask and draw again": also at an end-of-turn id and once the grammar has ended, decided by the mask.
        (`validate_tokens` alone is not the mask: in forced text it takes "n" where the mask allows only "name".)"""
        mx.async_eval(token)  # this step's forward pass and the unmasked draw
        self._take_pending()
        drawn = token.item()
        started = time.perf_counter()
        allowed = False
        if not (drawn in self._eos or self._done()):
            # Where the grammar forces bytes (a key, a separator) the mask allows only their canonical first token
            # (`compute_ff_tokens()[0]`), though the grammar would take other splits of them; elsewhere a token is in
            # the mask exactly when the matcher takes it (tests/test_constraint.py checks both on every token).
            forced = self._matcher.compute_ff_tokens()
            allowed = drawn == forced[0] if forced else self._matcher.validate_tokens([drawn]) == 1
        self.mask_s += time.perf_counter() - started
        if allowed:
            self.masks += 1
            self.checks += 1
        return allowed

    def replay(self, token_ids: Sequence[int]) -> None:
        """Tokens chosen outside the chain (a branch's forced tokens): the matcher takes them now."""
        self._ready = None
        self._take_pending()
        for token in token_ids:
            self._consume(token)

    def _take_pending(self) -> None:
        if self._pending is not None:
            token, self._pending = self._pending.item(), None
            self._consume(token)

    def _consume(self, token: int) -> None:
        if self._ended:
            return
        if token in self._eos:
            self._ended = True
        elif not self._matcher.consume_token(token):
            raise ValueError(f"token {token} does not fit the response format {self._label}: "
                             f"{self._matcher.get_error()}")
        elif self._ends is not None and self._ends(self._tokenizer.decode_bytes([token])):
            self._ended = True

    def _next_mask(self) -> np.ndarray | None:
        """The allowed tokens of the next step, or None when only an end-of-turn id may follow."""
        self._take_pending()
        ready, self._ready = self._ready, None
        started = time.perf_counter()
        allowed = None
        if ready is not None:
            allowed = ready
        elif not self._done():
            fill_next_token_bitmask(self._matcher, self._bits)
            allowed = _unpack(self._bits[0], self._vocab)
        self.mask_s += time.perf_counter() - started
        self.masks += 1
        return allowed

    def _done(self) -> bool:
        """Whether the reply may only end now (an end-of-turn id was drawn, or the grammar or `ends` ended it)."""
        return self._ended or self._matcher.is_stopped()


_EXECUTOR: LLExecutor | None = None


def _unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].view(bool)


def fill_masks(constraints: Sequence[Constraint], logits: mx.array) -> None:
    """The next masks of several rows of a batch (`logits`: the step's, queued first), in one llguidance call that
    fills a 2-D bitmask (`fill_next_token_bitmask_par`, its own threads, no GIL), instead of one call per row; each
    row's stage then takes its mask when the chain runs. The time is shared out among the rows' `mask_s`."""
    global _EXECUTOR
    mx.async_eval(logits)
    for c in constraints:
        c._take_pending()
    started = time.perf_counter()
    live = [c for c in constraints if not c._done()]
    if live:
        if _EXECUTOR is None:
            _EXECUTOR = LLExecutor()
        bits = allocate_token_bitmask(len(live), live[0]._vocab)
        fill_next_token_bitmask_par(_EXECUTOR, [(c._matcher, i) for i, c in enumerate(live)], bits)
        for c, row in zip(live, bits):
            c._ready = _unpack(row, c._vocab)
    share = (time.perf_counter() - started) / len(constraints)
    for c in constraints:
        c.mask_s += share


def constraint_for(fmt: ResponseFormat | None, tokenizer: ChatTokenizer, vocab_size: int,
                   ends: Callable[[bytes], bool] | None = None) -> Constraint | None:
    """The constraint stage of a response format on this model (see `Constraint` for `ends`), or None without
    one."""
    if fmt is None:
        return None
    compiled = prepare(fmt, tokenizer, vocab_size).result()  # at once when prepared; else compiled on the pool
    return Constraint(fmt, llg_tokenizer(tokenizer, vocab_size), tokenizer.eos_ids, ends, compiled)


__all__ = ["GRAMMAR_CACHE", "Compiled", "Constraint", "constraint_for", "fill_masks", "llg_tokenizer", "prepare",
           "warm"]
