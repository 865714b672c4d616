"""The bridge between the UI and the engine: ONE long-lived worker thread and a command queue.

The thread loads the engine (in the background, while the UI is already visible) and iterates each reply's
stream. Tokens are coalesced into batches of about ``BATCH_S`` (40 ms) and posted to the UI with
``post_message``, which is thread-safe and never blocks this thread (``call_from_thread`` would wait for the UI on
every token and inflate TPOT). Nothing is dropped: every delta goes into a batch, and the last batch is posted
before ``Finished``.

Like toolong's reader thread, it posts messages declared here, which the screen handles with ``@on(...)``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual.message import Message
from textual.message_pump import MessagePump

if TYPE_CHECKING:
    from mlxchat.core import Engine, Stream
    from mlxchat.core.events import GenerationResult, Metrics

BATCH_S = 0.040  # the shortest batch; the UI may ask for longer ones (see ``batch_s``)
MAX_BATCH_S = 0.5


@dataclass
class _Load:
    spec: str | None


@dataclass
class _Generate:
    request_id: int
    start: Callable[[], "Stream"]
    cancelled: threading.Event


@dataclass
class _Call:
    fn: Callable[[], Any]


class EngineWorker:
    """Owns the bridge thread. Every public method is non-blocking and safe to call from the UI."""

    class Loading(Message):
        def __init__(self, spec: str | None) -> None:
            super().__init__()
            self.spec = spec

    class Loaded(Message):
        def __init__(self, engine: "Engine", spec: str | None, seconds: float) -> None:
            super().__init__()
            self.engine, self.spec, self.seconds = engine, spec, seconds

    class LoadFailed(Message):
        def __init__(self, spec: str | None, error: BaseException) -> None:
            super().__init__()
            self.spec, self.error = spec, error

    class Started(Message):
        """The request reached the engine (its stream exists)."""

        def __init__(self, request_id: int) -> None:
            super().__init__()
            self.request_id = request_id

    class Prefill(Message):
        def __init__(self, request_id: int, done: int, total: int) -> None:
            super().__init__()
            self.request_id, self.done, self.total = request_id, done, total

    class Tokens(Message):
        """A coalesced batch of text deltas, with the metrics of its last token."""

        def __init__(self, request_id: int, text: str, metrics: "Metrics", count: int) -> None:
            super().__init__()
            self.request_id, self.text, self.metrics, self.count = request_id, text, metrics, count

    class Finished(Message):
        def __init__(self, request_id: int, result: "GenerationResult") -> None:
            super().__init__()
            self.request_id, self.result = request_id, result

    class Failed(Message):
        """The request failed (an engine error mid-stream, or bad input); the text so far was already posted."""

        def __init__(self, request_id: int, error: BaseException) -> None:
            super().__init__()
            self.request_id, self.error = request_id, error

    def __init__(self, target: MessagePump, *, batch_s: float = BATCH_S) -> None:
        self.target = target
        # How old a batch may get before it is posted. The UI raises it when drawing each batch costs more CPU
        # than its budget (a float written by the UI thread, read here: no lock needed).
        self.batch_s = batch_s
        self._commands: queue.Queue[_Load | _Generate | _Call | None] = queue.Queue()
        self._lock = threading.Lock()
        self._current: _Generate | None = None
        self._stream: Stream | None = None
        self._next_id = 0
        self._pending: list[_Generate] = []
        self.batches_posted = 0
        self.tokens_posted = 0
        self._thread = threading.Thread(target=self._run, name="mlxchat-ui-bridge", daemon=True)
        self._thread.start()

    # --- the UI side ---------------------------------------------------------------------------------------------

    def load(self, spec: str | None) -> None:
        self._commands.put(_Load(spec))

    def generate(self, start: Callable[[], "Stream"]) -> int:
        """Queue a reply: ``start`` runs on the bridge thread and returns the engine's stream (e.g.
        ``lambda: chat.send(text)``). Returns the request id that the posted messages carry."""
        with self._lock:
            self._next_id += 1
            command = _Generate(self._next_id, start, threading.Event())
            self._pending.append(command)
        self._commands.put(command)
        return command.request_id

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the bridge thread, after what is queued (e.g. closing an old engine)."""
        self._commands.put(_Call(fn))

    def cancel(self) -> bool:
        """Stop the reply in progress (prefill or decode) and any queued one. True if there was one."""
        with self._lock:
            found = bool(self._pending) or self._current is not None
            for command in self._pending:
                command.cancelled.set()
            if self._current is not None:
                self._current.cancelled.set()
                if self._stream is not None:
                    self._stream.cancel()
        return found

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._current is not None or bool(self._pending)

    def close(self, timeout: float = 5.0) -> None:
        self.cancel()
        self._commands.put(None)
        self._thread.join(timeout)

    # --- the bridge thread ---------------------------------------------------------------------------------------

    def _post(self, message: Message) -> None:
        self.target.post_message(message)

    def _run(self) -> None:
        while (command := self._commands.get()) is not None:
            if isinstance(command, _Load):
                self._load(command.spec)
            elif isinstance(command, _Generate):
                self._generate(command)
            else:
                try:
                    command.fn()
                except Exception:  # noqa: BLE001 - a housekeeping call must not kill the bridge
                    pass

    def _load(self, spec: str | None) -> None:
        self._post(self.Loading(spec))
        started = time.perf_counter()
        try:
            from mlxchat.core import Engine  # imports MLX (via core) on this thread, not the UI's

            engine = Engine.load(spec)
        except Exception as e:  # noqa: BLE001 - shown in the app, which stays usable
            self._post(self.LoadFailed(spec, e))
            return
        self._post(self.Loaded(engine, spec, time.perf_counter() - started))

    def _generate(self, command: _Generate) -> None:
        from mlxchat.core.events import Done, PrefillProgress, TokenEvent

        rid = command.request_id
        with self._lock:
            self._pending.remove(command)
            self._current = command
        try:
            stream = command.start()
        except Exception as e:  # noqa: BLE001 - e.g. an empty message or no engine
            with self._lock:
                self._current = None
            self._post(self.Failed(rid, e))
            return
        with self._lock:
            self._stream = stream
            if command.cancelled.is_set():
                stream.cancel()
        self._post(self.Started(rid))
        pending: list[str] = []
        count = 0
        metrics = None
        last_post = last_event = time.perf_counter()

        def flush() -> None:
            nonlocal pending, count, last_post
            if pending or count:
                self._post(self.Tokens(rid, "".join(pending), metrics, count))
                self.batches_posted += 1
                self.tokens_posted += count
            pending, count = [], 0
            last_post = time.perf_counter()

        try:
            for event in stream:
                now = time.perf_counter()
                if isinstance(event, TokenEvent):
                    pending.append(event.text)
                    count += len(event.token_ids)
                    metrics = event.metrics
                    # Post when the batch is ~40 ms old, or when waiting for the next token (judging by the last
                    # gap) would make it older than that: slow decoding gets every token at once, fast decoding
                    # gets ~40 ms batches, and the UI never waits on a held-back token for long.
                    gap = now - last_event
                    if now - last_post + gap >= self.batch_s:
                        flush()
                elif isinstance(event, PrefillProgress):
                    flush()
                    self._post(self.Prefill(rid, event.done, event.total))
                elif isinstance(event, Done):
                    flush()
                    self._post(self.Finished(rid, event.result))
                last_event = now
        except Exception as e:  # noqa: BLE001 - an engine error mid-stream: shown in the app
            flush()
            self._post(self.Failed(rid, e))
        finally:
            with self._lock:
                self._current = None
                self._stream = None
