"""The one KV-reuse service (core/cache/prefix.py, issue 38): the prefix index's match, its LRU memory, its disk
fallback, and that every path asks it: a chat turn, a solo request repeated, two server requests sharing a system
prompt, the split model's scheduler. The first tests need no model: tiny caches whose keys are their ids."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxchat.core.cache.kv_cache import ConversationCache, common_prefix
from mlxchat.core.cache.kv_store import KVStore
from mlxchat.core.cache.prefix import PrefixIndex, held

LAYERS = 2


def caches(ids) -> list[KVCache]:
    """Plain caches holding `ids`: each position's keys and values are its id, so a trim can be read back."""
    layers = []
    for _ in range(LAYERS):
        c = KVCache()
        x = mx.array(list(ids), dtype=mx.float32).reshape(1, 1, len(ids), 1) * mx.ones((1, 1, 1, 4))
        c.update_and_fetch(x, x + 0.5)
        layers.append(c)
    mx.eval([c.state for c in layers])
    return layers


def held_ids(layers: list) -> list[int]:
    c = layers[0]
    return [int(v) for v in c.keys[0, 0, :c.offset, 0].tolist()]


def index_of(*entries, max_bytes: int = 1 << 30, disk: KVStore | None = None) -> PrefixIndex:
    index = PrefixIndex(max_bytes, disk)
    for ids in entries:
        assert index.insert(ids, caches(ids))
    return index


@pytest.mark.parametrize("entries, prompt, reused, trimmed_from", [
    # exact: the whole prompt is cached; its last id still runs (its logits give the first token)
    ([(1, 2, 3, 4)], [1, 2, 3, 4], 3, (1, 2, 3, 4)),
    # a cached prefix of a longer prompt: all of it, nothing trimmed
    ([(1, 2, 3)], [1, 2, 3, 4, 5], 3, (1, 2, 3)),
    # the longest of several prefixes
    ([(1, 2, 9, 9), (1, 2, 3, 4), (1, 5)], [1, 2, 3, 4, 5, 6], 4, (1, 2, 3, 4)),
    # an entry that diverges mid-way: trimmed to the shared part
    ([(1, 2, 3, 7, 8)], [1, 2, 3, 4, 5], 3, (1, 2, 3, 7, 8)),
    # a longer entry that holds the whole prompt and more
    ([(1, 2, 3, 4, 5, 6)], [1, 2, 3, 4], 3, (1, 2, 3, 4, 5, 6)),
    # as much from two entries: the shorter (less to trim)
    ([(1, 2, 3, 9, 9, 9), (1, 2, 3, 8)], [1, 2, 3, 4], 3, (1, 2, 3, 8)),
    # nothing shared
    ([(9, 9, 9)], [1, 2, 3], 0, None),
    # a prompt of one id: nothing can be reused
    ([(1, 2)], [1], 0, None),
])
def test_the_longest_reusable_prefix_is_found_and_trimmed_to_it(entries, prompt, reused, trimmed_from):
    index = index_of(*entries)
    assert index.match(prompt) == (trimmed_from, reused)
    hit = index.fetch(prompt)
    if trimmed_from is None:
        assert hit is None
        return
    assert (hit.reused, hit.disk) == (reused, 0)
    assert held_ids(hit.layers) == prompt[:reused] and all(c.offset == reused for c in hit.layers)
    # The entry itself is untouched: the hit is a copy.
    assert held_ids(index._entries[trimmed_from].layers) == list(trimmed_from)


@pytest.mark.parametrize("a, b, n", [((), (), 0), ((1,), [1], 1), ((1, 2, 3), [1, 2, 4], 2),
                                     (tuple(range(200)), list(range(130)) + [7], 130),
                                     (tuple(range(64)), list(range(64)), 64), ((5,), [6], 0)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_an_entry_replaces_its_prefixes_and_only_plain_caches_of_their_ids_are_kept():
    index = index_of((1, 2), (1, 2, 3))
    assert list(index._entries) == [(1, 2, 3)]
    assert not index.insert([1, 2, 3, 4], caches([1, 2, 3]))  # the caches do not hold those ids
    assert not PrefixIndex(0).insert([1, 2], caches([1, 2]))  # no room at all
    assert index.nbytes == sum(c.nbytes for c in index._entries[(1, 2, 3)].layers)


def test_eviction_is_least_recently_used_and_spills_to_disk(tmp_path: Path):
    one = sum(c.nbytes for c in held(caches([1, 2, 3])))  # an entry: its caches cut to the ids they hold
    store = _store(tmp_path)
    index = index_of((1, 2, 3), (4, 5, 6), max_bytes=2 * one, disk=store)
    assert index.fetch([1, 2, 3, 9]).reused == 3  # a hit: (1, 2, 3) is now the most recently used
    index.insert([7, 8, 9], caches([7, 8, 9]))
    assert list(index._entries) == [(1, 2, 3), (7, 8, 9)] and index.nbytes == 2 * one
    store.flush()
    # The evicted entry was saved to disk, and is found there.
    hit = index.fetch([4, 5, 6, 0])
    assert (hit.reused, hit.disk) == (3, 3) and held_ids(hit.layers) == [4, 5, 6]
    index.spill_all()
    store.flush()
    assert len(index) == 0 and index.nbytes == 0 and len(store) == 3


def _store(folder: Path) -> KVStore:
    model_file = folder / "model.gguf"
    model_file.write_bytes(b"GGUF" + bytes(60))
    return KVStore(folder / "kv", SimpleNamespace(source=str(model_file), weights_path="fp32", num_layers=LAYERS))


@pytest.mark.parametrize("memory, disk, prompt, reused, from_disk", [
    ((1, 2, 3), (1, 2, 3, 4, 5), [1, 2, 3, 4, 5, 6], 5, 5),  # the disk holds more: it wins
    ((1, 2, 3, 4, 5), (1, 2, 3), [1, 2, 3, 4, 5, 6], 5, 0),  # memory holds more
    ((1, 2, 3), (1, 2, 3), [1, 2, 3, 4], 3, 0),  # as much: memory first
    (None, (1, 2, 3, 7), [1, 2, 3, 4], 3, 3),  # only the disk, trimmed to the shared part
    (None, None, [1, 2, 3], 0, 0),
])
def test_disk_fallback(tmp_path: Path, memory, disk, prompt, reused, from_disk):
    store = _store(tmp_path)
    if disk is not None:
        store.save(disk, caches(disk))
        store.flush()
    index = index_of(*([memory] if memory else []), disk=store)
    hit = index.fetch(prompt)
    assert ((hit.reused, hit.disk) if hit else (0, 0)) == (reused, from_disk)
    if hit:
        assert held_ids(hit.layers) == prompt[:reused]
    # A conversation's own cache asks the same way, and keeps what it holds when that is the longest.
    cache = ConversationCache(SimpleNamespace(layers=[None] * LAYERS))
    assert index.reuse(cache, prompt) == (reused, from_disk)
    assert cache.tokens == prompt[:reused] and (not reused or held_ids(cache.layers) == prompt[:reused])
    own = ConversationCache(SimpleNamespace(layers=[None] * LAYERS))
    own.adopt(caches(prompt[:-1]), prompt[:-1], from_disk=False)
    assert index.reuse(own, prompt) == (len(prompt) - 1, 0)


# --- every path asks the index (the real embedded model) ---------------------------------------------------------


@pytest.fixture()
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every answer the prefix index gives, as (how it was asked, ids reused, of which from disk)."""
    answers: list[tuple[str, int, int]] = []
    reuse, fetch = PrefixIndex.reuse, PrefixIndex.fetch

    def spy_reuse(self, cache, prompt):  # noqa: ANN001, ANN202
        answers.append(("reuse", *(out := reuse(self, cache, prompt))))
        return out

    def spy_fetch(self, prompt):  # noqa: ANN001, ANN202
        hit = fetch(self, prompt)
        answers.append(("fetch", hit.reused if hit else 0, hit.disk if hit else 0))
        return hit

    monkeypatch.setattr(PrefixIndex, "reuse", spy_reuse)
    monkeypatch.setattr(PrefixIndex, "fetch", spy_fetch)
    return answers


def test_a_chat_turn_reuses_through_the_index(engine, greedy, asked):
    chat = engine.chat(system="You are terse.", profile=greedy)
    first = chat.send("Name a fruit.", max_tokens=4).wait()
    second = chat.send("Name a colour.", max_tokens=4).wait()
    assert [a[1] for a in asked] == [0, second.metrics.cached_tokens] and first.metrics.cached_tokens == 0
    assert second.metrics.cached_tokens >= first.metrics.prompt_tokens


def test_a_solo_request_repeated_reuses_its_prompt_from_memory(engine, greedy, asked):
    prompt = "Tell me about cats in one sentence."
    assert engine.generate(prompt, profile=greedy, max_tokens=6).metrics.cached_tokens == 0  # no memory by default
    solo = engine.with_prefix_cache(64)
    first = solo.generate(prompt, profile=greedy, max_tokens=6)
    again = solo.generate(prompt, profile=greedy, max_tokens=6)
    assert first.metrics.cached_tokens == 0
    assert again.metrics.cached_tokens == again.metrics.prompt_tokens - 1 and again.metrics.disk_tokens == 0
    assert again.token_ids == first.token_ids
    assert [a[1] for a in asked] == [0, 0, again.metrics.cached_tokens]
    assert 0 < solo.prefix_index().nbytes <= 64 * 2**20


def test_two_server_requests_sharing_a_system_prompt_reuse_it(engine, greedy, asked):
    from mlxchat.core.batch import BatchRequest, BatchScheduler
    from mlxchat.core.decode.events import Done

    system = {"role": "system", "content": "You are a helpful assistant who answers in one short sentence. " * 4}
    tok = engine.model.tokenizer

    def answer(s, text):  # noqa: ANN001, ANN202
        q: queue.Queue = queue.Queue()
        s.submit(BatchRequest(tok.encode_chat([system, {"role": "user", "content": text}]), greedy, q.put,
                              max_tokens=4))
        while not isinstance(event := q.get(timeout=120), Done):
            assert not isinstance(event, BaseException), event
        return event.result

    s = BatchScheduler(engine, max_batch=2)
    first, second = answer(s, "Name a fruit."), answer(s, "Name a colour.")
    shared = common_prefix(tok.encode_chat([system, {"role": "user", "content": "Name a fruit."}]),
                           tok.encode_chat([system, {"role": "user", "content": "Name a colour."}]))
    assert first.metrics.cached_tokens == 0 and second.metrics.cached_tokens == shared > 40
    assert asked == [("fetch", 0, 0), ("fetch", shared, 0)]
    assert second.token_ids == answer(BatchScheduler(engine, prefix_cache_bytes=0), "Name a colour.").token_ids


def test_the_split_models_scheduler_reuses_through_the_index(engine, greedy, asked):
    """`SequentialScheduler` (core/distributed/serving.py) on a plain engine: its one kept cache, matched by the
    index; admitted by the batch's admission queue."""
    from mlxchat.core.batch import BatchRequest, QueueFull
    from mlxchat.core.decode.events import Done
    from mlxchat.core.distributed.serving import SequentialScheduler

    tok = engine.model.tokenizer
    s = SequentialScheduler(engine, max_queue=0)
    turn1 = [{"role": "user", "content": "Tell me about cats in one sentence."}]

    def ask(messages):  # noqa: ANN001, ANN202
        q: queue.Queue = queue.Queue()
        s.submit(BatchRequest(tok.encode_chat(messages), greedy, q.put, max_tokens=6))
        return q

    def wait(q):  # noqa: ANN001, ANN202
        while not isinstance(event := q.get(timeout=120), Done):
            assert not isinstance(event, BaseException), event
        return event.result

    first = ask(turn1)
    with pytest.raises(QueueFull, match="1 request is running"):
        ask(turn1)  # the first runs (or waits its turn): a queue of 0 takes no other
    one = wait(first)
    deadline = time.monotonic() + 10
    while s.load != (0, 0) and time.monotonic() < deadline:  # its slot is freed just after its Done
        time.sleep(0.01)
    assert s.load == (0, 0)
    turn2 = turn1 + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "And dogs?"}]
    two = wait(ask(turn2))
    assert two.metrics.cached_tokens > one.metrics.prompt_tokens
    assert asked[-1] == ("reuse", two.metrics.cached_tokens, 0)


# --- one admission queue for the server's schedulers (core/batch.py) -----------------------------------------------


def test_the_admission_queue_checks_bounds_and_hands_out_in_order():
    from mlxchat.core import ContextLengthError, SamplingProfile
    from mlxchat.core.batch import Admission, BatchRequest, QueueFull

    engine = SimpleNamespace(context_length=8, name="m")
    admission = Admission(engine, 2, 1)
    req = [BatchRequest([1, 2, 3], SamplingProfile(temperature=0), lambda _: None) for _ in range(4)]
    with pytest.raises(ValueError, match="empty"):
        admission.check(BatchRequest([], SamplingProfile(), lambda _: None))
    with pytest.raises(ContextLengthError):
        admission.check(BatchRequest(list(range(8)), SamplingProfile(), lambda _: None))
    with admission.lock:
        admission.add(req[0])
        admission.add(req[1], ready=False)  # held (its grammar compiling): counted as waiting
        admission.add(req[2])
        with pytest.raises(QueueFull, match="2 requests are running and 3 waiting"):
            admission.add(req[3])
    assert admission.load == (0, 3)
    assert admission.take(busy=0) is req[0] and admission.take(busy=2) is None
    with admission.lock:
        admission.ready(req[1])
    assert admission.take(busy=1) is req[2] and admission.take(busy=1) is req[1] and admission.take(busy=0) is None
    assert admission.load == (3, 0)
    admission.release()
    assert admission.load == (2, 0)
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        Admission(engine, 0, 1)
