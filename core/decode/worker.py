"""The inference thread and the lifetime of the work on it: `Job` (one unit of work, its events and cancel flag),
`InferenceThread` (runs jobs one at a time and never exits), `Stream` (a caller's view of a job's events).

MLX streams are per thread, so every MLX call of an engine runs here. At interpreter exit the work in flight is
cancelled and waited for (`InferenceThread.halt`): a daemon thread still inside MLX when the interpreter finalises
is killed mid-call, which aborts the process ("terminate called without an active exception", exit 134) — what a
script that leaves a stream loop early, or raises inside one, used to end with.
"""

from __future__ import annotations

import atexit
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..errors import GenerationError, MlxChatError
from .events import Done, Event, GenerationResult, PrefillProgress

# How long interpreter exit waits for the job in flight to see its cancel (a decode step or one prefill layer; a
# model load or a beam search, which do not check it, run to their end). A thread blocked for good (a split
# model's lost peer) is given up on after this.
EXIT_WAIT_S = 30.0


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

    def fail(self, error: BaseException) -> None:
        """End the job's stream with `error`, from any thread: a split model's job whose thread is blocked on a
        lost peer (core/distributed) still reaches its caller."""
        self.events.put(_Failure(error))


class InferenceThread:
    """Runs jobs one at a time, in order, on a single daemon thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._current: Job | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxchat-inference", daemon=True)
        self._thread.start()
        atexit.register(self.halt)

    def _run(self) -> None:
        # Ctrl-C is the main thread's to handle (its handler cancels the job): delivered here, it interrupted MLX
        # mid-call, which hung or crashed the process.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while (job := self._jobs.get()) is not None:
            self._current = job
            try:
                job.fn(job)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller, and the thread live on
                job.events.put(_Failure(e))
            self._current = None
            del job  # the last job's closure (model, cache) is not kept alive while the thread waits
        mx.synchronize()  # a step queued ahead of a reply that stopped early finishes here, not under exit
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

    def run(self, fn: Callable[[], Any], wait: Callable[[threading.Event], None] = threading.Event.wait) -> Any:
        """Run `fn` on the inference thread and return its value (or raise its exception) here. `wait(finished)`
        returns once `finished` is set; a caller that must give up on a blocked thread raises from it instead."""
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
        wait(finished)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the queued jobs, then park the thread (see `_run`)."""
        self._jobs.put(None)
        self._stopped.wait(timeout=timeout_s)

    def halt(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """Drop the queued jobs, cancel the running one and wait until the thread is parked: at interpreter exit
        (registered with atexit), nothing may still be running MLX. Nobody reads the dropped jobs' events then."""
        if self._stopped.is_set():
            return
        while True:
            try:
                dropped = self._jobs.get_nowait()
            except queue.Empty:
                break
            if dropped is not None:
                dropped.fail(GenerationError("the interpreter is exiting"))
        current = self._current
        if current is not None:
            current.cancelled.set()
        self.stop(timeout_s)

    def abandon(self) -> None:
        """Never wait for this thread again, at exit either: it may be blocked for good (a split model's lost
        peer), and a process that has one should leave with `os._exit`."""
        atexit.unregister(self.halt)


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

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` from any thread, e.g. when its job can no longer run (see Job.fail)."""
        self._job.fail(error)

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


__all__ = ["EXIT_WAIT_S", "InferenceThread", "Job", "Stream"]
