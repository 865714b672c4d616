"""The tool loop: a turn of a chat with tools, for the Python API (`engine.chat(tools=[...])`), the CLI
(`mlxchat generate --mcp NAME`) and the TUI alike.

    generate ─▶ the reply's calls (parsed by core/decode/tools.py) ─▶ approve each ─▶ run it (an MCP server's tool, or a
    Python function) ─▶ its result fed back as a tool message (the chat template's, or core/decode/tools.py's generic
    rendering) ─▶ generate again … until a reply makes no call, or `max_tool_steps` rounds of calls.

A `Toolbox` holds the tools' sources: `MCPServer`s (core/chat/mcp.py; started when the loop first needs them) and plain
Python callables (their signature and docstring are the spec). A `ToolStream` is one turn: iterate it as a
`Stream` (TokenEvents, PrefillProgress, then one Done with the last reply's result), with `ToolCallEvent` before each
call and `ToolResultEvent` after it. The first reply follows the turn's `tool_choice` ("required" forces a call,
through the sampler's constraint, core/decode/tools.py); the replies after results follow "auto", and the one after the
last allowed round "none" (it must answer in text). The calls and their results are kept on the reply's
`ChatMessage.tool_calls` (what the store saves and the export shows); the model's next reply reads them.

Failures are results: a server that does not start, a call that fails, hangs or crashes its server, a call the
user denies: the call's result says so in one line (the model reads it), a `ToolResultEvent` carries it with
``ok=False``, and the turn goes on.
"""

from __future__ import annotations

import inspect
import json
import threading
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..decode.events import Done, GenerationResult
from ..decode.tools import NAME_RE, Tool, ToolCall, ToolError, ToolUse
from ..decode.worker import Stream
from .mcp import MAX_RESULT_CHARS, MCPError, MCPServer, ToolOutcome
from .messages import ChatMessage

Decision = Literal["once", "always", "deny"]
# Asked before each call: the call and the source of its tool (an MCP server's name, or "python").
Approve = Callable[[ToolCall, str], Decision]
TOOL_CHOICES = ("auto", "required", "none")


@dataclass(frozen=True)
class ToolCallEvent:
    """The model called a tool: asked for approval (unless already allowed), then run."""

    call: ToolCall
    source: str
    text: str = ""  # no text delta: a stream's consumers that join `event.text` can pass it by


@dataclass(frozen=True)
class ToolResultEvent:
    """A call's outcome, as the model reads it (``ok=False``: it failed, was denied or timed out; the text says)."""

    call: ToolCall
    source: str
    outcome: ToolOutcome
    decision: Decision
    text: str = ""


@dataclass(frozen=True)
class ToolNotice:
    """A line about the turn's tools (a server that did not start, the step limit reached)."""

    message: str
    text: str = ""


def _schema(annotation: Any) -> dict[str, Any]:
    """A Python annotation as a JSON Schema (the common types; anything else is left open)."""
    origin = typing.get_origin(annotation)
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation is bool:
        return {"type": "boolean"}
    if annotation is int:
        return {"type": "integer"}
    if annotation is float:
        return {"type": "number"}
    if annotation is str:
        return {"type": "string"}
    if annotation in (list, tuple) or origin in (list, tuple, Sequence):
        args = typing.get_args(annotation)
        return {"type": "array", **({"items": _schema(args[0])} if args and args[0] is not Ellipsis else {})}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    if origin is Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _schema(options[0]) if len(options) == 1 else {"anyOf": [_schema(a) for a in options]}
    return {}


def function_tool(fn: Callable[..., Any]) -> Tool:
    """A plain Python function as a tool: its name, its docstring's first paragraph, and its parameters' schema
    from their annotations (a parameter with no default is required)."""
    name = getattr(fn, "__name__", "")
    if not NAME_RE.match(name):
        raise ToolError("tools", f"a function tool needs a name of 1-64 letters, digits, '_' or '-', got {name!r}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: left open
        hints = {}
    properties: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        properties[p.name] = _schema(hints.get(p.name, p.annotation))
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ").strip()
    return Tool.from_openai({"type": "function", "function": {
        "name": name, "description": doc,
        "parameters": {"type": "object", "properties": properties, **({"required": required} if required else {})}}},
        0)


class Toolbox:
    """The tools a chat may call, by source: MCP servers (started on first use) and Python functions. Tool names
    must be unique across sources: a later source's tool of a name already taken is left out, with a notice.
    `disabled` holds the names the user turned off for this chat (the TUI's tools screen)."""

    def __init__(self, sources: Sequence[MCPServer | Callable[..., Any]] = (), *,
                 max_result_chars: int = MAX_RESULT_CHARS, start_on_use: bool = True) -> None:
        self.servers: list[MCPServer] = []
        self.functions: dict[str, tuple[Tool, Callable[..., Any]]] = {}
        for s in sources:
            if isinstance(s, MCPServer):
                self.servers.append(s)
            elif callable(s):
                tool = function_tool(s)
                self.functions[tool.name] = (tool, s)
            else:
                raise ToolError("tools", f"each tool must be an MCPServer or a Python function, got {s!r}")
        self.max_result_chars = max_result_chars
        # Whether a turn starts the servers not running yet (the API, the CLI). A UI starts them in the background
        # (`start`) instead: a turn's first reply is started on its thread, which must not wait for a server.
        self.start_on_use = start_on_use
        self.disabled: set[str] = set()
        self.notices: list[str] = []  # servers that did not start, names taken twice: shown once each
        self._failed: dict[str, str] = {}  # server name -> why it did not start
        self._sources: dict[str, str] = {}  # tool name -> its source
        self._lock = threading.Lock()

    def start(self, wait: bool = True, retry: bool = False) -> list[tuple[str, list[Tool] | str]]:
        """Start every server not running yet; per source (each server, then "python"), its tools or why it did
        not start. A server that did not start is tried again only with `retry` (a slow failure must not cost
        every round of a turn again). `wait=False` starts none: a server not running yet is "starting"."""
        out: list[tuple[str, list[Tool] | str]] = []
        for server in self.servers:
            if not server.running and not wait and server.known_tools and server.name not in self._failed:
                out.append((server.name, server.known_tools))  # it stopped (a crash): its next call starts it
                continue
            if not server.running and ((not wait and server.name not in self._failed)
                                       or (server.name in self._failed and not retry)):
                out.append((server.name, self._failed.get(server.name, "starting")))
                continue
            try:
                out.append((server.name, server.start()))
                self._failed.pop(server.name, None)
                self.notices += [line for line in server.skipped if line not in self.notices]
            except MCPError as e:
                if self._failed.get(server.name) != str(e):
                    self.notices.append(str(e))
                self._failed[server.name] = str(e)
                out.append((server.name, str(e)))
        if self.functions:
            out.append(("python", [t for t, _ in self.functions.values()]))
        return out

    def tools(self, start: bool | None = None) -> list[Tool]:
        """The tools the model may call now (enabled ones of the sources that started; `start`: start the servers
        not running yet, `start_on_use` when None)."""
        with self._lock:
            found: list[Tool] = []
            self._sources = {}
            for source, tools in self.start(self.start_on_use if start is None else start):
                if isinstance(tools, str):
                    continue
                for tool in tools:
                    if tool.name in self._sources:
                        line = (f"{source}'s tool {tool.name} is left out: {self._sources[tool.name]} has one of "
                                "that name")
                        if line not in self.notices:
                            self.notices.append(line)
                        continue
                    self._sources[tool.name] = source
                    if tool.name not in self.disabled:
                        found.append(tool)
            return found

    def use(self, choice: str) -> ToolUse | None:
        """The request's tools for `choice`; None when there are none to call (no server started, all off)."""
        tools = self.tools()
        if not tools:
            return None
        return ToolUse.make(tools, choice if choice in TOOL_CHOICES else "auto", False)

    def source(self, name: str) -> str:
        return self._sources.get(name, "python" if name in self.functions else "?")

    def run(self, call: ToolCall) -> ToolOutcome:
        """Run `call`; every failure is an outcome with ``ok=False`` and one line."""
        try:
            arguments = call.input()
        except (json.JSONDecodeError, TypeError):
            return ToolOutcome(f"{call.name}: the arguments are not a JSON object: {call.arguments[:200]}", ok=False)
        if call.name in self.disabled:
            return ToolOutcome(f"{call.name} is turned off in this chat", ok=False)
        if call.name in self.functions:
            try:
                value = self.functions[call.name][1](**arguments)
            except Exception as e:  # noqa: BLE001 - the function's failure is the call's result
                return ToolOutcome(f"{call.name} failed: {type(e).__name__}: {e}".splitlines()[0], ok=False)
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
            if len(text) > self.max_result_chars:
                cut = len(text) - self.max_result_chars
                return ToolOutcome(text[:self.max_result_chars] + f"\n[… cut: {cut} more characters]", True,
                                   f"cut to its first {self.max_result_chars} of {len(text)} characters")
            return ToolOutcome(text)
        source = self.source(call.name)
        server = next((s for s in self.servers if s.name == source), None)
        if server is None:
            return ToolOutcome(f"there is no tool named {call.name}", ok=False)
        return server.call(call.name, arguments)

    def close(self) -> None:
        """Stop the servers (each starts again if the toolbox is used after)."""
        for server in self.servers:
            server.close()


class ToolSession(Protocol):
    """What a turn with tools needs of its chat: core/chat/chat_session.py's `ChatSession`, which starts the turn
    (so this module does not import it)."""

    toolbox: Toolbox | None
    approve: Approve | None
    max_tool_steps: int

    @property
    def messages(self) -> list[ChatMessage]: ...

    def continue_tools(self, tools: ToolUse | None, *, max_tokens: int | None = None,
                       stop: Sequence[str] | None = None) -> Stream: ...


class ToolStream:
    """One turn of a chat with tools, as a `Stream` (see the module docstring). `start(tools)` starts the turn's
    first reply (ChatSession.send's, regenerate's or edit_last's); the later ones continue it."""

    def __init__(self, session: ToolSession, start: Callable[[ToolUse | None], Stream], tool_choice: str,
                 max_tokens: int | None, stop: Sequence[str] | None) -> None:
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {tool_choice!r}")
        assert session.toolbox is not None
        self.session, self.toolbox = session, session.toolbox
        self.tool_choice, self.max_tokens, self.stop = tool_choice, max_tokens, stop
        self.result: GenerationResult | None = None
        self.calls: list[tuple[ToolCall, str, ToolOutcome, Decision]] = []  # every call of the turn, in order
        self._cancelled = False
        self._done: dict[str, ToolOutcome] = {}  # each distinct call of the turn (name and arguments): its outcome
        self._notices = len(self.toolbox.notices)
        # The first reply starts now, as a plain turn's does (a bad message or a busy session fails here).
        self._stream = start(self.toolbox.use(tool_choice) if tool_choice != "none" else None)

    def cancel(self) -> None:
        self._cancelled = True
        self._stream.cancel()

    def fail(self, error: BaseException) -> None:
        self._stream.fail(error)

    def wait(self, progress: Callable[[int, int], None] | None = None) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def __iter__(self) -> Iterator[Any]:
        session, box = self.session, self.toolbox
        yield from self._new_notices()
        step = 0
        kept: GenerationResult | None = None  # the last reply that made calls (kept by the session)
        while True:
            result = None
            for event in self._stream:
                if isinstance(event, Done):
                    result = event.result
                    break
                yield event
            assert result is not None
            if not result.tool_calls or self._cancelled or result.finish_reason == "cancelled":
                if kept is not None and not result.text and result.finish_reason == "cancelled":
                    # Stopped before the first token after results: the reply is its calls (the session keeps
                    # it, and so must whoever shows the turn): the round that made them ends the turn.
                    result = kept
                self.result = result
                yield Done(result)
                return
            kept = result
            step += 1
            repeats = 0
            for call in result.tool_calls:
                source = box.source(call.name)
                yield ToolCallEvent(call, source)
                key = _identity(call)
                if key in self._done:  # the loop of a small model: the same call again gets the same result
                    repeats += 1
                    earlier = self._done[key]
                    outcome = ToolOutcome(f"(this call was already made in this turn; its result) {earlier.text}",
                                          earlier.ok, earlier.note)
                    self._record(call, outcome)
                    self.calls.append((call, source, outcome, "once"))
                    yield ToolResultEvent(call, source, outcome, "once")
                    continue
                decision = self._decide(call, source)
                if self._cancelled:
                    outcome = ToolOutcome("the turn was stopped before this call ran", ok=False)
                elif decision == "deny":
                    outcome = ToolOutcome(f"the user denied this call of {call.name}", ok=False)
                else:
                    outcome = box.run(call)
                self._record(call, outcome)
                self.calls.append((call, source, outcome, decision))
                self._done[key] = outcome
                yield ToolResultEvent(call, source, outcome, decision)
            if self._cancelled:
                self.result = result
                yield Done(result)
                return
            last = step >= session.max_tool_steps
            if repeats == len(result.tool_calls):  # nothing new was called: the model answers from the results
                last = True
            elif last:
                yield ToolNotice(f"{step} rounds of tool calls: the model answers now, without tools "
                                 f"(max_tool_steps = {session.max_tool_steps})")
            use = box.use("none" if last else "auto")
            self._stream = session.continue_tools(use, max_tokens=self.max_tokens, stop=self.stop)
            yield from self._new_notices()

    def _decide(self, call: ToolCall, source: str) -> Decision:
        approve = self.session.approve
        if approve is None:
            return "once"
        try:
            return approve(call, source)
        except Exception:  # noqa: BLE001 - an approval that cannot be asked (no terminal) denies
            return "deny"

    def _record(self, call: ToolCall, outcome: ToolOutcome) -> None:
        """The result onto the call's record in the reply's message (what the next reply reads, the store saves)."""
        path = self.session.messages
        message = path[-1] if path else None
        if message is None or message.role != "assistant":
            return
        for record in message.tool_calls:
            if record.get("id") == call.id:
                record.update(outcome.as_dict())

    def _new_notices(self) -> Iterator[ToolNotice]:
        while self._notices < len(self.toolbox.notices):
            yield ToolNotice(self.toolbox.notices[self._notices])
            self._notices += 1


def _identity(call: ToolCall) -> str:
    try:
        return json.dumps([call.name, json.loads(call.arguments)], sort_keys=True)
    except json.JSONDecodeError:
        return json.dumps([call.name, call.arguments])


class AlwaysAllowed:
    """An approval that remembers "always" per tool: wraps an `ask(call, source)` that asks the user."""

    def __init__(self, ask: Approve) -> None:
        self.ask = ask
        self.allowed: set[str] = set()

    def __call__(self, call: ToolCall, source: str) -> Decision:
        if call.name in self.allowed:
            return "always"
        decision = self.ask(call, source)
        if decision == "always":
            self.allowed.add(call.name)
        return decision


__all__ = ["AlwaysAllowed", "Approve", "Decision", "ToolCallEvent", "ToolNotice", "ToolResultEvent", "ToolSession",
           "ToolStream", "Toolbox", "function_tool"]
