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
from mlxchat.core.model.loader import EMBEDDED_FILE
from mlxchat.server import anthropic as messages_api
from mlxchat.server.ollama import parameter_size, parse_options, response_format
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
    assert card.details.quantization_level == "Q4_1"  # the file's kind, as Ollama shows it
    assert card.details.parameter_size == "135M"
    info = client.show(name)
    assert info.capabilities == ["completion", "tools"] and info.modelinfo["llama.context_length"] >= 2048
    # Without --profile a request that sets nothing samples with Ollama's own defaults, not the raw distribution.
    assert info.parameters.split() == ["temperature", "0.8", "top_k", "40", "top_p", "0.9"]

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
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()
    assert e.value.status_code == 401 and "API key" in e.value.error
    assert httpx.post(f"{url}/api/pull", timeout=10).json() == {"error": "no route /api/pull"}


def test_ollama_options_map_onto_the_profile() -> None:
    settings = parse_options({"temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "typical_p": 0.8,
                              "repeat_penalty": 1.2, "repeat_last_n": 32, "presence_penalty": 0.1,
                              "frequency_penalty": 0.2, "seed": 7, "num_predict": 50, "num_ctx": 100, "stop": "\n",
                              "num_gpu": 99, "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2,
                              "dry_multiplier": 0.8}, SamplingProfile())
    p = settings.profile
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.dry_multiplier) == (2, 4.0, 0.2, 0.8)
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
                             ({"tfs_z": 0.5}, "options.tfs_z is not supported"),
                             ({"mirostat_tau": 0.0}, "options.mirostat_tau must be greater than 0, got 0.0"),
                             ({"dry_sequence_breakers": ["\n", 3]},
                              "options.dry_sequence_breakers must be a list of non-empty strings, got 3"),
                             ({"num_predict": 0}, "options.num_predict must be at least 1"),
                             ({"top_k": "40"}, "options.top_k: Input should be a valid integer"),
                             ({"bogus": 1}, "options.bogus is not a known option")):
        with pytest.raises(ApiError) as e:
            parse_options(options, base)
        assert e.value.message.startswith(message) and e.value.status == 400


def test_requests_that_set_nothing_sample_with_the_chat_preset() -> None:
    from mlxchat.server.service import ServerConfig
    from mlxchat.server.service import Service

    assert Service(None, None, ServerConfig()).base == SamplingProfile.preset("chat")  # type: ignore[arg-type]
    mine = SamplingProfile(name="mine", temperature=0.3)
    assert Service(None, None, ServerConfig(profile=mine)).base is mine  # type: ignore[arg-type]


def test_serve_warns_only_about_the_profile_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from mlxchat.core.sampling.profile import ProfileStore
    from mlxchat.server.cli import _profiles

    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path))
    ProfileStore().save(SamplingProfile(name="stacked", top_k=40, top_p=0.9, temperature=0.7))
    with caplog.at_level("WARNING"):
        profiles = _profiles()
    assert "stacked" in profiles and caplog.records == []  # loaded in case a request names it, not warned about
    with caplog.at_level("WARNING"):
        ProfileStore().load("stacked")  # where it is used, it still warns
    assert "top_k + top_p are stacked" in caplog.text


def test_parameter_sizes_read_as_ollama_shows_them() -> None:
    assert [parameter_size(n) for n in (134_515_008, 1_100_048_384, 7_615_616_512, 494_032_768, 52_000, 12)] == \
        ["135M", "1.1B", "7.62B", "494M", "52K", "12"]


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

    # Structured output: the reply is JSON valid under output_config.format's schema (the SDK's own parameter).
    person = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    shaped = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                    output_config={"format": {"type": "json_schema", "schema": person}},
                                    messages=[{"role": "user", "content": "Invent a person."}])
    assert shaped.stop_reason == "end_turn" and set(json.loads(shaped.content[0].text)) == {"name", "age"}

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
    for body, message in (({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
                          ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
                          ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 3}, "temperature"),
                          ({"messages": [{"role": "user", "content": "Hi"}], "top_n": 3}, "top_n: unrecognized"),
                          ({"messages": [{"role": "user", "content": "Hi"}],
                            "thinking": {"type": "enabled", "budget_tokens": -1}},
                           "thinking.budget_tokens must be an integer of 0 or more"),
                          ({"messages": [{"role": "user", "content": "Hi"}],
                            "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
                           "output_config.format.schema"),
                          ({"messages": [{"role": "user", "content": "Hi"}], "output_config": {"format": "json"}},
                           "output_config.format must be")):
        with pytest.raises(ApiError) as e:
            messages_api.parse({"model": "m", "max_tokens": 9, **body}, served="m", base=base)
        assert e.value.message.startswith(message) and e.value.status == 400


# --- tools (core/decode/tools.py behind each API's shapes)
# --------------------------------------------------------------

CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Rome"]}}}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_anthropic_sdk_calls_tools_streams_them_and_takes_their_results(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    r = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER_TOOL], tool_choice=one_call,
                               extra_body=GREEDY)
    [use] = r.content
    assert r.stop_reason == "tool_use" and use.type == "tool_use" and use.id.startswith("toolu_")
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    # Streamed: a tool_use block whose input arrives as input_json_delta; the SDK's final message has the same call.
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER_TOOL], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].input == {}
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == ["input_json_delta"]
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", "get_weather", {"city": "Paris"})]

    # The call and its result (text blocks, an error) go through the chat template: counted, and cached as a prefix.
    history = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                             "content": [{"type": "text", "text": "station offline"}]},
                                            {"type": "text", "text": "And now?"}]}]
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER_TOOL]).input_tokens
    assert counted > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens + 20  # the tool's spec
    again = client.messages.create(model=MODEL, max_tokens=1, messages=history, tools=[WEATHER_TOOL],
                                   extra_body=GREEDY)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > counted + 20
    assert again.usage.cache_read_input_tokens >= counted - 8 and again.stop_reason == "max_tokens"

    # Bad tools are Anthropic's invalid_request_error naming the field.
    for kwargs, message in (
            ({"tools": [{**WEATHER_TOOL, "input_schema": {"type": "strin"}}]}, "tools.0.input_schema: "),
            ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "clock"}}, "tool_choice.name: 'clock'"),
            ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: "),
            ({"tool_choice": {"type": "any"}}, "tool_choice: 'any' needs tools")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=4, messages=ASK, **kwargs)
        error = e.value.body["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(message), error


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
      city: The city
    """
    return "sunny"


def test_ollama_client_calls_tools_streams_them_and_takes_their_results(url: str) -> None:
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"})
    ask = [{"role": "system", "content": "You answer only with <tool_call>."},
           {"role": "user", "content": "Call get_weather for Paris."}]
    options = {"temperature": 0, "num_predict": 30}  # one call's worth: the model would go on calling
    r = client.chat(model=MODEL, messages=ask, tools=[get_weather], options=options)  # a Python function as a tool
    [call] = r.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris"})
    spec = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": CITY}}
    parts = list(client.chat(model=MODEL, messages=ask, tools=[spec], options=options, stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", {"city": "Paris"})]
    assert parts[-1].done and not any(p.done for p in parts[:-1])

    # The call and the tool's result (named by tool_name) go through the template, after the cached prefix.
    history = [*ask, r.message, {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    again = client.chat(model=MODEL, messages=history, tools=[get_weather], options={"temperature": 0,
                                                                                     "num_predict": 1})
    assert again.prompt_eval_count > r.prompt_eval_count + 25

    for kwargs, message in (({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                             "tools[0].function.name: "),
                            ({"tools": [spec], "format": "json"}, "format and tools both constrain")):
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=MODEL, messages=ask, **kwargs)
        assert e.value.status_code == 400 and e.value.error.startswith(message)


def test_anthropic_tool_blocks_become_template_messages_and_choices_constrain() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}
    req = messages_api.parse({"model": "m", "max_tokens": 9, "tools": [WEATHER_TOOL], "messages": [
        *ASK, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain",
                                      "is_error": True}, {"type": "text", "text": "So?"}]}]},
        served="m", base=SamplingProfile())
    assert req.messages[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: rain"}, {"role": "user", "content": "So?"}]
    assert [t.name for t in req.tools.tools] == ["get_weather"] and req.profile.response_format is None
    grammar = req.tools.response_format().grammar
    assert "calls | TEXT" in grammar and 'call ("\\n" call)*' in grammar  # auto: text or calls, several allowed

    def parsed(**body: object) -> messages_api.MessagesRequest:
        return messages_api.parse({"model": "m", "max_tokens": 9, "messages": ASK, "tools": [WEATHER_TOOL], **body},
                                  served="m", base=SamplingProfile())
    one = parsed(tool_choice={"type": "any", "disable_parallel_tool_use": True}).tools.response_format().grammar
    assert "start: calls\n" in one and "calls: call\n" in one
    named = parsed(tool_choice={"type": "tool", "name": "get_weather"}).tools.response_format().grammar
    assert "calls: call\n" in named  # a named tool is one call, as OpenAI's forced function
    none = parsed(tool_choice={"type": "none"}).tools
    assert none.shown == [] and none.response_format().name == "text, no tool calls"
    for body, message in (
            ({"messages": [*ASK, {"role": "assistant", "content": [use]}]}, "messages.1: the reply continues"),
            ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}, *ASK]},
             "messages.0.content.0: only text, thinking or tool_use blocks"),
            ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
             "messages.0.content.0.tool_use_id"),
            ({"tools": [{"name": "f"}]}, "tools.0.input_schema: field required"),
            ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools.1.name: 'get_weather' is given twice"),
            ({"tool_choice": {"type": "some"}}, "tool_choice.type: must be")):
        with pytest.raises(ApiError) as e:
            parsed(**body)
        assert e.value.message.startswith(message) and e.value.status == 400, e.value.message


@pytest.mark.anyio
async def test_a_choice_streams_its_events_and_an_engine_failure_ends_it_as_one_line() -> None:
    # What Ollama's NDJSON and Anthropic's SSE streams iterate: events up to the Done, and the engine's failure as
    # GenerationFailed, whose message is the stream's last line.
    import asyncio

    from mlxchat.core.decode.events import Metrics, TokenEvent
    from mlxchat.server.service import Choice, GenerationFailed

    choice = Choice(asyncio.get_running_loop(), [1, 2], SamplingProfile(), 4, 0)
    choice.request.emit(TokenEvent("Hi", (5,), Metrics()))
    choice.request.emit(RuntimeError("out of memory"))
    got = []
    with pytest.raises(GenerationFailed, match="^generation failed: out of memory$"):
        async for event in choice.stream():
            got.append(event.text)
    assert got == ["Hi"]


def test_llama_cpp_samplers_in_each_api_and_their_errors() -> None:
    """llama.cpp's samplers under llama.cpp server's names reach the profile on Anthropic's API (the SDK's
    extra_body) too, and a bad value is that API's 400 naming the field, the value and the range."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "dry_multiplier": 0.8,
            "top_n_sigma": 1.5, "adaptive_p_target": 0.3}
    p = messages_api.parse(body, served="m", base=SamplingProfile()).profile
    assert (p.dry_multiplier, p.top_n_sigma, p.adaptive_p_target) == (0.8, 1.5, 0.3)
    for field, value, message in (("dry_multiplier", -1.0, "dry_multiplier must be at least 0 (0 disables), got -1.0"),
                                  ("dry_base", 1.0, "dry_base must be greater than 1, got 1.0"),
                                  ("mirostat_tau", 0.0, "mirostat_tau must be greater than 0, got 0.0"),
                                  ("dry_sequence_breakers", ["\n", 2],
                                   "dry_sequence_breakers must be a list of non-empty strings, got 2")):
        with pytest.raises(ApiError) as e:
            messages_api.parse({**body, field: value}, served="m", base=SamplingProfile())
        assert e.value.status == 400 and e.value.message.startswith(message)  # Anthropic's errors name no param
