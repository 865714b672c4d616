"""The ASGI app: OpenAI's endpoints over a `BatchScheduler`, SSE streaming, API key, body limit, CORS; Ollama's
(server/ollama.py) and Anthropic's (server/anthropic.py) on the same model.

Handlers run on the event loop; generation runs on the engine's inference thread (server/service.py: the request
path all three APIs share). A client that goes away (sse-starlette cancels the stream; a plain request is polled)
cancels its requests, which leave the batch at their next token.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxchat.core import Engine, GenerationResult, TokenEvent
from mlxchat.core.batch import BatchScheduler
from mlxchat.core.decode.events import Done
from mlxchat.core.decode.tools import ToolCall, render_messages

from . import anthropic, ollama, protocol
from .protocol import ApiError
from .service import Choice, ErrorShape, ServerConfig, Service

log = logging.getLogger("mlxchat.server")


def _sse(bodies: list[Any]) -> bytes:
    """Server-sent events in one write (what sse-starlette would send for each, one after another)."""
    return b"".join(b"data: " + (b if isinstance(b, bytes) else json.dumps(b).encode()) + b"\n\n" for b in bodies)


def create_app(engine: Engine, scheduler: BatchScheduler, config: ServerConfig) -> Starlette:
    service = Service(engine, scheduler, config)
    base, profiles, name = service.base, service.profiles, service.name
    read_json, collect, log_line = service.read_json, service.collect, service.log_line
    token_text = lambda i: engine.model.tokenizer.decode([i])  # noqa: E731 - the token as text, for logprobs

    def encode(req: protocol.Request) -> list[int]:
        tok = engine.model.tokenizer
        try:
            if req.chat:
                messages, tools = render_messages(req.messages, req.tools.shown if req.tools else [], tok.knows_tools)
                ids = tok.encode_chat(messages, tools=tools, template_kwargs=req.template_kwargs)
            else:
                ids = list(req.prompt) if isinstance(req.prompt, list) else tok.encode(req.prompt)
        except ValueError as e:
            raise ApiError(400, str(e), "messages" if req.chat else "prompt") from None
        bad = [t for t in (ids if isinstance(req.prompt, list) else ()) if not 0 <= t < engine.model.vocab_size]
        bad += [t for t in req.profile.logit_bias if t >= engine.model.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{engine.model.vocab_size - 1})",
                           "prompt" if not req.profile.logit_bias or bad[0] not in req.profile.logit_bias
                           else "logit_bias")
        service.check_fits(ids, "messages" if req.chat else "prompt")
        return ids

    def start(req: protocol.Request, ids: list[int]) -> list[Choice]:
        profiles = [req.profile.model_copy(update={"seed": (req.seed + i) % 2**64}) for i in range(req.n)]
        return service.start(ids, profiles, req.max_tokens, req.trace, req.tools, req.reasoning, req.speculative)

    def endpoint(fn: Callable[[HttpRequest], Awaitable[Response]], *, auth: bool = True):  # noqa: ANN202
        return service.endpoint(fn, ApiError.body, auth=auth)

    async def completions(request: HttpRequest, chat: bool) -> Response:
        started = time.perf_counter()
        req = protocol.parse(await read_json(request), chat=chat, served=name, base=base, profiles=profiles)
        ids = encode(req)
        choices = start(req, ids)
        rid = protocol.new_id(chat)
        if req.stream:
            return EventSourceResponse(stream(request, req, rid, choices, started), sep="\n", ping=15)
        results = await collect(request, choices)
        if results is None:  # the client went away
            return Response(status_code=499)
        request.state.results = results
        body = protocol.envelope(rid, chat, name, chunk=False)
        body["choices"] = [answer(req, i, r) for i, r in enumerate(results)]
        body["usage"] = protocol.usage(results)
        body["seed"] = req.seed
        body["timings"] = protocol.timings(results[0].metrics)
        return JSONResponse(body)

    def answer(req: protocol.Request, index: int, r: GenerationResult) -> dict[str, Any]:
        # A reply with tools is text or calls (core/decode/tools.py): with calls, the content is null, as OpenAI's.
        calls = r.tool_calls
        out: dict[str, Any] = {"index": index, "finish_reason": protocol.finish_reason(r, bool(calls)),
                               "logprobs": None}
        if req.trace:
            out["traces"] = [t.as_dict() for t in r.traces]  # one per generated token, in order
        if req.chat:
            out["message"] = {"role": "assistant", "content": (r.text or None) if calls else r.text}
            if r.reasoning:  # a thinking model's reasoning, apart (llama.cpp's and vLLM's field)
                out["message"]["reasoning_content"] = r.reasoning
            if calls:
                out["message"]["tool_calls"] = [c.as_openai() for c in calls]
            if req.profile.logprobs:
                out["logprobs"] = protocol.chat_logprobs(r.logprobs, token_text)
        else:
            out["text"] = r.text
            if req.profile.logprobs:
                out["logprobs"] = protocol.completion_logprobs(r.logprobs, token_text)
        return out

    async def stream(request: HttpRequest, req: protocol.Request, rid: str, choices: list[Choice],
                     started: float) -> AsyncIterator[bytes]:
        results: list[GenerationResult | None] = [None] * len(choices)
        offsets = [0] * len(choices)
        calls = [0] * len(choices)  # each choice's calls sent so far (a streamed call's index)
        status = 200
        wake = choices[0].wake
        try:
            if req.chat:
                yield _sse([chunk(req, rid, i, {"role": "assistant", "content": ""}) for i in range(len(choices))])
            # Choices run together in the batch: whatever arrived for any of them goes out in one write.
            while None in results:
                wake.clear()  # before taking: an event that arrives after the take wakes the wait below
                bodies: list[Any] = []
                for i, c in enumerate(choices):
                    for event in c.take():
                        if isinstance(event, BaseException):  # in-stream errors are sent as an error event
                            status = 500
                            bodies.append(ApiError(500, f"generation failed: {event}", kind="server_error").body())
                            yield _sse(bodies)
                            return
                        if isinstance(event, Done):
                            results[i] = event.result
                            final = chunk(req, rid, i, {} if req.chat else "",
                                          protocol.finish_reason(event.result, bool(event.result.tool_calls)))
                            final["seed"] = c.request.profile.seed
                            final["timings"] = protocol.timings(event.result.metrics)
                            bodies.append(final)
                        # A split model's scheduler passes on prefill progress too: nothing to stream for it.
                        elif isinstance(event, TokenEvent):
                            if event.text or event.reasoning or event.logprobs or event.traces:
                                bodies.append(delta(req, rid, i, event, offsets))
                            for call in event.tool_calls:  # each call whole, once its closing tag arrived
                                bodies.append(tool_delta(req, rid, i, call, calls[i]))
                                calls[i] += 1
                if bodies:
                    yield _sse(bodies)
                elif None in results:
                    await wake.wait()
            tail: list[Any] = []
            if req.include_usage:
                body = protocol.envelope(rid, req.chat, name, chunk=True)
                body["choices"] = []
                body["usage"] = protocol.usage([r for r in results if r is not None])
                tail.append(body)
            yield _sse([*tail, b"[DONE]"])
        finally:
            for c in choices:
                c.request.cancel()
            log_line(request, status, started, [r for r in results if r is not None])

    def chunk(req: protocol.Request, rid: str, index: int, content: Any,
              finish: str | None = None) -> dict[str, Any]:
        body = protocol.envelope(rid, req.chat, name, chunk=True)
        piece: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if req.chat:
            piece["delta"] = content
        else:
            piece["text"] = content
        body["choices"] = [piece]
        return body

    def delta(req: protocol.Request, rid: str, index: int, event: TokenEvent, offsets: list[int]) -> dict[str, Any]:
        content: dict[str, Any] = {"content": event.text} if event.text or not event.reasoning else {}
        if event.reasoning:
            content["reasoning_content"] = event.reasoning
        body = chunk(req, rid, index, content if req.chat else event.text)
        if req.profile.logprobs and event.logprobs:
            body["choices"][0]["logprobs"] = (
                protocol.chat_logprobs(event.logprobs, token_text) if req.chat
                else protocol.completion_logprobs(event.logprobs, token_text, offsets[index]))
        if req.trace and event.trace:
            body["choices"][0]["trace"] = event.trace.as_dict()  # the server emits one token per event
        offsets[index] += len(event.text)
        return body

    def tool_delta(req: protocol.Request, rid: str, index: int, call: ToolCall, number: int) -> dict[str, Any]:
        """One whole call of choice `index`, its `number`-th (OpenAI's `delta.tool_calls`)."""
        return chunk(req, rid, index, {"tool_calls": [{"index": number, **call.as_openai()}]})

    async def chat_completions(request: HttpRequest) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: HttpRequest) -> Response:
        return await completions(request, chat=False)

    def model_card() -> dict[str, Any]:
        # The id is the name requests use; where the weights lie on this machine is no client's business.
        return {"id": name, "object": "model", "created": 0, "owned_by": "mlxchat",
                "context_length": engine.context_length}

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: HttpRequest) -> Response:
        protocol.check_model(request.path_params["model_id"], name)
        return JSONResponse(model_card())

    async def health(request: HttpRequest) -> Response:
        running, waiting = scheduler.load
        return JSONResponse({"status": "ok", "model": name, "running": running, "waiting": waiting,
                             "memory": scheduler.memory()})

    async def http_error(request: HttpRequest, exc: HTTPException) -> Response:
        log.info("%s %s %d", request.method, request.url.path, exc.status_code)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        err = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                       kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(error_shape(request.url.path)(err), exc.status_code)

    async def server_error(request: HttpRequest, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        err = ApiError(500, "internal server error", kind="server_error")
        return JSONResponse(error_shape(request.url.path)(err), 500)

    def error_shape(path: str) -> ErrorShape:
        """An error outside a route's handler answers in the shape of the API its path belongs to."""
        if path.startswith("/v1/messages"):
            return anthropic.error_body
        return ollama.error_body if path.startswith("/api/") else ApiError.body

    middleware = []
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type", "x-api-key"]))
    routes = [
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(text_completions), methods=["POST"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(model), methods=["GET"]),
        # Liveness probes carry no key: /health says only that the server is up and how busy it is.
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        *ollama.routes(service),
        *anthropic.routes(service),
    ]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
