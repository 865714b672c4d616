"""The bridge between the UI and the engine: ONE long-lived worker thread and a command queue.

The thread loads the engine (in the background, while the UI is already visible) and iterates each reply's
stream. A reply is started on the UI thread (``ChatSession.send`` only queues it on the engine's thread and
returns its ``Stream``); ``follow(stream)`` hands the stream to this thread. Tokens are coalesced into batches of
about ``BATCH_S`` (40 ms) and posted to the UI with ``post_message``, which is thread-safe and never blocks this
thread (``call_from_thread`` would wait for the UI on every token and inflate TPOT). Nothing is dropped: every
delta goes into a batch, and the last batch is posted before ``Finished``.

Like toolong's reader thread, it posts dataclass messages declared here, which the screen handles with
``@on(...)``; each carries the ``Stream`` it reports on. It is a plain thread rather than a Textual
``@work(thread=True)`` worker because it lives as long as the screen (loads, replies and housekeeping share one
queue, in order) and because the benchmark and the tests drive it without an App: any object with
``post_message`` will do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from textual.message import Message

if TYPE_CHECKING:
    from mlxchat.core import Engine, Stream
    from mlxchat.core.decode.events import GenerationResult, Metrics

BATCH_S = 0.040  # the shortest batch; the UI may ask for longer ones (see ``batch_s``)
MAX_BATCH_S = 0.5


def next_batch_s(ui_cpu_s: float, budget: float) -> float:
    """The time until the next batch that pays for drawing the last one (``ui_cpu_s`` of the UI thread's CPU) at
    ``budget`` of the UI thread's time: each batch pays for its own drawing, so the budget holds on average whatever
    the batches cost, and a costly one (a layout of the screen) slows only the batch after it. (Easing towards the
    needed length kept one layout's cost for seconds: 2 updates a second for the rest of a reply and the next.)
    Clamped to [BATCH_S, MAX_BATCH_S]."""
    return min(MAX_BATCH_S, max(BATCH_S, ui_cpu_s / budget))


class Target(Protocol):
    def post_message(self, message: Message) -> bool: ...


@dataclass
class _Load:
    spec: str | None


@dataclass
class _Follow:
    stream: "Stream"


@dataclass
class _Call:
    fn: Callable[[], Any]


class EngineWorker:
    """Owns the bridge thread. Every public method is non-blocking and safe to call from the UI."""

    @dataclass
    class Loading(Message):
        spec: str | None

    @dataclass
    class Loaded(Message):
        engine: "Engine"
        spec: str | None
        seconds: float

    @dataclass
    class LoadFailed(Message):
        spec: str | None
        error: BaseException

    @dataclass
    class Prefill(Message):
        stream: "Stream"
        done: int
        total: int

    @dataclass
    class Tokens(Message):
        """A coalesced batch of text deltas, with the metrics of its last token."""

        stream: "Stream"
        text: str
        metrics: "Metrics | None"
        count: int
        reasoning: str = ""  # a thinking model's reasoning in this batch (it comes before the answer's text)

    @dataclass
    class Finished(Message):
        stream: "Stream"
        result: "GenerationResult"

    @dataclass
    class ToolActivity(Message):
        """A turn with tools called one (core.chat.tool_loop's ToolCallEvent), got its result (ToolResultEvent), or has
        a line to say (ToolNotice). The text before it was already posted."""

        stream: "Stream"
        event: Any

    @dataclass
    class Failed(Message):
        """The reply failed (an engine error mid-stream, or a prompt the engine refused); the text so far was
        already posted."""

        stream: "Stream"
        error: BaseException

    def __init__(self, target: Target, *, batch_s: float = BATCH_S,
                 engine_options: dict[str, Any] | None = None) -> None:
        self.target = target
        self.engine_options = engine_options or {}  # what Engine.load takes besides the model (the KV disk cache)
        # How old a batch may get before it is posted. The UI raises it when drawing each batch costs more CPU
        # than its budget (a float written by the UI thread, read here: no lock needed).
        self.batch_s = batch_s
        self._commands: queue.Queue[_Load | _Follow | _Call | None] = queue.Queue()
        self._lock = threading.Lock()
        self._following: list[Stream] = []  # queued or being iterated, for close()
        self.batches_posted = 0  # what the benchmark reports next to the TUI's decode speed
        self._thread = threading.Thread(target=self._run, name="mlxchat-ui-bridge", daemon=True)
        self._thread.start()

    # --- the UI side ---------------------------------------------------------------------------------------------

    def load(self, spec: str | None) -> None:
        self._commands.put(_Load(spec))

    def follow(self, stream: "Stream") -> None:
        """Iterate ``stream`` (e.g. ``chat.send(text)``) on the bridge thread and post what it yields. Stop it with
        ``stream.cancel()``: the last batch and ``Finished`` (reason "cancelled") still come."""
        with self._lock:
            self._following.append(stream)
        self._commands.put(_Follow(stream))

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the bridge thread, after what is queued (e.g. closing an old engine)."""
        self._commands.put(_Call(fn))

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            for stream in self._following:
                stream.cancel()
        self._commands.put(None)
        self._thread.join(timeout)

    # --- the bridge thread ---------------------------------------------------------------------------------------

    def _post(self, message: Message) -> None:
        self.target.post_message(message)

    def _run(self) -> None:
        while (command := self._commands.get()) is not None:
            if isinstance(command, _Load):
                self._load(command.spec)
            elif isinstance(command, _Follow):
                try:
                    self._follow(command.stream)
                finally:
                    with self._lock:
                        self._following.remove(command.stream)
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

            engine = Engine.load(spec, **self.engine_options)
        except Exception as e:  # noqa: BLE001 - shown in the app, which stays usable
            self._post(self.LoadFailed(spec, e))
            return
        self._post(self.Loaded(engine, spec, time.perf_counter() - started))

    def _follow(self, stream: "Stream") -> None:
        from mlxchat.core.decode.events import Done, PrefillProgress, TokenEvent

        pending: list[str] = []
        thought: list[str] = []
        count = 0
        metrics = None
        last_post = last_event = time.perf_counter()

        def flush() -> None:
            nonlocal pending, thought, count, last_post
            if pending or thought or count:
                self._post(self.Tokens(stream, "".join(pending), metrics, count, "".join(thought)))
                self.batches_posted += 1
            pending, thought, count = [], [], 0
            last_post = time.perf_counter()

        try:
            for event in stream:
                now = time.perf_counter()
                if isinstance(event, TokenEvent):
                    if event.reasoning and pending:  # a batch is reasoning then answer, never answer then reasoning
                        flush()
                    pending.append(event.text)
                    thought.append(event.reasoning)
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
                    self._post(self.Prefill(stream, event.done, event.total))
                elif isinstance(event, Done):
                    flush()
                    self._post(self.Finished(stream, event.result))
                elif type(event).__name__ in ("ToolCallEvent", "ToolResultEvent", "ToolNotice"):
                    flush()
                    self._post(self.ToolActivity(stream, event))
                last_event = now
        except Exception as e:  # noqa: BLE001 - an engine error mid-stream, or a refused prompt: shown in the app
            flush()
            self._post(self.Failed(stream, e))
