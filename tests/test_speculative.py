"""Speculative decoding (core/decode/speculative.py): the same text with and without it, greedy and seeded, through stop
strings, traces, penalties and chat turns; the guesses and the cache after rejections; what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxchat.core import SamplingProfile
from mlxchat.core.decode.events import TokenEvent
from mlxchat.core.decode.speculative import Governor, NgramDrafter, Speculation, check, load_draft

# An edit of a code block: the reply copies long runs of its input, which prompt lookup guesses.
CODE = '''def mix(h: int) -> int:
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)'''
EDIT = f"Rename the function mix to fmix32 and print the whole code:\n\n```python\n{CODE}\n```"


def test_ngram_guesses_what_followed_the_latest_occurrence() -> None:
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3, 7, 2, 3], 2) == [7, 2]  # the latest "2 3" is followed by 7
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3, 7, 2, 3, 5], 4) == []  # 5 never occurred before
    assert NgramDrafter(max_n=2, min_n=2).propose([5, 6, 7, 6], 2) == []  # "7 6" is new, 1-grams are not tried
    assert NgramDrafter(max_n=2, min_n=1).propose([5, 6, 7, 6], 2) == [7, 6]


def test_speculation_settings_and_refusals() -> None:
    assert Speculation.make(None).mode == "off" and Speculation.make("auto").on
    for bad, field in ((Speculation("fast"), "speculative must be one of off, ngram, draft, auto"),
                       (Speculation("ngram", draft_tokens=8), "draft_tokens must be between 1 and 7"),
                       (Speculation("ngram", ngram=2, min_ngram=3), "min_ngram <= ngram")):
        with pytest.raises(ValueError, match=field):
            Speculation.make(bad)
    with pytest.raises(ValueError, match="speculative='ngram' cannot run here: a rotating KV window"):
        check(Speculation("ngram"), rotating=True)
    with pytest.raises(ValueError, match="speculative='draft' needs a draft model"):
        check(Speculation("draft"), draft=False)
    check(Speculation("auto"), rotating=True, quantized=True, draft=False)  # auto falls back to plain decode


def test_governor_backs_off_when_speculation_does_not_pay_and_stays_when_it_does() -> None:
    auto = Governor(Speculation("auto", draft_tokens=6), adaptive=True)
    assert auto.peek() and auto.k == 2
    for _ in range(4):  # fully accepted guesses grow the guess up to draft_tokens
        auto.verified(auto.k, auto.k, 0.040)
    assert auto.k == 6
    auto.verified(6, 1, 0.040)
    assert auto.k == 2
    auto.plain(0.010)  # plain decode: 10 ms a token; the episode made 20 ms a token: stop peeking for 16 tokens
    auto.episode_done()
    assert [auto.peek() for _ in range(17)] == [False] * 16 + [True]
    auto.verified(2, 0, 0.020), auto.episode_done()
    assert auto.cooldown == 32  # failed again: twice as long
    ngram = Governor(Speculation("ngram", draft_tokens=4), adaptive=False)  # sized like auto, never backs off
    assert ngram.k == 2
    ngram.verified(2, 2, 1.0), ngram.plain(0.001), ngram.episode_done()
    assert ngram.peek() and ngram.k == 3
    ngram.verified(3, 0, 1.0)
    assert ngram.k == 1
    fixed = Governor(Speculation("draft", draft_tokens=4), adaptive=False)  # a draft model's guesses keep their length
    fixed.verified(4, 0, 1.0), fixed.plain(0.001), fixed.episode_done()
    assert fixed.peek() and fixed.k == 4


def test_same_text_with_ngram_greedy_seeded_chat_turns_and_draft_models(engine, tmp_path: Path) -> None:  # noqa: ANN001
    greedy = SamplingProfile(temperature=0)
    off = engine.generate(EDIT, profile=greedy, max_tokens=32)
    chat = engine.chat(profile=greedy, speculative="ngram")
    on = chat.send(EDIT, max_tokens=32).wait()  # the same prompt ids as the one-off request
    assert on.token_ids == off.token_ids and on.text == off.text
    m = on.metrics
    assert m.speculative == "ngram" and m.accepted_tokens > 8 and m.draft_tokens >= m.accepted_tokens
    assert m.decode_steps < m.completion_tokens and m.tokens_per_step > 1.2
    assert off.metrics.decode_steps == off.metrics.completion_tokens and off.metrics.draft_tokens == 0
    # The next turn starts from the trimmed cache: rejected guesses left nothing behind.
    assert all(c.offset == len(chat.cache.tokens) for c in chat.cache.layers)
    second = chat.send("Print it again.", max_tokens=8).wait()
    assert second.metrics.cached_tokens > 0
    history = [{"role": m.role, "content": m.content} for m in chat.messages[:-1]]
    assert second.token_ids == engine.generate(history, profile=greedy, max_tokens=8).token_ids
    # A cancel lands at the next token, even inside a verified step.
    stream = engine.stream(EDIT, profile=greedy, max_tokens=32, speculative="ngram")
    for event in stream:
        if isinstance(event, TokenEvent) and len(event.token_ids) and event.metrics.completion_tokens >= 3:
            stream.cancel()
    cut = stream.result
    assert cut.finish_reason == "cancelled" and 3 <= len(cut.token_ids) < 32  # the thread may be a step ahead
    assert cut.token_ids == off.token_ids[:len(cut.token_ids)]
    # Sampling: the same seed, penalties (counting accepted tokens only), a stop string and a trace.
    sampled = SamplingProfile(temperature=0.7, top_p=0.95, seed=11, repetition_penalty=1.05, frequency_penalty=0.2)
    a = engine.generate(EDIT, profile=sampled, max_tokens=20, stop=["0xC2"], trace=2)
    b = engine.generate(EDIT, profile=sampled, max_tokens=20, stop=["0xC2"], trace=2, speculative="ngram")
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    assert [t.candidates for t in b.traces] == [t.candidates for t in a.traces] and len(b.traces) == len(b.token_ids)
    assert b.metrics.draft_tokens > 0
    with pytest.raises(ValueError, match="rotating KV window"):
        engine.chat(context_policy="rotate", speculative="ngram")
    assert engine.chat(context_policy="rotate", speculative="auto").speculative == "auto"  # decodes plainly

    # Draft models: the model as its own draft agrees with itself; a separate 2-layer one keeps its own cache.
    from tests.model_files import tiny_llama_gguf

    with pytest.raises(ValueError, match="needs a draft model"):
        engine.generate("Hi", speculative="draft")
    tiny = tiny_llama_gguf(tmp_path / "tiny.gguf")
    try:
        engine.draft = engine.run(lambda: load_draft("self", engine.model))
        own = engine.generate(EDIT, profile=greedy, max_tokens=10, speculative="draft")
        assert own.token_ids == off.token_ids[:10]
        assert own.metrics.accepted_tokens == own.metrics.draft_tokens > 0
        engine.draft = engine.run(lambda: load_draft(tiny, engine.model))
        assert engine.generate(EDIT, profile=greedy, max_tokens=10,
                               speculative="draft").token_ids == off.token_ids[:10]
    finally:
        engine.draft = None
    other = tiny_llama_gguf(tmp_path / "other.gguf", renamed={0: "<|not-the-same|>"})
    with pytest.raises(ValueError, match="does not share the vocabulary"):
        engine.run(lambda: load_draft(other, engine.model))
    with pytest.raises(ValueError, match="self:N"):
        engine.run(lambda: load_draft("self:99", engine.model))


def test_the_stats_line_shows_acceptance_and_tokens_per_step() -> None:
    from mlxchat.app.formatting import stats_line

    m = {"completion_tokens": 16, "speculative": "ngram", "draft_tokens": 10, "accepted_tokens": 6,
         "decode_steps": 8}
    assert stats_line(m).endswith(" · speculative ngram: 60% accepted, 2.0 tok/step")
    assert "speculative" not in stats_line({**m, "speculative": "off"})


def test_cli_speculative_flags(engine, capsys: pytest.CaptureFixture,  # noqa: ANN001
                               monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxchat.app.cli import main
    from mlxchat.core import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: engine))
    assert main(["generate", EDIT, "--temperature", "0", "--max-tokens", "12", "--speculative", "ngram",
                 "--stats"]) == 0
    err = capsys.readouterr().err
    assert "speculative ngram: " in err and " tok/step" in err and "guesses accepted" in err
    for argv, expected in ((["generate", "hi", "--speculative", "draft"], "--speculative draft needs --draft-model"),
                           (["chat", "--speculative", "draft"], "only `mlxchat generate --draft-model` loads")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("mlxchat: error: ") and expected in err and len(err.splitlines()) == 1


def test_bench_section_rows_verify_cost_and_targets(engine) -> None:  # noqa: ANN001
    from mlxchat.bench import speculative as SB

    rows = SB._prompt_rows(engine, {"edit code": "Say 1 2 3 1 2 3 1 2 3"}, "grounded", ("off", "ngram"), 6, 1)
    assert rows[0]["ngram"]["exact"] and rows[0]["ngram"]["tokens_per_step"] >= 1
    cost = SB.verify_cost(engine, 1, context=16)
    assert [c["rows"] for c in cost] == list(SB.ROWS) and cost[0]["vs_one_row"] == 1.0
    spec = {"max_tokens": 6, "repeats": 1, "prompts": [*rows, {**rows[0], "kind": "free", "auto": rows[0]["ngram"]}],
            "verify_cost": cost, "self_speculation": []}
    assert "edit code (grounded" in "\n".join(SB.summary_lines(spec))
    assert [t["passed"] for t in SB.targets(spec)] == [rows[0]["ngram"]["speedup"] >= 2,
                                                       rows[0]["ngram"]["speedup"] >= 0.97]


def test_chat_flag_and_config_setting() -> None:
    from pydantic import ValidationError

    from mlxchat.app.cli import build_parser, chat_options
    from mlxchat.app.config import Settings

    options = chat_options(build_parser().parse_args(["chat", "--speculative", "auto"]))
    assert options["settings"]["speculative"] == "auto" and Settings(**options["settings"]).speculative == "auto"
    with pytest.raises(ValidationError, match="speculative"):
        Settings(speculative="draft")  # the chat loads no draft model


def test_a_constrained_reply_speculates_to_the_same_text(engine) -> None:  # noqa: ANN001
    # The constraint stage (core/sampling/constraint.py) sees only the tokens speculation accepts, in order.
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompt = 'Repeat this JSON exactly: {"name": "Alice Smith", "age": 42}. Again: {"name": "Alice Smith", "age": 42}'
    for temperature in (0.0, 1.0):
        p = SamplingProfile(temperature=temperature, seed=7, max_tokens=40,
                            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        plain, guessed = (engine.generate(prompt, profile=p, speculative=mode) for mode in ("off", "ngram"))
        assert guessed.text == plain.text and guessed.finish_reason == plain.finish_reason == "stop"
        assert guessed.metrics.draft_tokens > 0


def test_a_row_joining_ends_the_lone_rows_verified_steps(engine) -> None:  # noqa: ANN001
    """The step loop (core/decode/generate.py): a lone row verifies guesses; a second row joining sends it back to plain
    batched steps (and its own cache into the batch); both give the tokens they give alone."""
    import time

    from mlx_lm.models.cache import make_prompt_cache

    from mlxchat.core.decode.generate import Row, StepLoop, prefill_all_but_last
    from mlxchat.core.decode.reply import Reply

    m, tok = engine.model, engine.model.tokenizer
    grounded = tok.encode_chat([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy "
                                                            "dog. the quick brown fox jumps over the lazy dog."}])
    other = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    request = engine.request(SamplingProfile(temperature=0), 14, speculative="ngram")

    def row(prompt: list[int], spec: bool) -> tuple[Row, list]:
        layers = make_prompt_cache(m.model)
        reply = Reply(m, request, prompt, lambda e: None, lambda: False, accepted=time.perf_counter(),
                      context=lambda: 0)
        r = Row(reply, [], context=prompt, drafter=NgramDrafter() if spec else None, spec=request.speculative)
        prefill_all_but_last(m.model, layers, prompt, r.fed, 512, lambda: False, None)
        return r, layers

    def alone(prompt: list[int]) -> tuple[int, ...]:
        r, layers = row(prompt, False)
        StepLoop(m.model).run(r, layers, prompt[-1])
        return r.reply.finish(r.reason).token_ids

    def together() -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        loop = StepLoop(m.model)
        a, layers = row(grounded, True)
        loop.join(a, layers, grounded[-1])
        for _ in range(24):
            if loop._verifying is a:
                break
            loop.step()
        verifying = loop._verifying is a
        b, layers = row(other, False)
        loop.join(b, layers, other[-1])
        while loop.rows:
            loop.step()
        return a.reply.finish(a.reason).token_ids, b.reply.finish(b.reason).token_ids, verifying

    ids_a, ids_b = engine.run(lambda: alone(grounded)), engine.run(lambda: alone(other))
    got_a, got_b, verifying = engine.run(together)
    assert verifying  # the second row joined during the first one's verified steps
    assert (got_a, got_b) == (ids_a, ids_b)
