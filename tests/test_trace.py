"""The sampler inspector (issue 14): per-token traces of every stage of the chain, checked against NumPy on hand-made
logits, against the draws themselves, and on the embedded model (tracing never changes the tokens of a seed)."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.decode.events import TokenEvent
from mlxchat.core.chat.messages import ChatMessage
from mlxchat.core.sampling.chain import Sampler
from mlxchat.core.sampling.trace import TokenTrace
from mlxchat.core.sampling.tracing import MAX_TRACE, Tracer

CHAIN = dict(top_k=5, top_p=0.5, temperature=0.7, sampler_order=["top_k", "top_p", "temperature"])
STAGES = ("processed", "TopK(5)", "TopP(0.5)", "Temperature(0.7)")


def _logits(n: int = 64, seed: int = 0) -> np.ndarray:
    # Flat enough at the top that TopP(0.5) keeps several of TopK's five: each stage visibly cuts.
    return np.random.default_rng(seed).normal(0, 0.6, n).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def _reference(logits: np.ndarray) -> dict[str, dict[int, float]]:
    """The chain by its definition, in NumPy: each stage's survivors and their renormalised probabilities."""
    processed = dict(enumerate(_softmax(logits)))
    top5 = np.argsort(-logits, kind="stable")[:5]
    after_k = dict(zip(top5.tolist(), _softmax(logits[top5])))
    mass, kept = 0.0, []
    for t in sorted(after_k, key=lambda t: -after_k[t]):  # smallest most-likely prefix reaching 0.5
        if mass >= 0.5:
            break
        kept.append(t)
        mass += after_k[t]
    kept_ids = np.array(kept)
    after_p = dict(zip(kept, _softmax(logits[kept_ids])))
    after_t = dict(zip(kept, _softmax(logits[kept_ids] / 0.7)))
    return dict(zip(STAGES, (processed, after_k, after_p, after_t)))


def _tracer(profile: SamplingProfile, vocab: int, k: int = 10) -> Tracer:
    return Tracer(Sampler(profile, vocab_size=vocab, eos_ids={0}), k, lambda i: f"<{i}>")


def _step(tracer: Tracer, logits: np.ndarray) -> tuple[int, TokenTrace]:
    token, _ = tracer.step(mx.array(logits))
    token_id = token.item()
    return token_id, tracer.take(token_id)


def test_each_stage_keeps_what_the_numpy_reference_keeps():
    logits = _logits()
    ref = _reference(logits)
    assert 1 < len(ref["TopP(0.5)"]) < 5, "the hand-made logits should make every stage cut"
    tracer = _tracer(SamplingProfile(seed=11, **CHAIN), logits.size)
    for _ in range(20):
        token, trace = _step(tracer, logits)
        assert trace.stages == STAGES
        by_id = {c.token_id: c for c in trace.candidates}
        for stage in STAGES[1:]:
            assert {c.token_id for c in trace.candidates if c.probs[stage] is not None} == set(ref[stage]), stage
            for t, p in ref[stage].items():
                assert by_id[t].probs[stage] == pytest.approx(p, rel=1e-5), (stage, t)
        for c in trace.candidates:
            assert c.probs["processed"] == pytest.approx(ref["processed"][c.token_id], rel=1e-5)
            assert c.logit == pytest.approx(float(logits[c.token_id]))
            gone = [s for s in STAGES if c.probs[s] is None]
            assert c.removed_by == (gone[0] if gone else None)
            assert gone == list(STAGES[len(STAGES) - len(gone):]), "once removed, a candidate stays removed"
        chosen = trace.chosen
        assert chosen.token_id == token and chosen.removed_by is None
        assert all(chosen.probs[s] is not None for s in STAGES), "the chosen token survives every stage"
        assert [c.token_id for c in trace.candidates] == sorted(by_id, key=lambda t: -logits[t])  # best first
        assert trace.chosen_rank == int(np.sum(logits > logits[token]))
        p = np.array(list(ref["processed"].values()))
        assert trace.entropy_before == pytest.approx(-(p * np.log(p)).sum(), rel=1e-4)
        q = np.array(list(ref["Temperature(0.7)"].values()))
        assert trace.entropy_after == pytest.approx(-(q * np.log(q)).sum(), rel=1e-4)


def test_the_last_column_is_the_distribution_the_tokens_are_drawn_from():
    logits = _logits(seed=1) - 2
    logits[:5] = [2.0, 1.9, 1.8, 1.7, 1.6]  # TopP(0.5) keeps three of them: a three-way draw to check
    tracer = _tracer(SamplingProfile(seed=5, **CHAIN), logits.size)
    draws, column = 2000, None
    counts: dict[int, int] = {}
    for _ in range(draws):
        token, trace = _step(tracer, logits)
        counts[token] = counts.get(token, 0) + 1
        column = {c.token_id: c.probs[STAGES[-1]] for c in trace.candidates if c.probs[STAGES[-1]] is not None}
    assert set(counts) <= set(column)
    assert len(column) >= 3
    # Pearson's chi-square against the traced column; 0.1% critical values by degrees of freedom.
    chi2 = sum((counts.get(t, 0) - draws * p) ** 2 / (draws * p) for t, p in column.items())
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[len(column) - 1]
    assert chi2 < critical, (chi2, counts, column)


def test_tracing_draws_the_same_tokens_as_the_plain_step():
    logits = _logits(seed=2)
    profile = SamplingProfile(seed=9, temperature=1.3, top_k=30, min_p=0.02, xtc_threshold=0.1, xtc_probability=0.5,
                              repetition_penalty=1.2, frequency_penalty=0.3)
    plain = Sampler(profile, vocab_size=logits.size, eos_ids={0})
    tracer = _tracer(profile, logits.size)
    for _ in range(30):
        assert plain.step(mx.array(logits))[0].item() == _step(tracer, logits)[0]


def test_penalty_shifts_and_banned_tokens_are_traced():
    logits = _logits(seed=3)
    logits[0] = logits.max() + 1  # the end token is the best, and min_tokens bans it
    tracer = _tracer(SamplingProfile(seed=1, temperature=1, min_tokens=5, repetition_penalty=2.0), logits.size,
                     k=logits.size)
    first, _ = _step(tracer, logits)
    _, trace = _step(tracer, logits)
    eos = next(c for c in trace.candidates if c.token_id == 0)
    assert eos.removed_by == "processed" and eos.probs["processed"] is None
    assert eos.shifts["MinTokens(5)"] == -math.inf
    again = next(c for c in trace.candidates if c.token_id == first)
    x = float(logits[first])
    assert again.shifts["RepetitionPenalty(2)"] == pytest.approx((x / 2 if x > 0 else x * 2) - x)
    as_json = json.loads(json.dumps(trace.as_dict(), allow_nan=False))  # strict JSON: no infinities
    assert TokenTrace.from_dict(as_json) == trace


def test_greedy_traces_only_the_processed_column():
    logits = _logits(seed=4)
    token, trace = _step(_tracer(SamplingProfile(temperature=0), logits.size, k=3), logits)
    assert token == int(np.argmax(logits)) and trace.stages == ("processed",)
    assert [c.token_id for c in trace.candidates] == np.argsort(-logits)[:3].tolist()
    assert trace.chosen_rank == 0 and trace.entropy_after == trace.entropy_before


@pytest.mark.parametrize("bad", [-1, MAX_TRACE + 1, 2.5, True])
def test_a_bad_trace_count_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=rf"trace must be an integer between 0 and {MAX_TRACE}"):
        _tracer(SamplingProfile(), 10, k=bad)


# --- on the embedded model -------------------------------------------------------------------------------------

FULL = SamplingProfile(seed=1234, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                       frequency_penalty=0.2, xtc_threshold=0.2, xtc_probability=0.3)


def test_tracing_does_not_change_the_tokens_of_a_seed(engine: Engine):
    plain = engine.generate("Write a short line about rivers.", profile=FULL, max_tokens=24)
    events = list(engine.stream("Write a short line about rivers.", profile=FULL, max_tokens=24, trace=4))
    traced = events[-1].result
    assert traced.token_ids == plain.token_ids and traced.text == plain.text
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.token_ids]
    assert [e.trace.chosen.token_id for e in tokens] == list(traced.token_ids)
    assert [t.chosen.token_id for t in traced.traces] == list(traced.token_ids)
    assert all(e.trace is None for e in events if isinstance(e, TokenEvent) and not e.token_ids)
    stages = traced.traces[0].stages
    assert " → ".join(stages[1:]) in traced.sampler  # stage names are the printed chain's
    assert all(len(t.candidates) >= 4 or all(c.removed_by is None for c in t.candidates) for t in traced.traces)


def test_chat_send_traces_and_plain_replies_carry_none(engine: Engine):
    chat = engine.chat(profile=SamplingProfile(temperature=0))
    assert chat.send("Hi", max_tokens=3).wait().traces == ()
    result = chat.send("And again", max_tokens=3, trace=2).wait()
    assert len(result.traces) == len(result.token_ids) == 3
    assert all(t.chosen_rank == 0 for t in result.traces)
    with pytest.raises(ValueError, match="trace must be"):
        chat.send("x", trace=-1)
    assert chat.messages[-1].role == "assistant", "a refused request records nothing"


# --- branching ---------------------------------------------------------------------------------------------------

def test_branching_trims_the_cache_and_continues_from_the_forced_token(engine: Engine):
    chat = engine.chat(system="Be brief.", profile=FULL)
    first = chat.send("Name a colour and say why.", max_tokens=12, trace=3).wait()
    prompt_tokens = first.metrics.prompt_tokens
    at = 5
    # Forcing the token the reply had reproduces it: the same keys and penalties continue from there.
    same = chat.branch(-1, at, first.token_ids[at], max_tokens=12, trace=3)
    events = list(same)
    assert same.result.token_ids == first.token_ids and same.result.text == first.text
    assert same.result.metrics.cached_tokens == prompt_tokens + at  # trimmed to the kept tokens, not prefilled
    forced_event = next(e for e in events if isinstance(e, TokenEvent))
    assert forced_event.token_ids == first.token_ids[:at + 1] and len(forced_event.traces) == at + 1
    assert [t.chosen.token_id for t in same.result.traces] == list(first.token_ids)
    eos = engine.model.tokenizer.eos_ids
    other = next(c.token_id for c in first.traces[at].candidates
                 if c.token_id != first.token_ids[at] and c.token_id not in eos)
    branched = chat.branch(-1, at, other, max_tokens=12, trace=3).wait()
    assert branched.token_ids[:at + 1] == (*first.token_ids[:at], other)
    assert branched.metrics.cached_tokens == prompt_tokens + at
    assert branched.traces[at].chosen.token_id == other and len(branched.traces) == len(branched.token_ids)
    assert len(chat.alternatives(-1)) == 3 and chat.active_branch(-1) == 2
    assert chat.messages[-1].content == branched.text
    ended = chat.branch(-1, at, min(eos), max_tokens=12).wait()  # forcing the end token ends the reply there
    assert ended.token_ids == first.token_ids[:at] and ended.finish_reason == "stop"
    assert len(chat.alternatives(-1)) == 4
    chat.select_branch(-1, 0)
    assert chat.messages[-1].content == first.text
    # A turn after switching builds on the selected branch, reusing the cache up to where it matches.
    follow = chat.send("Why?", max_tokens=3).wait()
    assert follow.metrics.cached_tokens > prompt_tokens
    chat.select_branch(-3, 2)  # the first reply, now followed by a question and its answer
    assert chat.messages[-1].content == branched.text and len(chat.messages) == 3


def test_branch_refuses_bad_positions_with_one_clear_line(engine: Engine):
    chat = engine.chat(profile=SamplingProfile(temperature=0))
    chat.send("Hi", max_tokens=3).wait()
    with pytest.raises(ValueError, match="reply_index must point at an assistant reply"):
        chat.branch(0, 0, 1)
    with pytest.raises(ValueError, match="token_index must be between 0 and 3"):
        chat.branch(1, 4, 1)
    with pytest.raises(ValueError, match="token_id must be between 0 and"):
        chat.branch(1, 0, -1)
    with pytest.raises(ValueError, match="branch index must be between 0 and 0"):
        chat.select_branch(1, 1)


def test_the_reply_tree_keeps_nested_branches_when_switching():
    from mlxchat.core.chat.messages import ReplyTree

    msg = lambda role, text: ChatMessage(role, text)  # noqa: E731
    tree = ReplyTree([msg("user", "q"), msg("assistant", "a1")])
    assert tree.add_alternative(1, msg("assistant", "a2")) == 1
    tree.path += [msg("user", "q2"), msg("assistant", "b1")]
    tree.add_alternative(3, msg("assistant", "b2"))
    assert [m.content for m in tree.alternatives(3)] == ["b1", "b2"]
    tree.select(1, 0)
    assert [m.content for m in tree.path] == ["q", "a1"] and set(tree.forks) == {1}
    tree.select(1, 1)
    assert [m.content for m in tree.path] == ["q", "a2", "q2", "b2"] and tree.active(3) == 1
    tree.truncate(2)
    assert set(tree.forks) == {1} and [m.content for m in tree.alternatives(1)] == ["a1", "a2"]


def test_a_stored_reply_can_still_be_branched_after_a_restart(engine: Engine, tmp_path):
    from mlxchat.app.store import Store

    chat = engine.chat(profile=FULL)
    reply = chat.send("Say something short.", max_tokens=8, trace=3).wait()
    store = Store(tmp_path / "c.db")
    cid = store.create_conversation("t").id
    store.add_message(cid, ChatMessage("user", "Say something short."))
    store.add_message(cid, ChatMessage("assistant", reply.text, finish_reason=reply.finish_reason,
                                   profile=reply.profile, seed=reply.seed, token_ids=reply.token_ids,
                                   traces=reply.traces))
    store.close()
    store = Store(tmp_path / "c.db")
    again = engine.chat(profile=SamplingProfile())  # a new session: the reply's own profile and seed are used
    again.replace_history(store.messages(cid), store.forks(cid))
    assert again.messages[-1].traces == reply.traces
    # Not token for token the old reply: a fresh session prefills the kept ids in one pass, and prefill computes
    # (quantized) logits on another path than decode, so a close draw may go the other way.
    same = again.branch(-1, 4, reply.token_ids[4], max_tokens=8).wait()
    assert same.token_ids[:5] == reply.token_ids[:5] and same.seed == reply.seed
    stored = store.add_branch(cid, 1, ChatMessage("assistant", same.text, token_ids=same.token_ids, seed=same.seed))
    assert stored.position == 1 and store.branches(cid, 1).active == 1
    again.replace_history(store.messages(cid), store.forks(cid))
    assert len(again.alternatives(-1)) == 2 and again.active_branch(-1) == 1
