"""OpenAI's request and response shapes, mapped onto the engine's `SamplingProfile` and results.

Requests are checked in two layers: JSON types here (strictly: "0.5" is not a number), ranges by
`SamplingProfile` (one source of truth for what a setting allows). Either failure is an `ApiError` whose message names
the field, and its `param` is that field, as OpenAI's errors do. A field OpenAI defines that this server does not
implement is refused by name rather than silently dropped; `user` is accepted and ignored by design (it is an abuse-
monitoring tag for OpenAI's platform, with no meaning for a local model).
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from mlxchat.core import GenerationResult, SamplingProfile
from mlxchat.core.decode.events import Metrics, TokenLogprob
from mlxchat.core.decode.reasoning import Reasoning
from mlxchat.core.sampling.sampler_params import PARAMS, SamplerParam
from mlxchat.core.sampling.tracing import check_trace

from mlxchat.core.decode import tools as tool_calls
from mlxchat.core.decode.tools import ToolError, ToolUse

# Fields of OpenAI's API that are not implemented; each is refused by name unless it carries its neutral value.
UNSUPPORTED = {
    "functions": ([], None), "function_call": ("none", None), "audio": (None,),
    "modalities": (["text"], None), "prediction": (None,), "web_search_options": (None,),
    "store": (False, None), "metadata": (None,), "service_tier": ("auto", "default", None), "suffix": (None,),
    "echo": (False, None), "best_of": (1, None),
}
# A sampler parameter's JSON type: strict (no "0.5" for a number); a list's items are Any, so that SamplingProfile
# names an item that is not a string, with its value and what is allowed. Ranges are SamplingProfile's.
_JSON_TYPES: dict[type, Any] = {float: float, int: int, bool: bool, list: list[Any]}


def sampler_types(name: str, params: dict[str, SamplerParam]) -> type[BaseModel]:
    """A model of the JSON types of the sampler parameters an API takes, by its names for them (`params`), for the
    API's request model to inherit; every field optional."""
    return create_model(name, **{key: (_JSON_TYPES[p.type] | None, None) for key, p in params.items()})


def sampler_settings(req: BaseModel, params: dict[str, SamplerParam]) -> dict[str, Any]:
    """The sampler parameters a request gave, by their profile names."""
    return {p.name: value for key, p in params.items() if (value := getattr(req, key)) is not None}


# Every sampler parameter, on /v1/chat/completions and /v1/completions, under its profile name: OpenAI's own
# (temperature, top_p, the penalties) and the rest at the top level (vLLM's `extra_body` convention, and llama.cpp
# server's names).
OPENAI_SAMPLERS: dict[str, SamplerParam] = dict(PARAMS)
_OpenAISamplers = sampler_types("_OpenAISamplers", OPENAI_SAMPLERS)


class ApiError(Exception):
    """An error answered to the client as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check_model(wanted: str | None, served: str) -> None:
    """Refuse a model this server does not serve, as OpenAI does (404, `model_not_found`): answering "gpt-4o" with
    another model would hide a client's misconfiguration. No model at all means the served one (as mlx_lm.server)."""
    if wanted is not None and wanted != served:
        raise ApiError(404, f"the model {wanted!r} does not exist on this server; it serves {served!r}", "model",
                       code="model_not_found")


class _Types(_OpenAISamplers):
    """JSON types of the fields both endpoints share (ranges are SamplingProfile's)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, bool] | None = None
    user: str | None = None
    profile: str | None = None
    sampler_order: list[str] | None = None
    trace: int | None = None  # mlxchat's extension: per-token sampler traces of this many candidates
    # core/sampling/response_format.py: OpenAI's shapes, plus regex and grammar
    response_format: dict[str, Any] | None = None
    speculative: str | None = None  # mlxchat's extension: "off", "ngram", "auto" (see `check_speculative`)
    # Thinking models (core/decode/reasoning.py): a budget of reasoning tokens (llama.cpp's name), OpenAI's effort, and
    # variables for the chat template (vLLM's chat_template_kwargs, e.g. {"enable_thinking": false}).
    reasoning_budget: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _ChatTypes(_Types):
    messages: list[dict[str, Any]]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # core/decode/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class _CompletionTypes(_Types):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None


@dataclass
class Request:
    """A validated completion request: what to run and how to answer."""

    chat: bool
    messages: list[dict[str, str]] | None
    prompt: str | list[int] | None
    profile: SamplingProfile
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    seed: int  # the base seed: choice i samples with seed + i
    trace: int = 0  # candidates per token in each choice's "trace" extension field (0 = none)
    tools: ToolUse | None = None  # the tools, the choice and parallel_tool_calls (None: no tools given)
    reasoning: Reasoning = Reasoning()  # a thinking model's switch and budget
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs, for the chat template
    speculative: str | None = None  # "off", "ngram" or "auto" (None: the server's default, `serve --speculative`)


def _type_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return ApiError(400, f"{where}: {first['msg']}", where.split(".")[0])


def profile_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    return ApiError(400, msg if msg.startswith(where) else f"{where}: {msg}", where.split(".")[0] or None)


def _refuse_unsupported(body: dict[str, Any], known: set[str]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            why = " (beam search does not stream and is not served: the Python API has engine.beam_search)" \
                if name == "best_of" else ""
            raise ApiError(400, f"{name} is not supported by this server{why}; remove it from the request", name)
        if name not in known and name not in UNSUPPORTED:
            raise ApiError(400, f"unrecognized request field: {name}", name)


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, str]]:
    if not raw:
        raise ApiError(400, "messages must not be empty: send at least one user message", "messages")
    out = []
    for i, m in enumerate(raw):
        try:
            tool_message = tool_calls.message_from_openai(m, i)  # a tool result, or an assistant's calls
        except ToolError as e:
            raise ApiError(400, str(e), "messages") from None
        if tool_message is not None:
            out.append(tool_message)
            continue
        role, content = m.get("role"), m.get("content")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r}",
                           "messages")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": role, "content": content})
        if role == "assistant" and isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            out[-1]["reasoning_content"] = m["reasoning_content"]  # the template keeps or strips it
    if not any(m["content"].strip() or m.get("tool_calls") for m in out if m["role"] != "system"):
        raise ApiError(400, "messages have no user content: send a non-empty user message", "messages")
    return out


def parse(body: Any, *, chat: bool, served: str, base: SamplingProfile,
          profiles: dict[str, SamplingProfile]) -> Request:
    """Validate a request body against the endpoint; `served` is the model's name, `base` the server's profile,
    `profiles` the named ones."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _ChatTypes if chat else _CompletionTypes
    _refuse_unsupported(body, set(model.model_fields))
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _type_error(e) from None
    check_model(req.model, served)

    if req.profile is not None:
        if req.profile not in profiles:
            raise ApiError(400, f"unknown profile {req.profile!r}; known: {', '.join(sorted(profiles))}", "profile")
        base = profiles[req.profile]
    fields = sampler_settings(req, OPENAI_SAMPLERS)
    if req.sampler_order is not None:
        fields["sampler_order"] = req.sampler_order
    if req.logit_bias:
        try:
            fields["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            raise ApiError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
    if req.stop is not None:
        fields["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if chat:
        if req.logprobs is not None:
            fields["logprobs"] = req.logprobs
        if req.top_logprobs is not None:
            fields["top_logprobs"] = req.top_logprobs
    elif req.logprobs is not None:  # completions: logprobs is the number of alternatives (0-5)
        if not 0 <= req.logprobs <= 5:
            raise ApiError(400, f"logprobs must be between 0 and 5, got {req.logprobs}", "logprobs")
        fields["logprobs"], fields["top_logprobs"] = True, req.logprobs
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    fields["seed"] = seed
    if req.response_format is not None:
        fields["response_format"] = req.response_format
    tools = _tools(req, fields) if chat else None
    try:
        profile = SamplingProfile.model_validate({**base.model_dump(), **fields})
    except ValidationError as e:
        err = profile_error(e)
        if err.param == "max_tokens" and req.max_completion_tokens is not None:
            err.param = "max_completion_tokens"
            err.message = err.message.replace("max_tokens", "max_completion_tokens")
        raise err from None
    n = 1 if req.n is None else req.n
    if not 1 <= n <= 16:
        raise ApiError(400, f"n must be between 1 and 16, got {n}", "n")

    trace = 0 if req.trace is None else req.trace
    try:
        check_trace(trace)
    except ValueError as e:
        raise ApiError(400, str(e), "trace") from None
    check_speculative(req.speculative)

    prompt: str | list[int] | None = None
    messages = None
    if chat:
        messages = _messages(req.messages)
    else:
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ApiError(400, "prompt: only one prompt per request is supported", "prompt")
            p = p[0]
        if not p or (isinstance(p, str) and not p.strip()):
            raise ApiError(400, "prompt must not be empty", "prompt")
        prompt = p
    reasoning = reasoning_settings(req.chat_template_kwargs, req.reasoning_budget, req.reasoning_effort)
    if not chat:  # a raw completion's text is the model's, markers and all
        reasoning = Reasoning(reasoning.enable_thinking, reasoning.budget, apart=False)
    return Request(chat, messages, prompt, profile, profile.max_tokens, n, bool(req.stream),
                   bool((req.stream_options or {}).get("include_usage")), seed, trace, tools, reasoning,
                   {**(req.chat_template_kwargs or {}), **reasoning.template_kwargs()}, req.speculative)


# What the server itself passes to the chat template (transformers' apply_chat_template arguments): not a client's.
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def reasoning_settings(template_kwargs: dict[str, Any] | None, budget: Any, effort: Any = None,
                       enable: Any = None, budget_field: str = "reasoning_budget",
                       enable_field: str = "chat_template_kwargs.enable_thinking") -> Reasoning:
    """A thinking model's settings from a request (every API's names), or an ApiError naming the field."""
    for key in template_kwargs or {}:
        if key in TEMPLATE_ARGUMENTS:
            raise ApiError(400, f"chat_template_kwargs.{key}: the server sets it; leave it out", "chat_template_kwargs")
    if enable is None and template_kwargs:
        enable = template_kwargs.get("enable_thinking")
    if enable is not None and not isinstance(enable, bool):
        raise ApiError(400, f"{enable_field} must be true or false, got {enable!r}", enable_field.split(".")[0])
    try:
        return Reasoning.make(enable, budget, effort, field=budget_field)
    except ValueError as e:
        field = "reasoning_effort" if str(e).startswith("reasoning_effort") else budget_field
        raise ApiError(400, str(e), field.split(".")[0]) from None


def _tools(req: _ChatTypes, fields: dict[str, Any]) -> ToolUse | None:
    """The request's tools, choice and parallel_tool_calls (None without tools); a choice that calls constrains the
    reply, so it cannot come with a response_format."""
    try:
        use = ToolUse.make(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolError as e:
        raise ApiError(400, str(e), e.field.split("[")[0].split(".")[0]) from None
    if use.calls and "response_format" in fields and fields["response_format"].get("type") != "text":
        raise ApiError(400, f"response_format and tool_choice {use.choice.mode!r} both constrain the reply: use one "
                            "(or tool_choice \"none\")", "response_format")
    return use if use.tools else None  # tool_choice "none" alone: no tools to keep out of the text


def check_speculative(mode: str | None) -> None:
    """The `speculative` field: "ngram" and "auto" guess tokens by prompt lookup and verify them while the request
    has the model to itself, and decode plainly in a busy batch (core/decode/generate.py); the text is the same either
    way, and the response's `timings` say what ran (`draft_n`, `draft_n_accepted`). "draft" is refused: the server loads
    no draft model."""
    if mode is None or mode in ("off", "ngram", "auto"):
        return
    if mode == "draft":
        raise ApiError(400, "speculative 'draft' needs a draft model, which the server does not load: use 'ngram', "
                            "'auto' or 'off'", "speculative")
    raise ApiError(400, f"speculative must be one of off, ngram, auto, got {mode!r}", "speculative")


# --- responses ---------------------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(results: list[GenerationResult]) -> dict[str, Any]:
    first = results[0].metrics
    completion = sum(r.metrics.completion_tokens for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
            # OpenAI's count of reasoning tokens within completion_tokens (a thinking model's; 0 otherwise)
            "completion_tokens_details": {"reasoning_tokens": sum(r.metrics.reasoning_tokens for r in results)}}


def timings(m: Metrics) -> dict[str, float | int]:
    """llama.cpp's `timings` object (plus TTFT): prefill and decode measured separately."""
    prompt_n = m.prompt_tokens - m.cached_tokens
    prompt_ms, predicted_ms = m.prefill_s * 1000, m.decode_s * 1000
    decoded = max(m.completion_tokens - 1, 0)  # the first token's time is in the prefill
    return {
        "cache_n": m.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_second": prompt_n / m.prefill_s if m.prefill_s > 0 else 0.0,
        "predicted_n": m.completion_tokens, "predicted_ms": predicted_ms,
        "predicted_per_second": decoded / m.decode_s if m.decode_s > 0 else 0.0,
        "ttft_ms": m.ttft_s * 1000,
        # Speculative decoding as it ran (llama.cpp's draft_n / draft_n_accepted): "off" in the batch.
        "speculative": m.speculative, "draft_n": m.draft_tokens, "draft_n_accepted": m.accepted_tokens,
    }


def finish_reason(result: GenerationResult, called: bool = False) -> str:
    """OpenAI's finish reason; `called`: the reply is tool calls (a reply cut by max_tokens stays "length")."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def chat_logprobs(lps: tuple[TokenLogprob, ...], token_text) -> dict[str, Any]:  # noqa: ANN001 - id -> str
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                        for t in lps]}


def completion_logprobs(lps: tuple[TokenLogprob, ...], token_text, offset: int = 0) -> dict[str, Any]:  # noqa: ANN001
    tokens = [token_text(t.token_id) for t in lps]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{token_text(i): v for i, v in t.top} for t in lps], "text_offset": offsets}


def envelope(rid: str, chat: bool, model: str, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "system_fingerprint": None}
