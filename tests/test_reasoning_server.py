"""A thinking model behind a real server (issue 40): OpenAI's `reasoning_content`, Ollama's `think` and `thinking`,
Anthropic's `thinking` blocks and `thinking_delta` events, the budget and the thinking switch on each, streamed or
not; the answer never holds a marker or reasoning. One server for the module (tests/thinking_models.py's model)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

STORY = "Write a story about a cat."
BUDGET = 4


@pytest.fixture(scope="module")
def url(serve_module, thinking_file: Path) -> str:  # noqa: ANN001 - conftest's factory
    return serve_module("--model", str(thinking_file))


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def _clean(answer: str, reasoning: str) -> None:
    assert answer and reasoning
    assert "think>" not in answer and "think>" not in reasoning


def test_openai_reasoning_content_streamed_and_not(url: str) -> None:
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 12, "temperature": 0,
            "reasoning_budget": BUDGET}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    message = whole["choices"][0]["message"]
    _clean(message["content"], message["reasoning_content"])
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET  # exact, as OpenAI counts it
    chunks = _sse(httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    # The reasoning comes first, then the answer: no delta after the first answer text carries reasoning.
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_answer:])
    # The switch, through vLLM's chat_template_kwargs: no reasoning at all.
    off = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        **body, "chat_template_kwargs": {"enable_thinking": False}}).json()["choices"][0]["message"]
    assert "reasoning_content" not in off and off["content"]
    # OpenAI's reasoning_effort is accepted (its budget is documented); a bad value is one line naming the field.
    effort = {**body, "reasoning_budget": None, "reasoning_effort": "minimal"}
    assert httpx.post(f"{url}/v1/chat/completions", json=effort, timeout=120).status_code == 200
    for bad, field, says in (({"reasoning_budget": -1}, "reasoning_budget",
                              "reasoning_budget must be an integer of 0"),
                             ({"reasoning_effort": "max"}, "reasoning_effort", "reasoning_effort must be one of"),
                             ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs",
                              "chat_template_kwargs.enable_thinking must be true or false"),
                             ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
                              "chat_template_kwargs.tokenize: the server sets it")):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert r.json()["error"]["message"].startswith(says)


def test_ollama_think_and_thinking(url: str) -> None:
    body = {"model": "thinking", "messages": [{"role": "user", "content": STORY}], "stream": False,
            "options": {"temperature": 0, "num_predict": 12}}
    name = httpx.get(f"{url}/api/tags", timeout=30).json()["models"][0]["name"]
    body["model"] = name
    assert "thinking" in httpx.post(f"{url}/api/show", json={"model": name}, timeout=30).json()["capabilities"]
    whole = httpx.post(f"{url}/api/chat", json={**body, "think": "low"}, timeout=120).json()["message"]
    assert whole["thinking"] and "think>" not in whole["thinking"]
    lines = [json.loads(x) for x in httpx.post(f"{url}/api/chat", json={**body, "think": "low", "stream": True},
                                               timeout=120).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines) == whole["thinking"]
    assert "".join(x["message"]["content"] for x in lines) == whole["content"]
    off = httpx.post(f"{url}/api/chat", json={**body, "think": False}, timeout=120).json()["message"]
    assert "thinking" not in off and off["content"] and "think>" not in off["content"]
    gen = httpx.post(f"{url}/api/generate", json={"model": name, "prompt": STORY, "stream": False, "think": False,
                                                  "options": {"temperature": 0, "num_predict": 8}}, timeout=120).json()
    assert "thinking" not in gen and gen["response"]
    bad = httpx.post(f"{url}/api/chat", json={**body, "think": "max"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"].startswith("think must be true, false or one of")


def test_anthropic_thinking_blocks_and_deltas(url: str) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": STORY}],
            "thinking": {"type": "enabled", "budget_tokens": BUDGET}}
    whole = httpx.post(f"{url}/v1/messages", json=body, timeout=120).json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    _clean(whole["content"][1]["text"], whole["content"][0]["thinking"])
    events = _sse(httpx.post(f"{url}/v1/messages", json={**body, "stream": True}, timeout=120))
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas if d["type"] == "thinking_delta") == \
        whole["content"][0]["thinking"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == whole["content"][1]["text"]
    # History's thinking blocks are accepted (the template strips old thinking); the switch turns it off.
    follow = {**body, "thinking": {"type": "disabled"}, "messages": [
        {"role": "user", "content": STORY}, {"role": "assistant", "content": whole["content"]},
        {"role": "user", "content": "Shorter."}]}
    off = httpx.post(f"{url}/v1/messages", json=follow, timeout=120).json()
    assert [b["type"] for b in off["content"]] == ["text"]
