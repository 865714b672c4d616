"""An OpenAI-compatible server as the lab sees it (another `mlxchat serve`, llama.cpp's server, Ollama, a hosted
API): one streamed chat completion at a time over plain HTTP (httpx), timed like the engine times its replies.
Used by `lab run --target URL` and by the judge's `--judge-url`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from mlxchat.core import SamplingProfile
from mlxchat.core.sampling.sampler_params import PARAMS


class EndpointError(ValueError):
    """The server cannot be reached or refused a request; the message is one line naming the URL."""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: list[float] | None  # None when the server sends none (Ollama, most hosted chat APIs)
    ttft_s: float
    tpot_s: float


def request_body(profile: SamplingProfile, max_tokens: int, stop: list[str] | None) -> dict[str, Any]:
    """A profile as a chat-completions request: OpenAI's names, plus the extra sampler fields a setting turns on.
    `stop` adds to the profile's stop strings, as it does for the engine (core/decode/reply.py's Request)."""
    body: dict[str, Any] = {**_sampler_fields(profile), "max_tokens": max_tokens}
    if profile.seed is not None:
        body["seed"] = profile.seed
    if stops := [*profile.stop, *(stop or [])]:
        body["stop"] = stops
    if profile.logit_bias:  # token ids of this model's vocabulary: only meaningful for the same tokenizer
        body["logit_bias"] = {str(k): v for k, v in profile.logit_bias.items()}
    if profile.sampler_order is not None:
        body["sampler_order"] = profile.sampler_order
    if profile.response_format is not None:  # a prompt with a schema (lab/prompts.py) asks the server to keep to it
        body["response_format"] = profile.response_format.model_dump(mode="json", exclude_none=True)
    return body


def _sampler_fields(profile: SamplingProfile) -> dict[str, Any]:
    """The sampler parameters to send (core/sampling/sampler_params.py): OpenAI's own always; the others (vLLM,
    llama.cpp and mlxchat serve take them at the top level) only when a setting turns their sampler on, since a hosted
    API refuses a name it does not know, and then with the parameters that go with it (dry_base with dry_multiplier)."""
    on = {n for n, p in PARAMS.items() if p.goes_with is None and (p.openai or getattr(profile, n) != p.defaults())}
    return {n: getattr(profile, n) for n, p in PARAMS.items() if n in on or p.goes_with in on}


class Endpoint:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise EndpointError(f"{url!r}: give the server's URL, e.g. http://127.0.0.1:8080 (or …/v1)")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def close(self) -> None:
        self.client.close()

    def _fail(self, e: Exception | httpx.Response) -> EndpointError:
        if isinstance(e, httpx.Response):
            try:
                detail = e.json().get("error", {}).get("message") or e.text
            except (ValueError, AttributeError):
                detail = e.text
            return EndpointError(f"{self.base}: HTTP {e.status_code}: {' '.join(str(detail).split())[:200]}")
        return EndpointError(f"{self.base}: cannot reach the server ({type(e).__name__}: {e}); is it running?")

    def models(self) -> list[str]:
        try:
            r = self.client.get(f"{self.base}/models")
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        if r.status_code != 200:
            raise self._fail(r)
        return [m["id"] for m in r.json().get("data", [])]

    def default_model(self) -> str:
        """The first model the server lists: a local server (mlxchat, llama.cpp) serves one."""
        names = self.models()
        if not names:
            raise EndpointError(f"{self.base}/models lists no model; name one with --model (or --judge)")
        return names[0]

    def chat(self, model: str, messages: list[dict[str, str]], body: dict[str, Any]) -> Completion:
        """One streamed chat completion; the time to the first text and per later token as the client sees them."""
        payload = {**body, "model": model, "messages": messages, "stream": True, "logprobs": True,
                   "stream_options": {"include_usage": True}}
        parts: list[str] = []
        logprobs: list[float] = []
        finish, usage, chunks = "stop", None, 0
        first = last = None
        start = time.perf_counter()
        try:
            with self.client.stream("POST", f"{self.base}/chat/completions", json=payload) as r:
                if r.status_code != 200:
                    r.read()
                    raise self._fail(r)
                for line in r.iter_lines():
                    if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        if text := (choice.get("delta") or {}).get("content"):
                            parts.append(text)
                            chunks += 1
                            last = time.perf_counter()
                            first = first or last
                        logprobs += [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        tokens = int((usage or {}).get("completion_tokens") or chunks)
        ttft = (first or time.perf_counter()) - start
        tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else 0.0
        return Completion("".join(parts), finish, tokens, logprobs or None, ttft, tpot)
