"""Ollama's and Anthropic's APIs on `mlxchat serve`, driven by their official Python clients (`ollama`,
`anthropic`) against one real server for the module; and how their settings map onto a profile (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import ollama
import pytest

from mlxchat.core import SamplingProfile
from mlxchat.core.loader import EMBEDDED_FILE
from mlxchat.server import anthropic as messages_api
from mlxchat.server.ollama import parse_options, response_format
from mlxchat.server.protocol import ApiError

KEY = "apis-key-7"
MODEL = Path(EMBEDDED_FILE).stem  # the name the server serves the embedded model under
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def url(serve_module) -> str:  # noqa: ANN001 - conftest's factory
    return serve_module("--api-key", KEY)


def test_ollama_client_lists_shows_chats_and_generates(url: str) -> None:
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"})
    [card] = client.list().models
    name = card.model
    assert name == MODEL and card.size > 0 and card.details.family == "llama"
    info = client.show(name)
    assert info.capabilities == ["completion"] and info.modelinfo["llama.context_length"] >= 2048

    # Streamed chat and a plain generate of the same user message run the same prompt: the same greedy text.
    options = {"temperature": 0, "num_predict": 6}
    parts = list(client.chat(model=f"{name}:latest", messages=[{"role": "user", "content": "Name a colour."}],
                             options=options, stream=True, keep_alive="5m", think=False))
    whole = client.generate(model=name, prompt="Name a colour.", options=options)
    *deltas, last = parts
    assert len(deltas) >= 2 and not any(p.done for p in deltas) and last.done and last.message.content == ""
    assert whole.response == "".join(p.message.content for p in deltas) != ""
    assert last.done_reason == whole.done_reason == "length" and last.eval_count == whole.eval_count == 6
    assert last.prompt_eval_count > 5 and 0 < last.prompt_eval_duration < last.total_duration
    assert 0 < last.eval_duration < last.total_duration

    assert client.chat(model=name, messages=[]).done_reason == "load"  # Ollama's "load the model" request

    # Ollama's own default is a stream: NDJSON lines, the last one done. A raw prompt is continued as it is.
    r = httpx.post(f"{url}/api/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": name, "prompt": "The capital of France is", "raw": True,
                         "options": {"temperature": 0, "num_predict": 8, "stop": ["."]}})
    *pieces, done = [json.loads(line) for line in r.text.splitlines()]
    assert r.headers["content-type"].startswith("application/x-ndjson") and done["done"] is True
    assert done["done_reason"] == "stop" and "".join(p["response"] for p in pieces).strip() == "Paris"

    # Errors in Ollama's shape, which its client reads as status and message.
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404 and "not found" in e.value.error
    # format: a JSON schema constrains the reply (the sampler's response_format); a bad one is a 400 naming format.
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    shaped = client.chat(model=name, messages=[{"role": "user", "content": "Pick a colour, as JSON."}],
                         format=schema, options={"temperature": 0, "num_predict": 24})
    assert shaped.done_reason == "stop" and json.loads(shaped.message.content)["colour"] in ("red", "blue")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=[{"role": "user", "content": "Hi"}], format={"type": "strin"})
    assert e.value.status_code == 400 and e.value.error.startswith("format: ")
    with pytest.raises(ollama.ResponseError, match="tools need constrained decoding"):
        client.chat(model=name, messages=[{"role": "user", "content": "Hi"}],
                    tools=[{"type": "function", "function": {"name": "clock"}}])
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()
    assert e.value.status_code == 401 and "API key" in e.value.error
    assert httpx.post(f"{url}/api/pull", timeout=10).json() == {"error": "no route /api/pull"}


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


def test_anthropic_sdk_creates_streams_stops_and_counts(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)  # the SDK sends the key as x-api-key
    question = "Name a colour."
    whole = client.messages.create(model=MODEL, max_tokens=4, system="Be brief.", extra_body=GREEDY,
                                   messages=[{"role": "user", "content": question}])
    with client.messages.stream(model=MODEL, max_tokens=4, system=[{"type": "text", "text": "Be brief."}],
                                messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
                                extra_body=GREEDY) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) >= 2 and "".join(deltas) == final.content[0].text == whole.content[0].text
    assert whole.stop_reason == final.stop_reason == "max_tokens" and whole.stop_sequence is None
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.",
                                           messages=[{"role": "user", "content": question}]).input_tokens
    for usage in (whole.usage, final.usage):  # the second prompt was mostly read from the prefix cache
        assert usage.output_tokens == 4 and usage.input_tokens + usage.cache_read_input_tokens == counted > 5
    assert final.usage.cache_read_input_tokens > 0

    counting = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, stop_sequences=["Three"],
                                      messages=[{"role": "user", "content": "Count: one, two, three, four"}])
    assert counting.stop_reason == "stop_sequence" and counting.stop_sequence == "Three"
    assert "Two" in counting.content[0].text and "Three" not in counting.content[0].text

    # The documented event sequence, on the wire.
    with httpx.stream("POST", f"{url}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": MODEL, "max_tokens": 3, "stream": True, **GREEDY,
                            "messages": [{"role": "user", "content": "Hi"}]}) as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1 and kinds == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]

    # Errors in Anthropic's shape, which the SDK turns into its exception classes.
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError, match="tools need constrained decoding"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               tools=[{"name": "clock", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    r = httpx.post(f"{url}/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                                            "message": "max_tokens: field required"}}


def test_anthropic_requests_map_onto_the_profile() -> None:
    base = SamplingProfile(temperature=0.7, min_p=0.1)
    req = messages_api.parse({"model": "m", "max_tokens": 9, "temperature": 0.2, "top_p": 0.8, "top_k": 5,
                              "stop_sequences": ["END"], "metadata": {"user_id": "u"}, "system": "Sys.",
                              "messages": [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": [{"type": "text", "text": "Hel"}]}]},
                             served="m", base=base)
    p = req.profile
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.stop, p.max_tokens) == (0.2, 0.8, 5, 0.1, ["END"], 9)
    assert req.messages == [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"}]
    assert req.prefill == "Hel"  # a last assistant turn is continued
    for body, message in (({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content[0]"),
                          ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
                          ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 3}, "temperature"),
                          ({"messages": [{"role": "user", "content": "Hi"}], "top_n": 3}, "top_n: unrecognized"),
                          ({"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "enabled"}},
                           "thinking is not supported")):
        with pytest.raises(ApiError) as e:
            messages_api.parse({"model": "m", "max_tokens": 9, **body}, served="m", base=base)
        assert e.value.message.startswith(message) and e.value.status == 400
