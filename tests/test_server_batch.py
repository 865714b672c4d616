"""The batch scheduler under the server, on the real embedded model: batching and the prefix cache change no
result, a cancelled row leaves at once, the queue is bounded."""

from __future__ import annotations

import queue
import time

import pytest

from mlxchat.core import ContextLengthError, Engine, GenerationResult, SamplingProfile
from mlxchat.core.batch import BatchRequest, BatchScheduler, QueueFull
from mlxchat.core.decode.events import Done, TokenEvent

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to ten.",
           "Explain gravity to a child in two sentences, please, and keep it short."]


def _submit(s: BatchScheduler, engine: Engine, text: str, profile: SamplingProfile, **kw) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    s.submit(BatchRequest(engine.model.tokenizer.encode_chat([{"role": "user", "content": text}]), profile, q.put,
                          **kw))
    return q


def _result(q: queue.Queue) -> GenerationResult:
    while True:
        event = q.get(timeout=120)
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, Done):
            return event.result


def test_greedy_alone_in_a_batch_of_4_and_from_the_engine_are_equal(engine: Engine, greedy: SamplingProfile) -> None:
    s = BatchScheduler(engine, max_batch=4, prefix_cache_bytes=0)  # no reuse: every row prefilled from scratch
    # 16 tokens: the first prompt's reply ends after 7, the others run to the limit.
    alone = [_result(_submit(s, engine, p, greedy, max_tokens=16)) for p in PROMPTS]
    together = [_result(q) for q in [_submit(s, engine, p, greedy, max_tokens=16) for p in PROMPTS]]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    assert alone[2].text == engine.generate(PROMPTS[2], profile=greedy, max_tokens=16).text
    assert len({len(r.token_ids) for r in alone}) > 1  # rows of different lengths left the batch at different steps


def test_seeded_sampling_in_a_batch_equals_alone(engine: Engine) -> None:
    s = BatchScheduler(engine, max_batch=2, prefix_cache_bytes=0)
    profile = SamplingProfile(temperature=1.0, top_p=0.9, seed=42, frequency_penalty=0.5)
    alone = _result(_submit(s, engine, PROMPTS[1], profile, max_tokens=12))
    qs = [_submit(s, engine, PROMPTS[0], profile, max_tokens=12), _submit(s, engine, PROMPTS[1], profile,
                                                                          max_tokens=12)]
    assert [_result(q) for q in qs][1].token_ids == alone.token_ids


def test_rows_sampled_as_one_op_draw_what_each_samples_alone(engine: Engine, greedy: SamplingProfile,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of mixed profiles: the two top-p rows (each its own seed, temperature and p) are sampled as one op over
    the batch (core/sampling/batch_sampling.py), the greedy and the penalised rows alone; every row's tokens are those
    of the row-by-row sampling."""
    from mlxchat.core.decode import generate
    grouped: list[int] = []
    sample_rows = generate.sample_rows
    monkeypatch.setattr(generate, "sample_rows", lambda ss, x: grouped.append(len(ss)) or sample_rows(ss, x))
    profiles = [SamplingProfile(temperature=0.8, top_p=0.9, seed=1), greedy,
                SamplingProfile(temperature=1.1, top_p=0.95, seed=2),
                SamplingProfile(temperature=0.7, frequency_penalty=0.5, seed=3)]

    def run() -> list[tuple[int, ...]]:
        s = BatchScheduler(engine, max_batch=4, prefix_cache_bytes=0)
        qs = [_submit(s, engine, p, profile, max_tokens=12) for p, profile in zip(PROMPTS, profiles)]
        return [_result(q).token_ids for q in qs]

    batched = run()
    assert grouped and max(grouped) == 2
    monkeypatch.setattr(generate, "BATCH_SAMPLING", False)
    assert batched == run()


def test_speculation_alone_and_in_a_batch_changes_no_token(engine: Engine, greedy: SamplingProfile) -> None:
    """A speculating request verifies guesses while it has the model to itself, decodes plainly while it shares it,
    and gets its own cache back to verify when the other row leaves; its tokens are the plain ones throughout."""
    s = BatchScheduler(engine, max_batch=2, prefix_cache_bytes=0)
    fox = "the quick brown fox jumps over the lazy dog."
    grounded = f"Repeat exactly: {fox} {fox}"
    for profile in (greedy, SamplingProfile(temperature=0.7, seed=5)):
        plain = _result(_submit(s, engine, grounded, profile, max_tokens=14))
        alone = _result(_submit(s, engine, grounded, profile, max_tokens=14, speculative="ngram"))
        assert alone.token_ids == plain.token_ids and alone.metrics.accepted_tokens > 0
        short = _submit(s, engine, PROMPTS[0], greedy, max_tokens=3)  # joins first, leaves after 3 tokens
        shared = _submit(s, engine, grounded, profile, max_tokens=14, speculative="ngram")
        _result(short)
        joined = _result(shared)
        assert joined.token_ids == plain.token_ids
        assert joined.metrics.speculative == "ngram" and joined.metrics.accepted_tokens > 0


def test_prefix_cache_reuses_a_resent_conversation(engine: Engine, greedy: SamplingProfile) -> None:
    s = BatchScheduler(engine, max_batch=2)
    tok = engine.model.tokenizer
    turn1 = [{"role": "user", "content": "Tell me about cats in one sentence."}]
    q: queue.Queue = queue.Queue()
    s.submit(BatchRequest(tok.encode_chat(turn1), greedy, q.put, max_tokens=12))
    first = _result(q)
    assert first.metrics.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And dogs?"}]
    ids = tok.encode_chat(turn2)
    s.submit(BatchRequest(ids, greedy, q.put, max_tokens=12))
    second = _result(q)
    assert second.metrics.cached_tokens >= first.metrics.prompt_tokens + len(first.token_ids) - 2
    # Reused keys/values give the same tokens as a fresh prefill.
    fresh = BatchScheduler(engine, prefix_cache_bytes=0)
    fresh.submit(BatchRequest(ids, greedy, q.put, max_tokens=12))
    assert _result(q).token_ids == second.token_ids


def test_prefix_cache_stays_under_its_bound(engine: Engine, greedy: SamplingProfile) -> None:
    bound = 3 * 2**20
    s = BatchScheduler(engine, max_batch=1, prefix_cache_bytes=bound)
    for p in PROMPTS:
        _result(_submit(s, engine, p, greedy, max_tokens=4))
    assert 0 < s.prefix_cache.nbytes <= bound


def test_cancel_leaves_the_batch_at_the_next_token(engine: Engine, greedy: SamplingProfile) -> None:
    s = BatchScheduler(engine, max_batch=2, max_queue=0)
    tok = engine.model.tokenizer
    q1: queue.Queue = queue.Queue()
    long = BatchRequest(tok.encode_chat([{"role": "user", "content": PROMPTS[0]}]),
                        SamplingProfile(temperature=0, min_tokens=500), q1.put, max_tokens=500)
    s.submit(long)
    q2 = _submit(s, engine, PROMPTS[1], greedy, max_tokens=8)
    with pytest.raises(QueueFull):
        _submit(s, engine, PROMPTS[2], greedy)
    assert isinstance(q1.get(timeout=60), TokenEvent)
    long.cancel()
    cancelled = _result(q1)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 100
    assert s.load[0] <= 1  # its slot is free while the other row goes on
    assert _result(q2).finish_reason in ("stop", "length")
    assert s.load == (0, 0)


def test_queue_and_context_limits(engine: Engine, greedy: SamplingProfile) -> None:
    s = BatchScheduler(engine, max_batch=1, max_queue=0)
    with pytest.raises(ContextLengthError):
        s.submit(BatchRequest([1] * engine.context_length, greedy, lambda e: None))
    with pytest.raises(ValueError):
        BatchScheduler(engine, max_batch=0)


def test_a_long_prompt_joining_mid_decode_changes_nothing(engine: Engine, greedy: SamplingProfile) -> None:
    s = BatchScheduler(engine, max_batch=2, prefix_cache_bytes=0)
    long_text = "Summarize this in one line: " + " ".join(f"item {i} is red." for i in range(40))
    alone = [_result(_submit(s, engine, p, greedy, max_tokens=12)) for p in (PROMPTS[2], long_text)]
    first = _submit(s, engine, PROMPTS[2], greedy, max_tokens=12)
    assert isinstance(first.get(timeout=60), TokenEvent)  # decoding already when the long prompt arrives
    second = _submit(s, engine, long_text, greedy, max_tokens=12)
    together = [_result(first), _result(second)]
    assert together[1].metrics.prompt_tokens > 3 * 64  # prefilled in several interleaved chunks
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_same_prompt_twice_at_once_is_prefilled_once(engine: Engine, greedy: SamplingProfile) -> None:
    s = BatchScheduler(engine, max_batch=2)
    a, b = (_submit(s, engine, PROMPTS[3], greedy, max_tokens=8) for _ in range(2))
    first, second = _result(a), _result(b)
    assert first.metrics.cached_tokens == 0
    assert second.metrics.cached_tokens == second.metrics.prompt_tokens - 1  # e.g. the choices of n=2
    assert second.token_ids == first.token_ids


def test_finished_rows_give_their_batch_memory_back(engine: Engine, greedy: SamplingProfile) -> None:
    # Rows of different lengths leave a batch of 4 at different steps; each one's KV rows go to the prefix cache.
    # What the scheduler holds afterwards is the prefix cache (within its bound) and nothing else: a stored row
    # that still pointed into the batch's buffers would keep every row of them alive.
    s = BatchScheduler(engine, max_batch=4)
    before = s.memory()
    results = [_result(q) for q in [_submit(s, engine, p, greedy, max_tokens=8) for p in PROMPTS]]
    assert len({len(r.token_ids) for r in results}) > 1  # the first reply ends after 7 tokens
    deadline = time.monotonic() + 30
    while not s.idle and time.monotonic() < deadline:  # a row's Done comes before it leaves the batch
        time.sleep(0.01)
    after = s.memory()
    assert after["prefix_cache_bytes"] > 0
    assert after["active_bytes"] - after["prefix_cache_bytes"] - before["active_bytes"] < 4 * 2**20


def test_a_request_taking_a_finished_rows_slot_changes_nothing(engine: Engine, greedy: SamplingProfile,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Three slots: the fourth request waits, then is written into the slot the short one left (core/decode/generate.py)
    # while the other rows decode on; each gives its tokens alone.
    from mlxchat.core.decode import generate
    filled: list[int] = []
    fill_slot = generate.fill_slot
    monkeypatch.setattr(generate, "fill_slot", lambda batch, slot, cache: filled.append(slot) or
                        fill_slot(batch, slot, cache))
    s = BatchScheduler(engine, max_batch=3, prefix_cache_bytes=0)
    runs = [(PROMPTS[2], 16), (PROMPTS[3], 16), (PROMPTS[0], 3), (PROMPTS[1], 8)]
    alone = [_result(_submit(s, engine, p, greedy, max_tokens=n)).token_ids for p, n in runs]
    assert not filled
    together = [_result(q).token_ids for q in [_submit(s, engine, p, greedy, max_tokens=n) for p, n in runs]]
    assert together == alone
    assert filled == [2] * len(engine.model.model.layers)  # one row written, once per layer


def test_a_row_that_joined_a_batch_stores_its_whole_conversation(engine: Engine, greedy: SamplingProfile) -> None:
    # A row joining rows already decoding leaves the batch before them: the prefix cache keeps its KV cache under
    # every id it holds (its `fed`, its first token included), so a client resending the conversation reuses it.
    s = BatchScheduler(engine, max_batch=2)
    tok = engine.model.tokenizer
    other = _submit(s, engine, PROMPTS[3], greedy, max_tokens=40)
    assert isinstance(other.get(timeout=60), TokenEvent)  # decoding already when the turn arrives
    turn1 = [{"role": "user", "content": "Tell me about cats in one sentence."}]
    q: queue.Queue = queue.Queue()
    s.submit(BatchRequest(tok.encode_chat(turn1), greedy, q.put, max_tokens=12))
    first = _result(q)
    assert _result(other).token_ids  # the other row was still decoding when the turn's row left
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And dogs?"}]
    s.submit(BatchRequest(tok.encode_chat(turn2), greedy, q.put, max_tokens=4))
    assert _result(q).metrics.cached_tokens >= first.metrics.prompt_tokens + len(first.token_ids) - 2
