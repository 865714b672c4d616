"""Ollama's and Anthropic's APIs on `mlxchat serve`, driven by their official Python clients (`ollama`,
`anthropic`) against one real server for the module; and how their settings map onto a profile (no model)."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from mlxchat.core import SamplingProfile
from mlxchat.server.ollama import parse_options, response_format
from mlxchat.server.protocol import ApiError

KEY = "apis-key-7"


@pytest.fixture(scope="module")
def url(serve_module) -> str:  # noqa: ANN001 - conftest's factory
    return serve_module("--api-key", KEY)


def test_ollama_client_lists_shows_chats_and_generates(url: str) -> None:
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"})
    [card] = client.list().models
    name = card.model
    assert card.size > 0 and card.details.family == "llama"
    info = client.show(name)
    assert info.capabilities == ["completion"] and info.modelinfo["llama.context_length"] >= 2048

    # Streamed chat and a plain generate of the same user message run the same prompt: the same greedy text.
    options = {"temperature": 0, "num_predict": 6}
    parts = list(client.chat(model=f"{name}:latest", messages=[{"role": "user", "content": "Name a colour."}],
                             options=options, stream=True))
    whole = client.generate(model=name, prompt="Name a colour.", options=options)
    *deltas, last = parts
    assert len(deltas) >= 2 and not any(p.done for p in deltas) and last.done and last.message.content == ""
    assert whole.response == "".join(p.message.content for p in deltas) != ""
    assert last.done_reason == whole.done_reason == "length" and last.eval_count == whole.eval_count == 6
    assert last.prompt_eval_count > 5 and 0 < last.prompt_eval_duration < last.total_duration
    assert 0 < last.eval_duration < last.total_duration

    stopped = client.generate(model=name, prompt="The capital of France is", raw=True,
                              options={"temperature": 0, "num_predict": 8, "stop": ["."]})
    assert stopped.done_reason == "stop" and "Paris" in stopped.response and "." not in stopped.response

    # Ollama's own default is a stream: NDJSON lines, the last one done.
    r = httpx.post(f"{url}/api/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": name, "prompt": "Hi", "options": {"temperature": 0, "num_predict": 2}})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert r.headers["content-type"].startswith("application/x-ndjson") and lines[-1]["done"] is True

    # Errors in Ollama's shape, which its client reads as status and message.
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=[{"role": "user", "content": "Hi"}], format="json")
    assert e.value.status_code == 400 and e.value.error.startswith("format needs constrained decoding")
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()
    assert e.value.status_code == 401 and "API key" in e.value.error


def test_ollama_options_map_onto_the_profile() -> None:
    settings = parse_options({"temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "typical_p": 0.8,
                              "repeat_penalty": 1.2, "repeat_last_n": 32, "presence_penalty": 0.1,
                              "frequency_penalty": 0.2, "seed": 7, "num_predict": 50, "num_ctx": 100, "stop": "\n",
                              "num_gpu": 99, "mirostat": 0}, SamplingProfile())
    p = settings.profile
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.typical_p) == (0.5, 0.9, 20, 0.05, 0.8)
    assert (p.repetition_penalty, p.penalty_window, p.presence_penalty, p.frequency_penalty) == (1.2, 32, 0.1, 0.2)
    assert (p.seed, p.stop) == (7, ["\n"])
    assert settings.max_tokens(30, 8192) == 50 and settings.max_tokens(60, 8192) == 40  # num_ctx holds both
    with pytest.raises(ApiError, match="num_ctx is 100"):
        settings.max_tokens(100, 8192)

    base = SamplingProfile(repetition_penalty=1.3, temperature=0.2)
    assert parse_options({"num_predict": -1}, base).max_tokens(10, 100) == 90  # until the context is full
    off = parse_options({"repeat_last_n": 0, "seed": -1}, base).profile
    assert off.repetition_penalty == 1 and off.temperature == 0.2 and off.seed is not None and off.seed >= 0
    for options, message in (({"repeat_penalty": 0}, "options.repeat_penalty must be greater than 0"),
                             ({"mirostat": 2}, "options.mirostat is not supported"),
                             ({"num_predict": 0}, "options.num_predict must be at least 1"),
                             ({"top_k": "40"}, "options.top_k: Input should be a valid integer"),
                             ({"bogus": 1}, "options.bogus is not a known option")):
        with pytest.raises(ApiError) as e:
            parse_options(options, base)
        assert e.value.message.startswith(message) and e.value.status == 400


def test_ollama_format_maps_to_openai_response_format() -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    assert response_format("json") == {"type": "json_object"}
    assert response_format(schema)["json_schema"]["schema"] == schema
    assert response_format(None) is response_format("") is None
    with pytest.raises(ApiError, match="format must be"):
        response_format("yaml")
