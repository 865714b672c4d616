"""One text layer (core/decode/reply.py) for the engine's solo path and the batch scheduler, on the real embedded model:
the same request gives the same text, finish reason and ids on both, whether it ends at a stop string that spans tokens,
at max_tokens (also inside a multi-byte character, issue 27 item 2) or at a cancel (which keeps held-back text)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path

import pytest

from mlxchat.core import Engine, GenerationResult, SamplingProfile, TokenEvent
from mlxchat.core.batch import BatchRequest, BatchScheduler
from mlxchat.core.decode.events import Done, Event

COUNT = "Count from 1 to 10, separated by commas."  # greedy: "1, 2, 3, ..., 10", one token per digit, comma, space
EMOJI = "Reply with three emojis that describe happiness."  # greedy: emojis of several tokens each


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.model.tokenizer.encode_chat([{"role": "user", "content": text}])


def _batched(engine: Engine, text: str, profile: SamplingProfile, cancel_after: int | None = None,
             **kw) -> tuple[GenerationResult, list[str]]:
    """The request through a BatchScheduler: its result and its streamed deltas. `cancel_after=n` cancels it from
    its own event callback once n tokens came, so the cancel lands after exactly n tokens."""
    events: queue.Queue[Event | BaseException] = queue.Queue()
    tokens = 0

    def emit(event: Event | BaseException) -> None:
        nonlocal tokens
        if isinstance(event, TokenEvent):
            tokens += len(event.token_ids)
            if tokens == cancel_after:
                req.cancel()
        events.put(event)

    req = BatchRequest(_ids(engine, text), profile, emit, **kw)
    BatchScheduler(engine, max_batch=2, prefix_cache_bytes=0).submit(req)
    deltas = []
    while True:
        event = events.get(timeout=120)
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, TokenEvent):
            deltas.append(event.text)
        if isinstance(event, Done):
            return event.result, deltas


def _solo(engine: Engine, text: str, profile: SamplingProfile,
          cancel: Callable[[int], bool] = lambda _: False, **kw) -> tuple[GenerationResult, list[str]]:
    """The request through `engine.stream`: its result and its deltas; `cancel(tokens so far)` says when to cancel."""
    stream = engine.stream(text, profile=profile, **kw)
    deltas, tokens = [], 0
    for event in stream:
        if isinstance(event, TokenEvent):
            deltas.append(event.text)
            tokens += len(event.token_ids)
            if cancel(tokens):
                stream.cancel()
    assert stream.result is not None
    return stream.result, deltas


def _same(a: GenerationResult, b: GenerationResult) -> None:
    assert (a.text, a.finish_reason, a.token_ids) == (b.text, b.finish_reason, b.token_ids)


@pytest.mark.parametrize("stop, max_tokens", [(["4, 5"], 40), ([], 7), ([", and"], 8)],
                         ids=["stop-spanning-tokens", "length", "length-holding-back"])
def test_solo_and_batch_give_the_same_reply(engine: Engine, greedy: SamplingProfile, stop: list[str],
                                           max_tokens: int) -> None:
    solo, solo_deltas = _solo(engine, COUNT, greedy, max_tokens=max_tokens, stop=stop)
    batch, batch_deltas = _batched(engine, COUNT, greedy, max_tokens=max_tokens, stop=stop)
    _same(solo, batch)
    assert "".join(solo_deltas) == solo.text and "".join(batch_deltas) == batch.text
    if stop == ["4, 5"]:
        assert solo.finish_reason == "stop" and solo.text == "1, 2, 3, "
    else:
        assert solo.finish_reason == "length" and len(solo.token_ids) == max_tokens


def test_a_cancel_keeps_held_back_text_alone_and_in_a_batch(engine: Engine, greedy: SamplingProfile) -> None:
    """", and" is held back after each "," and ", " (it may begin the stop string); a cancel there must emit it, as
    a max_tokens cut does: the batch path used to drop it."""
    stop = [", and"]
    # Alone: cancelled from the caller's thread, so it lands after a token or two more; whatever the count, the
    # batch cancelled after exactly as many tokens gives the same reply, and so does a cut at that length.
    solo, deltas = _solo(engine, COUNT, greedy, cancel=lambda n: n >= 5, max_tokens=40, stop=stop)
    n = len(solo.token_ids)
    assert solo.finish_reason == "cancelled" and "".join(deltas) == solo.text
    batch, _ = _batched(engine, COUNT, greedy, cancel_after=n, max_tokens=40, stop=stop)
    _same(solo, batch)
    assert solo.text == engine.generate(COUNT, profile=greedy, max_tokens=n, stop=stop).text
    # In the batch the cancel lands exactly: after "1, 2," the held-back "," is kept.
    held, held_deltas = _batched(engine, COUNT, greedy, cancel_after=5, max_tokens=40, stop=stop)
    assert held.finish_reason == "cancelled" and held.text == "1, 2," and "".join(held_deltas) == held.text


def _cut_inside_a_character(engine: Engine, greedy: SamplingProfile) -> list[int]:
    """The max_tokens values at which the greedy emoji reply stops inside a character."""
    ids = engine.generate(EMOJI, profile=greedy, max_tokens=12).token_ids
    tok = engine.model.tokenizer
    return [n for n in range(1, len(ids) + 1) if tok.decode(list(ids[:n])).endswith("\ufffd")]


def test_a_reply_cut_inside_a_character_ends_before_it(engine: Engine, greedy: SamplingProfile) -> None:
    """Issue 27 item 2: such a reply ended in U+FFFD; its text now ends before the incomplete character, the ids
    keep its tokens, and the deltas still concatenate to the text, alone and in a batch."""
    cuts = _cut_inside_a_character(engine, greedy)
    assert len(cuts) >= 3  # e.g. 1, 2, 4, 5, 7, ...: each emoji takes three tokens here
    tok = engine.model.tokenizer
    for n in cuts[:3]:
        solo, solo_deltas = _solo(engine, EMOJI, greedy, max_tokens=n)
        batch, batch_deltas = _batched(engine, EMOJI, greedy, max_tokens=n)
        _same(solo, batch)
        assert len(solo.token_ids) == n and solo.finish_reason == "length"
        assert not solo.text.endswith("\ufffd") and solo.text == tok.decode(list(solo.token_ids)).rstrip("\ufffd")
        assert "".join(solo_deltas) == solo.text and "".join(batch_deltas) == batch.text


@pytest.fixture(scope="module")
def tiny_engine(tiny: Path) -> Engine:
    e = Engine.load(tiny)  # a context of 256
    yield e
    e.close()


def test_the_context_limit_ends_a_reply_at_the_same_token_on_both(tiny_engine: Engine) -> None:
    """Prompt and reply together fill the context, no more: the batch path stopped one token earlier."""
    text = "word " * 220
    prompt = len(_ids(tiny_engine, text))
    profile = SamplingProfile(temperature=0, min_tokens=100)  # no end token before the context is full
    solo, _ = _solo(tiny_engine, text, profile)
    batch, _ = _batched(tiny_engine, text, profile)
    _same(solo, batch)
    assert solo.finish_reason == "length" and prompt + len(solo.token_ids) == tiny_engine.context_length
