"""The KV cache of one conversation, and which token ids it holds.

mlx-lm's `make_prompt_cache` ignores `max_kv_size` for models that define `make_cache()` (llama
does), so the rotating cache is built here for every architecture. The cache remembers the ids it
holds, so a new prompt only prefills the suffix that differs from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from ..model.backend import KVOptions, kv_options


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids `a` and `b` share from the start (slices compared a block at a time: prompts of thousands of ids
    are matched against every entry of the prefix index)."""
    n, end = 0, min(len(a), len(b))
    while n + 64 <= end and tuple(a[n:n + 64]) == tuple(b[n:n + 64]):  # a tuple never equals a list
        n += 64
    while n < end and a[n] == b[n]:
        n += 1
    return n


def reusable(held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many ids of `prompt` a cache holding `held` can give: their common prefix, all but the prompt's last id at
    most (its logits give the first token). Every prefix match asks this (the conversation's cache, the prefix index,
    the disk store)."""
    return min(common_prefix(held, prompt), len(prompt) - 1)


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
        self.from_disk = 0  # ids loaded from disk (core/cache/kv_store.py) that no request has reused yet

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
        self.from_disk = 0

    def adopt(self, layers: list, ids: Sequence[int], from_disk: bool = True) -> None:
        """Hold `layers` (caches loaded from disk, or copied from the prefix index's memory: core/cache/prefix.py)
        and the ids they hold, in place of what the cache held."""
        self.layers, self.tokens, self.from_disk = layers, list(ids), len(ids) if from_disk else 0

    def take_from_disk(self) -> int:
        """How many of the held ids were loaded from disk since a request last asked (a request reports them)."""
        n, self.from_disk = self.from_disk, 0
        return min(n, len(self.tokens))

    def matched(self, prompt: Sequence[int]) -> int:
        """How many ids of `prompt` the cache holds already: the common prefix, all but the prompt's last id at most
        (its logits give the first token)."""
        return reusable(self.tokens, prompt)

    def reuse(self, prompt: Sequence[int]) -> int:
        """Keep the longest cached prefix of `prompt`; return how many of its ids need no prefill.

        At least one prompt id is always left to run, because its logits give the first token. A
        rotating cache that has wrapped cannot be trimmed: then everything is prefilled again.
        """
        common = self.matched(prompt)
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


def slotted(layers: list) -> bool:
    """Whether a row can be written into a row of these batch caches (`fill_slot`): exactly mlx-lm's plain
    `BatchKVCache` (the fused decoder layer runs on exactly that kind), not a rotating one."""
    return all(type(c) is BatchKVCache for c in layers)


def fits_slot(batch: BatchKVCache, cache: KVCache) -> bool:
    """Whether `fill_slot` can write `cache` (one row) into a row of `batch`: a plain `KVCache` into a plain
    `BatchKVCache` (`slotted`), its positions no more than the batch's index (the row is right-aligned at it)."""
    return (slotted([batch]) and type(cache) is KVCache and batch.keys is not None and cache.keys is not None
            and 0 < cache.size() <= batch.size())


def fill_slot(batch: BatchKVCache, slot: int, cache: KVCache) -> None:
    """Write the one-row `cache` into row `slot` of `batch` in place of what that row held, as `BatchKVCache.extend`
    lays a row out (right-aligned at the batch's index, the positions before it left padding), without copying the
    other rows: the keys and values are updated in place (MLX writes a slice update into its input's buffer when
    nothing else references it), the row's left padding and offset set. Lazy, as the cache's own updates are."""
    n, end = cache.size(), batch.size()
    start = end - n
    batch.keys[slot:slot + 1, :, start:end, :] = cache.keys[..., :n, :]
    batch.values[slot:slot + 1, :, start:end, :] = cache.values[..., :n, :]
    # A few ints each: rebuilt, not written with `a[i] = x`, which changes the array object itself for anyone
    # holding it (a `state` read before this).
    mine = mx.arange(batch.left_padding.shape[0]) == slot
    batch.left_padding = mx.where(mine, start, batch.left_padding)
    batch.offset = mx.where(mine, n, batch.offset)


# Cancellation (Esc, Ctrl-C) lands between the layers of a prefill chunk: each layer's part of the cache is evaluated on
# its own, and a cancelled chunk leaves the cache as it was before it. So chunks can stay long, which prefill needs
# (on the embedded model here a 32-id chunk ran at ~190 tok/s, a 512-id one at ~300-350), while a cancel waits for
# one layer of one chunk at most: 11-71 ms measured with 2,000 ids of context. A model whose layer takes longer than
# LAYER_BUDGET_S gets shorter chunks, sized from the chunk before, never below MIN_CHUNK (where the quantized layers
# switch from one batched GEMM to per-row kernels; core/model/native_linear.py).
LAYER_BUDGET_S = 0.25
MIN_CHUNK = 32


def _interruptible(model: nn.Module) -> bool:
    """Whether a forward pass may stop between layers: not for a model split across machines in tensor parallel,
    whose other ranks wait in the same collective operations (`SplitModel.interruptible`)."""
    return getattr(model, "interruptible", True)


def _detached(state: Any) -> Any:
    """A cache state whose arrays are new handles on the same data: MLX's `a[i] = x` updates the array object in
    place, so the cache's own handles would follow the chunk's writes."""
    if isinstance(state, (tuple, list)):
        return type(state)(_detached(x) for x in state)
    return mx.array(state) if isinstance(state, mx.array) else state


def prefill_chunk(model: nn.Module, layers: list, ids: Sequence[int],
                  cancelled: Callable[[], bool] = lambda: False) -> bool:
    """Run `ids` through the model into `layers` as one forward pass; only the cache state is evaluated, a layer at
    a time. Returns False, with `layers` as they were before, when `cancelled()` turns true between two layers.
    A model that cannot stop between layers (`_interruptible`) is evaluated whole."""
    if not _interruptible(model):
        model(mx.array(ids)[None], cache=layers)
        mx.eval([c.state for c in layers])
        return True
    before = [_detached(c.state) for c in layers]
    model(mx.array(ids)[None], cache=layers)
    for i, c in enumerate(layers):
        mx.eval(c.state)
        if i + 1 < len(layers) and cancelled():
            for layer, state in zip(layers, before):
                layer.state = state
            return False
    return True


def prefill(model: nn.Module, layers: list, ids: Sequence[int], step: int,
            cancelled: Callable[[], bool] = lambda: False,
            layer_budget_s: float = LAYER_BUDGET_S) -> Iterator[Sequence[int]]:
    """Run `ids` through the model into `layers` in chunks of at most `step` ids, yielding each chunk once it is in
    the cache, and stopping (mid-chunk, the cache as before that chunk) once `cancelled()` is true.

    A chunk is shortened when the chunk before took over `layer_budget_s` per layer (per pass on a model that
    cannot stop between layers). The logits of these positions are never evaluated, so no output-head work is done.
    """
    stops = max(1, len(layers)) if _interruptible(model) else 1
    start, size = 0, step
    while start < len(ids) and not cancelled():
        chunk = ids[start:start + size]
        began = time.perf_counter()
        if not prefill_chunk(model, layers, chunk, cancelled):
            return
        elapsed = (time.perf_counter() - began) / stops
        start += len(chunk)
        yield chunk
        size = min(step, max(MIN_CHUNK, int(len(chunk) * layer_budget_s / max(elapsed, 1e-6))))
