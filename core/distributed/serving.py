"""`mlxchat serve --hosts`: the server's scheduler for a split model, one request at a time.

The batched scheduler (core/batch.py) merges sequences into mlx-lm's batch caches and splits them again; the workers
keep one KV cache per cache of rank 0's and follow its offset, which batch caches do not have. So a split model
serves its requests in order, each through `Engine.run_request` as a chat turn is, with the last request's KV cache
kept: a client that resends its conversation prefills only what is new (the engine's prefix index matches it,
core/cache/prefix.py; a split engine keeps nothing else in memory, and no disk store). Requests are admitted by the
batched server's admission queue (`core.batch.Admission`), with one slot.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import mlx.core as mx

from ..batch import Admission, BatchRequest
from ..cache.kv_cache import ConversationCache
from ..decode.speculative import Speculation
from ..decode.worker import Job
from ..engine import Engine


class SequentialScheduler:
    """`submit` and `load` as BatchScheduler's, for `server.app.create_app`."""

    def __init__(self, engine: Engine, *, max_queue: int = 16) -> None:
        self.engine, self.max_queue = engine, max_queue
        self.admission = Admission(engine, 1, max_queue)
        self._cache: ConversationCache | None = None  # the last request's, on the inference thread

    def submit(self, req: BatchRequest) -> BatchRequest:
        self.admission.check(req)
        with self.admission.lock:
            self.admission.add(req)
        stream = self.engine.submit(lambda job: self._run(job, req))
        threading.Thread(target=self._forward, args=(stream, req), name="mlxchat-split-serve", daemon=True).start()
        return req

    @property
    def load(self) -> tuple[int, int]:
        return self.admission.load

    def memory(self) -> dict[str, int]:
        """As BatchScheduler.memory (rank 0's share; no prefix cache here)."""
        return {"active_bytes": mx.get_active_memory(), "prefix_cache_bytes": 0,
                "buffer_cache_bytes": mx.get_cache_memory()}

    def _run(self, job: Job, req: BatchRequest) -> None:
        self.admission.start(req)
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
            self.admission.release()

    @staticmethod
    def _forward(stream: object, req: BatchRequest) -> None:
        """The job's events to the request's `emit`, a failure (a lost peer among them) as the exception."""
        try:
            for event in stream:  # type: ignore[attr-defined]
                req.emit(event)
        except Exception as e:  # noqa: BLE001 - the server turns it into the request's error
            req.emit(e)
