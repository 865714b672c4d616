"""Generation on the real embedded model: answers, parity with mlx-lm, streaming, stops, caches, cancel."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core import ContextLengthError, Engine, SamplingProfile
from mlxchat.core.decode.events import Done, PrefillProgress, TokenEvent

QUESTION = "What is the capital of France?"


def test_greedy_answers_paris(engine: Engine, greedy: SamplingProfile):
    r = engine.generate(QUESTION, profile=greedy, max_tokens=32)
    assert "Paris" in r.text
    assert r.finish_reason == "stop"
    m = r.metrics
    assert m.prompt_tokens > 10 and m.completion_tokens > 0 and m.ttft_s > 0 and m.tpot_s > 0
    assert m.peak_memory_bytes > 0 and m.decode_tokens_per_s > 0 and m.prefill_tokens_per_s > 0


def test_greedy_matches_mlx_lm_generate_step(engine: Engine, greedy: SamplingProfile):
    from mlx_lm.generate import generate_step

    prompt = "Write one sentence about the sea."
    ids = engine.model.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    n = 24

    def reference() -> list[int]:
        return [t for t, _ in generate_step(mx.array(ids), engine.model.model, max_tokens=n)]

    ref = engine.run(reference)  # on the inference thread, like everything MLX
    ours = engine.generate(prompt, profile=greedy, max_tokens=n)
    eos = engine.model.tokenizer.eos_ids
    expected = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert list(ours.token_ids) == expected


def test_deltas_concatenate_to_the_final_text(engine: Engine):
    stream = engine.stream("Tell me a short story about a cat.", profile=SamplingProfile(temperature=0.9, seed=3),
                           max_tokens=48)
    events = list(stream)
    assert isinstance(events[0], PrefillProgress) and isinstance(events[-1], Done)
    deltas = [e.text for e in events if isinstance(e, TokenEvent)]
    assert "".join(deltas) == stream.result.text
    ids = [i for e in events if isinstance(e, TokenEvent) for i in e.token_ids]
    assert tuple(ids) == stream.result.token_ids
    assert engine.model.tokenizer.decode(ids) == stream.result.text


@pytest.mark.parametrize("text", ["Emoji 🎉🐍👍🏽 and more 🇫🇷", "中文字符：你好，世界。日本語も。",
                                  "naïve café — ∑ ≤ ∞"])
def test_streaming_detokenizer_never_emits_broken_utf8(engine: Engine, text: str):
    from mlxchat.core.decode.streaming import IncrementalDetokenizer

    tok = engine.model.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert len(ids) > len([d for d in deltas if d])  # some tokens are partial characters, held back


def test_model_output_with_emoji_streams_clean(engine: Engine, greedy: SamplingProfile):
    stream = engine.stream("Reply with three emoji that describe summer, and nothing else.", profile=greedy,
                           max_tokens=24)
    deltas = [e.text for e in stream if isinstance(e, TokenEvent)]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == stream.result.text


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(engine: Engine, greedy: SamplingProfile):
    free = engine.generate("Count from 1 to 10, separated by commas.", profile=greedy, max_tokens=40).text
    assert "4, 5" in free
    stream = engine.stream("Count from 1 to 10, separated by commas.", profile=greedy, max_tokens=40,
                           stop=["4, 5"])
    deltas = [e.text for e in stream if isinstance(e, TokenEvent)]
    r = stream.result
    assert r.finish_reason == "stop" and r.text == free[: free.index("4, 5")]
    assert "".join(deltas) == r.text and not any("5" in d for d in deltas[-2:])


def test_stop_filter_holds_back_prefixes():
    from mlxchat.core.decode.streaming import StopStringFilter

    f = StopStringFilter(["</answer>", "STOP"])
    out = [f.feed(t) for t in ["The ", "result</", "ans", "wer> tail"]]
    assert out == ["The ", "result", "", ""] and f.stopped
    g = StopStringFilter(["abc"])
    assert [g.feed(t) for t in ["xa", "b", "d"]] + [g.flush()] == ["x", "", "abd", ""]
    h = StopStringFilter(["abc"])
    assert h.feed("xab") == "x" and h.flush() == "ab"


def test_max_tokens_gives_length(engine: Engine, greedy: SamplingProfile):
    r = engine.generate("Write a long essay about rivers.", profile=greedy, max_tokens=5)
    assert r.finish_reason == "length" and r.metrics.completion_tokens == 5


def test_a_reply_is_capped_by_default_and_the_call_or_profile_overrides_it(engine: Engine, greedy: SamplingProfile):
    from mlxchat.core.engine import DEFAULT_MAX_TOKENS

    assert engine.request(greedy).max_tokens == DEFAULT_MAX_TOKENS == 1024
    assert engine.request(SamplingProfile(max_tokens=7)).max_tokens == 7
    assert engine.request(SamplingProfile(max_tokens=7), max_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match=r"min_tokens \(9\) must not exceed max_tokens \(3\)"):
        engine.request(SamplingProfile(min_tokens=9), max_tokens=3)


def test_chat_cache_reuse_gives_the_same_tokens_as_a_fresh_prefill(engine: Engine, greedy: SamplingProfile):
    chat = engine.chat(system="You are terse.", profile=greedy)
    chat.send("Name a fruit.", max_tokens=16).wait()
    second = chat.send("Name a colour.", max_tokens=16).wait()
    assert second.metrics.cached_tokens > 10  # the first turn was not prefilled again
    fresh = engine.generate([m.as_prompt() for m in chat.messages[:-1]],
                            profile=greedy, max_tokens=16)
    assert fresh.metrics.cached_tokens == 0
    assert second.token_ids == fresh.token_ids


def test_a_reply_tokenized_unlike_its_text_is_reused_as_generated(engine: Engine):
    """A sampled reply is often not the tokenizer's own split of its text ("F" "TR" where encoding gives "FT" "R"):
    the next turn's prompt must hold the reply's ids, or everything from that token on is prefilled again (issue 25:
    "prompt 167 tok (40 cached)" on a plain second turn). The logit bias makes the model write "F" four times; its
    text "FFFF" encodes as one token."""
    f = engine.model.tokenizer.encode("F")[0]
    assert engine.model.tokenizer.encode("FFFF") != [f] * 4
    chat = engine.chat(profile=SamplingProfile(temperature=0, logit_bias={f: 100}))
    first = chat.send("Say F.", max_tokens=4).wait()
    assert first.token_ids == (f,) * 4 and first.text == "FFFF"
    second = chat.send("Again.", max_tokens=1).wait()
    # The first turn's prompt and reply are reused (the last id of a reply cut by max_tokens is never fed).
    assert second.metrics.cached_tokens == first.metrics.prompt_tokens + 3
    assert chat.cache.tokens[first.metrics.prompt_tokens:][:4] == [f] * 4


def test_regenerate_and_edit_trim_the_cache(engine: Engine, greedy: SamplingProfile):
    chat = engine.chat(profile=greedy)
    first = chat.send("Say hello.", max_tokens=8).wait()
    again = chat.regenerate(max_tokens=8).wait()
    assert again.token_ids == first.token_ids and len(chat.messages) == 2
    edited = chat.edit_last("Say goodbye.", max_tokens=8).wait()
    assert [m.content for m in chat.messages if m.role == "user"] == ["Say goodbye."]
    assert edited.token_ids == engine.generate("Say goodbye.", profile=greedy, max_tokens=8).token_ids


def test_cancel_during_decode_keeps_the_session_usable(engine: Engine, greedy: SamplingProfile):
    chat = engine.chat(profile=greedy)
    stream = chat.send("Write a very long story about dragons.", max_tokens=200)
    n = 0
    for event in stream:
        if isinstance(event, TokenEvent):
            n += 1
            if n == 3:
                stream.cancel()
    assert stream.result.finish_reason == "cancelled" and stream.result.metrics.completion_tokens <= 5
    after = chat.send("What is the capital of France?", max_tokens=24).wait()
    assert after.finish_reason == "stop" and "Paris" in after.text


def test_cancel_during_prefill(engine: Engine, greedy: SamplingProfile):
    big = "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 300  # ~3000 tokens
    e = engine.with_prefill_step(128)
    stream = e.stream(big, profile=greedy, max_tokens=8)
    for event in stream:
        if isinstance(event, PrefillProgress) and event.done > 0:
            stream.cancel()
    r = stream.result
    assert r.finish_reason == "cancelled" and r.metrics.completion_tokens == 0
    assert r.metrics.ttft_s >= r.metrics.prefill_s > 0  # no token at all: the time to the end, never 0
    assert "Paris" in engine.generate(QUESTION, profile=greedy, max_tokens=24).text


def test_an_empty_reply_reports_the_time_to_its_end_token(engine: Engine):
    eos = min(engine.model.tokenizer.eos_ids)
    r = engine.generate(QUESTION, profile=SamplingProfile(temperature=0, logit_bias={eos: 100}))
    assert (r.text, r.finish_reason, r.metrics.completion_tokens) == ("", "stop", 0)
    assert r.metrics.ttft_s >= r.metrics.prefill_s > 0 and r.metrics.tpot_s == 0


def test_leaving_the_iteration_early_cancels(engine: Engine, greedy: SamplingProfile):
    stream = engine.stream("Write a very long story.", profile=greedy, max_tokens=300)
    for event in stream:
        if isinstance(event, TokenEvent):
            break
    del event
    # The next request runs only after the abandoned one stopped; it must not wait for 300 tokens.
    done = threading.Event()
    threading.Thread(target=lambda: (engine.generate("Hi", profile=greedy, max_tokens=2), done.set())).start()
    assert done.wait(60)


def test_prompt_longer_than_the_context_is_a_clear_error(engine: Engine, greedy: SamplingProfile):
    huge = "word " * 9000
    with pytest.raises(ContextLengthError, match="context of 8192"):
        engine.generate(huge, profile=greedy, max_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        engine.generate("   ", profile=greedy)


def test_rotating_cache_keeps_generating_past_its_window_with_bounded_memory(engine: Engine,
                                                                             greedy: SamplingProfile):
    chat = engine.chat(profile=SamplingProfile(temperature=0.8, seed=1), max_kv_size=96, keep=4)
    sizes = []
    for q in ["Tell me about the sea.", "And about mountains?", "And rivers?"]:
        r = chat.send(q, max_tokens=48).wait()
        assert r.metrics.completion_tokens > 0
        sizes.append(chat.cache.nbytes())
        assert r.metrics.context_tokens <= 96 and r.metrics.kv_window == 96
    assert len(chat.cache.tokens) > 96  # the conversation outgrew the window ...
    assert max(sizes) <= 1.3 * min(sizes)  # ... and the cache did not grow with it


def test_prefill_chunks_shrink_to_the_time_budget(engine: Engine):
    """Issue #12 item 12: chunks stay at the step while a layer of one takes under the budget, and shrink (not below
    MIN_CHUNK) when it takes longer."""
    from mlxchat.core.cache.kv_cache import MIN_CHUNK, ConversationCache, prefill

    ids = engine.model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:300]

    def sizes(budget_s: float) -> list[int]:
        cache = ConversationCache(engine.model.model)
        out = [len(c) for c in prefill(engine.model.model, cache.layers, ids, 128, layer_budget_s=budget_s)]
        assert cache.layers[0].offset == len(ids)  # every id reached the cache whatever the chunking
        return out

    tight = engine.run(lambda: sizes(1e-6))
    assert tight[0] == 128 and set(tight[1:-1]) == {MIN_CHUNK}
    assert engine.run(lambda: sizes(1e6)) == [128, 128, 44]


def test_a_cancel_lands_between_layers_and_leaves_the_cache_as_before_the_chunk(engine: Engine):
    """Issue #12 item 12: a cancel waits for one layer of a chunk, not the whole chunk, and the cache keeps exactly
    the chunks before it: prefilling on from there gives the cache a fresh prefill gives."""
    from mlxchat.core.cache.kv_cache import ConversationCache, prefill

    model = engine.model.model
    ids = engine.model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:200]
    checks, layers = 0, len(model.layers)
    # Asked before each chunk and after each of its layers but the last: the second chunk's sixth layer is check
    # 1 + (layers - 1) + 1 + 6.
    cancel_at = layers + 7

    def cancel_in_the_second_chunk() -> bool:
        nonlocal checks
        checks += 1
        return checks >= cancel_at

    def run() -> tuple[list[int], int, list[int], np.ndarray, np.ndarray]:
        cache = ConversationCache(model)
        first = [len(c) for c in prefill(model, cache.layers, ids, 128, cancel_in_the_second_chunk)]
        offsets = [c.offset for c in cache.layers]
        evaluated = checks
        rest = [len(c) for c in prefill(model, cache.layers, ids[128:], 128)]
        fresh = ConversationCache(model)
        list(prefill(model, fresh.layers, ids, 128))
        return (first, evaluated, offsets + rest, np.array(cache.layers[-1].state[0][..., :200, :]),
                np.array(fresh.layers[-1].state[0][..., :200, :]))

    first, evaluated, offsets_then_rest, resumed, fresh = engine.run(run)
    assert first == [128] and evaluated == cancel_at  # stopped inside the second chunk, not after all its layers
    assert offsets_then_rest == [128] * len(model.layers) + [72]
    np.testing.assert_array_equal(resumed, fresh)


def test_a_model_that_cannot_stop_between_layers_finishes_its_chunk(engine: Engine):
    """A model split across machines (tensor parallel) says `interruptible = False`: its ranks must run each pass to
    the end, so a cancel waits for the chunk."""
    from mlxchat.core.cache.kv_cache import ConversationCache, prefill

    class WholePasses:
        interruptible = False

        def __init__(self, model):
            self.model, self.layers = model, model.layers

        def __call__(self, inputs, cache=None):
            return self.model(inputs, cache=cache)

    whole = WholePasses(engine.model.model)
    ids = list(range(100, 300))
    answers = iter([False, True])  # go, then cancel at once

    def run() -> tuple[list[int], int]:
        cache = ConversationCache(engine.model.model)
        done = [len(c) for c in prefill(whole, cache.layers, ids, 128, lambda: next(answers, True))]
        return done, cache.layers[-1].offset

    assert engine.run(run) == ([128], 128)


def test_loading_a_model_marks_it_used(tiny, tmp_path):
    """`mlxchat models` and F3's "last used" is the files' access time, which reads alone leave stale."""
    import os
    import shutil
    import time

    from mlxchat.app.models import _local

    model = Path(shutil.copy(tiny, tmp_path / "tiny.gguf"))
    os.utime(model, (1e9, 1e9))
    model.read_bytes()  # the first read after a write sets the access time; under relatime (the usual mount option)
    first = os.stat(model).st_atime  # later reads leave it for a day, so a load alone would not move it
    time.sleep(1.1)
    Engine.load(model).close()
    assert _local(str(model), model).last_used >= first + 1
    assert os.stat(model).st_mtime == 1e9  # its modification time is kept (Ollama's modified_at)
