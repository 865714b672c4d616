"""A seed reproduces a reply on every path (issue 21): the same seeded request gives one text as a chat's second turn
(its prefix in the KV cache from the first turn's decode), as a fresh request (the whole prompt prefilled), as a row
of a batch of 4 (one GEMM over the rows), through `mlxchat serve`, and traced. The draw's noise belongs to
(seed, position, token id) (core/sampling/draw.py), so last-bit logit differences between these paths move nothing."""

from __future__ import annotations

import queue

import httpx
import pytest

from mlxchat.core import Engine, GenerationResult, SamplingProfile
from mlxchat.core.model import loader
from mlxchat.core.batch import BatchRequest, BatchScheduler
from mlxchat.core.decode.events import Done

FIRST, SECOND = "Name a fruit, in one word.", "Now write two sentences about its colour."
OTHERS = ["What is the capital of France?", "Count from one to ten.", "Write a haiku about the sea."]
TOKENS = 24


def _profile(seed: int) -> SamplingProfile:
    return SamplingProfile.preset("chat").model_copy(update={"seed": seed})


def _batched(engine: Engine, messages: list[dict[str, str]], profile: SamplingProfile) -> GenerationResult:
    """The request as the second row of a batch of 4 whose other rows are different prompts."""
    s = BatchScheduler(engine, max_batch=4, prefix_cache_bytes=0)
    queues: list[queue.Queue] = []
    for msgs in [[{"role": "user", "content": OTHERS[0]}], messages,
                 *([{"role": "user", "content": o}] for o in OTHERS[1:])]:
        q: queue.Queue = queue.Queue()
        s.submit(BatchRequest(engine.model.tokenizer.encode_chat(msgs), profile, q.put, max_tokens=TOKENS))
        queues.append(q)
    results = []
    for q in queues:
        while not isinstance(event := q.get(timeout=300), Done):
            if isinstance(event, BaseException):
                raise event
        results.append(event.result)
    return results[1]


def _turn_two(engine: Engine, profile: SamplingProfile) -> tuple[list[dict[str, str]], GenerationResult]:
    chat = engine.chat(profile=profile)
    chat.send(FIRST, max_tokens=TOKENS).wait()
    second = chat.send(SECOND, max_tokens=TOKENS).wait()
    assert second.metrics.cached_tokens > 0  # the first turn's cache was reused, not prefilled again
    return [m.as_prompt() for m in chat.messages[:-1]], second


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chat_turn_two_fresh_batched_and_traced_give_one_text(engine: Engine, seed: int) -> None:
    profile = _profile(seed)
    messages, chat_reply = _turn_two(engine, profile)
    fresh = engine.generate(messages, profile=profile, max_tokens=TOKENS)
    traced = engine.generate(messages, profile=profile, max_tokens=TOKENS, trace=5)
    batched = _batched(engine, messages, profile)
    assert len(chat_reply.token_ids) > 3
    assert fresh.token_ids == chat_reply.token_ids
    assert traced.token_ids == chat_reply.token_ids
    assert batched.token_ids == chat_reply.token_ids
    assert {fresh.text, traced.text, batched.text} == {chat_reply.text}


def test_the_server_gives_the_same_seeded_text(engine: Engine, serve) -> None:
    url = serve()
    for seed in (1, 2):
        messages, chat_reply = _turn_two(engine, _profile(seed))
        body = {"messages": messages, "profile": "chat", "seed": seed, "max_tokens": TOKENS}
        served = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
        assert served["choices"][0]["message"]["content"] == chat_reply.text


def test_the_fp32_fallback_path_is_consistent_too(engine: Engine) -> None:
    """Without the native kernel (fp32 weights through BLAS) the arithmetic differs, and so may the text; within
    that path every route still agrees."""
    fallback = engine.with_model(engine.run(lambda: loader.load(None, "dequantize")))
    profile = _profile(1)
    messages, chat_reply = _turn_two(fallback, profile)
    assert fallback.generate(messages, profile=profile, max_tokens=TOKENS).token_ids == chat_reply.token_ids
    assert _batched(fallback, messages, profile).token_ids == chat_reply.token_ids
