"""Beam search: the `beam_size` most likely continuations, scored as HF does (sum of logprobs / length ** α).

It runs on the same model and KV-cache classes as sampling: the prompt is prefilled once, the cache is
repeated to one row per beam, and after each step every layer's keys/values are re-gathered in the order
of the surviving beams. It does not stream: a beam's text can still be overtaken until the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from .cache import prefill
from .streaming import drop_incomplete
from .tokenizer import ChatTokenizer


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]
    text: str  # without an incomplete last character (a beam cut inside one), as a streamed reply's
    logprob: float  # sum of the tokens' logprobs, the end-of-turn token included when it ended the beam
    score: float  # logprob / max(1, len(token_ids)) ** length_penalty
    finish_reason: Literal["stop", "length"]


def _score(logprob: float, length: int, alpha: float) -> float:
    return logprob / max(1, length) ** alpha


def _text(tokenizer: ChatTokenizer, ids: Sequence[int]) -> str:
    return drop_incomplete(tokenizer.decode(list(ids)))


def beam_search(model: nn.Module, tokenizer: ChatTokenizer, prompt: Sequence[int], *, beam_size: int,
                length_penalty: float = 1.0, max_tokens: int = 32, prefill_step: int = 512,
                cancelled: Callable[[], bool] = lambda: False) -> list[Beam]:
    """All finished beams, best score first (at least `beam_size` unless the vocabulary is smaller)."""
    if beam_size < 1 or max_tokens < 1:
        raise ValueError(f"beam_size and max_tokens must be at least 1, got {beam_size} and {max_tokens}")
    eos = tokenizer.eos_ids
    cache = [KVCache() for _ in model.layers]
    for _ in prefill(model, cache, prompt[:-1], prefill_step):
        pass
    inputs = mx.array(prompt[-1:])[None]
    alive: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    done: list[Beam] = []
    for step in range(max_tokens):
        logprobs = nn.log_softmax(model(inputs, cache=cache)[:, -1].astype(mx.float32), axis=-1)
        totals = mx.array([s for _, s in alive])[:, None] + logprobs
        vocab = totals.shape[-1]
        flat = totals.reshape(-1)
        k = min(2 * beam_size, flat.size)
        top = mx.argpartition(-flat, k - 1)[:k]
        top_ids, top_scores = np.asarray(top), np.asarray(flat[top])
        order = np.argsort(-top_scores, kind="stable")
        next_alive: list[tuple[tuple[int, ...], float]] = []
        parents: list[int] = []
        for i in order:
            parent, token = divmod(int(top_ids[i]), vocab)
            seq, total = alive[parent][0], float(top_scores[i])
            if token in eos:
                done.append(Beam(seq, _text(tokenizer, seq), total, _score(total, len(seq), length_penalty), "stop"))
            elif len(next_alive) < beam_size:
                next_alive.append((seq + (token,), total))
                parents.append(parent)
        alive = next_alive
        if not alive or cancelled() or step == max_tokens - 1:
            break
        best_done = sorted((b.score for b in done), reverse=True)[:beam_size]
        # HF's stopping rule: once beam_size beams have ended, stop when no live beam can still beat the worst.
        if len(best_done) >= beam_size and _score(alive[0][1], len(alive[0][0]), length_penalty) <= best_done[-1]:
            alive = []
            break
        gather = mx.array(parents)
        for c in cache:
            c.keys, c.values = c.keys[gather], c.values[gather]
        inputs = mx.array([[seq[-1]] for seq, _ in alive])
    done += [Beam(seq, _text(tokenizer, seq), s, _score(s, len(seq), length_penalty), "length") for seq, s in alive]
    return sorted(done, key=lambda b: b.score, reverse=True)
