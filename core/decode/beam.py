"""Beam search: the `beam_size` most likely continuations, scored as HF does (sum of logprobs / length ** α).

Each beam is a `core.decode.reply.Reply` of the request, the text layer every other request has: so a beam ends as a
reply does (an end-of-turn id, a stop string, `max_tokens` or the context's end; the text cut before the stop string and
without an incomplete last character), and its scores are the request's processed log-probabilities
(`Reply.scores`: penalties over the beam's own tokens, logit bias, min-tokens, DRY, the constraint's mask). A beam
that continues in two ways is forked (`Reply.fork`: a new reply that takes the same tokens), the other keeps its
reply. The prompt is prefilled once, the cache is one row per beam, and after each step every layer's keys/values
are re-gathered in the order of the surviving beams. `cancelled()` is checked before each step: the live beams then
end as "cancelled". It does not stream: a beam's text can still be overtaken until the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..cache.kv_cache import prefill
from ..model.loader import LoadedModel
from .events import Metrics
from .reply import Reply, Request


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]
    text: str  # as a reply's: without a stop string or an incomplete last character
    logprob: float  # sum of the tokens' logprobs, the end-of-turn token included when it ended the beam
    score: float  # logprob / max(1, len(token_ids)) ** length_penalty
    finish_reason: Literal["stop", "length", "cancelled"]
    metrics: Metrics = field(default_factory=Metrics)  # the search's clock and sizes; completion_tokens: this beam's


def _score(logprob: float, length: int, alpha: float) -> float:
    return logprob / max(1, length) ** alpha


def _ignore(event: object) -> None:
    """Beams do not stream: their replies' events go nowhere."""


def beam_search(model: LoadedModel, request: Request, prompt: Sequence[int], *, beam_size: int,
                length_penalty: float = 1.0, prefill_step: int = 512, cancelled: Callable[[], bool] = lambda: False,
                accepted: float | None = None) -> list[Beam]:
    """All finished beams, best score first (at least `beam_size` unless the vocabulary is smaller)."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    accepted = time.perf_counter() if accepted is None else accepted
    eos = model.tokenizer.eos_ids
    cache = [KVCache() for _ in model.model.layers]
    root = Reply(model, request, prompt, _ignore, lambda: False, accepted=accepted, context=lambda: cache[0].offset)
    started = time.perf_counter()
    for _ in prefill(model.model, cache, prompt[:-1], prefill_step, cancelled):
        pass
    inputs = mx.array(prompt[-1:])[None]
    # A live beam: its reply, its tokens, its summed logprob.
    alive: list[tuple[Reply, tuple[int, ...], float]] = [(root, (), 0.0)]
    done: list[tuple[Reply, tuple[int, ...], float, str]] = []
    first: float | None = None
    steps = 0
    while alive and not cancelled():
        logits = model.model(inputs, cache=cache)[:, -1]
        logprobs = mx.stack([reply.scores(logits[i]) for i, (reply, _, _) in enumerate(alive)])
        totals = mx.array([s for _, _, s in alive])[:, None] + logprobs
        vocab = totals.shape[-1]
        flat = totals.reshape(-1)
        k = min(2 * beam_size, flat.size)
        top = mx.argpartition(-flat, k - 1)[:k]
        top_ids, top_scores = np.asarray(top), np.asarray(flat[top])
        steps += 1
        first = first or time.perf_counter()
        chosen: list[tuple[int, int, float]] = []  # (parent, token, total) of the continuations kept
        slots = 0
        for i in np.argsort(-top_scores, kind="stable"):
            parent, token = divmod(int(top_ids[i]), vocab)
            if token in eos:
                chosen.append((parent, token, float(top_scores[i])))
            elif slots < beam_size:
                chosen.append((parent, token, float(top_scores[i])))
                slots += 1
        # A parent continued more than once is forked before any continuation takes its token; its last keeps it.
        last_child = {parent: n for n, (parent, _, _) in enumerate(chosen)}
        replies = [alive[p][0] if last_child[p] == n else alive[p][0].fork(_ignore)
                   for n, (p, _, _) in enumerate(chosen)]
        next_alive: list[tuple[Reply, tuple[int, ...], float]] = []
        parents: list[int] = []
        for reply, (parent, token, total) in zip(replies, chosen):
            seq = alive[parent][1]
            reason = reply.take(token, logprobs[parent])
            if reason is None:
                next_alive.append((reply, seq + (token,), total))
                parents.append(parent)
            else:  # an end-of-turn id (not part of the beam), a stop string or the length cap
                done.append((reply, seq if token in eos else seq + (token,), total, reason))
        alive = next_alive
        best_done = sorted((_score(s, len(seq), length_penalty) for _, seq, s, _ in done), reverse=True)[:beam_size]
        # HF's stopping rule: once beam_size beams have ended, stop when no live beam can still beat the worst.
        if alive and len(best_done) >= beam_size and \
                _score(alive[0][2], len(alive[0][1]), length_penalty) <= best_done[-1]:
            alive = []
        if not alive:
            break
        gather = mx.array(parents)
        for c in cache:
            c.keys, c.values = c.keys[gather], c.values[gather]
        inputs = mx.array([[seq[-1]] for _, seq, _ in alive])
    done += [(reply, seq, s, "cancelled") for reply, seq, s in alive]
    end = time.perf_counter()
    first = first or end
    metrics = Metrics(prompt_tokens=len(prompt), ttft_s=first - accepted, prefill_s=first - started,
                      decode_s=end - first, tpot_s=(end - first) / (steps - 1) if steps > 1 else 0.0,
                      peak_memory_bytes=mx.get_peak_memory(), context_tokens=len(prompt) + steps,
                      context_limit=model.context_length, decode_steps=steps)
    beams = [Beam(seq, reply.finish(reason).text, s, _score(s, len(seq), length_penalty), reason,  # type: ignore
                  replace(metrics, completion_tokens=len(seq)))
             for reply, seq, s, reason in done]
    return sorted(beams, key=lambda b: b.score, reverse=True)
