"""The KV cache of one conversation, and which token ids it holds.

mlx-lm's `make_prompt_cache` ignores `max_kv_size` for models that define `make_cache()` (llama
does), so the rotating cache is built here for every architecture. The cache remembers the ids it
holds, so a new prompt only prefills the suffix that differs from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

from .backend import KVOptions, kv_options


class ConversationCache:
    def __init__(self, model: nn.Module, max_kv_size: int | None = None, keep: int = 4,
                 kv: KVOptions = KVOptions()) -> None:
        if max_kv_size is not None and max_kv_size <= keep:
            raise ValueError(f"max_kv_size must be greater than keep ({keep}), got {max_kv_size}")
        if kv.quantized and max_kv_size is not None:
            kv_options(kv.bits, kv.group_size, rotating=True)  # raises: mlx-lm cannot combine them
        self.model, self.max_kv_size, self.keep, self.kv = model, max_kv_size, keep, kv
        self.tokens: list[int] = []  # ids whose keys/values are in the cache, in order
        self.layers = self._fresh()

    def _fresh(self) -> list:
        if self.kv.quantized:
            return [QuantizedKVCache(group_size=self.kv.group_size, bits=self.kv.bits) for _ in self.model.layers]
        if self.max_kv_size is None:
            return make_prompt_cache(self.model)  # plain, or the model's own mix for sliding-window layers
        return [RotatingKVCache(max_size=self.max_kv_size, keep=self.keep) for _ in self.model.layers]

    @property
    def rotating(self) -> bool:
        return self.max_kv_size is not None

    @property
    def size(self) -> int:
        """Positions the cache actually stores (bounded by the window for a rotating cache)."""
        return min(len(self.tokens), self.max_kv_size) if self.max_kv_size else len(self.tokens)

    def reset(self) -> None:
        self.tokens = []
        self.layers = self._fresh()

    def reuse(self, prompt: Sequence[int]) -> int:
        """Keep the longest cached prefix of `prompt`; return how many of its ids need no prefill.

        At least one prompt id is always left to run, because its logits give the first token. A
        rotating cache that has wrapped cannot be trimmed: then everything is prefilled again.
        """
        common = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        extra = len(self.tokens) - common
        if extra > 0:
            if all(c.is_trimmable() for c in self.layers):
                for c in self.layers:
                    c.trim(extra)
                del self.tokens[common:]
            else:
                self.reset()
                return 0
        return common

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if not c.empty())


# Work per prefill chunk: cancellation (Esc, Ctrl-C) lands between chunks, so a chunk must stay short however long
# the context already is (attention grows with it) and however busy the machine. Each chunk is sized from the
# previous chunk's measured speed; the first is at most FIRST_CHUNK tokens, since nothing is measured yet.
PREFILL_BUDGET_S = 0.5
FIRST_CHUNK = 128
MIN_CHUNK = 16


def prefill_chunk(model: nn.Module, layers: list, ids: Sequence[int]) -> None:
    """Run `ids` through the model into `layers` as one forward pass; only the cache state is evaluated."""
    model(mx.array(ids)[None], cache=layers)
    mx.eval([c.state for c in layers])


def prefill(model: nn.Module, layers: list, ids: Sequence[int], step: int,
            cancelled: Callable[[], bool] = lambda: False,
            budget_s: float = PREFILL_BUDGET_S) -> Iterator[Sequence[int]]:
    """Run `ids` through the model into `layers` in chunks of at most `step` ids, yielding each chunk once it is in
    the cache, and stopping before the next chunk once `cancelled()` is true.

    Chunks are sized to about `budget_s` of work each, measured on the chunk before. The logits of these positions
    are never evaluated: only the cache state is, so no output-head work is done.
    """
    start, size = 0, min(step, FIRST_CHUNK)
    while start < len(ids) and not cancelled():
        chunk = ids[start:start + size]
        began = time.perf_counter()
        prefill_chunk(model, layers, chunk)
        elapsed = time.perf_counter() - began
        start += len(chunk)
        yield chunk
        size = max(MIN_CHUNK, min(step, int(len(chunk) * budget_s / max(elapsed, 1e-6))))
