"""Tool calls through `mlxchat serve` with the official clients (issue 36): OpenAI's, Anthropic's and Ollama's SDKs
against a real server on a free 127.0.0.1 port, on the embedded model. Each choice (a named function, required,
one call only, auto) streamed and not, greedy and seeded at temperature 0.7, with one tool and two, max_tokens 200:
every reply ends as its API promises, with as many calls as the choice allows, arguments valid under the tool's
schema (`jsonschema`), never the same call twice and never call markup in the answer. Bad tools are a 400 in each
API's own error shape naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from mlxchat.core.model.loader import EMBEDDED_FILE

MODEL = EMBEDDED_FILE.removesuffix(".gguf")
ASK = "What is the weather in Paris?"
CITY = {"type": "object", "required": ["city"],  # no additionalProperties: the server reads it as false
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
ZONE = {"type": "object", "required": ["timezone"], "properties": {"timezone": {"type": "string"}}}
SPECS = {"get_weather": ("The current weather in a city", CITY), "get_time": ("The current time in a timezone", ZONE)}
MARKUP = ("<tool_call", "</tool_call")
# Each choice: greedy with two tools, streamed and not (the same reply); seeded at 0.7 with one tool and with two,
# streamed and not. Four settings, not seven: the suite's time budget (these two tests took ~50 s of it).
SETTINGS = [(0.0, None, 2, False), (0.0, None, 2, True), (0.7, 1, 1, False), (0.7, 2, 2, True)]
MAX_TOKENS = 200


@dataclass(frozen=True)
class Case:
    api: str
    choice: str  # "named", "one" (required, one call only), "required", "auto"
    temperature: float
    seed: int | None
    tools: int
    stream: bool


@dataclass
class Reply:
    """A reply in common terms: "calls" (OpenAI's tool_calls, Anthropic's tool_use), "stop" or "length"."""

    finish: str
    calls: list[tuple[str, dict[str, Any]]]
    text: str
    raw: Any = None


@pytest.fixture(scope="module")
def url(serve_module: Callable[..., str]) -> str:
    return serve_module()


def openai_tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "description": d, "parameters": p}}
            for name, (d, p) in list(SPECS.items())[:n]]


def anthropic_tools(n: int) -> list[dict[str, Any]]:
    return [{"name": name, "description": d, "input_schema": p} for name, (d, p) in list(SPECS.items())[:n]]


def ask_openai(url: str, case: Case) -> Reply:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    choice = {"named": {"type": "function", "function": {"name": "get_weather"}}, "one": "required",
              "required": "required", "auto": "auto"}[case.choice]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": ASK}],
                              "tools": openai_tools(case.tools), "tool_choice": choice, "max_tokens": MAX_TOKENS,
                              "temperature": case.temperature, "seed": case.seed}
    if case.choice == "one":
        kwargs["parallel_tool_calls"] = False
    finishes = {"tool_calls": "calls", "stop": "stop", "length": "length"}
    if not case.stream:
        r = client.chat.completions.create(**kwargs)
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return Reply(finishes[r.choices[0].finish_reason], calls, m.content or "", r)
    text, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            for call in c.delta.tool_calls or []:  # each call whole in one delta, its index counting up
                assert call.index == len(calls) and call.id and call.type == "function"
                calls.append((call.function.name, json.loads(call.function.arguments)))
            finish = c.finish_reason or finish
    return Reply(finishes[finish], calls, text)


def ask_anthropic(url: str, case: Case) -> Reply:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    choice = {"named": {"type": "tool", "name": "get_weather"}, "one": {"type": "any",
                                                                        "disable_parallel_tool_use": True},
              "required": {"type": "any"}, "auto": {"type": "auto"}}[case.choice]
    extra = {"temperature": case.temperature, **({"seed": case.seed} if case.seed is not None else {})}
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": ASK}],
                              "tools": anthropic_tools(case.tools), "tool_choice": choice, "extra_body": extra}
    if case.stream:
        with client.messages.stream(**kwargs) as stream:
            deltas = "".join(e.delta.text for e in stream if e.type == "content_block_delta"
                             and e.delta.type == "text_delta")
            r = stream.get_final_message()
        assert not any(m in deltas for m in MARKUP), deltas
    else:
        r = client.messages.create(**kwargs)
    finishes = {"tool_use": "calls", "end_turn": "stop", "max_tokens": "length"}
    calls = [(b.name, b.input) for b in r.content if b.type == "tool_use"]
    text = "".join(b.text for b in r.content if b.type == "text")
    return Reply(finishes[r.stop_reason], calls, text, r)


def ask_ollama(url: str, case: Case) -> Reply:
    client = ollama.Client(host=url)
    options = {"temperature": case.temperature, "num_predict": MAX_TOKENS,
               **({"seed": case.seed} if case.seed is not None else {})}
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": ASK}],
                              "tools": openai_tools(case.tools), "options": options}
    parts = list(client.chat(**kwargs, stream=True)) if case.stream else [client.chat(**kwargs)]
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    text = "".join(p.message.content or "" for p in parts)
    calls = [(c.function.name, dict(c.function.arguments)) for p in parts for c in p.message.tool_calls or []]
    finish = "calls" if calls and parts[-1].done_reason == "stop" else parts[-1].done_reason
    return Reply(finish, calls, text)


ASKERS = {"openai": ask_openai, "anthropic": ask_anthropic, "ollama": ask_ollama}


def check(case: Case, r: Reply) -> None:
    """What the API promises for the case (see the module docstring)."""
    assert not any(m in r.text for m in MARKUP), r.text
    for name, arguments in r.calls:
        jsonschema.validate(arguments, SPECS[name][1])
    assert len({(n, json.dumps(a, sort_keys=True)) for n, a in r.calls}) == len(r.calls), r.calls  # never twice
    if case.choice == "named":
        assert r.finish == "calls" and [n for n, _ in r.calls] == ["get_weather"]
    elif case.choice == "one":
        assert r.finish == "calls" and len(r.calls) == 1
    elif case.choice == "required":
        assert r.finish == "calls" and r.calls
    elif r.calls:  # auto, and the model called
        assert r.finish == "calls" and not r.text.strip()
    else:  # auto, and the model answered: text, ended by the model or cut as any text is
        assert r.finish in ("stop", "length") and r.text.strip()


def cases(api: str, choices: tuple[str, ...]) -> list[Case]:
    return [Case(api, c, t, s, n, stream) for c in choices for t, s, n, stream in SETTINGS]


@pytest.mark.parametrize("api,choices", [("openai", ("named", "required", "one", "auto")),
                                         ("anthropic", ("named", "required", "one", "auto")),
                                         ("ollama", ("auto",))])  # Ollama has no tool_choice: always auto
def test_every_choice_ends_as_the_api_promises(url: str, api: str, choices: tuple[str, ...]) -> None:
    todo = cases(api, choices)
    with ThreadPoolExecutor(8) as pool:  # the server decodes them in one batch
        replies = list(pool.map(lambda case: ASKERS[api](url, case), todo))
    for case, reply in zip(todo, replies):
        try:
            check(case, reply)
        except AssertionError as e:
            raise AssertionError(f"{case}: {reply}") from e
    # Greedy, the same request streamed or not is the same reply.
    by_case = dict(zip(todo, replies))
    for c in todo:
        if c.temperature == 0 and c.stream:
            plain = by_case[Case(c.api, c.choice, 0.0, None, c.tools, False)]
            assert (by_case[c].finish, by_case[c].calls, by_case[c].text) == (plain.finish, plain.calls, plain.text)


def test_a_call_cut_by_max_tokens_is_dropped_and_the_reply_says_length(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 12,
                              "tools": openai_tools(2), "tool_choice": "required", "temperature": 0}
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert not any(m in (r.choices[0].message.content or "") for m in MARKUP)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert not any(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in chunks if c.choices)
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": ASK}], tools=anthropic_tools(2),
        tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert a.stop_reason == "max_tokens" and [(b.type, b.text) for b in a.content] == [("text", "")]


NOT_AN_OBJECT = "city"
UNENFORCEABLE = {"type": "object", "properties": {"city": {"type": "string", "not": {"const": ""}}}}


def test_bad_tools_are_a_400_in_each_apis_shape_naming_the_field(url: str) -> None:
    ask = [{"role": "user", "content": ASK}]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    weather = openai_tools(1)
    for kwargs, param, message in [
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": NOT_AN_OBJECT}}]}, "tools",
             "tools[0].function.parameters: must be a JSON Schema object"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
             'tools[0].function.parameters: must be a schema of "type": "object"'),
            ({"tools": weather, "tool_choice": {"type": "function", "function": {"name": "clock"}}}, "tool_choice",
             "tool_choice.function.name: 'clock' is not one of the tools: get_weather"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": UNENFORCEABLE}}]}, "tools",
             "tools[0].function.parameters: the constraint cannot enforce the JSON Schema keyword(s) not"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "uniqueItems": True}}}}, "response_format",
             "response_format.json_schema.schema: the constraint cannot enforce the JSON Schema keyword(s) "
             "uniqueItems")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, **kwargs)
        error = e.value.body
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert error["message"].startswith(message), error

    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tool = anthropic_tools(1)
    for kwargs, message in [
            ({"tools": [{"name": "f", "input_schema": NOT_AN_OBJECT}]},
             "tools.0.input_schema: must be a JSON Schema object"),
            ({"tools": tool, "tool_choice": {"type": "tool", "name": "clock"}},
             "tool_choice.name: 'clock' is not one of the tools: get_weather"),
            ({"tools": [{"name": "f", "input_schema": UNENFORCEABLE}]},
             "tools.0.input_schema: the constraint cannot enforce the JSON Schema keyword(s) not")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model=MODEL, max_tokens=4, messages=ask, **kwargs)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(message), body

    # The ollama client rebuilds tools through its own model, which drops what it does not know ("not") and refuses
    # a string: other Ollama clients send the JSON as it is, so these go as raw JSON.
    for body, message in [
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": NOT_AN_OBJECT}}]},
             "tools[0].function.parameters: must be a JSON Schema object"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": UNENFORCEABLE}}]},
             "tools[0].function.parameters: the constraint cannot enforce the JSON Schema keyword(s) not"),
            ({"format": {"type": "array", "uniqueItems": True}},
             "format: response_format.json_schema.schema: the constraint cannot enforce")]:
        r = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": ask, "stream": False, **body}, timeout=60)
        assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"].startswith(message), r.text
