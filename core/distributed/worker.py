"""A worker rank (`mlxchat worker --hosts FILE --rank R`): it runs its stage of the model for rank 0.

The worker connects to rank 0's control channel (retrying until rank 0 listens), says hello with its free memory,
and gets the plan: which model, and how many layers each rank runs. It joins MLX's ring, loads only its own layers,
reports its memory, and then runs one forward pass per message, on its main thread, in the order rank 0 sends them:
rank 0 samples every token and sends each step's input ids, so the worker never decides anything and cannot drift
out of step (a cancelled or stopped reply is simply a forward pass that is not sent).

It ends, with one line on stderr and exit status 0, when rank 0 says goodbye or goes away (the connection closes
or its heartbeats stop): a thread blocked in a ring collective cannot be woken, so it leaves with `os._exit`.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import sys
from typing import Any

from .channel import DEFAULT_TIMEOUT_S, LOAD_TIMEOUT_S, Link, Message, connect, read_one, send_one
from .hosts import Hosts
from .common import PROTOCOL, Plan, align, free_memory, join_ring, make_caches, memory_report


def _say(line: str) -> None:
    print(f"mlxchat worker: {line}", file=sys.stderr, flush=True)


def _leave(code: int, line: str) -> None:
    _say(line)
    sys.stdout.flush()
    os._exit(code)


class Worker:
    def __init__(self, hosts: Hosts, rank: int) -> None:
        self.hosts, self.rank = hosts, rank
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.link: Link | None = None
        self.loaded: Any = None  # core.model.loader.LoadedModel
        self.plan: Plan | None = None
        self.steady_timeout: float | None = None  # the heartbeat timeout once rank 0 has loaded too
        self.caches: dict[int, list] = {}

    def connect(self, address: tuple[str, int], timeout_s: float) -> None:
        _say(f"rank {self.rank}: connecting to rank 0 at {address[0]}:{address[1]}")
        sock = connect(address, give_up=lambda: False)
        send_one(sock, {"op": "hello", "protocol": PROTOCOL, "rank": self.rank, "host": socket.gethostname(),
                        "free_memory": free_memory()})
        welcome, rest = read_one(sock, timeout_s)
        if welcome.get("op") != "welcome":
            raise ConnectionError(f"rank 0 refused this worker: {welcome.get('why', welcome)}")
        sock.settimeout(None)
        self.link = Link(sock, self._received, self._lost, timeout_s=float(welcome.get("timeout", DEFAULT_TIMEOUT_S)),
                         received=rest)
        self.link.start()

    def _received(self, message: Message) -> None:
        # Goodbye is handled here, on the reader thread: the connection's end follows it at once, and the main
        # thread may still be busy with the last forward pass.
        if message.get("op") == "bye":
            _leave(0, "rank 0 closed the model; exiting")
        self.inbox.put(message)

    def _lost(self, why: str) -> None:
        _leave(0, f"rank 0 went away: {why}; exiting")

    def serve(self) -> None:
        """Handle rank 0's messages until it says goodbye."""
        while True:
            message = self.inbox.get()
            op = message.get("op")
            if op != "plan" and self.steady_timeout is not None:  # rank 0 sends nothing else until it has loaded
                assert self.link is not None
                self.link.timeout_s, self.steady_timeout = self.steady_timeout, None
            try:
                if op == "plan":
                    self._plan(message)
                elif op == "fwd":
                    self._forward(message)
                elif op == "drop":
                    self.caches.pop(int(message["c"]), None)
                elif op == "stats":
                    self._send({"op": "stats", "memory": memory_report(self.loaded.model)})
            except Exception as e:  # noqa: BLE001 - reported to rank 0, which names this rank; then this rank ends
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                self._send({"op": "error", "why": f"{type(e).__name__}: {first}"})
                _leave(1, f"failed: {type(e).__name__}: {first}")

    def _send(self, message: Message) -> None:
        assert self.link is not None
        self.link.send(message)

    def _plan(self, message: Message) -> None:
        assert self.link is not None
        self.steady_timeout, self.link.timeout_s = self.link.timeout_s, LOAD_TIMEOUT_S
        self.plan = plan = Plan.of(message)
        group = join_ring(self.hosts.path, self.rank)
        self.loaded = plan.load(self.rank, group)
        memory = memory_report(self.loaded.model)
        _say(f"{plan.describe(self.rank)} loaded ({memory['weight_bytes'] / 2**20:.0f} MiB of weights, "
             f"{self.loaded.weights_path})")
        self._send({"op": "ready", "memory": memory})

    def _forward(self, message: Message) -> None:
        import mlx.core as mx

        key, offset = int(message["c"]), int(message["o"])
        model = self.loaded.model
        layers = self.caches.get(key)
        if layers is None or not align(layers, offset):
            if offset != 0:
                raise RuntimeError(f"cache {key} cannot be brought to offset {offset}: out of step with rank 0")
            layers = self.caches[key] = make_caches(message["spec"], model)
        out = self.plan.forward(model, mx.array(message["ids"]), layers)  # type: ignore[union-attr]
        mx.eval(out, [c.state for c in layers])


def run(hosts: Hosts, rank: int, control_port: int | None = None) -> int:
    """`mlxchat worker`: serve rank `rank` until rank 0 closes or goes away."""
    hosts.check_rank(rank)
    signal.signal(signal.SIGTERM, lambda *_: _leave(0, "stopped (SIGTERM)"))
    signal.signal(signal.SIGINT, lambda *_: _leave(130, "interrupted"))
    worker = Worker(hosts, rank)
    try:
        worker.connect(hosts.control_address(control_port), timeout_s=60.0)
    except (OSError, ConnectionError, TimeoutError) as e:
        _say(f"cannot join rank 0: {e}")
        return 2
    worker.serve()
    return 0
