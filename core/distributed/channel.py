"""The control channel between rank 0 and each worker: JSON lines over TCP, with heartbeats both ways.

MLX's ring collectives cannot time out: a peer that hangs (SIGSTOP, a frozen machine) blocks a `send`/`recv`
forever, and one that never starts blocks `init` forever. So liveness is judged here, on a separate TCP connection
that mlxchat owns: each side sends a heartbeat every `HEARTBEAT_S` from a thread of its own, and a side that hears
nothing for `timeout_s`, or sees the connection close, reports the peer lost once. Requests travel on the same
connection as JSON (never pickle: a worker must not run what arrives on a socket).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

HEARTBEAT_S = 0.5
DEFAULT_TIMEOUT_S = 3.0
# While the ranks load, a long tensor conversion may hold the GIL (numpy on a 400 MB tensor: ~1 s here) and delay the
# heartbeat thread: the timeout is looser then. A peer that dies while loading still closes its connection at once.
LOAD_TIMEOUT_S = 60.0
_MAX_LINE = 64 << 20  # a request's ids as JSON; anything longer is not from mlxchat

Message = dict[str, Any]


class Link:
    """One connection: `send(obj)` from any thread; `on_message(obj)` and, once, `on_lost(why)` on its reader
    thread. `start()` begins the heartbeats and the reading."""

    def __init__(self, sock: socket.socket, on_message: Callable[[Message], None],
                 on_lost: Callable[[str], None], timeout_s: float = DEFAULT_TIMEOUT_S, received: bytes = b"") -> None:
        self.sock, self.on_message, self.on_lost, self.timeout_s = sock, on_message, on_lost, timeout_s
        self._received = received  # what arrived after the handshake, before this Link read anything
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._closing = threading.Event()  # a goodbye was sent: the peer's end of the connection is expected
        self._ended = threading.Event()  # the reader is done
        self._lost_once = threading.Lock()
        self.last_heard = time.monotonic()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a forward's ids must not wait for Nagle

    def start(self) -> None:
        threading.Thread(target=self._read, name="mlxchat-link-read", daemon=True).start()
        threading.Thread(target=self._beat, name="mlxchat-link-beat", daemon=True).start()

    def send(self, message: Message) -> bool:
        """Send one message; False (and the peer reported lost) if the connection is gone."""
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError as e:
            self._lose(f"the connection failed ({e.strerror or e})")
            return False

    def goodbye(self, message: Message, wait_s: float = 2.0) -> None:
        """Send a last message and close once the peer has read it and hung up (closing at once could reset the
        connection before the peer reads it), or after `wait_s`."""
        self._closing.set()
        if self.send(message):
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._ended.wait(wait_s)
        self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            if not self.send({"op": "ping"}):
                return

    def _read(self) -> None:
        try:
            self._read_lines()
        finally:
            self._ended.set()

    def _read_lines(self) -> None:
        self.sock.settimeout(HEARTBEAT_S)
        buffer, self._received = self._received, b""
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            self._dispatch(line)
        while not self._closed.is_set():
            try:
                chunk = self.sock.recv(1 << 16)
            except socket.timeout:
                if time.monotonic() - self.last_heard > self.timeout_s:
                    self._lose(f"it sent nothing for {self.timeout_s:.0f} s (hung, stopped or unreachable)")
                    return
                continue
            except OSError as e:
                self._lose(f"the connection failed ({e.strerror or e})")
                return
            if not chunk:
                self._lose("it closed the connection (the process ended)")
                return
            self.last_heard = time.monotonic()
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._dispatch(line)
            if len(buffer) > _MAX_LINE:
                self._lose("it sent a message too long to be mlxchat's")
                return

    def _dispatch(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._lose("it sent something that is not mlxchat's JSON")
            return
        if isinstance(message, dict) and message.get("op") != "ping":
            self.on_message(message)

    def _lose(self, why: str) -> None:
        if self._closing.is_set() or self._closed.is_set() or not self._lost_once.acquire(blocking=False):
            return
        self.on_lost(why)


def listen(address: tuple[str, int]) -> socket.socket:
    """Rank 0's control socket; a port in use is one clear error."""
    try:
        return socket.create_server(address, reuse_port=False)
    except OSError as e:
        raise OSError(f"cannot listen for workers on {address[0]}:{address[1]}: {e.strerror or e} (another "
                      "mlxchat on this hosts file? pass --control-port)") from None


def connect(address: tuple[str, int], give_up: Callable[[], bool], retry_s: float = 0.5) -> socket.socket:
    """A worker's connection to rank 0, retried until rank 0 listens (workers may start first) or `give_up()`."""
    while True:
        try:
            return socket.create_connection(address, timeout=5)
        except OSError:
            if give_up():
                raise
            time.sleep(retry_s)


def read_one(sock: socket.socket, timeout_s: float) -> tuple[Message, bytes]:
    """The first message on a fresh connection (the handshake), before its Link starts, and what arrived after it
    (for the Link); raises TimeoutError or ConnectionError."""
    sock.settimeout(timeout_s)
    buffer = b""
    while b"\n" not in buffer:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        buffer += chunk
        if len(buffer) > _MAX_LINE:
            raise ConnectionError("the handshake is too long")
    line, rest = buffer.split(b"\n", 1)
    try:
        message = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConnectionError("the handshake is not JSON (not an mlxchat peer?)") from None
    if not isinstance(message, dict):
        raise ConnectionError("the handshake is not a JSON object (not an mlxchat peer?)")
    return message, rest


def send_one(sock: socket.socket, message: Message) -> None:
    sock.sendall((json.dumps(message, separators=(",", ":")) + "\n").encode())
