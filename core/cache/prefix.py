"""The one KV-reuse service: which cached keys and values a prompt can start from, in memory and on disk.

Every path that answers a prompt asks a `PrefixIndex` how much of it needs no prefill, instead of matching prefixes
itself: the solo path and chat sessions (`reuse`, on the `ConversationCache` they prefill into; core/engine.py's
`run_request`, which the split model's scheduler also runs), the batch scheduler (`fetch`, a cache of its own for a
newcomer; core/batch.py), and a chat reopened from the store (`warm`). What it owns:

* **Memory**: entries of token ids and plain KV caches cut to exactly those ids, in least-recently-used order (a hit
  or an insert makes an entry the newest), under a byte bound (`max_bytes`; 0 holds nothing). A new entry replaces
  the entries that are prefixes of it (it can be trimmed to each). The server's scheduler fills it (a newcomer's
  prompt when its prefill ends, a finished row's ids) and so does the solo path when `Engine.load(prefix_cache_mb=)`
  gives it room; a chat session keeps its own cache between turns and is not copied here.
* **Disk**: the engine's `KVStore` (core/cache/kv_store.py) when it has a KV cache folder. An entry evicted from
  memory is saved there (`spill_all` saves them all: the server is stopping), and a chat's cache is saved after each
  reply (`save`).

The match: the entry sharing the longest prefix with the prompt, at most all but the prompt's last id (its logits
give the first token); memory first, the disk only when it holds a longer prefix; a longer entry is copied and
trimmed to the shared prefix. `reuse` and `fetch` say how many ids were reused and how many of those came from disk
(`Metrics.cached_tokens`, `disk_tokens`). docs/architecture.md §5 and §14 have the whole picture.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .kv_cache import ConversationCache, reusable
from .kv_store import KVStore


@dataclass
class Hit:
    """Caches holding the first `reused` ids of a prompt (the caller's own copies), `disk` of them loaded from
    disk."""

    layers: list
    reused: int
    disk: int = 0


@dataclass
class _Entry:
    layers: list  # plain KV caches holding exactly the entry's ids
    nbytes: int


class PrefixIndex:
    """The prefix index of one model and KV setting: entries in memory (up to `max_bytes`) over an optional disk
    store. Every method but `match` runs on the inference thread (it makes or copies MLX arrays)."""

    def __init__(self, max_bytes: int = 0, disk: KVStore | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prefix cache's bound must be at least 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest first
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes the entries in memory hold (at most `max_bytes`)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    # --- the match -----------------------------------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> tuple[tuple[int, ...] | None, int]:
        """The entry in memory that shares the longest prefix with `prompt` (at most all but its last id), and how
        many ids it gives; (None, 0) when none shares any. Of entries giving as many, the shortest (least to trim)."""
        best, length = None, 0
        for ids in self._entries:
            n = reusable(ids, prompt)
            if n > length or (n == length and n > 0 and best is not None and len(ids) < len(best)):
                best, length = ids, n
        return best, length

    def _take(self, ids: tuple[int, ...], length: int) -> list:
        """A copy of entry `ids`'s caches trimmed to its first `length` ids; the entry becomes the newest."""
        self._entries.move_to_end(ids)
        layers = copy.deepcopy(self._entries[ids].layers)
        if len(ids) > length:
            for c in layers:
                c.trim(len(ids) - length)
        return layers

    def fetch(self, prompt: Sequence[int]) -> Hit | None:
        """Caches of their own holding the longest known prefix of `prompt` (memory first, the disk when it holds a
        longer one), or None when nothing is known of it. The batch scheduler's newcomers start here."""
        ids, length = self.match(prompt)
        found = self.disk.load(prompt, longer_than=length) if self.disk is not None else None
        if found is not None:
            return Hit(found[0], found[1], found[1])
        if ids is None:
            return None
        return Hit(self._take(ids, length), length)

    def reuse(self, cache: ConversationCache, prompt: Sequence[int]) -> tuple[int, int]:
        """Make `cache` hold the longest known prefix of `prompt` and return (ids reused, of which from disk): what
        the cache holds already, or an entry in memory or a file on disk that holds more (the cache then takes it in
        place of its own). A rotating window asks nothing else: it cannot take another cache, nor be trimmed once it
        has wrapped (it is then prefilled again; `ConversationCache.reuse`)."""
        if not cache.rotating:
            held = cache.matched(prompt)
            ids, length = self.match(prompt)
            if self.disk is not None and (found := self.disk.load(prompt, longer_than=max(held, length))):
                cache.adopt(found[0], prompt[:found[1]])
            elif ids is not None and length > held:
                cache.adopt(self._take(ids, length), prompt[:length], from_disk=False)
        reused = cache.reuse(prompt)
        return reused, min(cache.take_from_disk(), reused)

    def warm(self, cache: ConversationCache, prompt: Sequence[int]) -> int:
        """Load into `cache` the file on disk that holds a longer prefix of `prompt` than the cache does (a stored
        chat reopened, before its next message); how many ids were loaded (0: none longer, or no disk)."""
        if cache.rotating or self.disk is None:
            return 0
        if (found := self.disk.load(prompt, cache.matched(prompt))) is None:
            return 0
        cache.adopt(found[0], prompt[:found[1]])
        return found[1]

    # --- what is kept --------------------------------------------------------------------------------------

    def insert(self, ids: Sequence[int], layers: list, *, wait: bool = False) -> bool:
        """Keep a copy of `layers` (plain KV caches holding exactly `ids`) in memory; False when there is no room
        (`max_bytes` 0) or they are not plain caches of those ids. The copy is queued for evaluation (`wait`: and
        waited for): until it runs it holds the buffer it was cut from, which the byte bound does not see."""
        if self.max_bytes <= 0 or not ids or not layers or \
                not all(type(c) is KVCache and c.offset == len(ids) for c in layers):
            return False
        copies = held(layers)
        (mx.eval if wait else mx.async_eval)([c.state for c in copies])
        key = tuple(ids)
        if (old := self._entries.pop(key, None)) is not None:
            self._nbytes -= old.nbytes
        # The prefixes of a new entry take room for nothing: it can be trimmed to each.
        for shorter in [k for k in self._entries if len(k) < len(key) and key[:len(k)] == k]:
            self._nbytes -= self._entries.pop(shorter).nbytes
        entry = _Entry(copies, sum(c.nbytes for c in copies))
        self._entries[key] = entry
        self._nbytes += entry.nbytes
        while self._nbytes > self.max_bytes and self._entries:
            self._evict()
        return True

    def _evict(self) -> None:
        """Drop the least recently used entry, saving it to disk when there is a store."""
        ids, entry = self._entries.popitem(last=False)
        self._nbytes -= entry.nbytes
        if self.disk is not None:
            self.disk.save(ids, entry.layers)  # cut here (the inference thread), written in the background

    def spill_all(self) -> None:
        """Save every entry in memory to disk and drop it (the server is stopping)."""
        while self._entries:
            self._evict()

    def save(self, ids: Sequence[int], layers: list) -> None:
        """Queue `layers`, holding `ids`, to be saved on disk (a chat's cache after each reply); nothing without a
        store."""
        if self.disk is not None:
            self.disk.save(ids, layers)


def held(layers: list[KVCache]) -> list[KVCache]:
    """Lazy copies of plain KV caches cut to the positions they hold (their buffers grow in steps of 256 positions;
    a row cut from a batch holds the whole batch buffer it was cut from)."""
    copies = []
    for c in layers:
        cut = KVCache()
        cut.keys, cut.values = (mx.contiguous(x[..., :c.offset, :]) for x in (c.keys, c.values))
        cut.offset = c.offset
        copies.append(cut)
    return copies
