"""Anthropic's Messages API on the same server, for the Anthropic SDK and the tools built on it: POST /v1/messages
and /v1/messages/count_tokens.

A request is `system` (a string or text blocks), `messages` (user and assistant turns whose content is a string or
text blocks; a last assistant turn is a prefill the reply continues), `max_tokens` (required), `temperature`,
`top_p`, `top_k` (the SDK sends these three in `extra_body`) and `stop_sequences` over the server's profile, and
`stream`. A stream is Anthropic's event
sequence: message_start, content_block_start, ping, content_block_delta..., content_block_stop, message_delta (the
stop reason and usage), message_stop. `usage` counts as Anthropic does: `input_tokens` are the prompt tokens
computed for this request, `cache_read_input_tokens` those reused from the prefix cache. `metadata`,
`service_tier`, `cache_control` and the other tags of Anthropic's platform are accepted and ignored. Tools and a
JSON output format need constrained decoding and are a 400 until the sampler has it; so are extended thinking,
images and documents.

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

from pydantic import BaseModel, ConfigDict, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxchat.core import GenerationResult, SamplingProfile, TokenEvent
from mlxchat.core.events import Done, Metrics

from .protocol import ApiError, profile_error
from .service import Choice, Service

# Anthropic's error type for each status this server answers.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class _Types(BaseModel):
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
    output_config: dict[str, Any] | None = None  # its effort is a hint for thinking models; its format is refused
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


@dataclass
class MessagesRequest:
    """A validated Messages request: the conversation, what the reply continues, and how to sample it."""

    messages: list[dict[str, str]]
    prefill: str  # a last assistant turn's text: the reply continues it
    profile: SamplingProfile
    max_tokens: int | None
    stream: bool


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
            raise ApiError(400, f"{where}[{j}]: only text blocks are supported, got {kind or 'no type'!r}"
                           + (" (tools need constrained decoding, which this server does not have yet)"
                              if kind in ("tool_use", "tool_result") else ""))
        parts.append(block["text"])
    return "".join(parts)


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
    if req.tools or req.tool_choice:
        raise ApiError(400, "tools need constrained decoding, which this server does not have yet; leave tools and "
                            "tool_choice out")
    if (req.output_config or {}).get("format"):
        raise ApiError(400, "output_config.format needs constrained decoding, which this server does not have yet; "
                            "leave it out")
    if req.thinking and req.thinking.get("type") != "disabled":
        raise ApiError(400, "thinking is not supported by this server; leave it out")
    if req.max_tokens is None and not counting:
        raise ApiError(400, "max_tokens: field required")

    messages = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role must be user or assistant (the system prompt is `system`), "
                                f"got {role!r}")
        messages.append({"role": role, "content": _text(m.get("content"), f"messages.{i}.content")})
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        raise ApiError(400, "messages: send at least one user message with text")
    prefill = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
    if prefill != prefill.rstrip():
        raise ApiError(400, "messages: the final assistant content cannot end with whitespace")

    fields = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None}
    if req.stop_sequences:
        fields["stop"] = req.stop_sequences
    if req.max_tokens is not None:
        fields["max_tokens"] = req.max_tokens
    fields["seed"] = secrets.randbits(63)  # Anthropic's API has no seed: every request samples afresh
    try:
        profile = SamplingProfile.model_validate({**base.model_dump(), **fields})
    except ValidationError as e:
        err = profile_error(e)
        raise ApiError(400, err.message.replace("stop", "stop_sequences", 1) if err.param == "stop"
                       else err.message) from None
    return MessagesRequest(messages, prefill, profile, profile.max_tokens, bool(req.stream))


def usage(m: Metrics) -> dict[str, int]:
    return {"input_tokens": m.prompt_tokens - m.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": m.cached_tokens, "output_tokens": m.completion_tokens}


def stop_reason(result: GenerationResult, max_tokens: int | None) -> str:
    if result.finish_reason == "length":
        return "max_tokens" if result.metrics.completion_tokens == max_tokens else "model_context_window_exceeded"
    return "stop_sequence" if result.stop_sequence is not None else "end_turn"


def routes(service: Service) -> list[Route]:
    """The Messages routes over `service`, each answering errors in Anthropic's shape."""

    def encode(req: MessagesRequest) -> list[int]:
        ids = service.encode_chat(req.messages)
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
        choices = service.start(encode(req), [req.profile], req.max_tokens)
        rid = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return EventSourceResponse(events(request, req, rid, choices[0], started), sep="\n", ping=15)
        results = await service.collect(request, choices)
        if results is None:  # the client went away
            return Response(status_code=499)
        request.state.results = results
        r = results[0]
        return JSONResponse(message(rid, [{"type": "text", "text": r.text}], stop_reason(r, req.max_tokens),
                                    r.stop_sequence, r.metrics))

    def event(kind: str, data: dict[str, Any]) -> dict[str, str]:
        return {"event": kind, "data": json.dumps({"type": kind, **data})}

    async def events(request: HttpRequest, req: MessagesRequest, rid: str, choice: Choice,
                     started: float) -> AsyncIterator[dict]:
        results: list[GenerationResult] = []
        status, opened = 200, False
        try:
            while True:
                try:
                    got = await choice.next()
                except Exception as e:  # noqa: BLE001 - an in-stream error is the stream's last event
                    status = 500
                    yield event("error", error_body(ApiError(500, f"generation failed: {e}")))
                    return
                metrics = got.result.metrics if isinstance(got, Done) else getattr(got, "metrics", None)
                if not opened and metrics is not None:  # the usage is known once the prompt is in the cache
                    opened = True
                    yield event("message_start", {"message": message(rid, [], None, None, metrics)})
                    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    yield event("ping", {})
                if isinstance(got, TokenEvent) and got.text:
                    yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                              "text": got.text}})
                if isinstance(got, Done):
                    r = got.result
                    results.append(r)
                    yield event("content_block_stop", {"index": 0})
                    yield event("message_delta", {"delta": {"stop_reason": stop_reason(r, req.max_tokens),
                                                            "stop_sequence": r.stop_sequence},
                                                  "usage": usage(r.metrics)})
                    yield event("message_stop", {})
                    return
        finally:
            choice.request.cancel()
            service.log_line(request, status, started, results)

    async def count_tokens(request: HttpRequest) -> Response:
        req = parse(await service.read_json(request), served=service.name, base=service.base, counting=True)
        return JSONResponse({"input_tokens": len(encode(req))})

    def route(path: str, fn: Callable) -> Route:
        return Route(path, service.endpoint(fn, error_body), methods=["POST"])

    return [route("/v1/messages", messages), route("/v1/messages/count_tokens", count_tokens)]


__all__ = ["MessagesRequest", "error_body", "parse", "routes", "stop_reason", "usage"]
