"""The ASGI app: OpenAI's endpoints over a `BatchScheduler`, SSE streaming, API key, body limit, CORS.

Handlers run on the event loop; generation runs on the engine's inference thread. Each choice is a `BatchRequest`
whose events the scheduler hands back with `loop.call_soon_threadsafe` onto an `asyncio.Queue`. A client that goes
away (sse-starlette cancels the stream; a plain request is polled) cancels its requests, which leave the batch at
their next token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxchat.core import Engine, GenerationResult, SamplingProfile, TokenEvent
from mlxchat.core.batch import BatchRequest, BatchScheduler, QueueFull
from mlxchat.core.errors import ContextLengthError
from mlxchat.core.events import Done

from . import protocol
from . import tools as tool_calls
from .protocol import ApiError

log = logging.getLogger("mlxchat.server")
POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    cors_origins: tuple[str, ...] = ()
    profile: SamplingProfile | None = None
    profiles: dict[str, SamplingProfile] | None = None


class _Choice:
    """One running choice: its scheduler request and the queue its events arrive on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: list[int], profile: SamplingProfile,
                 max_tokens: int | None, trace: int) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self.request = BatchRequest(prompt, profile, self._deliver, max_tokens=max_tokens, trace=trace)

    def _deliver(self, event: object) -> None:
        """Called on the inference thread: hand the event to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.request.cancel()  # the loop has closed (the server is stopping): nobody is listening

    async def next(self) -> TokenEvent | Done:
        event = await self.events.get()
        if isinstance(event, BaseException):
            raise event
        return event


def create_app(engine: Engine, scheduler: BatchScheduler, config: ServerConfig) -> Starlette:
    base = config.profile or SamplingProfile()
    profiles = dict(config.profiles or {})
    name = engine.name
    token_text = lambda i: engine.model.tokenizer.decode([i])  # noqa: E731 - the token as text, for logprobs

    async def read_json(request: HttpRequest) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > config.max_body_bytes:
                raise ApiError(413, f"the request body is over {config.max_body_bytes} bytes")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the request body is not valid UTF-8 (byte {body[e.start]:#04x} at offset "
                                f"{e.start})") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column "
                                f"{e.colno}") from None

    def encode(req: protocol.Request) -> list[int]:
        tok = engine.model.tokenizer
        try:
            if req.chat:
                messages, tools = tool_calls.render_messages(req.messages, req.tools or [], tok.knows_tools)
                ids = tok.encode_chat(messages, tools=tools)
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
        if len(ids) >= engine.context_length:
            raise ApiError(400, f"the prompt is {len(ids)} tokens but the model's context is {engine.context_length}: "
                                "shorten it", "messages" if req.chat else "prompt")
        return ids

    def start(req: protocol.Request, ids: list[int]) -> list[_Choice]:
        loop = asyncio.get_running_loop()
        choices = []
        try:
            for i in range(req.n):
                profile = req.profile.model_copy(update={"seed": (req.seed + i) % 2**64})
                choice = _Choice(loop, ids, profile, req.max_tokens, req.trace)
                scheduler.submit(choice.request)
                choices.append(choice)
        except QueueFull as e:
            for c in choices:
                c.request.cancel()
            raise ApiError(429, f"the server is busy ({e}); retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except ContextLengthError as e:
            raise ApiError(400, f"{e}: shorten the prompt") from None
        except ValueError as e:  # settings valid alone but not together (core.reply.Request.make says which)
            for c in choices:
                c.request.cancel()
            raise ApiError(400, str(e)) from None
        return choices

    def log_line(request: HttpRequest, status: int, started: float, results: list[GenerationResult]) -> None:
        took = (time.perf_counter() - started) * 1000
        if not results:
            log.info("%s %s %d %.0f ms", request.method, request.url.path, status, took)
            return
        m = results[0].metrics
        out = sum(r.metrics.completion_tokens for r in results)
        log.info("%s %s %d %.0f ms · prompt %d tok (%d cached) · TTFT %.0f ms · %d tok out · decode %.1f tok/s · %s",
                 request.method, request.url.path, status, took, m.prompt_tokens, m.cached_tokens, m.ttft_s * 1000,
                 out, m.decode_tokens_per_s, ",".join(r.finish_reason for r in results))

    def check_auth(request: HttpRequest) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           kind="authentication_error")

    def endpoint(fn: Callable[[HttpRequest], Awaitable[Response]], *, auth: bool = True):  # noqa: ANN202
        async def handle(request: HttpRequest) -> Response:
            started = time.perf_counter()
            try:
                if auth:
                    check_auth(request)
                response = await fn(request)
            except ApiError as e:
                log_line(request, e.status, started, [])
                return JSONResponse(e.body(), e.status, headers=e.headers)
            if not isinstance(response, EventSourceResponse):
                log_line(request, response.status_code, started, getattr(request.state, "results", []))
            return response
        return handle

    async def completions(request: HttpRequest, chat: bool) -> Response:
        started = time.perf_counter()
        req = protocol.parse(await read_json(request), chat=chat, served=name, base=base, profiles=profiles)
        ids = encode(req)
        choices = start(req, ids)
        rid = protocol.new_id(chat)
        if req.stream:
            return EventSourceResponse(stream(request, req, rid, choices, started), sep="\n", ping=15)
        try:
            results = await collect(request, choices)
        except asyncio.CancelledError:
            for c in choices:
                c.request.cancel()
            raise
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
        content, calls = tool_calls.parse_calls(r.text) if req.tools and r.finish_reason == "stop" else (r.text, [])
        out: dict[str, Any] = {"index": index, "finish_reason": protocol.finish_reason(r, bool(calls)),
                               "logprobs": None}
        if req.trace:
            out["traces"] = [t.as_dict() for t in r.traces]  # one per generated token, in order
        if req.chat:
            out["message"] = {"role": "assistant", "content": content}
            if calls:
                out["message"]["tool_calls"] = [c.as_openai() for c in calls]
            if req.profile.logprobs:
                out["logprobs"] = protocol.chat_logprobs(r.logprobs, token_text)
        else:
            out["text"] = r.text
            if req.profile.logprobs:
                out["logprobs"] = protocol.completion_logprobs(r.logprobs, token_text)
        return out

    async def collect(request: HttpRequest, choices: list[_Choice]) -> list[GenerationResult] | None:
        results = []
        for choice in choices:
            while True:
                try:
                    event = await asyncio.wait_for(choice.next(), POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        for c in choices:
                            c.request.cancel()
                        return None
                    continue
                except Exception as e:  # noqa: BLE001 - the engine's failure, said in one line
                    for c in choices:
                        c.request.cancel()
                    raise ApiError(500, f"generation failed: {e}", kind="server_error") from None
                if isinstance(event, Done):
                    results.append(event.result)
                    break
        return results

    async def stream(request: HttpRequest, req: protocol.Request, rid: str, choices: list[_Choice],
                     started: float) -> AsyncIterator[str]:
        results: list[GenerationResult | None] = [None] * len(choices)
        offsets = [0] * len(choices)
        # With tools, each choice's text goes through a CallStream: content passes, calls go out whole.
        calls = [tool_calls.CallStream() for _ in choices] if req.tools else None
        status = 200
        waiting: dict[asyncio.Future, int] = {}
        try:
            if req.chat:
                for i in range(len(choices)):
                    yield json.dumps(chunk(req, rid, i, {"role": "assistant", "content": ""}))
            # Choices run together in the batch: interleave their events as they come.
            waiting.update({asyncio.ensure_future(c.next()): i for i, c in enumerate(choices)})
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = waiting.pop(task)
                    try:
                        event = task.result()
                    except Exception as e:  # noqa: BLE001 - in-stream errors are sent as an error event
                        status = 500
                        yield json.dumps(ApiError(500, f"generation failed: {e}", kind="server_error").body())
                        return
                    if isinstance(event, Done):
                        results[i] = event.result
                        for rest in calls[i].finish() if calls else ():
                            yield json.dumps(chunk(req, rid, i, {"content": rest}))
                        called = bool(calls and calls[i].calls)
                        final = chunk(req, rid, i, {} if req.chat else "", protocol.finish_reason(event.result, called))
                        final["seed"] = choices[i].request.profile.seed
                        final["timings"] = protocol.timings(event.result.metrics)
                        yield json.dumps(final)
                        continue
                    # A split model's scheduler passes on prefill progress too: nothing to stream for it.
                    if calls and isinstance(event, TokenEvent):
                        for piece in calls[i].feed(event.text):
                            yield json.dumps(tool_delta(req, rid, i, piece, calls[i]))
                    elif isinstance(event, TokenEvent) and (event.text or event.logprobs or event.traces):
                        yield json.dumps(delta(req, rid, i, event, offsets))
                    waiting[asyncio.ensure_future(choices[i].next())] = i
            if req.include_usage:
                body = protocol.envelope(rid, req.chat, name, chunk=True)
                body["choices"] = []
                body["usage"] = protocol.usage([r for r in results if r is not None])
                yield json.dumps(body)
            yield "[DONE]"
        finally:
            for c in choices:
                c.request.cancel()
            for task in waiting:
                task.cancel()
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
        body = chunk(req, rid, index, {"content": event.text} if req.chat else event.text)
        if req.profile.logprobs and event.logprobs:
            body["choices"][0]["logprobs"] = (
                protocol.chat_logprobs(event.logprobs, token_text) if req.chat
                else protocol.completion_logprobs(event.logprobs, token_text, offsets[index]))
        if req.trace and event.trace:
            body["choices"][0]["trace"] = event.trace.as_dict()  # the server emits one token per event
        offsets[index] += len(event.text)
        return body

    def tool_delta(req: protocol.Request, rid: str, index: int, piece: str | tool_calls.ToolCall,
                   stream: tool_calls.CallStream) -> dict[str, Any]:
        """A streamed piece of a reply with tools: content, or one whole call (OpenAI's `delta.tool_calls`)."""
        if isinstance(piece, str):
            return chunk(req, rid, index, {"content": piece})
        return chunk(req, rid, index, {"tool_calls": [{"index": stream.calls.index(piece), **piece.as_openai()}]})

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
        return JSONResponse({"status": "ok", "model": name, "running": running, "waiting": waiting})

    async def http_error(request: HttpRequest, exc: HTTPException) -> Response:
        log.info("%s %s %d", request.method, request.url.path, exc.status_code)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        err = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                       kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(err.body(), exc.status_code)

    async def server_error(request: HttpRequest, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), 500)

    middleware = []
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    routes = [
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(text_completions), methods=["POST"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(model), methods=["GET"]),
        # Liveness probes carry no key: /health says only that the server is up and how busy it is.
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
