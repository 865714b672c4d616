"""Tool calls, independent of any one API (the server's three, and `engine.generate(..., tools=...)`): tool specs,
the grammar their calls must follow, the calls parsed back out of a reply (whole or streamed), and tool messages
rendered for the model's chat template.

OpenAI's shapes come in through `Tool.from_openai`, `parse_tool_choice` and `message_from_openai`; another API
(Anthropic's ``tools``/``tool_use``, Ollama's ``tools``) maps its own shapes onto the same `Tool`, `ToolChoice` and
message dicts and reuses everything else. `ToolUse` is one request's tools, choice and ``parallel_tool_calls``.

**What the model writes**: each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, calls separated
by a newline (the Hermes/Qwen convention, which chat templates with a ``tools`` variable commonly teach). How a
choice constrains it (`ToolUse.response_format`, a Lark grammar for the sampler's constraint stage,
core/sampling/constraint.py):

* a named function: exactly one call to it, and the reply ends (whatever ``parallel_tool_calls`` says, as OpenAI's
  forced function gives one call).
* ``required``: one call, or with ``parallel_tool_calls`` (the default) several, the reply free to end after each;
  each call's ``name`` is one of the tools' and its ``arguments`` are valid under that tool's ``parameters`` schema
  (closed: `core.sampling.response_format.closed`), so the calls always parse and validate.
* ``auto``: the reply is either text or calls as above, decided at its first character: text does not start with
  ``<`` and never holds ``<tool_call>`` or ``</tool_call>``, so no call markup reaches the answer.
* ``none``: the tools are not shown to the model, and the reply is text that never holds call markup (a model that
  sees calls in the conversation's history may imitate them); a ``response_format`` given with it wins.

**No call twice** (`RepeatedCall`): a call identical to one the reply already made (the same name and the same
arguments, compared as JSON values) is the repetition loop of a small model in tool form. The constraint ends the
reply as soon as such a call closes (only an end-of-turn token is allowed after it), and the repeat is not returned
(`CallStream`): a model that would call ``get_weather(Paris)`` five times makes one call and stops.

**What comes back** (`CallStream`, which core/decode/reply.py runs over every reply with tools): the calls that closed,
in order, and text only from a reply that is text. A call cut by ``max_tokens`` is dropped (the reply's finish reason
says "length"); call markup never reaches the text.

**Rendering** (`render_messages`): a chat template that has a ``tools`` variable gets the specs through it and the
messages in Hugging Face's shape (an assistant message's ``tool_calls`` with arguments as objects, ``role: "tool"``
messages with their ``tool_call_id``). Any other template gets a documented generic rendering: the specs and the
call syntax appended to the system prompt (`tool_prompt`), an assistant's calls written as the ``<tool_call>`` text
above, and each tool result as a user message ``<tool_response>{"tool_call_id": ..., "content": ...}</tool_response>``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from ..sampling.response_format import ResponseFormat, closed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_OPEN, _CLOSE = OPEN.encode(), CLOSE.encode()
# A Lark lexeme for text that holds no call markup anywhere (llguidance's lexeme negation).
_NO_MARKUP = r"~/[\s\S]*<\/?tool_call>[\s\S]*/"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# JSON inside a call: compact, as core/sampling/response_format.py writes every schema.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A bad tool spec, choice or message: `field` is where (``tools[1].function.parameters``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_openai(cls, raw: Any, i: int) -> "Tool":
        """One entry of OpenAI's ``tools``: ``{"type": "function", "function": {"name", "description",
        "parameters", "strict"}}``; its parameters must be a JSON Schema that compiles."""
        where = f"tools[{i}]"
        if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
            raise ToolError(where, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        fn = raw["function"]
        return cls.checked(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function.",
                           "parameters", strict=bool(fn.get("strict")))

    @classmethod
    def checked(cls, name: Any, description: Any, params: Any, where: str, params_key: str,
                strict: bool = False) -> "Tool":
        """A tool from any API's fields, each checked; `where` prefixes the field an error names
        (``tools[0].function.``, ``tools.0.``) and `params_key` is the API's name for the schema (``parameters``,
        ``input_schema``)."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolError(f"{where}name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if not isinstance(description or "", str):
            raise ToolError(f"{where}description", "must be a string")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"{where}{params_key}", "must be a JSON Schema object, e.g. "
                                                    '{"type": "object", "properties": {...}}')
        if params.get("type", "object") != "object":
            raise ToolError(f"{where}{params_key}", f'must be a schema of "type": "object" (a call\'s arguments are '
                                                    f"an object), got type {params['type']!r}")
        try:
            ResponseFormat(type="json_schema", json_schema={"name": name, "schema": params, "strict": strict})
        except ValidationError as e:
            msg = e.errors()[0]["msg"].removeprefix("response_format.json_schema.schema")
            raise ToolError(f"{where}{params_key}", msg.removeprefix(": ").removeprefix(".")) from None
        return cls(name, description or "", params)

    def as_openai(self) -> dict[str, Any]:
        """The spec as OpenAI writes it (what chat templates' ``tools`` variable expects)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(raw: Any, one: Callable[[Any, int], Tool] = Tool.from_openai,
                name_at: str = "tools[{}].function.name") -> list[Tool]:
    """A ``tools`` list, each entry through `one` (OpenAI's shape unless another API's); names must be unique
    (`name_at` is where entry i's name sits, for the error)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolError("tools", "must be a list of tools")
    tools = [one(t, i) for i, t in enumerate(raw)]
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolError(name_at.format(i), f"{name!r} is given twice")
    return tools


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required"]
    name: str | None = None  # with "required": the one function to call


def parse_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's ``tool_choice``: "none", "auto" (the default with tools), "required", or
    ``{"type": "function", "function": {"name": ...}}``."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        choice = ToolChoice(raw)
    elif isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        choice = ToolChoice("required", raw["function"].get("name"))
        if choice.name not in {t.name for t in tools}:
            raise ToolError("tool_choice.function.name", f"{choice.name!r} is not one of the tools: "
                                                         f"{', '.join(t.name for t in tools) or 'none given'}")
    else:
        raise ToolError("tool_choice", 'must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if choice.mode != "none" and not tools:
        raise ToolError("tool_choice", f"{choice.mode!r} needs tools: give them in tools")
    return choice


@dataclass(frozen=True)
class ToolUse:
    """One request's tools: the specs, the choice, and whether one reply may make several calls."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True

    @classmethod
    def make(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> "ToolUse":
        """From OpenAI's fields (`tools` may also hold `Tool`s): a bad one raises `ToolError` naming it."""
        if isinstance(tools, list) and tools and all(isinstance(t, Tool) for t in tools):
            parsed = list(tools)
        else:
            parsed = parse_tools(tools)
        return cls(tuple(parsed), parse_tool_choice(tool_choice, parsed), parallel_tool_calls is not False)

    @property
    def calls(self) -> bool:
        """Whether the reply may make calls (not with tool_choice "none")."""
        return self.choice.mode != "none"

    @property
    def shown(self) -> list[Tool]:
        """The tools the model is shown: all of them, none with "none" (it cannot call them)."""
        return list(self.tools) if self.calls else []

    def response_format(self) -> ResponseFormat:
        """The constraint's format for this choice (see the module docstring)."""
        if not self.calls:
            return ResponseFormat(type="grammar", grammar=f"start: TEXT?\nTEXT: /[\\s\\S]+/ & {_NO_MARKUP}\n",
                                  name="text, no tool calls")
        allowed = [t for t in self.tools if self.choice.name in (None, t.name)]
        call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": t.name}, "arguments": closed(t.parameters)}}
                          for t in allowed],
                "x-guidance": {**_JSON_OPTIONS, "lenient": False}}
        several = self.parallel and self.choice.name is None
        calls = 'call ("\\n" call)*' if several else "call"
        lines = [f"start: {'calls | TEXT' if self.choice.mode == 'auto' else 'calls'}", f"calls: {calls}",
                 f'call: "{OPEN}" json_call "{CLOSE}"', f"json_call: %json {json.dumps(call)}"]
        if self.choice.mode == "auto":
            # Text, decided at its first character (not "<"), and never the markup of a call anywhere after it.
            lines.append(f"TEXT: /[^<][\\s\\S]*/ & {_NO_MARKUP}")
        label = "tool calls: " + ", ".join(t.name for t in allowed)
        return ResponseFormat(type="grammar", grammar="\n".join(lines) + "\n",
                              name=label if len(label) <= 64 else label[:63] + "…")


# --- calls out of a reply ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def input(self) -> dict[str, Any]:
        """The arguments as an object (how Anthropic's ``tool_use`` and Ollama's ``tool_calls`` send them)."""
        return json.loads(self.arguments)


def _call(body: str) -> tuple[ToolCall, str] | None:
    """A call's JSON body as a `ToolCall` and its identity (name and arguments as a canonical JSON value), or None
    when it is not a call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    call = ToolCall("call_" + uuid.uuid4().hex[:24], data["name"], json.dumps(arguments, ensure_ascii=False))
    return call, json.dumps([data["name"], arguments], sort_keys=True)


class RepeatedCall:
    """The constraint's side of "no call twice" (see the module docstring): `feed` it the bytes of each token the
    reply takes; it answers True once a call identical to an earlier one has closed, and the reply must end."""

    def __init__(self) -> None:
        self._buffer = b""
        self._seen: set[str] = set()

    def __call__(self, data: bytes) -> bool:
        self._buffer += data
        repeated = False
        while (end := self._buffer.find(_CLOSE)) >= 0:
            start = self._buffer.find(_OPEN)
            body = self._buffer[start + len(_OPEN):end] if 0 <= start < end else b""
            self._buffer = self._buffer[end + len(_CLOSE):]
            parsed = _call(body.decode("utf-8", errors="replace"))
            if parsed is not None:
                repeated |= parsed[1] in self._seen
                self._seen.add(parsed[1])
        return repeated


class CallStream:
    """A reply's calls as it streams: `feed` each text delta, get back text deltas (str) to send on and each
    `ToolCall` once its closing tag has arrived. A reply is text or calls, decided by its first characters (held back
    only while they may still open a call); in a reply of calls nothing is text: a call that repeats an earlier one
    is dropped, and so is whatever is left at the end (a call cut by max_tokens)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._calling: bool | None = None  # None until the reply's first characters decide it
        self._seen: set[str] = set()
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        if self._calling is None:
            head = self._buffer.lstrip()
            if not head or OPEN.startswith(head):
                return []
            self._calling = head.startswith(OPEN)
        if not self._calling:
            out, self._buffer = self._buffer, ""
            return [out] if out else []
        found: list[str | ToolCall] = []
        while (end := self._buffer.find(CLOSE)) >= 0:
            body = self._buffer[:end].strip().removeprefix(OPEN)
            self._buffer = self._buffer[end + len(CLOSE):]
            parsed = _call(body)
            if parsed is None or parsed[1] in self._seen:
                continue
            self._seen.add(parsed[1])
            self.calls.append(parsed[0])
            found.append(parsed[0])
        return found


# --- messages into the chat template -----------------------------------------------------------------------------

def message_from_openai(m: dict[str, Any], i: int) -> dict[str, Any] | None:
    """An OpenAI message that involves tools, in Hugging Face's shape: an assistant message with ``tool_calls`` (its
    arguments parsed to objects) or a ``role: "tool"`` result. None for any other message."""
    where = f"messages[{i}]"
    if m.get("role") == "tool":
        call_id, content = m.get("tool_call_id"), m.get("content")
        if not isinstance(call_id, str) or not call_id:
            raise ToolError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise ToolError(f"{where}.content", "must be a string (the tool's result)")
        return result_message(call_id, content)
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return None
    calls = []
    for j, c in enumerate(m["tool_calls"] if isinstance(m["tool_calls"], list) else [None]):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{where}.tool_calls[{j}]", 'must be {"id": ..., "type": "function", "function": '
                                                        '{"name": ..., "arguments": "<JSON>"}}')
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            raise ToolError(f"{where}.tool_calls[{j}].function.arguments", "must be a JSON object's text") from None
        calls.append(call_entry(c.get("id", ""), fn["name"], args))
    content = m.get("content")
    return {"role": "assistant", "content": content if isinstance(content, str) else "", "tool_calls": calls}


def call_entry(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One call of an assistant message, in Hugging Face's shape (arguments as an object), from any API."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result_message(call_id: str, content: str, name: str | None = None) -> dict[str, Any]:
    """A tool's result, in Hugging Face's shape; `call_id` or `name` (Ollama's results carry only the tool's name)
    says which call it answers."""
    return {"role": "tool", "tool_call_id": call_id, "content": content, **({"name": name} if name else {})}


def tool_prompt(tools: list[Tool]) -> str:
    """The generic rendering's instructions, appended to the system prompt."""
    specs = "\n".join(json.dumps(t.as_openai()["function"]) for t in tools)
    return (f"You may call these functions:\n<tools>\n{specs}\n</tools>\nTo call one, reply with only "
            f'{OPEN}{{"name": <name>, "arguments": <JSON>}}{CLOSE}; results come in <tool_response>.')


def render_messages(messages: list[dict[str, Any]], tools: list[Tool], template_knows_tools: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` variable to hand the chat template (see the module docstring). `tools` are
    the ones to show (none with tool_choice "none")."""
    if template_knows_tools:
        return messages, [t.as_openai() for t in tools] or None
    out = [_generic(m) for m in messages]
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tool_prompt(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return out, None


def _generic(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":
        said = {k: m[k] for k in ("tool_call_id", "name") if m.get(k)}
        body = json.dumps({**said, "content": m["content"]}, ensure_ascii=False)
        return {"role": "user", "content": f"<tool_response>{body}</tool_response>"}
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = "\n".join(OPEN + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                            ensure_ascii=False) + CLOSE for c in m["tool_calls"])
        return {"role": "assistant", "content": f"{m['content']}\n{calls}".lstrip("\n")}
    return m


__all__ = ["CLOSE", "OPEN", "CallStream", "RepeatedCall", "Tool", "ToolCall", "ToolChoice", "ToolError", "ToolUse",
           "call_entry", "message_from_openai", "parse_tool_choice", "parse_tools", "render_messages",
           "result_message", "tool_prompt"]
