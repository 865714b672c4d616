"""Rank 0: the app's side of a model split across machines.

`SplitEngine.start(hosts, model)` waits for every worker on the control channel (core/distributed/channel.py),
gives each its share of the layers (proportional to free memory), joins MLX's ring, loads its own layers (the last
ones, the final norm and the head) and returns an `Engine`: chat sessions, streaming, the CLI and the TUI use it as
they use a local one.

Each forward pass goes through `SplitModel`, which first sends the workers the pass's input ids and which of rank
0's KV caches it extends (and that cache's offset), then runs rank 0's stage, which receives the previous stage's
hidden state over the ring. Rank 0 alone samples, so seeds, penalties, stop strings and cancellation need no
agreement: a reply that stops just sends no further pass. Workers mirror each KV cache, trimming to rank 0's
offset, so a chat turn reuses its prefix split as it does on one machine.

Faults: a worker that dies, hangs or sends an error is reported once by its link; the reply in flight ends with a
`PeerLostError` naming the rank and its address (its inference thread may be blocked in a ring collective for
good, so it is abandoned), and every later request fails at once with the same error. What was stored stays.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..engine import DEFAULT_PREFILL_STEP, Engine, InferenceThread, Job, Stream
from ..errors import MlxChatError
from ..model import loader
from ..model.split import check_tensor_parallel, split_layers, tensor_logits
from .channel import DEFAULT_TIMEOUT_S, LOAD_TIMEOUT_S, Link, Message, listen, read_one, send_one
from .common import (PARALLEL_MODES, PROTOCOL, Plan, cache_spec, free_memory, join_ring, layer_weights,
                     memory_report, model_shape)
from .hosts import Hosts, read_hosts

DEFAULT_CONNECT_TIMEOUT_S = 30.0


class SplitError(MlxChatError):
    """A split model's failure. The inference thread may be blocked in a ring collective for good, so a process
    that gets one should leave with `os._exit` (the CLI does), not through the interpreter's shutdown."""


class PeerLostError(SplitError):
    """A rank of a split model failed; the model cannot run until it is loaded again."""

    def __init__(self, rank: int, address: str, why: str) -> None:
        self.rank, self.address, self.why = rank, address, why
        super().__init__(f"rank {rank} ({address}) failed: {why}. The split model stopped; load the model on this "
                         "machine, or restart the workers and rank 0")


class SplitStartError(SplitError):
    """The group could not be formed: a worker did not come, or could not load its part."""


class Group:
    """Rank 0's links to the workers: broadcast, answers, and the first failure (after which nothing is sent)."""

    def __init__(self, hosts: Hosts, timeout_s: float) -> None:
        self.hosts, self.timeout_s = hosts, timeout_s
        self.links: dict[int, Link] = {}
        self.failed: PeerLostError | None = None
        self.on_failure: list[Callable[[PeerLostError], None]] = []
        self._answers: dict[int, queue.Queue[Message]] = {}
        self._lock = threading.Lock()

    def add(self, rank: int, sock: socket.socket, received: bytes) -> None:
        self._answers[rank] = queue.Queue()
        link = Link(sock, lambda m, r=rank: self._message(r, m), lambda why, r=rank: self.fail(r, why),
                    timeout_s=self.timeout_s, received=received)
        self.links[rank] = link
        link.start()

    def _message(self, rank: int, message: Message) -> None:
        if message.get("op") == "error":
            self.fail(rank, f"it reported an error: {message.get('why')}")
        else:
            self._answers[rank].put(message)

    def fail(self, rank: int, why: str) -> None:
        with self._lock:
            if self.failed is not None:
                return
            self.failed = PeerLostError(rank, self.hosts.address(rank), why)
        for callback in list(self.on_failure):
            callback(self.failed)

    def set_timeout(self, timeout_s: float) -> None:
        """How long each link waits for a heartbeat (looser while the ranks load, see channel.LOAD_TIMEOUT_S)."""
        for link in self.links.values():
            link.timeout_s = timeout_s

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed

    def broadcast(self, message: Message) -> None:
        self.check()
        for link in self.links.values():
            link.send(message)
        self.check()

    def answers(self, op: str) -> dict[int, Message]:
        """Wait for one `op` message from every worker (however long they take while their heartbeats go on)."""
        got: dict[int, Message] = {}
        for rank, box in self._answers.items():
            while rank not in got:
                self.check()
                try:
                    message = box.get(timeout=0.2)
                except queue.Empty:
                    continue
                if message.get("op") == op:
                    got[rank] = message
        return got

    def close(self) -> None:
        """Say goodbye (the workers exit) and close the links; again is a no-op."""
        for link in self.links.values():
            if self.failed is None and not link.closed:
                link.goodbye({"op": "bye"})
            link.close()


class SplitModel:
    """Rank 0's model as the engine sees it: each forward pass first tells the workers what to run."""

    def __init__(self, model: Any, group: Group, plan: Plan) -> None:  # noqa: ANN401 - an mlx-lm model
        self.model, self.group, self.plan = model, group, plan
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count()

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def interruptible(self) -> bool:
        """Whether a prefill may stop between layers (core/cache/kv_cache.py). Pipeline: yes, once rank 0's first layer
        has received the workers' output (they are done with the pass; they trim to rank 0's offset at the next one).
        Tensor: no, the workers wait in every layer's all-sum for rank 0's part."""
        return self.plan.parallel != "tensor"

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)  # the model's own mix (sliding layers), else one KVCache per layer

    def parameters(self) -> dict:
        return self.model.parameters()

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        if cache is None:
            raise ValueError("a split model runs with a KV cache (rank 0 and the workers keep theirs in step)")
        ids = inputs.tolist()  # the step's input: the token just sampled, so this waits for it
        self.group.broadcast({"op": "fwd", "c": self._key(cache), "o": cache[0].offset, "ids": ids,
                              "spec": cache_spec(cache)})
        if self.plan.parallel == "tensor":
            return tensor_logits(self.model, inputs, cache)
        return self.model(inputs, cache=cache)

    def _key(self, cache: list) -> int:
        """A number for this set of caches (held weakly through its first layer): the workers keep one of theirs
        under it, and drop it when rank 0's is gone."""
        first = cache[0]
        key = self._keys.get(first)
        if key is None:
            key = self._keys[first] = next(self._next)
            weakref.finalize(first, self._drop, key)
        return key

    def _drop(self, key: int) -> None:
        if self.group.failed is None:
            for link in self.group.links.values():
                link.send({"op": "drop", "c": key})


class SplitEngine(Engine):
    """An Engine whose model is split across the ranks of a hosts file; see the module docstring."""

    def __init__(self, model: loader.LoadedModel, worker: InferenceThread, prefill_step: int, group: Group,
                 plan: Plan, memory: dict[int, dict[str, int]]) -> None:
        super().__init__(model, worker, prefill_step)
        self.group, self.plan, self.memory = group, plan, memory
        # Every stream a caller may still wait on: after a failure the inference thread may never run (or finish)
        # their jobs, so they are ended from the link's thread.
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        group.on_failure.append(self._failed)

    @classmethod
    def start(cls, hosts: str | Path | Hosts, model: str | Path | None = None, *,
              weights: loader.WeightPolicy | None = None, prefill_step: int = DEFAULT_PREFILL_STEP,
              connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, control_port: int | None = None,
              peer_timeout_s: float = DEFAULT_TIMEOUT_S, parallel: str = "pipeline",
              progress: Callable[[str], None] = lambda _: None) -> "SplitEngine":
        """Form the group and load rank 0's part. Raises SplitStartError naming the rank that did not come or
        could not load, after at most `connect_timeout_s` for the workers to connect and the ring to form.
        `parallel` is "pipeline" (layer ranges, the default) or "tensor" (mlx-lm's `shard()`)."""
        hosts = hosts if isinstance(hosts, Hosts) else read_hosts(hosts)
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be {' or '.join(PARALLEL_MODES)}, got {parallel!r}")
        shape = model_shape(model)
        if parallel == "tensor":
            check_tensor_parallel(shape["heads"], shape["kv_heads"], hosts.size)
        group = Group(hosts, peer_timeout_s)
        try:
            hellos = _gather(hosts, group, control_port, connect_timeout_s, progress)
            free = [free_memory(), *(h["free_memory"] for h in hellos)]
            loader.resolve_policy(weights)  # a policy this machine cannot run is refused here, before any worker loads
            plan = Plan(_shared_spec(model), loader.requested_policy(weights), parallel,
                        tuple(split_layers(shape["layers"], layer_weights(free))))
            group.set_timeout(LOAD_TIMEOUT_S)
            group.broadcast(plan.message())
            progress(f"joining the ring ({hosts.size} ranks) and loading {plan.describe(0)}")
            thread = InferenceThread()
            ring = _bounded(thread, lambda: join_ring(hosts.path, 0), connect_timeout_s, group,
                            f"the ring did not connect within {connect_timeout_s:.0f} s: check that the ports of "
                            f"{hosts.path} are open between the hosts")
            loaded = _bounded(thread, lambda: plan.load(0, ring), None, group, "")
            ready = group.answers("ready")
            group.set_timeout(peer_timeout_s)
        except PeerLostError as e:
            group.close()
            raise SplitStartError(f"rank {e.rank} ({e.address}) failed: {e.why}") from None
        except BaseException:
            group.close()
            raise
        memory = {0: memory_report(loaded.model), **{r: m["memory"] for r, m in ready.items()}}
        split_loaded = dataclasses.replace(loaded, model=SplitModel(loaded.model, group, plan))
        atexit.register(group.close)  # a script that never closes the engine still lets its workers go
        return cls(split_loaded, thread, prefill_step, group, plan, memory)

    # --- the Engine surface, made safe after a failure ---------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.group.failed is None

    def describe(self) -> str:
        weights = " + ".join(f"{self.memory[r]['weight_bytes'] / 2**20:.0f}" for r in sorted(self.memory))
        return (f"{super().describe()} · split over {self.group.hosts.size} ranks ({self.plan.describe(0)}; "
                f"weights per rank {weights} MiB)")

    def submit(self, fn: Callable[[Job], Any]) -> Stream:
        if self.group.failed is not None:
            job = Job(fn)
            job.fail(self.group.failed)
            return Stream(job)

        def tracked(job: Job) -> None:
            try:
                fn(job)
            except RuntimeError:
                # A dead peer also breaks the ring (MLX raises "connection lost"): say which rank, not that.
                if self._settle() is not None:
                    raise self.group.failed from None
                raise

        stream = super().submit(tracked)
        self._streams.add(stream)
        return stream

    def run(self, fn: Callable[[], Any]) -> Any:
        self.group.check()
        return super().run(fn)

    def beam_search(self, *args: Any, **kw: Any) -> Any:  # noqa: ANN401 - Engine.beam_search's
        raise ValueError("beam search is not available on a model split across machines (it reorders its cache "
                         "rows, which the workers do not mirror); sample with beam_size 1")

    def worker_memory(self) -> dict[int, dict[str, int]]:
        """Each rank's weights, active and peak memory now (rank 0's measured here, the workers' asked for)."""
        self.group.broadcast({"op": "stats"})
        answers = self.group.answers("stats")
        return {0: memory_report(self.model.model), **{r: a["memory"] for r, a in answers.items()}}

    def close(self) -> None:
        self.group.close()
        if self.group.failed is None:
            super().close()  # a failed group's inference thread may never return: it is left parked

    def _failed(self, error: PeerLostError) -> None:
        self._worker.abandon()  # it may be blocked in a ring collective: exit must not wait for it
        for stream in list(self._streams):
            stream.fail(error)  # a stream that already ended has read its Done and reads no further

    def _settle(self, wait_s: float = 1.0) -> PeerLostError | None:
        """The group's failure, waiting briefly for the link to report it (the ring may notice a death first)."""
        deadline = time.monotonic() + wait_s
        while self.group.failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.group.failed


def _shared_spec(model: str | Path | None) -> str | None:
    """The model as the workers should find it: a local path made absolute (the same path on every machine, not
    relative to where each process started), a repo id as it is."""
    if model is None:
        return None
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _gather(hosts: Hosts, group: Group, control_port: int | None, timeout_s: float,
            progress: Callable[[str], None]) -> list[Message]:
    """Accept every worker's hello within `timeout_s`; the hellos in rank order."""
    address = hosts.control_address(control_port)
    server = listen(address)
    server.settimeout(0.2)
    progress(f"waiting for {hosts.size - 1} worker(s) on {address[0]}:{address[1]}")
    hellos: dict[int, Message] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(hellos) < hosts.size - 1:
            if time.monotonic() > deadline:
                missing = [r for r in range(1, hosts.size) if r not in hellos]
                raise SplitStartError(
                    f"no worker came for rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(f'{r} ({hosts.address(r)})' for r in missing)} within {timeout_s:.0f} s: start "
                    f"`mlxchat worker --hosts {hosts.path.name} --rank {missing[0]}` there")
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            hello = _welcome(hosts, group, sock, hellos, timeout_s)
            if hello is not None:
                hellos[hello["rank"]] = hello
                progress(f"rank {hello['rank']} ({hello.get('host', '?')}) joined")
    finally:
        server.close()
    return [hellos[r] for r in sorted(hellos)]


def _welcome(hosts: Hosts, group: Group, sock: socket.socket, hellos: dict[int, Message], timeout_s: float
             ) -> Message | None:
    """Check one connection's hello; welcome it into the group, or refuse it with the reason."""
    try:
        hello, rest = read_one(sock, min(5.0, timeout_s))
    except (OSError, ConnectionError, TimeoutError):
        sock.close()
        return None
    rank = hello.get("rank")
    why = None
    if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL:
        why = f"protocol {hello.get('protocol')} is not this mlxchat's {PROTOCOL}: run the same mlxchat version"
    elif not isinstance(rank, int) or not 1 <= rank < hosts.size:
        why = f"rank {rank!r} is not a worker rank of {hosts.path.name} (1 to {hosts.size - 1})"
    elif rank in hellos:
        why = f"rank {rank} has already joined"
    if why is not None:
        send_one(sock, {"op": "refused", "why": why})
        sock.close()
        return None
    send_one(sock, {"op": "welcome", "timeout": group.timeout_s})
    sock.settimeout(None)
    group.add(rank, sock, rest)
    return hello


def _bounded(thread: InferenceThread, fn: Callable[[], Any], timeout_s: float | None, group: Group,
             why: str) -> Any:
    """Run `fn` on the inference thread, giving up (the thread abandoned) after `timeout_s` or a peer's failure."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def wait(done: threading.Event) -> None:
        while not done.wait(0.1):
            group.check()
            if deadline is not None and time.monotonic() > deadline:
                raise SplitStartError(why)

    return thread.run(fn, wait)
