"""`mlxchat serve` for real: the server in a subprocess on a free 127.0.0.1 port, driven by the official `openai`
client and by raw httpx (for the SSE bytes). One server per purpose, started once for the module."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from mlxchat.core.model.loader import EMBEDDED_FILE

HOST = "127.0.0.1"
KEY = "test-key-123"
MODEL = Path(EMBEDDED_FILE).stem  # the name the server serves the embedded model under
GREEDY = {"temperature": 0}
FOX = "the quick brown fox jumps over the lazy dog."


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLXCHAT_API_KEY"}  # the key, if any, comes from flags
    proc = subprocess.Popen([sys.executable, "-m", "mlxchat.app.cli", "serve", "--host", HOST, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
            output: list[str] = []
            proc.output = output  # type: ignore[attr-defined] - what it printed after starting
            threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()  # keep the pipe drained
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the server did not start: {proc.stdout.read() if proc.stdout else ''}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = _start("--max-concurrent", "4", "--max-body-mb", "0.1")
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def tight() -> Iterator[str]:
    """One slot, no queue, an API key: for 401, 429 and the disconnect test."""
    proc, url = _start("--max-concurrent", "1", "--max-queue", "0", "--api-key", KEY, "--cors", "http://app.test")
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _chat(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _sse(url: str, path: str, body: dict) -> tuple[bytes, list[dict]]:
    raw = httpx.post(url + path, json={**body, "stream": True}, timeout=60).content
    chunks = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    return raw, chunks


# --- endpoints --------------------------------------------------------------------------------------------------

def test_models_and_health(client: openai.OpenAI, server: str) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].context_length > 0
    assert client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["model"] == models[0].id == MODEL


def test_an_unknown_model_is_a_404_naming_it_and_no_model_means_the_served_one(server: str) -> None:
    for path, body in (("/v1/chat/completions", {"messages": _msgs("Hi")}), ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(server + path, json={**body, "model": "gpt-4o", "max_tokens": 2}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert "'gpt-4o'" in error["message"] and MODEL in error["message"]
        assert httpx.post(server + path, json={**body, "max_tokens": 2}, timeout=60).status_code == 200
    assert httpx.get(server + "/v1/models/gpt-4o").json()["error"]["code"] == "model_not_found"


def test_model_ids_are_names_not_paths(server: str) -> None:
    """The embedded model loads from a file in site-packages: /v1/models shows its name, not where it lies."""
    card = httpx.get(server + "/v1/models").json()["data"][0]
    assert card["id"] == MODEL and not any("/" in str(v) for v in card.values())


def test_chat_completion_reports_usage_seed_and_timings(client: openai.OpenAI, server: str) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Say hello."), max_tokens=8, seed=11, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    extra = r.model_extra
    assert extra["seed"] == 11
    t = extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    assert t["ttft_ms"] > 0


def test_text_completion_and_max_completion_tokens(client: openai.OpenAI, server: str) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Count to twenty."), max_completion_tokens=3,
                                       **GREEDY)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stream_bytes_usage_and_final_chunk(server: str) -> None:
    body = {"messages": _msgs("Name three colors."), "max_tokens": 10, **GREEDY}
    plain = _chat(server, body).json()
    raw, chunks = _sse(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert raw.startswith(b"data: {") and raw.endswith(b"data: [DONE]\n\n")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert final[0]["timings"]["predicted_n"] == plain["usage"]["completion_tokens"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    # Without include_usage there is no usage chunk.
    _, chunks = _sse(server, "/v1/chat/completions", body)
    assert all(c["choices"] for c in chunks)


def test_text_completion_stream_with_openai_client(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, **GREEDY)
    parts = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
    assert "".join(p.choices[0].text for p in parts if p.choices) == plain.choices[0].text
    assert parts[-1].usage.completion_tokens == 6


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    msgs = _msgs("Count from one to ten, in digits.")
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, **GREEDY)
    full = full.choices[0].message.content
    stop = full.strip()[3:5]
    assert stop
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, stop=[stop], **GREEDY).choices[0]
    assert cut.message.content == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    ask = dict(model=MODEL, messages=_msgs("Write a word."), max_tokens=8, temperature=1.2, seed=1234)
    a, b = (client.chat.completions.create(**ask).choices[0].message.content for _ in range(2))
    assert a == b


def test_logprobs(client: openai.OpenAI, server: str) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Hi"), max_tokens=4, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy takes the most likely token
    _, chunks = _sse(server, "/v1/chat/completions", {"messages": _msgs("Hi"), "max_tokens": 4, "logprobs": True,
                                                       "top_logprobs": 3, **GREEDY})
    streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["logprob"] for t in streamed] == pytest.approx([t.logprob for t in content])
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "logprobs": 2, **GREEDY},
                   timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3 and all(len(t) <= 2 for t in lp["top_logprobs"])


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Pick a number."), max_tokens=6, n=2, seed=5,
                                       temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 12  # both choices' tokens, the prompt counted once


def test_extra_sampler_fields_and_profile(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Hi"), max_tokens=3, seed=3, extra_body={
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "profile": "creative",
        "sampler_order": ["top_n_sigma", "top_k", "min_p", "temperature"], "top_n_sigma": 2.0,
        "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"], "dynatemp_range": 0.3})
    assert r.usage.completion_tokens >= 2
    r = client.chat.completions.create(model=MODEL, messages=_msgs("Hi"), max_tokens=3, seed=3, extra_body={
        "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2})
    assert r.usage.completion_tokens >= 1


def test_resent_conversation_prefills_only_the_suffix(client: openai.OpenAI) -> None:
    msgs = _msgs("Tell me about cats in one sentence.")
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **GREEDY)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And dogs?"}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything but the new turn (and the template's tokens around it) comes from the cache.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert second.usage.prompt_tokens - cached < 16


# --- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "status", "words"), [
    (b"{not json", 400, "not valid JSON"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "not valid UTF-8"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"messages": []}).encode(), 400, "messages must not be empty"),
    (json.dumps({"messages": _msgs("  ")}).encode(), 400, "no user content"),
    (json.dumps({"messages": "hello"}).encode(), 400, "messages"),
    (json.dumps({"messages": _msgs("hi"), "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"messages": _msgs("hi"), "temperature": 3}).encode(), 400, "between 0 and 2"),
    (json.dumps({"messages": _msgs("hi"), "top_p": 0}).encode(), 400, "top_p must be greater than 0"),
    (json.dumps({"messages": _msgs("hi"), "dry_base": 1}).encode(), 400, "dry_base must be greater than 1, got 1"),
    (json.dumps({"messages": _msgs("hi"), "dry_sequence_breakers": ["\n", 7]}).encode(), 400,
     "dry_sequence_breakers must be a list of non-empty strings, got 7"),
    (json.dumps({"messages": _msgs("hi"), "mirostat_tau": -1}).encode(), 400, "mirostat_tau must be greater than 0"),
    (json.dumps({"messages": _msgs("hi"), "max_tokens": 0}).encode(), 400, "max_tokens must be at least 1"),
    (json.dumps({"messages": _msgs("hi"), "min_tokens": 2000}).encode(), 400,
     "min_tokens (2000) must not exceed max_tokens (1024)"),
    (json.dumps({"messages": _msgs("hi"), "logit_bias": {"5": 200}}).encode(), 400, "between -100 and 100"),
    (json.dumps({"messages": _msgs("hi"), "logit_bias": {"99999999": 1}}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"messages": _msgs("hi"), "n": 0}).encode(), 400, "n must be between"),
    (json.dumps({"messages": _msgs("hi"), "tools": [{"type": "function"}]}).encode(), 400, "tools[0]: must be"),
    (json.dumps({"messages": _msgs("hi"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}).encode(), 400, "response_format.json_schema.schema.type: 'strin'"),
    (json.dumps({"messages": _msgs("hi"), "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}]}).encode(), 400,
     "tools[0].function.parameters: "),
    (json.dumps({"messages": _msgs("hi"), "tools": [{"type": "function", "function": {"name": "f"}}],
                 "tool_choice": {"type": "function", "function": {"name": "g"}}}).encode(), 400,
     "tool_choice.function.name: 'g' is not one of the tools: f"),
    (json.dumps({"messages": _msgs("hi"), "functions": [{"name": "f"}]}).encode(), 400, "functions is not supported"),
    (json.dumps({"messages": _msgs("hi"), "frobnicate": 1}).encode(), 400, "unrecognized request field: frobnicate"),
    (json.dumps({"messages": _msgs("hi"), "profile": "nope"}).encode(), 400, "unknown profile"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), 400, "messages[0].tool_call_id: a tool"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "role"),
    (json.dumps({"messages": _msgs("x" * 200_000)}).encode(), 413, "over"),
])
def test_bad_requests_get_one_clear_400(server: str, body: bytes, status: int, words: str) -> None:
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and "Traceback" not in r.text
    assert httpx.get(server + "/health").status_code == 200  # and the server keeps serving


def test_param_names_the_field(server: str) -> None:
    err = _chat(server, {"messages": _msgs("hi"), "presence_penalty": 9}).json()["error"]
    assert err["param"] == "presence_penalty" and "between -2 and 2" in err["message"]


def test_prompt_over_the_context(server: str, client: openai.OpenAI) -> None:
    context = client.models.list().data[0].context_length
    r = httpx.post(server + "/v1/completions", json={"prompt": "hello " * (context + 10)}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_unknown_route_is_json_404(server: str) -> None:
    r = httpx.get(server + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# --- API key, queue, disconnect (one slot, no queue) ------------------------------------------------------------

def test_api_key(tight: str) -> None:
    assert _chat(tight, {"messages": _msgs("hi"), "max_tokens": 1}).status_code == 401
    assert _chat(tight, {"messages": _msgs("hi"), "max_tokens": 1}, key="wrong").status_code == 401
    assert httpx.get(tight + "/v1/models").status_code == 401
    ok = openai.OpenAI(base_url=tight + "/v1", api_key=KEY, max_retries=0)
    assert ok.chat.completions.create(model=MODEL, messages=_msgs("hi"), max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tight + "/v1", api_key="nope", max_retries=0).models.list()


def _running(url: str) -> int:
    return httpx.get(url + "/health").json()["running"]


def test_full_server_says_429_and_a_disconnect_frees_the_slot(tight: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": _msgs("Write a long story about a dragon."), "max_tokens": 2000, "stream": True,
            "min_tokens": 2000}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", tight + "/v1/chat/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if '"content": "' in line and '"role"' not in line)
            busy = _chat(tight, {"messages": _msgs("hi"), "max_tokens": 1}, key=KEY)
            assert busy.status_code == 429 and busy.headers["retry-after"]
            assert busy.json()["error"]["type"] == "rate_limit_error"
        # The client hung up: its sequence is cancelled at the next token and the slot frees.
        deadline = time.monotonic() + 10
        while _running(tight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(tight) == 0
    assert _chat(tight, {"messages": _msgs("hi"), "max_tokens": 1}, key=KEY).status_code == 200


# --- batching ---------------------------------------------------------------------------------------------------

def test_four_concurrent_streams_each_equal_their_solo_greedy_text(server: str) -> None:
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to ten.",
               "Explain gravity to a child in two sentences, please, and keep it short."]
    solo = [_chat(server, {"messages": _msgs(p), "max_tokens": 12, **GREEDY}).json()["choices"][0]["message"]
            ["content"] for p in prompts]
    out: list[str | None] = [None] * 4
    peak = [0]
    barrier = threading.Barrier(4)

    def one(i: int) -> None:
        barrier.wait()
        _, chunks = _sse(server, "/v1/chat/completions", {"messages": _msgs(prompts[i]), "max_tokens": 12, **GREEDY})
        out[i] = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], _running(server))
        time.sleep(0.02)
    assert out == solo
    assert peak[0] >= 2  # they really ran together


def test_a_short_soak_with_faults(server: str) -> None:
    """scripts/soak_server.py for 2 s (`make soak` runs it for 2 minutes): clients that hang up, oversize and malformed
    bodies among greedy completions; every completed reply equals the request alone, /health stays fast, and the
    memory requests held is given back."""
    spec = importlib.util.spec_from_file_location("soak_server", Path(__file__).parent.parent / "scripts" /
                                                  "soak_server.py")
    soak = sys.modules.setdefault("soak_server", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(soak)
    summary = soak.soak(server, clients=4, duration=2, max_body_bytes=int(0.1 * 2**20), seed=1,
                        questions=soak.QUESTIONS[:2], max_tokens=(6,))
    assert summary["violations"] == [] and summary["completed"] >= 2
    assert {"malformed", "oversize", "drop-stream", "stream"} <= set(summary["sent"])  # one first request each


# --- CORS and flags ---------------------------------------------------------------------------------------------

def _preflight(url: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://app.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_is_off_unless_asked(server: str, tight: str) -> None:
    assert "access-control-allow-origin" not in _preflight(server).headers
    allowed = _preflight(tight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://app.test"


@pytest.mark.parametrize(("flags", "words"), [
    (["--max-concurrent", "0"], "--max-concurrent must be at least 1"),
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["--api-key", " "], "--api-key is empty"),
    (["--profile", "nope"], "unknown profile"),
])
def test_bad_flags_are_one_line(flags: list[str], words: str, capsys: pytest.CaptureFixture) -> None:
    from mlxchat.app.cli import main

    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_ctrl_c_stops_with_one_line() -> None:
    import signal

    proc, url = _start()
    assert httpx.get(url + "/health").status_code == 200
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 130
    time.sleep(0.2)  # the drain thread reads the last lines
    said = "".join(proc.output)
    assert "mlxchat: stopped" in said and "Traceback" not in said


def test_trace_extension_field_streams_and_round_trips(server: str) -> None:
    from mlxchat.core.sampling.trace import TokenTrace

    body = {"messages": _msgs("Name three colors."), "max_tokens": 6, "seed": 3, "temperature": 0.8, "top_k": 10,
            "trace": 4}
    plain = _chat(server, body).json()
    traces = [TokenTrace.from_dict(t) for t in plain["choices"][0]["traces"]]
    assert len(traces) == plain["usage"]["completion_tokens"]
    assert traces[0].stages == ("processed", "TopK(10)", "TopP(0.9)", "Temperature(0.8)")  # over the chat preset
    raw, chunks = _sse(server, "/v1/chat/completions", body)
    streamed = [TokenTrace.from_dict(c["choices"][0]["trace"]) for c in chunks
                if c["choices"] and "trace" in c["choices"][0]]
    assert [t.chosen.token_id for t in streamed] == [t.chosen.token_id for t in traces]  # same seed, same tokens
    assert all(len(t.candidates) == 4 and t.chosen.removed_by is None for t in streamed)
    assert b"Infinity" not in raw and b"NaN" not in raw  # strict JSON
    _, untraced = _sse(server, "/v1/chat/completions", {k: v for k, v in body.items() if k != "trace"})
    assert not any("trace" in c["choices"][0] for c in untraced if c["choices"])
    for bad in (-1, 101, "3"):
        r = _chat(server, {**body, "trace": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "trace"
        assert r.json()["error"]["message"].startswith("trace")
    assert "between 0 and 100" in _chat(server, {**body, "trace": 101}).json()["error"]["message"]


# --- constrained decoding and tool calls (issue 22) -------------------------------------------------------------

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "sunny"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Rome"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}}]


def test_response_format_and_tool_calls_with_the_openai_client(client: openai.OpenAI) -> None:
    # Two choices are two rows of the batch, each with its own constraint; sampled at temperature 1.
    r = client.chat.completions.create(model=MODEL, messages=_msgs("The weather in Rome?"), n=2, seed=3, max_tokens=24,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "weather", "schema": WEATHER, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    ask = _msgs("What is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=40, **GREEDY)
    message, finish = r.choices[0].message, r.choices[0].finish_reason
    call = message.tool_calls[0]
    assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    # Streamed: the call arrives as delta.tool_calls, the same call, and the stream ends with "tool_calls".
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=40, stream=True, **GREEDY))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
        [(0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and its result go back through the chat template (the same tools: the prefix is cached).
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"sunny": true}'}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1, **GREEDY)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + 20  # the call and the result were rendered
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 8


def test_the_server_speculates_to_the_same_text_and_the_timings_say_what_ran(server: str) -> None:
    ask = {"messages": _msgs(f"Repeat exactly: {FOX} {FOX}"), "max_tokens": 16, **GREEDY}
    plain, spec = (_chat(server, {**ask, "speculative": mode}).json() for mode in ("off", "ngram"))
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    t = spec["timings"]
    assert t["speculative"] == "ngram" and t["draft_n_accepted"] > 0, t  # alone, the request verified guesses
    for mode, words in (("draft", "needs a draft model"), ("fast", "speculative must be one of off, ngram, auto")):
        err = _chat(server, {"messages": _msgs("hi"), "speculative": mode}).json()["error"]
        assert err["param"] == "speculative" and words in err["message"]
    err = _chat(server, {"messages": _msgs("hi"), "best_of": 3}).json()["error"]  # beam search: refused, one line
    assert err["param"] == "best_of" and "beam search" in err["message"]
