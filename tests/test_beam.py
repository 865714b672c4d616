"""Beam search on the embedded model against a brute-force search without any KV cache."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.decode.beam import _score, beam_search


def brute_force(model: nn.Module, eos: frozenset[int], prompt: list[int], beam_size: int, horizon: int,
                alpha: float) -> list[tuple[tuple[int, ...], float]]:
    """The same beam rule, but every candidate scored by a fresh full forward pass over prompt + sequence."""
    alive, done = [((), 0.0)], []
    for step in range(horizon):
        cands = []
        for seq, total in alive:
            lp = np.asarray(nn.log_softmax(model(mx.array(prompt + list(seq))[None])[0, -1].astype(mx.float32)))
            best = np.argsort(-lp, kind="stable")[: 2 * beam_size]
            cands += [(total + float(lp[t]), seq, int(t)) for t in best]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * beam_size]
        alive = []
        for total, seq, t in cands:
            if t in eos:
                done.append((seq, _score(total, len(seq), alpha)))
            elif len(alive) < beam_size:
                alive.append((seq + (t,), total))
    done += [(seq, _score(total, len(seq), alpha)) for seq, total in alive]
    return sorted(done, key=lambda d: -d[1])


def test_beam_search_equals_brute_force(engine: Engine):
    prompt = "Name a colour."
    ids = engine.model.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    profile = SamplingProfile(beam_size=3, length_penalty=1.0)
    beams = engine.beam_search(prompt, profile=profile, max_tokens=3)
    ref = engine.run(lambda: brute_force(engine.model.model, engine.model.tokenizer.eos_ids, ids, 3, 3, 1.0))
    assert [b.token_ids for b in beams] == [seq for seq, _ in ref]
    assert [b.score for b in beams] == pytest.approx([s for _, s in ref], abs=2e-3)
    assert beams[0].score >= beams[-1].score and len(beams) >= 3


def test_beam_search_ends_on_eos_and_scores_with_length_penalty(engine: Engine):
    beams = engine.beam_search("What is the capital of France? Answer in one word.",
                               profile=SamplingProfile(beam_size=2, length_penalty=0.5), max_tokens=24)
    finished = [b for b in beams if b.finish_reason == "stop"]
    assert finished and "Paris" in beams[0].text
    for b in beams:
        assert b.score == pytest.approx(b.logprob / max(1, len(b.token_ids)) ** 0.5)


def test_streaming_with_beams_is_a_clear_error(engine: Engine):
    with pytest.raises(ValueError, match="does not stream"):
        engine.stream("Hi", profile=SamplingProfile(beam_size=4))


def test_a_beam_cut_inside_a_character_ends_before_it(engine: Engine):
    """As a streamed reply (tests/test_text_layer.py): no U+FFFD at the end of a beam that max_tokens cut inside an
    emoji; its token ids keep the partial character's tokens."""
    beams = engine.beam_search("Reply with three emojis that describe happiness.",
                               profile=SamplingProfile(beam_size=2), max_tokens=2)
    tok = engine.model.tokenizer
    cut = [b for b in beams if tok.decode(list(b.token_ids)).endswith("\ufffd")]
    assert cut  # the emojis take three tokens each here
    for b in cut:
        assert not b.text.endswith("\ufffd") and b.text == tok.decode(list(b.token_ids)).rstrip("\ufffd")


def test_a_beam_is_a_reply_stop_strings_bias_cancel_and_metrics(engine: Engine):
    """Beams go through the text layer every request has (core/decode/reply.py): a stop string ends a beam before it,
    the processors (here logit_bias) shape the scores, a cancel ends the live beams, each beam carries the metrics."""
    ask = "Count from one to ten, separated by commas."
    plain = engine.beam_search(ask, profile=SamplingProfile(beam_size=2), max_tokens=6)
    best = plain[0]
    assert best.text.startswith("123") and best.metrics.completion_tokens == len(best.token_ids) == 6
    assert best.metrics.prompt_tokens > 10 and best.metrics.decode_steps == 6
    stopped = engine.beam_search(ask, profile=SamplingProfile(beam_size=2), max_tokens=6, stop=["3"])
    ended = [b for b in stopped if b.token_ids[:3] == best.token_ids[:3]]
    assert ended and ended[0].finish_reason == "stop" and ended[0].text == "12"
    assert all("3" not in b.text for b in stopped)
    banned = best.token_ids[0]
    biased = engine.beam_search(ask, profile=SamplingProfile(beam_size=2, logit_bias={banned: -100}), max_tokens=3)
    assert all(b.token_ids[:1] != (banned,) for b in biased)
    # Cancelled after two steps (a one-id prompt: nothing to prefill, so the check runs once per step).
    checks = iter([False, False, True])
    request = engine.request(SamplingProfile(), 6)
    cut = engine.run(lambda: beam_search(engine.model, request, best.token_ids[:1], beam_size=2,
                                         cancelled=lambda: next(checks)))
    assert {b.finish_reason for b in cut} == {"cancelled"} and {len(b.token_ids) for b in cut} == {2}
