"""`mlxchat serve --hosts`: the server's scheduler for a split model, one request at a time.

The batched scheduler (core/batch.py) merges sequences into mlx-lm's batch caches and splits them again; the workers
keep one KV cache per cache of rank 0's and follow its offset, which batch caches do not have. So a split model
serves its requests in order, each through `Engine.run_request` as a chat turn is, with the last request's KV cache
kept: a client that resends its conversation prefills only what is new (the engine's prefix index matches it,
core/cache/prefix.py; a split engine keeps nothing else in memory, and no disk store).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace

import mlx.core as mx

from ..batch import BatchRequest, QueueFull
from ..cache.kv_cache import ConversationCache
from ..decode.speculative import Speculation
from ..decode.worker import Job
from ..engine import Engine
from ..errors import ContextLengthError


class SequentialScheduler:
    """`submit` and `load` as BatchScheduler's, for `server.app.create_app`."""

    def __init__(self, engine: Engine, *, max_queue: int = 16) -> None:
        self.engine, self.max_queue = engine, max_queue
        self._lock = threading.Lock()
        self._waiting: deque[BatchRequest] = deque()
        self._running = 0
        self._cache: ConversationCache | None = None  # the last request's, on the inference thread

    def submit(self, req: BatchRequest) -> BatchRequest:
        if not req.prompt:
            raise ValueError("the prompt is empty: type a message first")
        if len(req.prompt) >= self.engine.context_length:
            raise ContextLengthError(len(req.prompt), self.engine.context_length, self.engine.name)
        with self._lock:
            if self._running + len(self._waiting) >= 1 + self.max_queue:
                raise QueueFull(f"1 request is running and {len(self._waiting)} waiting")
            self._waiting.append(req)
        stream = self.engine.submit(lambda job: self._run(job, req))
        threading.Thread(target=self._forward, args=(stream, req), name="mlxchat-split-serve", daemon=True).start()
        return req

    @property
    def load(self) -> tuple[int, int]:
        with self._lock:
            return self._running, len(self._waiting)

    def memory(self) -> dict[str, int]:
        """As BatchScheduler.memory (rank 0's share; no prefix cache here)."""
        return {"active_bytes": mx.get_active_memory(), "prefix_cache_bytes": 0,
                "buffer_cache_bytes": mx.get_cache_memory()}

    def _run(self, job: Job, req: BatchRequest) -> None:
        with self._lock:
            self._waiting.remove(req)
            self._running = 1
        try:
            job.cancelled = req.cancelled  # the client's cancel stops this job at the next token
            if self._cache is None:
                self._cache = ConversationCache(self.engine.model.model)
            try:
                # Plainly: a verify pass's trim of rank 0's cache is not yet known to be followed by the workers
                # (untested over a split model), so `speculative` is not honoured here.
                self.engine.run_request(job, self._cache, req.prompt, replace(req.request, speculative=Speculation()))
            except BaseException:
                self._cache = None  # its keys and values may be ahead of its ids
                raise
        finally:
            with self._lock:
                self._running = 0

    @staticmethod
    def _forward(stream: object, req: BatchRequest) -> None:
        """The job's events to the request's `emit`, a failure (a lost peer among them) as the exception."""
        try:
            for event in stream:  # type: ignore[attr-defined]
                req.emit(event)
        except Exception as e:  # noqa: BLE001 - the server turns it into the request's error
            req.emit(e)
