"""Anthropic's Messages API on the same server, for the Anthropic SDK and the tools built on it: POST /v1/messages
and /v1/messages/count_tokens.

A request is `system` (a string or text blocks), `messages` (user and assistant turns whose content is a string or
text blocks; a last assistant turn is a prefill the reply continues), `max_tokens` (required), `temperature`,
`top_p`, `top_k` (the SDK sends these three in `extra_body`, and llama.cpp's samplers under llama.cpp server's
names: dry_*, top_n_sigma, dynatemp_*, mirostat*, adaptive_p_*), `seed` (mlxchat's extension, in `extra_body` too)
and `stop_sequences` over the server's profile, and `stream`. A stream is Anthropic's event
sequence: message_start, content_block_start, ping, content_block_delta..., content_block_stop, message_delta (the
stop reason and usage), message_stop. `usage` counts as Anthropic does: `input_tokens` are the prompt tokens
computed for this request, `cache_read_input_tokens` those reused from the prefix cache. `metadata`,
`service_tier`, `cache_control` and the other tags of Anthropic's platform are accepted and ignored.

Tools (core/decode/tools.py does the work): custom `tools` (name, description, input_schema) and `tool_choice` ("auto",
"any", "tool" with its name, "none"; `disable_parallel_tool_use`) constrain the reply as OpenAI's do ("tool" is one
call, as OpenAI's named function); calls come back as `tool_use` blocks (`stop_reason: "tool_use"`), streamed as a
whole block each (one `input_json_delta`). History's
`tool_use` blocks and `tool_result` blocks (string or text content; `is_error` prefixes "Error: ") go through the
chat template as tool calls and tool messages. Structured output, `output_config.format` (a JSON schema), constrains
the reply the same way. Anthropic's server tools (web search, bash, ...), images and documents are a 400.

Extended thinking (core/decode/reasoning.py): a thinking model's reasoning comes back as a `thinking` block before the
text (streamed as `thinking_delta` events); `thinking` {"type": "enabled", "budget_tokens": N} bounds it at N tokens,
{"type": "disabled"} turns a template's thinking switch off. History's thinking blocks go to the template as the
reply's `reasoning_content` (most templates leave old thinking out). Signatures are empty: nothing is signed.

Errors are Anthropic's shape, `{"type": "error", "error": {"type": ..., "message": ...}}`; a stream that fails
ends with an `error` event.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxchat.core import GenerationResult, SamplingProfile, TokenEvent
from mlxchat.core.decode.events import Done, Metrics
from mlxchat.core.decode.reasoning import Reasoning, markers_for
from mlxchat.core.sampling.sampler_params import PARAMS, SamplerParam

from mlxchat.core.decode import tools as tool_calls
from mlxchat.core.decode.tools import Tool, ToolCall, ToolChoice, ToolError, ToolUse

from .protocol import ApiError, profile_error, sampler_settings, sampler_types
from .service import Choice, GenerationFailed, Service

# Anthropic's error type for each status this server answers.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


# Anthropic's temperature, top_p and top_k, and llama.cpp's samplers under llama.cpp server's names (the SDK sends
# them in `extra_body`, as on /v1/chat).
SAMPLERS: dict[str, SamplerParam] = {p.name: p for p in PARAMS.values() if p.anthropic}


class _Types(sampler_types("_AnthropicSamplers", SAMPLERS)):
    """JSON types of a Messages request (ranges are SamplingProfile's)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    messages: list[Any]
    max_tokens: int | None = None
    system: str | list[Any] | None = None
    # Tags of Anthropic's platform (billing, routing, its prompt cache and region, fast mode): no meaning here.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: dict[str, Any] | None = None  # its effort is a hint for thinking models; format: a schema
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    seed: int | None = None  # mlxchat's extension (in the SDK's extra_body): Anthropic's API has none
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


@dataclass
class MessagesRequest:
    """A validated Messages request: the conversation, what the reply continues, and how to sample it."""

    messages: list[dict[str, Any]]
    prefill: str  # a last assistant turn's text: the reply continues it
    profile: SamplingProfile
    max_tokens: int | None
    stream: bool
    tools: ToolUse | None  # the tools, the choice and whether calls may come in parallel (None: no tools)
    reasoning: Reasoning = Reasoning()  # `thinking`: a thinking model's switch and budget (budget_tokens)


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (cache_control and citations mark them for Anthropic's platform only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks")
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}.{j}: only text blocks are supported here, got {kind or 'no type'!r}")
        parts.append(block["text"])
    return "".join(parts)


def _turn(m: Any, i: int) -> list[dict[str, Any]]:
    """One turn as chat-template messages: an assistant's text and `tool_use` blocks become one message with its
    calls; a user's `tool_result` blocks become tool messages, before the user text that follows them."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise ApiError(400, f"messages.{i}.role must be user or assistant (the system prompt is `system`), "
                            f"got {role!r}")
    content, where = m.get("content"), f"messages.{i}.content"
    if not isinstance(content, list):
        return [{"role": role, "content": _text(content, where)}]
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(block.get("thinking"), str):  # given to the template, which keeps or strips it
                thoughts.append(block["thinking"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, f"{where}.{j}"))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, f"{where}.{j}"))
        elif kind == "text":
            texts.append(_text([block], where))
        else:
            wanted = "text, thinking or tool_use" if role == "assistant" else "text or tool_result"
            raise ApiError(400, f"{where}.{j}: only {wanted} blocks are supported in a {role} turn, "
                                f"got {kind or 'no type'!r}")
    if role == "assistant":
        return [{"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {}),
                 **({"reasoning_content": "".join(thoughts)} if thoughts else {})}]
    return results + ([{"role": role, "content": "".join(texts)}] if texts or not results else [])


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise ApiError(400, f"{where}: a tool_use block needs its id and name")
    if not isinstance(block.get("input", {}), dict):
        raise ApiError(400, f"{where}.input: must be an object (the call's arguments)")
    return tool_calls.call_entry(block["id"], block["name"], block.get("input", {}))


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise ApiError(400, f"{where}.tool_use_id: a tool_result block needs the id of the tool_use it answers")
    content = _text(block.get("content", ""), f"{where}.content")
    return tool_calls.result_message(block["tool_use_id"], "Error: " + content if block.get("is_error") else content)


def _tool(raw: Any, i: int) -> Tool:
    """One custom tool: name, description, input_schema (Anthropic's server tools run on its platform only)."""
    if not isinstance(raw, dict):
        raise ToolError(f"tools.{i}", 'must be {"name": ..., "description": ..., "input_schema": {...}}')
    if raw.get("type", "custom") != "custom":
        raise ToolError(f"tools.{i}.type", f"{raw['type']!r} is a server tool of Anthropic's platform; this "
                                           "server takes custom tools (name, description, input_schema)")
    if "input_schema" not in raw:
        raise ToolError(f"tools.{i}.input_schema", "field required")
    return Tool.checked(raw.get("name"), raw.get("description"), raw["input_schema"], f"tools.{i}.", "input_schema",
                        strict=bool(raw.get("strict")))


def _tool_choice(raw: dict[str, Any] | None, tools: list[Tool]) -> tuple[ToolChoice, bool]:
    """Anthropic's tool_choice as the shared `ToolChoice` ("any" and "tool" must call), and whether several calls
    may come in one reply."""
    modes = {"auto": "auto", "any": "required", "tool": "required", "none": "none"}
    if raw is None:
        return ToolChoice("auto" if tools else "none"), True
    kind = raw.get("type")
    if kind not in modes:
        raise ToolError("tool_choice.type", f'must be "auto", "any", "tool" or "none", got {kind!r}')
    name = raw.get("name") if kind == "tool" else None
    if kind == "tool" and name not in {t.name for t in tools}:
        raise ToolError("tool_choice.name", f"{name!r} is not one of the tools: "
                                            f"{', '.join(t.name for t in tools) or 'none given'}")
    if kind != "none" and not tools:
        raise ToolError("tool_choice", f"{kind!r} needs tools: give them in tools")
    return ToolChoice(modes[kind], name), not raw.get("disable_parallel_tool_use", False)  # type: ignore[arg-type]


def parse(body: Any, *, served: str, base: SamplingProfile, counting: bool = False) -> MessagesRequest:
    """Validate a Messages request against the model `served` and the server's profile `base`; `counting` is
    count_tokens, which needs no max_tokens."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = _Types.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"{where}: unrecognized field; remove it") from None
        raise ApiError(400, f"{where}: {first['msg']}") from None
    if not req.model:
        raise ApiError(400, "model: field required")
    if req.model != served:
        raise ApiError(404, f"model: {req.model!r} is not served here; this server serves {served!r}")
    try:
        tools = tool_calls.parse_tools(req.tools, _tool, "tools.{}.name")
        choice, parallel = _tool_choice(req.tool_choice, tools)
    except ToolError as e:
        raise ApiError(400, str(e)) from None
    reasoning = _thinking(req.thinking)
    if req.max_tokens is None and not counting:
        raise ApiError(400, "max_tokens: field required")

    messages = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _turn(m, i)
    if not any(m["content"].strip() for m in messages if m["role"] in ("user", "tool")):
        raise ApiError(400, "messages: send at least one user message with text")
    if messages[-1].get("tool_calls"):
        raise ApiError(400, f"messages.{len(req.messages) - 1}: the reply continues a final assistant turn, so it "
                            "cannot hold tool_use blocks; answer them with tool_result blocks in a user turn")
    prefill = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
    if prefill != prefill.rstrip():
        raise ApiError(400, "messages: the final assistant content cannot end with whitespace")

    fields = sampler_settings(req, SAMPLERS)
    if req.stop_sequences:
        fields["stop"] = req.stop_sequences
    if req.max_tokens is not None:
        fields["max_tokens"] = req.max_tokens
    # Anthropic's API has no seed: every request samples afresh unless the extension field gives one.
    fields["seed"] = req.seed if req.seed is not None else secrets.randbits(63)
    use = ToolUse(tuple(tools), choice, parallel) if tools else None
    if (fmt := (req.output_config or {}).get("format")) is not None:
        if use is not None and use.calls:
            raise ApiError(400, 'output_config.format and tools both constrain the reply: use one (or tool_choice '
                                '{"type": "none"})')
        fields["response_format"] = _output_format(fmt)
    try:
        profile = SamplingProfile.model_validate({**base.model_dump(), **fields})
    except ValidationError as e:
        err = profile_error(e)
        if err.param == "response_format":  # the sampler's name for it; the client sent output_config.format
            raise ApiError(400, err.message.replace("response_format.json_schema", "output_config.format")) from None
        raise ApiError(400, err.message.replace("stop", "stop_sequences", 1) if err.param == "stop"
                       else err.message) from None
    return MessagesRequest(messages, prefill, profile, profile.max_tokens, bool(req.stream), use, reasoning)


def _thinking(raw: dict[str, Any] | None) -> Reasoning:
    """`thinking`: {"type": "enabled", "budget_tokens": N} (a budget of N reasoning tokens: 0 or more, not
    Anthropic's minimum of 1024, for small local models), {"type": "disabled"} (a template's thinking switched off),
    {"type": "adaptive"} (on, no budget)."""
    if raw is None:
        return Reasoning()
    kind = raw.get("type")
    if kind == "disabled":
        return Reasoning(False)
    if kind not in ("enabled", "adaptive"):
        raise ApiError(400, f"thinking.type must be enabled, disabled or adaptive, got {kind!r}")
    extra = set(raw) - {"type", "budget_tokens", "display"}
    if extra:
        raise ApiError(400, f"thinking.{sorted(extra)[0]}: unrecognized field; remove it")
    try:
        return Reasoning.make(True, raw.get("budget_tokens"), field="thinking.budget_tokens")
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def _output_format(fmt: Any) -> dict[str, Any]:
    """Structured output, `output_config.format` = {"type": "json_schema", "schema": {...}}: the reply is JSON valid
    under the schema (the sampler's constraint stage, core/sampling/constraint.py)."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def usage(m: Metrics) -> dict[str, int]:
    return {"input_tokens": m.prompt_tokens - m.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": m.cached_tokens, "output_tokens": m.completion_tokens}


def stop_reason(result: GenerationResult, max_tokens: int | None, called: bool = False) -> str:
    """Anthropic's stop reason; `called`: the reply made tool calls (one cut by max_tokens stays "max_tokens")."""
    if result.finish_reason == "length":
        return "max_tokens" if result.metrics.completion_tokens == max_tokens else "model_context_window_exceeded"
    if called:
        return "tool_use"
    return "stop_sequence" if result.stop_sequence is not None else "end_turn"


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as Anthropic's `tool_use` block (ids "toolu_...", as Anthropic's)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.input()}


def _event(kind: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **data})}


class Blocks:
    """A streamed reply's content blocks, as events: text goes into an open text block (opened by its first delta),
    each call is a whole tool_use block of its own (start, one input_json_delta, stop)."""

    def __init__(self) -> None:
        self.index = -1  # the last block opened
        self.open: str | None = None  # the kind of the block open now ("thinking" or "text")
        self.called = False

    def _start(self, kind: str) -> list[dict[str, str]]:
        out = self.close()
        self.index, self.open = self.index + 1, kind
        block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                      "signature": ""}
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block})]

    def thinking(self, text: str) -> list[dict[str, str]]:
        """A thinking model's reasoning: a thinking block (before the text) with thinking_delta events."""
        out = [] if self.open == "thinking" else self._start("thinking")
        if text:
            out.append(_event("content_block_delta", {"index": self.index, "delta": {"type": "thinking_delta",
                                                                                      "thinking": text}}))
        return out

    def text(self, text: str) -> list[dict[str, str]]:
        out = [] if self.open == "text" else self._start("text")
        if text:
            out.append(_event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta",
                                                                                      "text": text}}))
        return out

    def call(self, call: ToolCall) -> list[dict[str, str]]:
        out = self.close()
        self.index, self.called = self.index + 1, True
        block = {**tool_use(call), "input": {}}  # the input arrives as JSON text in the delta
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block}),
                _event("content_block_delta", {"index": self.index, "delta": {"type": "input_json_delta",
                                                                              "partial_json": call.arguments}}),
                _event("content_block_stop", {"index": self.index})]

    def close(self) -> list[dict[str, str]]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


def routes(service: Service) -> list[Route]:
    """The Messages routes over `service`, each answering errors in Anthropic's shape."""

    def encode(req: MessagesRequest) -> list[int]:
        ids = service.encode_chat(req.messages, tools=req.tools.shown if req.tools else [],
                                  template_kwargs=req.reasoning.template_kwargs())
        if req.prefill:
            ids += service.engine.model.tokenizer.encode(req.prefill)
            service.check_fits(ids, "messages")
        return ids

    def message(rid: str, content: list[dict[str, Any]], reason: str | None, stop: str | None,
                m: Metrics) -> dict[str, Any]:
        return {"id": rid, "type": "message", "role": "assistant", "model": service.name, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": usage(m)}

    async def messages(request: HttpRequest) -> Response:
        started = time.perf_counter()
        req = parse(await service.read_json(request), served=service.name, base=service.base)
        choices = service.start(encode(req), [req.profile], req.max_tokens, tools=req.tools, reasoning=req.reasoning)
        rid = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return EventSourceResponse(events(request, req, rid, choices[0], started), sep="\n", ping=15)
        results = await service.collect(request, choices)
        if results is None:  # the client went away
            return Response(status_code=499)
        request.state.results = results
        r = results[0]
        # A reply with tools is text or calls (core/decode/tools.py): one text block, or a tool_use block per call.
        content = [tool_use(c) for c in r.tool_calls] or [{"type": "text", "text": r.text}]
        if r.reasoning:  # a thinking model's reasoning: a thinking block first
            content.insert(0, {"type": "thinking", "thinking": r.reasoning, "signature": ""})
        return JSONResponse(message(rid, content, stop_reason(r, req.max_tokens, bool(r.tool_calls)),
                                    r.stop_sequence, r.metrics))

    async def events(request: HttpRequest, req: MessagesRequest, rid: str, choice: Choice,
                     started: float) -> AsyncIterator[dict]:
        results: list[GenerationResult] = []
        status, opened = 200, False
        blocks = Blocks()
        calls = req.tools is not None and req.tools.calls  # the reply may be tool_use blocks instead of text
        # A thinking model's reply may open with a thinking block: its text block opens with the first answer text.
        thinks = markers_for(service.engine.model.tokenizer) is not None
        try:
            async for got in choice.stream():
                metrics = got.result.metrics if isinstance(got, Done) else getattr(got, "metrics", None)
                if not opened and metrics is not None:  # the usage is known once the prompt is in the cache
                    opened = True
                    yield _event("message_start", {"message": message(rid, [], None, None, metrics)})
                    for e in [] if calls or thinks else blocks.text(""):  # no tools: the reply is one text block
                        yield e
                    yield _event("ping", {})
                if isinstance(got, TokenEvent):
                    for e in [*(blocks.thinking(got.reasoning) if got.reasoning else []),
                              *(blocks.text(got.text) if got.text else []),
                              *(e for call in got.tool_calls for e in blocks.call(call))]:
                        yield e
                if isinstance(got, Done):
                    r = got.result
                    results.append(r)
                    if not blocks.called and blocks.open != "text" and (blocks.open == "thinking"
                                                                        or thinks and not calls):
                        for e in blocks.text(""):  # the reply has a text block, if only an empty one
                            yield e
                    for e in blocks.close():
                        yield e
                    yield _event("message_delta", {"delta": {"stop_reason": stop_reason(r, req.max_tokens,
                                                                                        blocks.called),
                                                             "stop_sequence": r.stop_sequence},
                                                   "usage": usage(r.metrics)})
                    yield _event("message_stop", {})
        except GenerationFailed as e:  # an in-stream error is the stream's last event
            status = 500
            yield _event("error", error_body(ApiError(500, str(e))))
        finally:
            choice.request.cancel()
            service.log_line(request, status, started, results)

    async def count_tokens(request: HttpRequest) -> Response:
        req = parse(await service.read_json(request), served=service.name, base=service.base, counting=True)
        return JSONResponse({"input_tokens": len(encode(req))})

    def route(path: str, fn: Callable) -> Route:
        return Route(path, service.endpoint(fn, error_body), methods=["POST"])

    return [route("/v1/messages", messages), route("/v1/messages/count_tokens", count_tokens)]


__all__ = ["Blocks", "MessagesRequest", "error_body", "parse", "routes", "stop_reason", "tool_use", "usage"]
