"""The step loop's batch slots (core/decode/generate.py, core/cache/kv_cache.py `fill_slot`): a row that ends leaves
its slot free instead of the batch being rebuilt, and a newcomer whose prompt fits is written into a free slot;
neither copies the other rows, and every row gives the tokens it gives alone."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.cache.kv_cache import fill_slot, fits_slot
from mlxchat.core.decode.events import GenerationResult
from mlxchat.core.decode.generate import Row, StepLoop, prefill_all_but_last
from mlxchat.core.decode.reply import Reply

LONG = "Write a long story about a lighthouse keeper and a storm, with many details about the sea and the light."
SHORT = ["Say hi.", "Name a colour.", "Count to three."]
PROFILES = [SamplingProfile(temperature=0, logprobs=True, top_logprobs=2), SamplingProfile(temperature=0.8, seed=7)]


def _kv(length: int, capacity: int, seed: int) -> KVCache:
    """A one-row plain cache holding `length` positions of random keys and values, in a buffer of `capacity`."""
    c = KVCache()
    c.keys = mx.random.normal((1, 2, capacity, 4), key=mx.random.key(seed))
    c.values = mx.random.normal((1, 2, capacity, 4), key=mx.random.key(seed + 100))
    c.offset = length
    return c


def _held(batch: BatchKVCache, row: int) -> tuple[np.ndarray, np.ndarray, int]:
    """What row `row` of `batch` holds: its keys and values from its left padding to the index, and its offset."""
    pad = batch.left_padding.tolist()[row]
    keys, values = (np.array(x[row, :, pad:batch.size()]) for x in (batch.keys, batch.values))
    return keys, values, batch.offset.tolist()[row]


def _address(a: mx.array) -> int:
    """The address of an array's buffer (evaluated here; the view is dropped at once: it would hold the buffer)."""
    mx.eval(a)
    view = np.array(a, copy=False)
    address = view.__array_interface__["data"][0]
    del view
    return address


def test_fill_slot_lays_a_row_out_as_extend_does_and_leaves_the_others_where_they_are() -> None:
    rows = [_kv(9, 256, 1), _kv(5, 256, 2), _kv(7, 256, 3)]
    batch = BatchKVCache.merge(rows)
    newcomer = _kv(6, 256, 4)
    reference = BatchKVCache.merge(rows)
    reference.filter([0, 2])
    reference.extend(BatchKVCache.merge([newcomer]))
    mx.eval(batch.keys, batch.values)
    buffer = _address(batch.keys)
    assert fits_slot(batch, newcomer) and not fits_slot(batch, _kv(10, 256, 5))
    fill_slot(batch, 1, newcomer)
    assert _address(batch.keys) == buffer  # written in place: the other rows were not copied
    for mine, theirs in ((0, 0), (1, 2), (2, 1)):
        for a, b in zip(_held(batch, mine), _held(reference, theirs)):
            np.testing.assert_array_equal(a, b)
    assert batch.left_padding.tolist() == [0, 3, 2] and batch.offset.tolist() == [9, 6, 7]


def _row(engine: Engine, text: str, max_tokens: int, profile: SamplingProfile) -> tuple[Row, list, list[int]]:
    m = engine.model
    prompt = m.tokenizer.encode_chat([{"role": "user", "content": text}])
    layers = make_prompt_cache(m.model)
    reply = Reply(m, engine.request(profile, max_tokens), prompt, lambda e: None, lambda: False,
                  accepted=time.perf_counter(), context=lambda: 0)
    row = Row(reply, [], logprobs=profile.logprobs)
    prefill_all_but_last(m.model, layers, prompt, row.fed, 512, lambda: False, None)
    return row, layers, prompt


def _alone(engine: Engine, text: str, max_tokens: int, profile: SamplingProfile) -> GenerationResult:
    def run() -> GenerationResult:
        row, layers, prompt = _row(engine, text, max_tokens, profile)
        StepLoop(engine.model.model).run(row, layers, prompt[-1])
        return row.reply.finish(row.reason)
    return engine.run(run)


def _to_the_end(loop: StepLoop, rows: dict[str, Row]) -> dict[str, GenerationResult]:
    """Step until every row has ended; each row's result, by its prompt."""
    while loop.rows:
        loop.step()
    return {text: r.reply.finish(r.reason) for text, r in rows.items()}


def _same(got: GenerationResult, alone: GenerationResult) -> None:
    assert got.token_ids == alone.token_ids
    assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in alone.logprobs]
    np.testing.assert_allclose([lp.logprob for lp in got.logprobs], [lp.logprob for lp in alone.logprobs],
                               atol=1e-4)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The BatchKVCache methods that copy every row (`extend`, `filter`), by name, as they are called."""
    seen: list[str] = []
    for name in ("extend", "filter"):
        method = getattr(BatchKVCache, name)

        def spy(self: BatchKVCache, *args: object, _method: Callable = method, _name: str = name) -> None:
            seen.append(_name)
            _method(self, *args)
        monkeypatch.setattr(BatchKVCache, name, spy)
    return seen


def _width(loop: StepLoop) -> int:
    """Rows of the loop's batch caches, free slots included."""
    return loop.layers[0].left_padding.shape[0]


@pytest.mark.parametrize("profile", PROFILES, ids=["greedy-logprobs", "seeded"])
def test_a_newcomer_in_a_left_rows_slot_gives_its_tokens_alone(engine: Engine, profile: SamplingProfile,
                                                               copies: list[str]) -> None:
    """Three rows; the short one ends and its slot is kept (no filter); a newcomer is written into it (no extend),
    the other rows' key buffers staying where they were; every row's tokens (and logprobs) are the ones it gives
    alone."""
    lengths = {LONG: 24, SHORT[0]: 3, SHORT[1]: 14, SHORT[2]: 6}
    alone = {text: _alone(engine, text, n, profile) for text, n in lengths.items()}

    held: list[tuple[int, int]] = []  # each leaving row's ids, and the positions of the cache cut from its slot

    def together() -> dict[str, GenerationResult]:
        loop = StepLoop(engine.model.model, lambda row, cache: held.append((len(row.fed), cache()[0].offset)))
        rows = {}
        for text in (LONG, SHORT[0], SHORT[1]):
            row, layers, prompt = _row(engine, text, lengths[text], profile)
            loop.join(row, layers, prompt[-1])
            rows[text] = row
        joined = len(copies)
        while rows[SHORT[0]].reason is None:
            loop.step()
        for _ in range(3):  # the free slot computes on: nothing it holds may turn into NaN
            loop.step()
        assert len(loop.rows) == 2 and _width(loop) == 3 and copies[joined:] == []
        assert not any(mx.isnan(c.keys).any().item() or mx.isnan(c.values).any().item() for c in loop.layers)
        buffer = _address(loop.layers[5].keys)
        row, layers, prompt = _row(engine, SHORT[2], lengths[SHORT[2]], profile)
        assert len(prompt) <= loop.layers[0].size()  # it fits before the batch's index
        loop.join(row, layers, prompt[-1])
        rows[SHORT[2]] = row
        loop.step()
        assert _width(loop) == 3 and copies[joined:] == []
        assert _address(loop.layers[5].keys) == buffer  # the newcomer's keys went into the batch's own buffer
        assert all(type(c) is BatchKVCache for c in loop.layers)  # the kind the fused layer runs on
        return _to_the_end(loop, rows)

    got = engine.run(together)
    for text in lengths:
        _same(got[text], alone[text])
    assert len(held) == 4 and all(ids == positions for ids, positions in held)  # what the prefix cache stores


def test_a_newcomer_longer_than_the_batch_extends_it_and_free_slots_are_compacted(engine: Engine,
                                                                                  copies: list[str]) -> None:
    """A newcomer holding more positions than the batch's index cannot be written into a slot: the batch is
    compacted (its free slot dropped) and extended, as before slots. Once free slots are as many as the rows, they
    are compacted away. Every row's tokens are still its own."""
    greedy = SamplingProfile(temperature=0)
    poem = "Write a poem about the sea."
    lengths = {poem: 30, SHORT[0]: 3, SHORT[2]: 16, LONG: 6}
    alone = {text: _alone(engine, text, n, greedy) for text, n in lengths.items()}

    def together() -> dict[str, GenerationResult]:
        loop = StepLoop(engine.model.model)
        rows = {}
        for text in (poem, SHORT[0], SHORT[2]):
            row, layers, prompt = _row(engine, text, lengths[text], greedy)
            loop.join(row, layers, prompt[-1])
            rows[text] = row
        while rows[SHORT[0]].reason is None:
            loop.step()
        assert _width(loop) == 3 and len(loop.rows) == 2  # one free slot for two rows: kept
        del copies[:]
        row, layers, prompt = _row(engine, LONG, lengths[LONG], greedy)
        assert len(prompt) > loop.layers[0].size()  # longer than the batch holds: no slot can take it
        loop.join(row, layers, prompt[-1])
        rows[LONG] = row
        n = len(loop.layers)
        assert copies == ["filter"] * n + ["extend"] * n and _width(loop) == 3  # compacted, then extended
        while len(loop.rows) > 1:
            loop.step()
        assert _width(loop) == 1  # two free slots for one row: compacted
        return _to_the_end(loop, rows)

    got = engine.run(together)
    assert [len(got[text].token_ids) for text in lengths] == list(lengths.values())  # each ran to its max_tokens
    for text in lengths:
        _same(got[text], alone[text])


def test_a_deferred_step_waits_for_a_newcomer_and_gives_the_same_tokens(engine: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """While someone waits to prefill (`defer()`), the step loop reads a step without submitting the next one (built
    already), so the newcomer's prefill and first token run before it, not after a whole step of every row; the
    deferred step is evaluated when read, and every row's tokens are the ones it gives alone."""
    greedy = SamplingProfile(temperature=0)
    lengths = {LONG: 12, SHORT[1]: 8, SHORT[2]: 6}
    alone = {text: _alone(engine, text, n, greedy) for text, n in lengths.items()}
    submitted: list[int] = []
    real = mx.async_eval

    def spy(*arrays: mx.array) -> None:
        submitted.append(len(arrays))
        real(*arrays)
    monkeypatch.setattr(mx, "async_eval", spy)
    waiting = [False]

    def together() -> dict[str, GenerationResult]:
        loop = StepLoop(engine.model.model, defer=lambda: waiting[0])
        rows = {}
        for text in (LONG, SHORT[1]):
            row, layers, prompt = _row(engine, text, lengths[text], greedy)
            loop.join(row, layers, prompt[-1])
            rows[text] = row
        loop.step()
        loop.step()
        waiting[0] = True
        before = len(submitted)
        loop.step()  # reads a step; the next one is built, not submitted
        assert len(submitted) == before
        row, layers, prompt = _row(engine, SHORT[2], lengths[SHORT[2]], greedy)  # the newcomer's prefill runs now
        loop.join(row, layers, prompt[-1])
        rows[SHORT[2]] = row
        waiting[0] = False
        return _to_the_end(loop, rows)

    got = engine.run(together)
    for text in lengths:
        _same(got[text], alone[text])
