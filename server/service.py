"""What every API's handlers share: the served model, the body reader, the API key, submitting a request's choices
to the `BatchScheduler` and collecting their results, and the endpoint wrapper that answers an `ApiError` in the
API's own error shape (OpenAI's, Ollama's or Anthropic's).

Each choice is a `BatchRequest` whose events the scheduler hands back with `loop.call_soon_threadsafe` onto an
`asyncio.Queue` (`Choice`); a client that goes away cancels its choices, which leave the batch at their next token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxchat.core import Engine, GenerationResult, SamplingProfile, TokenEvent
from mlxchat.core.batch import BatchRequest, BatchScheduler, QueueFull
from mlxchat.core.errors import ContextLengthError
from mlxchat.core.decode.events import Done
from mlxchat.core.decode.reasoning import Reasoning

from mlxchat.core.decode import tools as tool_calls
from mlxchat.core.decode.tools import Tool, ToolUse

from .protocol import ApiError

log = logging.getLogger("mlxchat.server")
POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
DEFAULT_PROFILE = "chat"  # what requests sample with when neither `mlxchat serve --profile` nor the request says
ErrorShape = Callable[[ApiError], dict[str, Any]]


@dataclass
class ServerConfig:
    """What `mlxchat serve` was started with (server/cli.py), read by the service and the routes (server/app.py)."""

    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    cors_origins: tuple[str, ...] = ()
    profile: SamplingProfile | None = None
    profiles: dict[str, SamplingProfile] | None = None
    speculative: str = "off"  # a request's `speculative` when it does not say (`mlxchat serve --speculative`)


class Choice:
    """One running choice: its scheduler request and the events that arrived for it.

    The inference thread appends to a deque and wakes the event loop only when no wake-up is pending, so a loop
    that falls behind (8 streams, a step's tokens all at once) takes many events per wake-up instead of one
    `call_soon_threadsafe` (a self-pipe write) per token. The choices of one request share `wake`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: list[int], profile: SamplingProfile,
                 max_tokens: int | None, trace: int, wake: asyncio.Event | None = None,
                 tools: ToolUse | None = None, reasoning: Reasoning = Reasoning(), speculative: str = "off") -> None:
        self._ready: deque = deque()
        self._pending = False  # a wake-up is scheduled on the loop and has not run yet
        self._loop = loop
        self.wake = wake or asyncio.Event()
        self.request = BatchRequest(prompt, profile, self._deliver, max_tokens=max_tokens, trace=trace, tools=tools,
                                    reasoning=reasoning, speculative=speculative)

    def _deliver(self, event: object) -> None:
        """Called on the inference thread: queue the event; wake the loop unless a wake-up is on its way."""
        self._ready.append(event)
        if self._pending:
            return
        self._pending = True
        try:
            self._loop.call_soon_threadsafe(self._signal)
        except RuntimeError:
            self.request.cancel()  # the loop has closed (the server is stopping): nobody is listening

    def _signal(self) -> None:
        self._pending = False  # before the set: an event appended from now on schedules its own wake-up
        self.wake.set()

    def take(self) -> list:
        """Every event that has arrived, in order (an engine failure arrives as an exception)."""
        events = []
        while self._ready:
            events.append(self._ready.popleft())
        return events

    async def next(self) -> TokenEvent | Done:
        while not self._ready:
            self.wake.clear()
            await self.wake.wait()
        event = self._ready.popleft()
        if isinstance(event, BaseException):
            raise event
        return event

    async def stream(self) -> AsyncIterator[TokenEvent | Done]:
        """The events a streamed reply sends, up to and including its Done; an engine failure is raised as
        `GenerationFailed`, which a stream sends as its last event."""
        while True:
            try:
                event = await self.next()
            except Exception as e:  # noqa: BLE001 - the engine's failure, in one type the streams catch
                raise GenerationFailed(f"generation failed: {e}") from e
            yield event
            if isinstance(event, Done):
                return


class GenerationFailed(Exception):
    """The engine failed while a reply streamed (its message is the one line the client gets)."""



class Service:
    """The model being served, as every API's handlers use it."""

    def __init__(self, engine: Engine, scheduler: BatchScheduler, config: "ServerConfig") -> None:
        self.engine, self.scheduler, self.config = engine, scheduler, config
        # Without --profile, the chat preset: the raw distribution (temperature 1, no filter) rambles.
        self.base = config.profile or SamplingProfile.preset(DEFAULT_PROFILE)
        self.profiles = dict(config.profiles or {})

    @property
    def name(self) -> str:
        return self.engine.name

    async def read_json(self, request: HttpRequest) -> Any:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
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

    def check_fits(self, ids: Sequence[int], field: str) -> None:
        """Refuse a prompt that leaves no room in the model's context for a reply."""
        if len(ids) >= self.engine.context_length:
            raise ApiError(400, f"the prompt is {len(ids)} tokens but the model's context is "
                                f"{self.engine.context_length}: shorten it", field)

    def encode_chat(self, messages: list[dict[str, Any]], field: str = "messages", tools: Sequence[Tool] = (),
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation through the model's chat template, ready for a reply; it must fit the context. `tools`
        are shown to the model, and tool messages rendered, as core/decode/tools.py says."""
        tok = self.engine.model.tokenizer
        rendered, shown = tool_calls.render_messages(messages, list(tools), tok.knows_tools)
        try:
            ids = tok.encode_chat(rendered, tools=shown, template_kwargs=template_kwargs)
        except ValueError as e:
            raise ApiError(400, str(e), field) from None
        self.check_fits(ids, field)
        return ids

    def encode_text(self, text: str, field: str = "prompt") -> list[int]:
        """Text as it is, no template (a raw prompt); it must fit the context."""
        try:
            ids = self.engine.model.tokenizer.encode(text)
        except ValueError as e:
            raise ApiError(400, str(e), field) from None
        self.check_fits(ids, field)
        return ids

    def start(self, ids: list[int], profiles: Sequence[SamplingProfile], max_tokens: int | None,
              trace: int = 0, tools: ToolUse | None = None, reasoning: Reasoning = Reasoning(),
              speculative: str | None = None) -> list[Choice]:
        """Submit one choice per profile (each may call `tools`, each speculates as `speculative` says, by default
        as the server's `--speculative` unless it has a reasoning budget, which speculation does not combine with
        yet); all or none run."""
        loop = asyncio.get_running_loop()
        choices: list[Choice] = []
        wake = asyncio.Event()  # one for the request: its stream waits on all its choices at once
        try:
            for profile in profiles:
                choice = Choice(loop, ids, profile, max_tokens, trace, wake, tools, reasoning,
                                speculative or ("off" if reasoning.budget is not None else self.config.speculative))
                self.scheduler.submit(choice.request)
                choices.append(choice)
        except QueueFull as e:
            for c in choices:
                c.request.cancel()
            raise ApiError(429, f"the server is busy ({e}); retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except ContextLengthError as e:
            raise ApiError(400, f"{e}: shorten the prompt") from None
        except ValueError as e:  # settings valid alone but not together (core.decode.reply.Request.make says which)
            for c in choices:
                c.request.cancel()
            raise ApiError(400, str(e)) from None
        return choices

    async def collect(self, request: HttpRequest, choices: list[Choice]) -> list[GenerationResult] | None:
        """Every choice's result, or None when the client went away (its choices are cancelled)."""
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
                except asyncio.CancelledError:
                    for c in choices:
                        c.request.cancel()
                    raise
                except Exception as e:  # noqa: BLE001 - the engine's failure, said in one line
                    for c in choices:
                        c.request.cancel()
                    raise ApiError(500, f"generation failed: {e}", kind="server_error") from None
                if isinstance(event, Done):
                    results.append(event.result)
                    break
        return results

    def check_auth(self, request: HttpRequest) -> None:
        """The key as OpenAI's clients send it (`Authorization: Bearer`) or as Anthropic's do (`x-api-key`)."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>')", kind="authentication_error")

    def log_line(self, request: HttpRequest, status: int, started: float, results: list[GenerationResult]) -> None:
        took = (time.perf_counter() - started) * 1000
        if not results:
            log.info("%s %s %d %.0f ms", request.method, request.url.path, status, took)
            return
        m = results[0].metrics
        out = sum(r.metrics.completion_tokens for r in results)
        log.info("%s %s %d %.0f ms · prompt %d tok (%d cached) · TTFT %.0f ms · %d tok out · decode %.1f tok/s · %s",
                 request.method, request.url.path, status, took, m.prompt_tokens, m.cached_tokens, m.ttft_s * 1000,
                 out, m.decode_tokens_per_s, ",".join(r.finish_reason for r in results))

    def endpoint(self, fn: Callable[[HttpRequest], Awaitable[Response]], shape: ErrorShape, *,
                 auth: bool = True) -> Callable[[HttpRequest], Awaitable[Response]]:
        """A route's handler: the key checked, an `ApiError` answered in `shape`, the request logged (a stream
        logs itself when it ends)."""
        async def handle(request: HttpRequest) -> Response:
            started = time.perf_counter()
            try:
                if auth:
                    self.check_auth(request)
                response = await fn(request)
            except ApiError as e:
                self.log_line(request, e.status, started, [])
                return JSONResponse(shape(e), e.status, headers=e.headers)
            if not isinstance(response, (EventSourceResponse, StreamingResponse)):
                self.log_line(request, response.status_code, started, getattr(request.state, "results", []))
            return response
        return handle


__all__ = ["Choice", "ErrorShape", "GenerationFailed", "Service"]
