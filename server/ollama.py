"""Ollama's API on the same server, for the clients written against it (oterm, the `ollama` Python client, ...):
GET /api/tags and /api/version, POST /api/show, /api/chat and /api/generate.

Replies stream as NDJSON (one JSON object a line, the last with `done: true`, `done_reason` and the durations in
nanoseconds) unless the request says `"stream": false`. Errors are Ollama's shape, `{"error": "..."}`, with the
HTTP status; an error after the stream started is its last line.

`options` map onto the server's profile given with `--profile` (a field not given keeps the profile's value), and
without one onto Ollama's own defaults (`OLLAMA_DEFAULTS`: temperature 0.8, top_k 40, top_p 0.9), which Ollama's
clients expect:
temperature, top_p, top_k, min_p, typical_p, repeat_penalty (`repetition_penalty`), repeat_last_n (the penalty
window: 0 turns the penalties off, -1 means all tokens), presence/frequency_penalty, seed (negative: a random one),
num_predict (-1 or -2: until the context is full), num_ctx (prompt and reply together stay within it), stop,
mirostat, mirostat_tau, mirostat_eta, and llama.cpp's other samplers under llama.cpp's names (dry_*, top_n_sigma,
dynatemp_*, adaptive_p_*). The options that say how Ollama runs a model (num_gpu, num_thread, use_mmap, ...) have no
meaning here and are ignored; tfs_z is refused unless neutral. `keep_alive` is accepted: the model stays loaded while
the server runs.
`format` ("json" or a JSON schema) becomes the profile's `response_format` (OpenAI's shape; constrained decoding,
core/sampling/constraint.py), so the reply is valid JSON when it ends with "stop".

`/api/chat`'s `tools` are OpenAI's function tools, chosen as OpenAI's tool_choice "auto" (Ollama has no choice):
core/decode/tools.py constrains a call once the model starts one, and the calls come back as `message.tool_calls`
(`[{"function": {"name", "arguments": {...}}}]`; streamed, each call a line of its own). History's assistant
`tool_calls` and `role: "tool"` results (`tool_name` says whose) go through the chat template.

`think` (core/decode/reasoning.py): a thinking model's reasoning comes back apart, as `message.thinking` (/api/chat) or
`thinking` (/api/generate), a line of its own while it streams; `think: false` turns a template's switch off, and a
level ("low", "medium", "high") is a budget of reasoning tokens. History's `thinking` goes to the template as the
reply's `reasoning_content`. A raw /api/generate prompt's reply is the model's text as written.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxchat.core import GenerationResult, SamplingProfile, TokenEvent
from mlxchat.core.decode.events import Done
from mlxchat.core.decode.reasoning import EFFORT_BUDGETS, Reasoning, markers_for
from mlxchat.core.decode import tools as tool_calls
from mlxchat.core.decode.reply import DEFAULT_MAX_TOKENS
from mlxchat.core.sampling.sampler_params import PARAMS, SamplerParam
from mlxchat.core.decode.tools import ToolCall, ToolError, ToolUse

from .protocol import ApiError, profile_error, sampler_settings, sampler_types
from .service import Choice, GenerationFailed, Service

# Options that tell Ollama how to run a model (threads, GPU layers, memory mapping, batch size): no meaning here.
IGNORED_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                             "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
                             "penalize_newline"})
# Samplers this server does not have, accepted only with the value that turns them off.
NEUTRAL_OPTIONS = {"tfs_z": 1.0}
# The sampler parameters among Ollama's options, by their Ollama names (Ollama's own, llama.cpp's other samplers
# under llama.cpp's names); repeat_last_n is the penalties' window with Ollama's values, so `parse_options` maps it.
SAMPLER_OPTIONS: dict[str, SamplerParam] = {p.ollama: p for p in PARAMS.values() if p.ollama is not None}
# What Ollama samples with when a request sets nothing: used on /api/* unless `mlxchat serve --profile` names one.
OLLAMA_DEFAULTS = SamplingProfile(name="ollama", temperature=0.8, top_k=40, top_p=0.9)


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": e.message}


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's `format` as OpenAI's `response_format`: "json" is any JSON object, a dict is a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise ApiError(400, f"format must be \"json\" or a JSON schema object, got {fmt!r}", "format")


class _Options(sampler_types("_OllamaSamplers", SAMPLER_OPTIONS)):
    model_config = ConfigDict(strict=True, extra="allow")

    repeat_last_n: int | None = None
    seed: int | None = None
    num_predict: int | None = None
    num_ctx: int | None = None
    stop: str | list[str] | None = None


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    stream: bool | None = None
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: str | int | float | None = None  # the model stays loaded while the server runs
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class _Chat(_Common):
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class _Generate(_Common):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    template: str | None = None
    suffix: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class OptionSettings:
    """A request's sampling settings: the profile, and the limits that need the prompt's length."""

    def __init__(self, profile: SamplingProfile, num_predict: int | None, num_ctx: int | None) -> None:
        self.profile, self.num_predict, self.num_ctx = profile, num_predict, num_ctx

    def max_tokens(self, prompt_tokens: int, context: int) -> int:
        window = min(self.num_ctx or context, context)
        if prompt_tokens >= window:
            raise ApiError(400, f"the prompt is {prompt_tokens} tokens but num_ctx is {window}: shorten the prompt "
                                "or raise num_ctx")
        room = window - prompt_tokens
        if self.num_predict is not None and self.num_predict < 0:  # -1 and -2: until the context is full
            return room
        return min(self.num_predict or self.profile.max_tokens or DEFAULT_MAX_TOKENS, room)


def parse_options(raw: dict[str, Any] | None, base: SamplingProfile) -> OptionSettings:
    """Ollama's `options` over the server's profile `base`; a bad option is an `ApiError` naming it."""
    raw = raw or {}
    try:
        opts = _Options.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        raise ApiError(400, f"options.{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    for name, value in (opts.model_extra or {}).items():
        if name in NEUTRAL_OPTIONS and value != NEUTRAL_OPTIONS[name]:
            raise ApiError(400, f"options.{name} is not supported by this server; remove it or set it to "
                                f"{NEUTRAL_OPTIONS[name]}")
        if name not in NEUTRAL_OPTIONS and name not in IGNORED_OPTIONS:
            raise ApiError(400, f"options.{name} is not a known option")
    fields = sampler_settings(opts, SAMPLER_OPTIONS)
    if opts.repeat_last_n is not None:
        if opts.repeat_last_n < -1:
            raise ApiError(400, f"options.repeat_last_n must be -1 (all tokens), 0 (off) or more, got "
                                f"{opts.repeat_last_n}")
        if opts.repeat_last_n == 0:  # Ollama's "disabled": no token is penalised
            fields.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        else:
            fields["penalty_window"] = max(opts.repeat_last_n, 0)  # -1: the whole context, the profile's 0
    if opts.stop is not None:
        fields["stop"] = [opts.stop] if isinstance(opts.stop, str) else opts.stop
    fields["seed"] = opts.seed if opts.seed is not None and opts.seed >= 0 else secrets.randbits(63)
    if opts.num_predict is not None and (opts.num_predict == 0 or opts.num_predict < -2):
        raise ApiError(400, f"options.num_predict must be at least 1, or -1 (until the context is full), got "
                            f"{opts.num_predict}")
    if opts.num_ctx is not None and opts.num_ctx < 1:
        raise ApiError(400, f"options.num_ctx must be at least 1, got {opts.num_ctx}")
    try:
        profile = SamplingProfile.model_validate({**base.model_dump(), **fields})
    except ValidationError as e:
        err = profile_error(e)
        if err.param in PARAMS and (ollama := PARAMS[err.param].ollama):  # the option's name, as the client sent it
            err.message = err.message.replace(err.param, ollama)
        raise ApiError(400, f"options.{err.message}") from None
    return OptionSettings(profile, opts.num_predict, opts.num_ctx)


def with_format(settings: OptionSettings, fmt: str | dict[str, Any] | None) -> OptionSettings:
    """The settings with Ollama's `format` as the profile's response format (a bad schema is a 400 naming format)."""
    wanted = response_format(fmt)
    if wanted is None:
        return settings
    try:
        profile = SamplingProfile.model_validate({**settings.profile.model_dump(), "response_format": wanted})
    except ValidationError as e:
        message = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"format: {message}", "format") from None
    return OptionSettings(profile, settings.num_predict, settings.num_ctx)


def _refuse(req: _Common, **fields: Any) -> None:
    """Fields of Ollama's API this server does not implement: a 400 that names the field unless it is neutral."""
    if req.logprobs or req.top_logprobs:
        raise ApiError(400, "logprobs are not supported on /api routes; use /v1/chat/completions for them")
    for name, value in fields.items():
        if value:
            raise ApiError(400, f"{name} is not supported by this server; leave it out")


def _think(think: bool | str | None) -> Reasoning:
    """Ollama's `think`: false turns a template's thinking off, true (or absent) leaves it on; the reasoning comes
    back apart as `thinking` either way. A level ("low", "medium", "high") is a budget (core/decode/reasoning.py)."""
    if isinstance(think, str):
        if think not in EFFORT_BUDGETS:
            raise ApiError(400, f"think must be true, false or one of {', '.join(EFFORT_BUDGETS)}, got {think!r}")
        return Reasoning(True, EFFORT_BUDGETS[think])
    return Reasoning(think)


def thought(part: dict[str, Any], thinking: str) -> None:
    """Add a reply's thinking to its line: `message.thinking` (/api/chat) or `thinking` (/api/generate)."""
    if thinking:
        (part["message"] if "message" in part else part)["thinking"] = thinking


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content", "")
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be system, user, assistant or tool, got {role!r}")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string")
        if m.get("images"):
            raise ApiError(400, f"messages[{i}].images: images are not supported; send text only")
        # A reply's thinking goes to the template (which keeps or strips it); tool_call_id is what newer clients
        # send with a tool's result.
        extra = set(m) - {"role", "content", "images", "tool_calls", "thinking", "tool_name", "tool_call_id"}
        if extra:
            raise ApiError(400, f"messages[{i}] has an unknown field: {sorted(extra)[0]}")
        if role == "tool":
            out.append(tool_calls.result_message(m.get("tool_call_id") or "", content, m.get("tool_name")))
        elif m.get("tool_calls") and role == "assistant":
            out.append({"role": role, "content": content, "tool_calls": _calls(m["tool_calls"], i)})
        elif m.get("tool_calls"):
            raise ApiError(400, f"messages[{i}].tool_calls: only an assistant message makes tool calls")
        else:
            out.append({"role": role, "content": content})
        if role == "assistant" and isinstance(m.get("thinking"), str) and m["thinking"]:
            out[-1]["reasoning_content"] = m["thinking"]
    if not any(m["content"].strip() or m.get("tool_calls") for m in out if m["role"] != "system"):
        raise ApiError(400, "messages have no user content: send a non-empty user message")
    return out


def _calls(raw: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (`[{"function": {"name", "arguments": {...}}}]`) for the template."""
    calls = []
    for j, c in enumerate(raw if isinstance(raw, list) else [None]):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", {}), dict):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] must be "
                                '{"function": {"name": ..., "arguments": {...}}}')
        calls.append(tool_calls.call_entry(c.get("id", ""), fn["name"], fn.get("arguments", {})))
    return calls


def _tools(raw: list[dict[str, Any]] | None, settings: OptionSettings) -> ToolUse | None:
    """The request's tools, chosen "auto" (None without tools); they constrain a call, so not with `format`."""
    try:
        use = ToolUse.make(raw, "auto") if raw else None
    except ToolError as e:
        raise ApiError(400, str(e)) from None
    if use is not None and settings.profile.response_format is not None:
        raise ApiError(400, "format and tools both constrain the reply: use one")
    return use


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": call.input()}}


def _parameters(profile: SamplingProfile) -> str:
    """The server's profile as Ollama's `parameters` text: one option a line, under Ollama's names."""
    names = {**{p.name: option for option, p in SAMPLER_OPTIONS.items()}, "penalty_window": "repeat_last_n",
             "seed": "seed", "max_tokens": "num_predict", "stop": "stop"}
    lines = []
    for field, value in profile.model_dump(exclude_defaults=True).items():
        if field in names:
            lines += [f"{names[field]:<30} {json.dumps(v) if isinstance(v, str) else v}"
                      for v in (value if isinstance(value, list) else [value])]
    return "\n".join(lines)


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def parameter_size(n: int) -> str:
    """A parameter count as Ollama's clients show it, to three significant digits: "135M", "1.1B", "7.62B"."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def routes(service: Service) -> list[Route]:
    """The /api routes over `service`, each answering errors in Ollama's shape."""
    names = {service.name, f"{service.name}:latest"}  # Ollama's clients add the default tag

    def check_model(wanted: str | None) -> str:
        if not wanted:
            raise ApiError(400, "model is required")
        if wanted not in names:
            raise ApiError(404, f"model '{wanted}' not found; this server serves '{service.name}'")
        return wanted

    async def body_of(request: HttpRequest, kind: type[BaseModel]) -> Any:
        body = await service.read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return kind.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = "unknown field: remove it" if first["type"] == "extra_forbidden" else first["msg"]
            raise ApiError(400, f"{where}: {msg}") from None

    def base() -> SamplingProfile:
        return service.base if service.config.profile is not None else OLLAMA_DEFAULTS

    def details() -> dict[str, Any]:
        model = service.engine.model
        family = model.architecture or getattr(model.model, "model_type", "") or ""
        # Ollama's level is the file's kind ("Q4_K_M").
        level = model.quantization_kind or ("quantized" if model.quantized else "unquantized")
        return {"parent_model": "", "format": "gguf" if model.source.endswith(".gguf") else "mlx",
                "family": family, "families": [family] if family else None,
                "parameter_size": parameter_size(service.engine.parameter_count()),
                "quantization_level": level}

    def modified_at() -> str:
        source = Path(service.engine.model.source)
        stamp = source.stat().st_mtime if source.exists() else time.time()
        return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")

    async def tags(request: HttpRequest) -> Response:
        # `digest` identifies the model to a client; it is not the weights' hash (hashing gigabytes per call is not
        # worth it), but changes when another model is served.
        digest = hashlib.sha256(f"{service.engine.model.source}:{service.engine.model.weight_bytes}".encode())
        card = {"name": service.name, "model": service.name, "modified_at": modified_at(),
                "size": service.engine.model.weight_bytes, "digest": digest.hexdigest(), "details": details()}
        return JSONResponse({"models": [card]})

    async def api_version(request: HttpRequest) -> Response:
        return JSONResponse({"version": version("mlxchat")})

    async def show(request: HttpRequest) -> Response:
        body = await service.read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        check_model(body.get("model") or body.get("name"))  # older clients send "name"
        family = details()["family"] or "general"
        return JSONResponse({
            "modelfile": f"# served by mlxchat\nFROM {service.name}\n", "parameters": _parameters(base()),
            "template": service.engine.model.tokenizer.chat_template or "", "details": details(),
            "model_info": {"general.architecture": family, "general.basename": service.name,
                           f"{family}.context_length": service.engine.context_length},
            "capabilities": ["completion", "tools",
                             *(["thinking"] if markers_for(service.engine.model.tokenizer) else [])],
            "modified_at": modified_at()})

    def finish(result: GenerationResult, started: float) -> dict[str, Any]:
        m = result.metrics
        return {"done": True, "done_reason": "length" if result.finish_reason == "length" else "stop",
                "total_duration": _nanoseconds(time.perf_counter() - started), "load_duration": 0,
                "prompt_eval_count": m.prompt_tokens, "prompt_eval_duration": _nanoseconds(m.prefill_s),
                "eval_count": m.completion_tokens, "eval_duration": _nanoseconds(m.decode_s)}

    async def reply(request: HttpRequest, model: str, ids: list[int], settings: OptionSettings, stream: bool,
                    piece: Callable[..., dict[str, Any]], tools: ToolUse | None = None,
                    reasoning: Reasoning = Reasoning()) -> Response:
        """Run one choice; `piece(text)` is the part of a line that carries text (message or response), and with
        `tools` `piece(text, calls)` also the calls the reply made."""
        started = time.perf_counter()
        max_tokens = settings.max_tokens(len(ids), service.engine.context_length)
        [choice] = service.start(ids, [settings.profile], max_tokens, tools=tools, reasoning=reasoning)
        if stream:
            return StreamingResponse(lines(request, model, choice, piece, started),
                                     media_type="application/x-ndjson")
        results = await service.collect(request, [choice])
        if results is None:  # the client went away
            return Response(status_code=499)
        request.state.results = results
        r = results[0]
        said = piece(r.text, r.tool_calls) if r.tool_calls else piece(r.text)
        thought(said, r.reasoning)
        return JSONResponse({"model": model, "created_at": _now(), **said, **finish(r, started)})

    async def lines(request: HttpRequest, model: str, choice: Choice, piece: Callable[..., dict[str, Any]],
                    started: float) -> AsyncIterator[str]:
        results: list[GenerationResult] = []
        status = 200

        def line(text: str | ToolCall, thinking: str = "") -> str:
            part = piece("", [text]) if isinstance(text, ToolCall) else piece(text)
            thought(part, thinking)
            return json.dumps({"model": model, "created_at": _now(), **part, "done": False}) + "\n"

        try:
            async for event in choice.stream():
                if isinstance(event, Done):
                    results.append(event.result)
                    yield json.dumps({"model": model, "created_at": _now(), **piece(""),
                                      **finish(event.result, started)}) + "\n"
                elif isinstance(event, TokenEvent):  # text, and each call as a line of its own
                    if out := "".join([line("", event.reasoning)] if event.reasoning else []) + "".join(
                            line(part) for part in [*([event.text] if event.text else []), *event.tool_calls]):
                        yield out
        except GenerationFailed as e:  # an in-stream error is the stream's last line
            status = 500
            yield json.dumps({"error": str(e)}) + "\n"
        finally:
            choice.request.cancel()
            service.log_line(request, status, started, results)

    def loaded(model: str, piece: dict[str, Any]) -> Response:
        """An empty request loads the model, in Ollama: here it is loaded already."""
        return JSONResponse({"model": model, "created_at": _now(), **piece, "done": True, "done_reason": "load"})

    async def chat(request: HttpRequest) -> Response:
        req: _Chat = await body_of(request, _Chat)
        model = check_model(req.model)
        _refuse(req)
        settings = with_format(parse_options(req.options, base()), req.format)
        tools = _tools(req.tools, settings)

        def piece(text: str, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
            said = {"tool_calls": [_tool_call(c) for c in calls]} if calls else {}
            return {"message": {"role": "assistant", "content": text, **said}}

        if not req.messages:
            return loaded(model, piece(""))
        reasoning = _think(req.think)
        ids = service.encode_chat(_messages(req.messages), tools=tools.shown if tools else [],
                                  template_kwargs=reasoning.template_kwargs())
        return await reply(request, model, ids, settings, req.stream is not False, piece, tools, reasoning)

    async def generate(request: HttpRequest) -> Response:
        req: _Generate = await body_of(request, _Generate)
        model = check_model(req.model)
        _refuse(req, template=req.template, suffix=req.suffix, context=req.context, images=req.images)
        settings = with_format(parse_options(req.options, base()), req.format)

        def piece(text: str) -> dict[str, Any]:
            return {"response": text}

        if not req.prompt:
            return loaded(model, piece(""))
        reasoning = _think(req.think)
        if req.raw:
            ids = service.encode_text(req.prompt)
            reasoning = Reasoning(apart=False)  # a raw prompt's reply is the model's text as it is
        else:
            system = [{"role": "system", "content": req.system}] if req.system else []
            ids = service.encode_chat([*system, {"role": "user", "content": req.prompt}], "prompt",
                                      template_kwargs=reasoning.template_kwargs())
        return await reply(request, model, ids, settings, req.stream is not False, piece, reasoning=reasoning)

    def route(path: str, fn: Callable, method: str, *, auth: bool = True) -> Route:
        return Route(path, service.endpoint(fn, error_body, auth=auth), methods=[method])

    return [
        route("/api/tags", tags, "GET"),
        route("/api/version", api_version, "GET", auth=False),  # says only which server this is, as /health does
        route("/api/show", show, "POST"),
        route("/api/chat", chat, "POST"),
        route("/api/generate", generate, "POST"),
    ]


__all__ = ["OLLAMA_DEFAULTS", "OptionSettings", "error_body", "parameter_size", "parse_options", "response_format",
           "routes"]
