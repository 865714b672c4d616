"""The engine: one long-lived inference thread that owns every MLX call, and the sessions that feed it.

MLX streams are per thread, so loading, prefill and decode all run on the same thread; callers (a
script, the CLI, the TUI) talk to it through queues. Each request gets its own event queue and a
cancel flag checked between prefill chunks and between decode steps.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import loader
from .beam import Beam, beam_search
from .cache import ConversationCache, prefill
from .errors import ContextLengthError, GenerationError, MlxChatError
from .events import Done, Event, FinishReason, GenerationResult, Metrics, PrefillProgress, TokenEvent, TokenLogprob
from .messages import ChatMessage
from .profile import SamplingProfile
from .sampling import Sampler
from .streaming import IncrementalDetokenizer, StopStringFilter

Prompt = str | Sequence[dict[str, str] | ChatMessage]
DEFAULT_PREFILL_STEP = 512


@dataclass
class _Failure:
    error: BaseException


class Job:
    """One unit of work on the inference thread: the events it emits, a cancel flag, and when it was accepted."""

    def __init__(self, fn: Callable[["Job"], Any]) -> None:
        self.fn = fn
        self.events: queue.Queue[Event | _Failure] = queue.Queue()
        self.cancelled = threading.Event()
        self.accepted = time.perf_counter()

    def emit(self, event: Event) -> None:
        self.events.put(event)


class InferenceThread:
    """Runs jobs one at a time, in order, on a single daemon thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxchat-inference", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.fn(job)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller, and the thread live on
                job.events.put(_Failure(e))
            del job  # the last job's closure (model, cache) is not kept alive while the thread waits
        # Never return. When a thread that ran MLX ends, MLX's thread-local destructors take the GIL; if that
        # races the interpreter's finalization the process aborts ("terminate called without an active
        # exception", about half of the processes that close an engine and then exit). A parked daemon thread
        # is never finalized.
        self._stopped.set()
        threading.Event().wait()

    def submit(self, fn: Callable[[Job], Any]) -> Job:
        job = Job(fn)
        self._jobs.put(job)
        return job

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the inference thread and return its value (or raise its exception) here."""
        finished = threading.Event()
        box: dict[str, Any] = {}

        def job(_: Job) -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
            finally:
                finished.set()

        self.submit(job)
        finished.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        """Finish the queued jobs, then park the thread (see `_run`)."""
        self._jobs.put(None)
        self._stopped.wait(timeout=5)


class Stream:
    """Iterate for events; `cancel()` stops at the next token (or prefill chunk). Leaving early cancels."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Event]:
        try:
            while self.result is None:
                event = self._job.events.get()
                if isinstance(event, _Failure):
                    raise _as_caller_error(event.error)
                if isinstance(event, Done):
                    self.result = event.result
                yield event
        finally:
            if self.result is None:
                self._job.cancelled.set()

    def cancel(self) -> None:
        self._job.cancelled.set()

    def wait(self, progress: Callable[[int, int], None] | None = None) -> GenerationResult:
        for event in self:
            if progress and isinstance(event, PrefillProgress):
                progress(event.done, event.total)
        assert self.result is not None
        return self.result


def _as_caller_error(error: BaseException) -> BaseException:
    if isinstance(error, (MlxChatError, ValueError)):
        return error
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return GenerationError(f"the engine failed: {type(error).__name__}" + (f": {first}" if first else ""))


def _messages(prompt: Prompt, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        m.as_prompt() if isinstance(m, ChatMessage) else dict(m) for m in prompt]
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string 'role' and a string 'content'")
    if not messages or not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise ValueError("the prompt is empty: type a message first")
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


@dataclass
class _Request:
    profile: SamplingProfile
    max_tokens: int | None
    stop: list[str]


class Engine:
    """A loaded model and its inference thread. See DESIGN.md §2 for the surface scripts rely on."""

    def __init__(self, model: loader.LoadedModel, worker: InferenceThread, prefill_step: int) -> None:
        self.model = model
        self._worker = worker
        self.prefill_step = prefill_step

    @classmethod
    def load(cls, model: str | Path | None = None, *, weights: loader.WeightPolicy | None = None,
             prefill_step: int = DEFAULT_PREFILL_STEP) -> "Engine":
        if prefill_step < 1:
            raise ValueError(f"prefill_step must be at least 1, got {prefill_step}")
        worker = InferenceThread()
        try:
            loaded = worker.run(lambda: loader.load(model, weights))
        except BaseException:
            worker.stop()
            raise
        return cls(loaded, worker, prefill_step)

    # --- the surface ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def context_length(self) -> int:
        return self.model.context_length

    def stream(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
               stop: Sequence[str] | None = None, system: str | None = None) -> Stream:
        messages = _messages(prompt, system)
        request = self._request(profile, max_tokens, stop)

        def run(job: Job) -> None:
            self._generate(job, ConversationCache(self.model.model), self.model.tokenizer.encode_chat(messages), request)

        return self.submit(run)

    def generate(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                 stop: Sequence[str] | None = None, system: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> GenerationResult:
        return self.stream(prompt, profile=profile, max_tokens=max_tokens, stop=stop, system=system).wait(progress)

    def beam_search(self, prompt: Prompt, *, profile: SamplingProfile | None = None, max_tokens: int | None = None,
                    system: str | None = None) -> list[Beam]:
        """The profile's `beam_size` best continuations (n best, best score first); see core/beam.py."""
        profile = profile or SamplingProfile(beam_size=4)
        ids = self.model.tokenizer.encode_chat(_messages(prompt, system))
        return self.run(lambda: beam_search(
            self.model.model, self.model.tokenizer, ids, beam_size=profile.beam_size,
            length_penalty=profile.length_penalty, max_tokens=max_tokens or profile.max_tokens or 64,
            prefill_step=self.prefill_step))

    def chat(self, *, system: str | None = None, profile: SamplingProfile | None = None,
             max_kv_size: int | None = None, keep: int = 4) -> "ChatSession":
        return ChatSession(self, system=system, profile=profile, max_kv_size=max_kv_size, keep=keep)

    def count_tokens(self, prompt: Prompt, system: str | None = None) -> int:
        return len(self.model.tokenizer.encode_chat(_messages(prompt, system)))

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the inference thread (where MLX work on this engine's model must run), after the work queued
        before it, and return its value or raise its exception here."""
        return self._worker.run(fn)

    def submit(self, fn: Callable[[Job], Any]) -> Stream:
        """Queue `fn(job)` on the inference thread and return the Stream of the events it emits with `job.emit`.
        `fn` should check `job.cancelled` between steps and end by emitting a `Done`."""
        return Stream(self._worker.submit(fn))

    def close(self) -> None:
        self._worker.stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- on the inference thread ----------------------------------------------------------------

    def _request(self, profile: SamplingProfile | None, max_tokens: int | None,
                 stop: Sequence[str] | None) -> _Request:
        profile = profile or SamplingProfile()
        if profile.beam_size > 1:
            raise ValueError(f"beam search (beam_size {profile.beam_size}) does not stream: call "
                             "engine.beam_search(), or use beam_size 1 to sample")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        return _Request(profile, max_tokens or profile.max_tokens, [*profile.stop, *(stop or [])])

    def _generate(self, job: Job, cache: ConversationCache, prompt: list[int], req: _Request) -> GenerationResult:
        m = self.model
        limit = m.context_length
        if not prompt:
            raise ValueError("the prompt is empty: type a message first")
        if not cache.rotating and len(prompt) >= limit:
            raise ContextLengthError(
                f"the prompt is {len(prompt)} tokens but {m.name} has a context of {limit}: shorten it, "
                "start a new chat, or use a rotating window (max_kv_size)")
        mx.reset_peak_memory()
        clock = _Clock(job.accepted, time.perf_counter(), len(prompt), cache.reuse(prompt), cache, limit)
        sampler = Sampler(req.profile, vocab_size=m.vocab_size, eos_ids=m.tokenizer.eos_ids, prompt_ids=prompt)
        layers = cache.layers
        want_lp = req.profile.logprobs

        def forward(ids: mx.array) -> tuple[mx.array, mx.array]:
            logits = m.model(ids[None], cache=layers)[0, -1]
            token, logprobs = sampler.step(logits)
            # Logprobs cost a vocabulary-wide exp: evaluate them only when asked for.
            mx.async_eval(token, logprobs) if want_lp else mx.async_eval(token)
            return token, logprobs

        todo = prompt[clock.reused:]
        job.emit(PrefillProgress(clock.reused, clock.total))
        chunks = prefill(m.model, layers, todo[:-1], self.prefill_step)
        while not job.cancelled.is_set() and (chunk := next(chunks, None)) is not None:
            cache.tokens.extend(chunk)
            job.emit(PrefillProgress(len(cache.tokens), clock.total))
        if job.cancelled.is_set():
            return self._finish(job, clock, "", [], [], "cancelled", sampler, req)

        y, logprobs = forward(mx.array(todo[-1:]))
        cache.tokens.append(todo[-1])
        detok = IncrementalDetokenizer(m.tokenizer)
        stops = StopStringFilter(req.stop)
        text: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        reason: FinishReason = "length"
        while True:
            at_limit = (req.max_tokens is not None and len(ids) + 1 >= req.max_tokens) or (
                not cache.rotating and len(cache.tokens) + 1 >= limit)
            if not at_limit:
                # Queue the next step before waiting on this token, so the host never idles the device.
                next_y, next_lp = forward(y.reshape(1))
            token = y.item()
            if not at_limit:
                cache.tokens.append(token)
            if token in m.tokenizer.eos_ids:
                reason = "stop"
                break
            clock.tick()
            ids.append(token)
            token_lp = ()
            if want_lp:
                chosen, top = sampler.top_logprobs(logprobs, token, req.profile.top_logprobs)
                token_lp = (TokenLogprob(token, chosen, tuple(top)),)
                lps.extend(token_lp)
            delta = stops.feed(detok.add(token))
            text.append(delta)
            job.emit(TokenEvent(delta, (token,), clock.metrics(), token_lp))
            if stops.stopped:
                reason = "stop"
                break
            if at_limit:
                break
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            y, logprobs = next_y, next_lp
        if not stops.stopped:
            tail = stops.feed(detok.flush()) + stops.flush()
            if tail:
                text.append(tail)
                job.emit(TokenEvent(tail, (), clock.metrics()))
        return self._finish(job, clock, "".join(text), ids, lps, reason, sampler, req)

    def _finish(self, job: Job, clock: "_Clock", text: str, ids: list[int], lps: list[TokenLogprob],
                reason: FinishReason, sampler: Sampler, req: _Request) -> GenerationResult:
        result = GenerationResult(text, reason, clock.metrics(), tuple(ids), tuple(lps), sampler.describe(),
                                  sampler.seed, req.profile.model_dump(mode="json"))
        job.emit(Done(result))
        return result


@dataclass
class _Clock:
    """Times one generation and turns them into `Metrics` snapshots."""

    accepted: float
    started: float
    total: int
    reused: int
    cache: ConversationCache
    limit: int
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def tick(self) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.tokens += 1

    def metrics(self) -> Metrics:
        first, last, n = self.first, self.last, self.tokens
        return Metrics(
            prompt_tokens=self.total, cached_tokens=self.reused, completion_tokens=n,
            ttft_s=first - self.accepted if first else 0.0,
            tpot_s=(last - first) / (n - 1) if first and last and n > 1 else 0.0,
            prefill_s=(first or time.perf_counter()) - self.started,
            decode_s=last - first if first and last else 0.0,
            peak_memory_bytes=mx.get_peak_memory(),
            context_tokens=self.cache.size, context_limit=self.limit, kv_window=self.cache.max_kv_size,
        )


class ChatSession:
    """A conversation whose KV cache lives between turns: each turn prefills only the new suffix."""

    def __init__(self, engine: Engine, *, system: str | None = None, profile: SamplingProfile | None = None,
                 max_kv_size: int | None = None, keep: int = 4) -> None:
        self.engine = engine
        self.profile = profile or SamplingProfile()
        self._messages: list[ChatMessage] = [ChatMessage("system", system)] if system else []
        self.max_kv_size, self.keep = max_kv_size, keep
        self._cache: ConversationCache | None = None
        self._lock = threading.Lock()  # guards `messages` between the caller and the inference thread

    @property
    def messages(self) -> list[ChatMessage]:
        """A copy of the conversation, system prompt first; change it with the methods below."""
        with self._lock:
            return list(self._messages)

    @property
    def system(self) -> str | None:
        with self._lock:
            return self._messages[0].content if self._messages and self._messages[0].role == "system" else None

    def replace_history(self, messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
        """Replace every message but the system prompt (e.g. a stored conversation reopened). The KV cache stays:
        the next turn re-matches it by prefix and prefills only what differs."""
        history = [ChatMessage.coerce(m) for m in messages]
        if any(m.role == "system" for m in history):
            raise ValueError("the history must not contain a system message: set it with the session's system")
        with self._lock:
            self._messages = [m for m in self._messages[:1] if m.role == "system"] + history

    def drop_last_user(self) -> ChatMessage | None:
        """Take back the last message if it is an unanswered user message (one the engine refused); return it."""
        with self._lock:
            if self._messages and self._messages[-1].role == "user":
                return self._messages.pop()
        return None

    @property
    def cache(self) -> ConversationCache | None:
        """The conversation's KV cache (None before the first turn), for size and memory readouts."""
        return self._cache

    def send(self, text: str, *, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> Stream:
        _messages(text, None)  # the same checks as a one-off prompt, before anything is recorded
        message = ChatMessage("user", text)
        with self._lock:
            self._messages.append(message)
        return self._reply(max_tokens, stop, message)

    def regenerate(self, *, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> Stream:
        """Drop the last reply and answer the last user message again."""
        with self._lock:
            if self._messages and self._messages[-1].role == "assistant":
                self._messages.pop()
            if not self._messages or self._messages[-1].role != "user":
                raise ValueError("there is no user message to answer again")
        return self._reply(max_tokens, stop)

    def edit_last(self, text: str, *, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> Stream:
        """Replace the last user message (dropping what followed it) and answer it."""
        _messages(text, None)
        with self._lock:
            last = max((i for i, m in enumerate(self._messages) if m.role == "user"), default=None)
            if last is None:
                raise ValueError("there is no user message to edit")
            del self._messages[last:]
            message = ChatMessage("user", text)
            self._messages.append(message)
        return self._reply(max_tokens, stop, message)

    def clear(self) -> None:
        """Forget every message but the system prompt; the cache starts again on the next turn."""
        with self._lock:
            self._messages = [m for m in self._messages[:1] if m.role == "system"]
            self._cache = None

    def _reply(self, max_tokens: int | None, stop: Sequence[str] | None,
               sent: ChatMessage | None = None) -> Stream:
        engine = self.engine
        request = engine._request(self.profile, max_tokens, stop)

        def run(job: Job) -> None:
            if self._cache is None:
                self._cache = ConversationCache(engine.model.model, self.max_kv_size, self.keep)
            with self._lock:
                rendered = [m.as_prompt() for m in self._messages]
            try:
                prompt = engine.model.tokenizer.encode_chat(rendered)
                result = engine._generate(job, self._cache, prompt, request)
            except BaseException as e:
                # The turn did not happen: take back the message it answered (or a message that cannot be
                # answered, e.g. one longer than the context, fails every later turn too). A ContextLengthError
                # comes before any model call; after any other failure the cache's keys/values may be ahead of
                # its ids, so it is dropped.
                if not isinstance(e, ContextLengthError):
                    self._cache = None
                with self._lock:
                    if sent is not None and self._messages and self._messages[-1] is sent:
                        self._messages.pop()
                raise
            if result.text or result.finish_reason != "cancelled":
                with self._lock:
                    self._messages.append(ChatMessage("assistant", result.text, result.finish_reason,
                                                      result.metrics.as_dict(), result.profile))

        return engine.submit(run)
