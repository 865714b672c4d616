"""Tools from Model Context Protocol servers, through the official `mcp` SDK, for the chat, the CLI and the Python
API (`engine.chat(tools=[MCPServer(...)])`).

A server is configured by an `MCPServerSpec` (``[mcp.servers.NAME]`` in config.toml: ``command``/``args``/``env``
for a process spoken to over stdio, or ``url`` for streamable HTTP). `MCPServer` is one connection to it, started
on first use (`start`, or the first `tools`/`call`) and stopped by `close`. The SDK is asynchronous; each server
runs its session on an event loop of its own, in a daemon thread, and the methods here block the caller (never the
inference thread: the tool loop, core/chat/tool_loop.py, runs calls in the thread that iterates the reply).

Failures are values, not tracebacks: a server that does not start raises `MCPError` with one line; a call that
fails in any way (the tool's own error, a server that crashed mid-call, a call past its timeout) returns a
`ToolOutcome` with ``ok=False`` and one line saying what happened, which the loop feeds back to the model as the
call's result. A result longer than `max_result_chars` is cut, and says so; content that is not text (an image,
audio, a binary resource) is named, not sent. A server that crashed is started again by its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ..decode.tools import Tool, ToolError

DEFAULT_CALL_TIMEOUT_S = 30.0
DEFAULT_START_TIMEOUT_S = 30.0
MAX_RESULT_CHARS = 8000  # what a result may hold before it is cut: a small model's context is short


class MCPError(Exception):
    """A server could not be started or listed: the message is one line and names the server."""


@dataclass(frozen=True)
class MCPServerSpec:
    """One ``[mcp.servers.NAME]`` table: a `command` (with `args` and `env`, over stdio) or a `url` (streamable
    HTTP); `timeout` is the most one call may take, in seconds."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    timeout: float = DEFAULT_CALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"mcp.servers.{self.name}: give either command (a program run over stdio) or url "
                             "(streamable HTTP), not both or neither")

    @property
    def where(self) -> str:
        return self.url or " ".join([self.command or "", *self.args])


@dataclass(frozen=True)
class ToolOutcome:
    """What a call gave: its text for the model; ``ok=False`` when it failed (the text then says how, in one
    line); `note` says what was left out (a cut, content that is not text)."""

    text: str
    ok: bool = True
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"result": self.text, "ok": self.ok, **({"note": self.note} if self.note else {})}


def _one_line(error: BaseException) -> str:
    """An exception as one line: its first non-empty line (an ExceptionGroup's first leaf), or its type's name."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return text or type(error).__name__


def outcome_of(result: Any, max_chars: int = MAX_RESULT_CHARS) -> ToolOutcome:
    """An SDK ``CallToolResult`` as a `ToolOutcome`: its text blocks joined (a structured result as JSON when there
    is no text), other content named, the whole cut at `max_chars`."""
    parts: list[str] = []
    skipped: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            skipped.append(f"{kind} ({getattr(block, 'mime_type', '') or 'unknown type'})")
        elif kind == "resource" and isinstance(getattr(block.resource, "text", None), str):
            parts.append(block.resource.text)
        else:
            skipped.append(kind or type(block).__name__)
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    text = "\n".join(parts)
    notes = []
    if skipped:
        notes.append(f"not text, left out: {', '.join(skipped)}")
        if not text:
            text = f"[the tool returned no text: {', '.join(skipped)}]"
    if len(text) > max_chars:
        notes.append(f"cut to its first {max_chars} of {len(text)} characters")
        text = text[:max_chars] + f"\n[… cut: {len(text) - max_chars} more characters]"
    return ToolOutcome(text, not getattr(result, "is_error", False), "; ".join(notes))


class MCPServer:
    """One connection to an MCP server (see the module docstring). Thread-safe: `start` once (or let the first
    `tools`/`call` do it); `close` stops the server (a stdio process ends with its pipes)."""

    def __init__(self, spec: MCPServerSpec, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 max_result_chars: int = MAX_RESULT_CHARS) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.max_result_chars = max_result_chars
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._tools: list[Tool] = []
        self.skipped: list[str] = []  # tools it listed that cannot be offered to the model, each in one line
        self._errlog: Any = None

    @classmethod
    def stdio(cls, name: str, command: str, args: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
              timeout: float = DEFAULT_CALL_TIMEOUT_S) -> "MCPServer":
        return cls(MCPServerSpec(name, command, tuple(args), dict(env or {}), timeout=timeout))

    @classmethod
    def http(cls, name: str, url: str, timeout: float = DEFAULT_CALL_TIMEOUT_S) -> "MCPServer":
        return cls(MCPServerSpec(name, url=url, timeout=timeout))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._session is not None

    def __repr__(self) -> str:
        return f"MCPServer({self.name!r}, {self.spec.where!r})"

    # --- the caller's side ----------------------------------------------------------------------------------------

    def start(self) -> list[Tool]:
        """Start the server (if it is not running) and list its tools; `MCPError` in one line when it cannot."""
        with self._lock:
            if not self.running:
                self._start()
            return list(self._tools)

    @property
    def tools(self) -> list[Tool]:
        return self.start()

    @property
    def known_tools(self) -> list[Tool]:
        """The tools it listed when it last started (none before it has), without starting it."""
        return list(self._tools)

    def call(self, name: str, arguments: dict[str, Any] | None = None) -> ToolOutcome:
        """Call tool `name`; every failure is an outcome with ``ok=False`` and one line (see the module docstring)."""
        try:
            self.start()
        except MCPError as e:
            return ToolOutcome(str(e), ok=False)
        loop, session = self._loop, self._session
        assert loop is not None
        future = asyncio.run_coroutine_threadsafe(session.call_tool(name, arguments or {}), loop)
        try:
            result = future.result(self.spec.timeout)
        except FutureTimeout:
            future.cancel()
            return ToolOutcome(f"{self.name}: {name} did not answer within {self.spec.timeout:g} s (timed out)",
                               ok=False)
        except Exception as e:  # noqa: BLE001 - a crashed server, a protocol error: one line for the model
            # A tool's own error comes back as a result (is_error); an exception here is the connection's: the
            # server is stopped, and its next call starts it again.
            why = self._last_stderr() or _one_line(e)
            self.close()
            return ToolOutcome(f"{self.name}: {name} failed, the server stopped ({why}); it restarts on the next "
                               "call", ok=False)
        return outcome_of(result, self.max_result_chars)

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def __enter__(self) -> "MCPServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the server's own thread ------------------------------------------------------------------------------------

    def _start(self) -> None:
        self._shutdown()
        ready: Future[list[Tool]] = Future()
        self._errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"mcp-{self.name}", daemon=True)
        self._thread.start()
        try:
            self._tools = ready.result(self.start_timeout_s)
        except FutureTimeout:
            self._shutdown()
            raise MCPError(f"MCP server {self.name} ({self.spec.where}) did not start within "
                           f"{self.start_timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - reported in one line
            why = self._last_stderr() or _one_line(e)
            self._shutdown()
            raise MCPError(f"MCP server {self.name} ({self.spec.where}) did not start: {why}") from None

    def _run(self, ready: Future[list[Tool]]) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as e:  # noqa: BLE001 - the server's end, reported through `ready` or the next call
            if not ready.done():
                ready.set_exception(e)
        finally:
            self._session = None
            if not ready.done():
                ready.set_exception(MCPError("the connection closed"))

    async def _main(self, ready: Future[list[Tool]]) -> None:
        from mcp import ClientSession

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as stack:
            if self.spec.url is not None:
                from mcp.client.streamable_http import streamable_http_client

                streams = await stack.enter_async_context(streamable_http_client(self.spec.url))
            else:
                from mcp.client.stdio import StdioServerParameters, stdio_client

                params = StdioServerParameters(command=self.spec.command or "", args=list(self.spec.args),
                                               env=dict(self.spec.env) or None)
                streams = await stack.enter_async_context(stdio_client(params, errlog=self._errlog))
            read, write = streams[0], streams[1]
            session = await stack.enter_async_context(ClientSession(read, write))
            await session.initialize()
            listed = await session.list_tools()
            tools, self.skipped = [], []
            for t in listed.tools:
                # Checked as the server checks a client's tools: a name a template can carry, a schema the
                # constraint can enforce (else a turn offering it would fail); one that is not is left out, said.
                try:
                    tools.append(Tool.checked(t.name, t.description or "", t.input_schema, f"{t.name}: ",
                                              "inputSchema"))
                except ToolError as e:
                    self.skipped.append(f"{self.name}'s tool {t.name!r} is left out ({e})")
            self._session = session
            ready.set_result(tools)
            await self._stop.wait()

    def _shutdown(self) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            thread.join(5.0)
        self._loop = self._stop = self._thread = self._session = None

    def _last_stderr(self) -> str:
        """The server's last line on stderr (why a process did not start or died), or ""."""
        if self._errlog is None:
            return ""
        try:
            self._errlog.flush()
            self._errlog.seek(0)
            lines = [line.strip() for line in self._errlog.read()[-4000:].splitlines() if line.strip()]
        except (OSError, ValueError):
            return ""
        return lines[-1][:300] if lines else ""


__all__ = ["MCPError", "MCPServer", "MCPServerSpec", "ToolOutcome", "outcome_of"]
