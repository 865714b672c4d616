"""The sampler inspector's recorder: a `sample` callable for the token layer that also traces each step.

`Tracer.step` has the signature of `Sampler.step` (``core.sampling.chain.Sample``), so it plugs into the step loop
(`core.decode.generate.StepLoop`: the solo path and the batch) unchanged; it runs `Sampler.traced_step` (the same
draw, plus the per-stage bookkeeping) and queues the step's `StepRecord`. Decode is pipelined (step n+1 is queued
before token n is read), so records wait in a FIFO and `Tracer.take(token_id)` turns the oldest into a
`core.sampling.trace.TokenTrace` once its token is read. A trace costs nothing when not asked for: without `trace=K`
the engine calls `Sampler.step` itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from . import dry
from .chain import DRY, Sampler, StepRecord
from .trace import Candidate, TokenTrace

# The most candidates a trace may hold: enough for any inspector table, bounded so a typo cannot ask for the
# whole vocabulary on every token.
MAX_TRACE = 100
PROCESSED = "processed"


def check_trace(k: int, what: str = "trace") -> int:
    """`k` if it is a valid number of traced candidates (0 = off), else a ValueError naming `what` and the range."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TRACE:
        raise ValueError(f"{what} must be an integer between 0 and {MAX_TRACE} (candidates per token; 0 = off), "
                         f"got {k!r}")
    return k


class Tracer:
    """Wraps one request's `Sampler`: `step` samples exactly as the sampler would and records the chain; `take`
    gives the trace of each token in the order the tokens are read."""

    def __init__(self, sampler: Sampler, k: int, token_text: Callable[[int], str]) -> None:
        self.sampler = sampler
        self.k = min(check_trace(k), sampler.vocab_size)
        self.processors = tuple(repr(p) for p in sampler.processors)
        self.stages = (PROCESSED, *(repr(t) for t in sampler.stages))
        self._token_text = token_text
        self._texts: dict[int, str] = {}
        self._dry = next((p for p in sampler.processors if isinstance(p, DRY)), None)
        self._pending: deque[StepRecord] = deque()

    def step(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        token, logprobs, record = self.sampler.traced_step(logits, self.k)
        mx.async_eval(*record)  # computed alongside the token, not when the host asks for it
        self._pending.append(record)
        return token, logprobs

    def take(self, token_id: int) -> TokenTrace:
        """The trace of the oldest step not taken yet, whose token was `token_id`."""
        return self._build(self._pending.popleft(), token_id)

    def _text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self._token_text(token_id)
        return self._texts[token_id]

    def _build(self, r: StepRecord, token_id: int) -> TokenTrace:
        ids = np.asarray(r.ids).tolist()
        raw, logprobs = np.asarray(r.raw), np.asarray(r.logprobs)
        shifts, probs, alive = np.asarray(r.shifts), np.asarray(r.probs), np.asarray(r.alive)
        entropy = np.asarray(r.entropy)
        kept = alive.sum(axis=0)
        # Which K to show: the chosen token, then those the most stages kept (the last stage's survivors first),
        # then the likeliest; shown best first by processed logit (log-probability orders the same), ties by id.
        first: dict[int, int] = {}
        for j in sorted(range(len(ids)), key=lambda j: (ids[j] != token_id, -kept[j], -logprobs[j], ids[j])):
            first.setdefault(ids[j], j)
        shown = sorted(list(first.values())[:self.k], key=lambda j: (-float(logprobs[j]), ids[j]))
        history = np.asarray(r.dry_history).tolist() if self._dry is not None else []
        candidates = [self._candidate(ids[j], float(raw[j]), float(logprobs[j]), shifts[:, j], probs[:, j],
                                      alive[:, j], ids[j] == token_id, history) for j in shown]
        return TokenTrace(candidates, float(entropy[0]), float(entropy[1]), int(np.asarray(r.rank)), self.stages)

    def _candidate(self, token_id: int, raw: float, logprob: float, shifts: np.ndarray, probs: np.ndarray,
                   alive: np.ndarray, chosen: bool, history: list[int]) -> Candidate:
        column = [math.exp(logprob), *probs.tolist()]
        kept = dict(zip(self.stages, (p if a else None for p, a in zip(column, alive.tolist()))))
        # A token a processor banned (min_tokens) is removed by "processed"; its shift of -inf says which one.
        removed = next((s for s in self.stages if kept[s] is None), None)
        moved = dict(zip(self.processors, shifts.tolist()))
        notes = {}
        if self._dry is not None and moved.get(repr(self._dry), 0.0) < 0:
            notes[repr(self._dry)] = self._dry_note(moved[repr(self._dry)], token_id, history)
        return Candidate(token_id, self._text(token_id), raw, kept, removed, chosen, moved, notes)

    def _dry_note(self, shift: float, token_id: int, history: list[int]) -> str:
        """The repeated sequence a DRY penalty stands for: the history's last n tokens, which appeared before
        followed by this candidate (n from the penalty, `core.sampling.dry.repeat_length`)."""
        d = self._dry
        n = dry.repeat_length(shift, d.multiplier, d.base, d.allowed)
        text = "".join(self._text(t) for t in history[-n:])
        return f"repeats {text + self._text(token_id)!r} ({n} tokens + this one)"


__all__ = ["MAX_TRACE", "PROCESSED", "Tracer", "check_trace"]
