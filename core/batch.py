"""Continuous batching: many requests decode together, one batched forward per step, on the engine's thread.

Each request is a `_Sequence`: its `core.decode.reply.Reply` (sampler, text, stops, metrics, result: the same text layer
as the engine's solo path, so a request gives the same text alone and in a batch), its row of the step loop
(`core.decode.generate.StepLoop`, the same loop as the solo path) and, until it joins, its own KV cache. The scheduler
is one long job on the engine's inference thread (the only place MLX runs) that loops while there is work:

    admit waiting requests (up to `max_batch`) ─▶ prefill one chunk of one newcomer ─▶ a finished prefill joins the
    loop (its first token from its own one-row step, sent at once) ─▶ one step of the loop: queue step k+1 over every
    row, read step k's tokens, emit them, drop the rows that ended

A newcomer joins at the next step and a finished or cancelled row leaves at once (its slot is free for the next
admission). Prefill runs per sequence, in chunks interleaved with decode steps, so one long prompt does not stall
the clients already streaming; it runs through the same `core.cache.kv_cache.prefill_chunk` as a single request. The
loop decodes a lone row on its own cache and merges rows into mlx-lm's `BatchKVCache` (left-padded, with a per-row
attention mask) while there are several; a row that leaves keeps its row of that cache as a free slot, and a newcomer
is written into a free slot, so neither copies the rows that go on decoding (core/decode/generate.py). A request with
`speculative` ("ngram", "auto") verifies guesses while it has the model to itself, as the solo path does, and decodes
plainly in a busy batch (core/decode/generate.py says why).

The prefix cache is a `PrefixIndex` (core/cache/prefix.py, the KV-reuse service every path asks; LRU order, a byte
bound): a prompt's KV cache is stored when its prefill ends and a finished sequence's under the ids it holds, and a
new prompt starts from the longest cached prefix, so a client that resends a whole conversation prefills only what is
new. `Metrics.cached_tokens` reports what was reused. With the engine's KV cache folder, evicted entries spill to disk
and a prompt falls back to it (core/cache/kv_store.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .cache.kv_cache import prefill_chunk
from .cache.prefix import PrefixIndex
from .decode.events import Event, FinishReason
from .decode.generate import Row, StepLoop
from .decode.reasoning import Reasoning
from .decode.reply import Reply, Request
from .decode.speculative import Speculation, plan
from .decode.tools import ToolUse
from .decode.worker import Job
from .engine import Engine
from .errors import ContextLengthError
from .sampling import constraint
from .sampling.profile import SamplingProfile

Emit = Callable[[Event | BaseException], None]
# Prefill chunk while other sequences are decoding: ~0.4 s of a 2-core CPU (prefill ~150 tok/s), the longest
# pause a streaming client sees when another joins; alone, a sequence prefills in the engine's full chunks.
INTERLEAVED_PREFILL = 64


class QueueFull(Exception):
    """More requests wait than the scheduler's queue holds; the caller should retry later."""


@dataclass
class BatchRequest:
    """One generation: prompt ids, its settings, and where its events go (called on the inference thread).

    The settings are validated into `request` as the engine's are (`Request.make`: the same max_tokens default and
    checks); an invalid one raises ValueError here."""

    prompt: list[int]
    profile: SamplingProfile
    emit: Emit
    max_tokens: int | None = None
    stop: Sequence[str] = ()  # in addition to the profile's
    trace: int = 0  # candidates traced per token (0 = off): each TokenEvent then carries its token's TokenTrace
    tools: ToolUse | None = None  # the tools the reply may call (core/decode/tools.py)
    reasoning: Reasoning = field(default_factory=Reasoning)  # a thinking model's budget (core/decode/reasoning.py)
    # "ngram" or "auto": guess and verify while alone (core/decode/generate.py)
    speculative: str | Speculation | None = None
    accepted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    request: Request = field(init=False)

    def __post_init__(self) -> None:
        self.request = Request.make(self.profile, self.max_tokens, self.stop, self.trace, self.speculative,
                                    tools=self.tools, reasoning=self.reasoning)
        if self.request.speculative.mode == "draft":
            raise ValueError("speculative='draft' needs a draft model, which the batch scheduler does not run: use "
                             "'ngram', 'auto' or 'off'")

    def cancel(self) -> None:
        """Stop at the next token (or prefill chunk); the request then ends with finish_reason "cancelled"."""
        self.cancelled.set()


class Admission:
    """The one admission queue of the server's schedulers (`BatchScheduler`, and the split model's
    `SequentialScheduler`, core/distributed/serving.py): the checks every request passes before it waits (an empty
    prompt, a prompt that fills the context), and one bound: up to `slots` requests run, up to `max_queue` more wait
    (those held while their grammar compiles among them), beyond that `QueueFull`. Thread-safe; the scheduler takes
    the waiting requests in order as it has room (`take`, or `start` for a given one) and frees a slot when a request
    is done (`release`)."""

    def __init__(self, engine: Engine, slots: int, max_queue: int) -> None:
        if slots < 1:
            raise ValueError(f"max_batch must be at least 1, got {slots}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be at least 0, got {max_queue}")
        self.engine, self.slots, self.max_queue = engine, slots, max_queue
        self.lock = threading.Lock()  # the scheduler's own state may share it
        self.waiting: deque[BatchRequest] = deque()
        self.held: list[BatchRequest] = []  # accepted, not yet waiting (a grammar compiling: `ready` when done)
        self.active = 0  # taken and not yet done

    def check(self, req: BatchRequest) -> None:
        """Refuse a request no scheduler can run: an empty prompt, or one that leaves no room for a reply."""
        if not req.prompt:
            raise ValueError("the prompt is empty: type a message first")
        limit = self.engine.context_length
        if len(req.prompt) >= limit:
            raise ContextLengthError(len(req.prompt), limit, self.engine.name)

    def add(self, req: BatchRequest, ready: bool = True) -> None:
        """With the lock held: queue `req` (or hold it until `ready`), or raise QueueFull when the queue is full."""
        waiting = len(self.waiting) + len(self.held)
        if self.active + waiting >= self.slots + self.max_queue:
            running = f"{self.slots} requests are" if self.slots > 1 else "1 request is"
            raise QueueFull(f"{running} running and {waiting} waiting")
        (self.waiting.append if ready else self.held.append)(req)

    def ready(self, req: BatchRequest) -> None:
        """With the lock held: a held request waits its turn now."""
        self.held[:] = [r for r in self.held if r is not req]
        self.waiting.append(req)

    def take(self, busy: int) -> BatchRequest | None:
        """The next waiting request, its slot taken, while fewer than `slots` are `busy`; None otherwise."""
        with self.lock:
            if not self.waiting or busy >= self.slots:
                return None
            self.active += 1
            return self.waiting.popleft()

    def start(self, req: BatchRequest) -> None:
        """`req` runs now (a scheduler that runs requests in the order the inference thread has them)."""
        with self.lock:
            self.waiting.remove(req)
            self.active += 1

    def release(self) -> None:
        with self.lock:
            self.active -= 1

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) right now; waiting counts the held requests."""
        with self.lock:
            return self.active, len(self.waiting) + len(self.held)

    def everyone(self) -> list[BatchRequest]:
        """The requests waiting or held."""
        with self.lock:
            return [*self.waiting, *self.held]


class _Sequence:
    """A request's state on the inference thread, from admission to its `Done`: its reply, its row of the step loop,
    and its KV cache until it joins the loop."""

    def __init__(self, req: BatchRequest, engine: Engine) -> None:
        self.req = req
        self.reply = Reply(engine.model, req.request, req.prompt, req.emit, req.cancelled.is_set,
                           accepted=req.accepted, context=lambda: len(self.row.fed))
        # `fed`: the ids in the sequence's cache (the loop extends it); the prompt but its last id once prefilled.
        # Whether it speculates is decided when it joins, on its cache (`_join`).
        self.row = Row(self.reply, [], logprobs=req.profile.logprobs)
        self.cache: list | None = None  # per-layer caches from the start of its prefill until it joins the loop
        self.todo: list[int] = []  # prefilled before joining; the last prompt id is the row's first step

    def begin(self, cache: list, reused: int, disk: int = 0) -> None:
        self.cache = cache
        self.todo = self.req.prompt[reused:-1]
        self.row.fed[:] = self.req.prompt[:-1]
        self.reply.begin_prefill(len(self.req.prompt), reused, disk)


class BatchScheduler:
    """Serve many requests on one engine with continuous batching; see the module docstring.

    `submit` is thread-safe and never blocks: up to `max_batch` requests run at once, up to `max_queue` more wait,
    and beyond that `submit` raises `QueueFull`. `prefix_cache_bytes` bounds the prefix cache (0 disables it)."""

    def __init__(self, engine: Engine, *, max_batch: int = 4, max_queue: int = 16,
                 prefix_cache_bytes: int = 512 * 2**20, prefill_step: int | None = None) -> None:
        self.admission = Admission(engine, max_batch, max_queue)
        self.engine = engine
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_step = prefill_step or engine.prefill_step
        # KV caches saved to disk (core/cache/kv_store.py), with the engine's kv_cache_dir: a prompt whose prefix was
        # saved there loads it, and the prefix cache's evicted entries (all of them at shutdown) are saved there.
        self.disk = engine.kv_store()
        # Its memory is the scheduler's own (`prefix_cache_bytes`; 0 keeps nothing there), over the engine's disk store.
        self.prefix_cache = PrefixIndex(prefix_cache_bytes, self.disk)
        self._lock = self.admission.lock
        self._running = False  # whether the scheduler job is on (or queued for) the inference thread
        # Inference-thread state.
        self._prefilling: deque[_Sequence] = deque()
        self._loop = StepLoop(engine.model.model, self._ended, self._newcomer_waits)
        self._decoding: dict[Row, _Sequence] = {}  # the loop's rows' sequences
        # The llguidance tokenizer holds the GIL while it builds (~0.5 s, core/sampling/constraint.py): built now, as
        # the server starts, not when the first constrained request arrives and others decode.
        constraint.warm(engine.model.tokenizer, engine.model.vocab_size)

    # --- any thread ----------------------------------------------------------------------------------------

    def submit(self, req: BatchRequest) -> BatchRequest:
        self.admission.check(req)
        fmt = req.request.response_format()
        # A request whose grammar compiles on the grammar pool (core/sampling/constraint.py) is held there, not in
        # the batch, and waits once compiled, so the rows decoding never wait for a newcomer's compile.
        compiled = None if fmt is None else constraint.prepare(fmt, self.engine.model.tokenizer,
                                                               self.engine.model.vocab_size)
        with self._lock:
            ready = compiled is None or compiled.done()
            self.admission.add(req, ready)
            if ready:
                self._wake()
                return req
        compiled.add_done_callback(lambda _: self._compiled(req))  # on the pool's thread (or here, if done by now)
        return req

    def _compiled(self, req: BatchRequest) -> None:
        """A request's grammar has compiled (or failed to: its admission then fails it alone): it waits its turn."""
        with self._lock:
            self.admission.ready(req)
            self._wake()

    def _wake(self) -> None:
        """With the lock held: a request waits for admission, so the scheduler job runs."""
        if not self._running:
            self._running = True
            self.engine.submit(self._run)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) right now; waiting counts the requests whose grammar is compiling."""
        return self.admission.load

    @property
    def idle(self) -> bool:
        """Whether the scheduler's loop has ended: nothing runs or waits, and the last rows' caches are stored."""
        with self._lock:
            return not self._running and not self.admission.held

    def memory(self) -> dict[str, int]:
        """Bytes now: MLX's active memory (weights, KV caches, the prefix cache), the prefix cache's share of it
        (bounded by `prefix_cache_bytes`), and the freed buffers MLX keeps for reuse. A server's /health reports it,
        so a load test can see that what requests held is given back."""
        return {"active_bytes": mx.get_active_memory(),
                "prefix_cache_bytes": self.prefix_cache.nbytes,
                "buffer_cache_bytes": mx.get_cache_memory()}

    # --- the inference thread ------------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        while True:
            if job.cancelled.is_set():  # the interpreter is exiting (InferenceThread.halt)
                self._cancel_all()
            try:
                self._admit()
                if self._prefilling:
                    self._prefill_chunk()
                if self._loop.rows:
                    self._loop.step()
            except Exception as e:  # noqa: BLE001 - an MLX failure ends every request in flight, not the server
                self._fail_all(e)
            with self._lock:
                if not (self.admission.waiting or self._prefilling or self._loop.rows):
                    self._running = False
                    return

    def _admit(self) -> None:
        while (req := self.admission.take(len(self._prefilling) + len(self._loop.rows))) is not None:
            try:
                seq = _Sequence(req, self.engine)
            except Exception as e:  # noqa: BLE001 - a request the sampler refuses fails alone
                self._release()
                req.emit(e)
                continue
            if req.cancelled.is_set():
                self._done(seq, "cancelled")
            else:
                self._prefilling.append(seq)

    def _cache_for(self, prompt: list[int]) -> tuple[list, int, int]:
        """A KV cache holding the longest known prefix of `prompt` (leaving at least one id to run: the prefix
        index's match), its length, and how many of those ids came from disk."""
        if (hit := self.prefix_cache.fetch(prompt)) is None:
            return make_prompt_cache(self.engine.model.model), 0, 0
        return hit.layers, hit.reused, hit.disk

    def _prefill_chunk(self) -> None:
        seq = self._prefilling[0]
        if seq.req.cancelled.is_set():
            self._prefilling.popleft()
            self._done(seq, "cancelled")
            return
        # While other rows decode, every chunk delays their next token: keep chunks short then.
        if seq.cache is None:
            # Looked up when its prefill starts, not at admission: a prompt prefilled just before (the other
            # choices of an n > 1 request, a shared system prompt) is in the prefix cache by then.
            seq.begin(*self._cache_for(seq.req.prompt))
        chunk = seq.todo[:self.prefill_step if not self._loop.rows else min(self.prefill_step, INTERLEAVED_PREFILL)]
        if chunk:
            prefill_chunk(self.engine.model.model, seq.cache, chunk)
            seq.todo = seq.todo[len(chunk):]
        if not seq.todo:
            self._prefilling.popleft()
            self._join(seq)

    def _join(self, seq: _Sequence) -> None:
        """A prefilled sequence joins the step loop: its prompt's cache is stored for the prefix cache (a copy: a lone
        row decodes on its own cache), and its last prompt id is its first step."""
        prompt, spec = seq.req.prompt, seq.req.request.speculative
        # Where speculation cannot run (a model's sliding-window layers) the request, already accepted, decodes
        # plainly; the server loads no draft model ("draft" is refused at submission).
        seq.reply.speculative, drafter = plan(spec, seq.cache, strict=False)
        if drafter is not None:
            seq.row = Row(seq.reply, seq.row.fed, logprobs=seq.req.profile.logprobs, context=prompt, drafter=drafter,
                          spec=spec)
        self._decoding[seq.row] = seq  # from here a failure reaches it (_fail_all)
        self.prefix_cache.insert(prompt[:-1], seq.cache, wait=True)  # a copy: a lone row decodes into its own
        cache, seq.cache = seq.cache, None
        self._loop.join(seq.row, cache, prompt[-1])

    def _newcomer_waits(self) -> bool:
        """Whether a request waits to be prefilled: the loop then leaves its next step unsubmitted until it reads it,
        so the newcomer's prefill and first token wait for the step running, not for the one after it too (1.1B
        model, 7 rows decoding: ~100 ms a step)."""
        return bool(self.admission.waiting or self._prefilling)

    def _ended(self, row: Row, cache: Callable[[], list]) -> None:
        """A row left the loop: store its KV cache in the prefix cache (under the ids it holds), end its reply."""
        seq = self._decoding.pop(row)
        if self.prefix_cache.max_bytes > 0:
            # Copies of what the cache holds (`PrefixIndex.insert`), queued, not waited for: they run after the step
            # in flight.
            self.prefix_cache.insert(list(row.fed), cache())
        self._done(seq, row.reason)

    def _done(self, seq: _Sequence, reason: FinishReason) -> None:
        self._release()  # before the Done, so a caller that reads it sees the slot free
        seq.reply.finish(reason)

    def _cancel_all(self) -> None:
        requests = [*self.admission.everyone(), *(seq.req for seq in (*self._prefilling, *self._decoding.values()))]
        for req in requests:
            req.cancel()

    def _release(self) -> None:
        self.admission.release()

    def _fail_all(self, error: Exception) -> None:
        for seq in [*self._prefilling, *self._decoding.values()]:
            self._release()
            try:
                seq.req.emit(error)
            except Exception:  # noqa: BLE001, S110 - a caller that cannot take the error must not stop the others'
                pass
        self._prefilling.clear()
        self._decoding.clear()
        self._loop = StepLoop(self.engine.model.model, self._ended, self._newcomer_waits)


__all__ = ["Admission", "BatchRequest", "BatchScheduler", "QueueFull"]
