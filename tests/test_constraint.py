"""Constrained decoding (issue 22): response formats validated at the edge, the constraint stage of the sampler chain
on hand-made logits (greedy and the seeded draw only pick allowed tokens, end-of-turn only where the grammar ends),
and on the embedded model (replies validate, the trace names the stage, a cut reply is "length")."""

from __future__ import annotations

import io
import json
import queue
import sys
import time
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from pydantic import ValidationError

from mlxchat.app.cli import main
from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.sampling import constraint
from mlxchat.core.batch import BatchRequest, BatchScheduler
from mlxchat.core.sampling.candidates import Candidates
from mlxchat.core.sampling.constraint import constraint_for
from mlxchat.core.decode.events import Done, TokenEvent
from mlxchat.core.sampling.profile import ProfileError, ProfileStore
from mlxchat.core.sampling.chain import Sampler

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1, "maxItems": 2}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "response_format.json_schema.schema.type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "zzz"}, "strict": True}},
     "response_format.json_schema.schema: Unknown format: zzz"),
    ({"type": "regex", "regex": "a(b"}, "response_format.regex: "),
    ({"type": "grammar", "grammar": "start: foo"}, "response_format.grammar: "),
    ({"type": "regex"}, "response_format.regex is required when type is 'regex'"),
    ({"type": "json_object", "regex": "a"}, "response_format.regex is not allowed"),
    ({"type": "xml"}, "response_format.type"),
])
def test_a_bad_format_is_one_error_naming_the_field(fmt: dict, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        SamplingProfile(response_format=fmt)
    assert words in str(e.value)


def test_formats_print_in_the_chain_and_round_trip_through_toml(tmp_path: Path) -> None:
    assert SamplingProfile(response_format={"type": "text"}).response_format is None
    p = SamplingProfile(name="people", top_p=0.9, temperature=0.7, response_format=PERSON_FORMAT)
    assert p.describe_chain() == "JsonSchema(person) → TopP(0.9) → Temperature(0.7) → sample"
    assert SamplingProfile(temperature=0, response_format={"type": "json_object"}).describe_chain() == \
        "JsonObject → greedy"
    regex = SamplingProfile(response_format={"type": "regex", "regex": r"\d+"})
    assert regex.describe_chain() == r"Regex(\d+) → sample"
    gbnf = SamplingProfile(response_format={"type": "grammar", "grammar": 'root ::= "yes" | "no"'})  # converted
    assert gbnf.describe_chain() == 'Grammar(root ::= "yes" | "no") → sample'
    store = ProfileStore(tmp_path)
    store.save(p)
    loaded = store.load("people")
    assert loaded == p and loaded.response_format.json_schema.schema_ == PERSON
    assert "[response_format.json_schema.schema.properties.name]" in (tmp_path / "people.toml").read_text()
    with pytest.raises(ProfileError, match="TOML has no null"):
        store.save(SamplingProfile(name="nulls", response_format={"type": "json_schema", "json_schema": {
            "schema": {"const": None}}}))
    with pytest.raises(ValidationError, match="response_format cannot be used with beam search"):
        SamplingProfile(beam_size=2, response_format={"type": "json_object"})


def _allowed(engine: Engine, fmt: dict, prefix: list[int]) -> np.ndarray:
    """The constraint's mask after `prefix`, as a bool vector."""
    c = constraint_for(SamplingProfile(response_format=fmt).response_format, engine.model.tokenizer,
                       engine.model.vocab_size)
    c.replay(prefix)
    return np.asarray(c(Candidates(mx.zeros(engine.model.vocab_size), None)).logits) == 0


def test_the_stage_masks_before_the_transforms_for_greedy_and_the_draw(engine: Engine) -> None:
    tok, vocab = engine.model.tokenizer, engine.model.vocab_size
    fmt = {"type": "regex", "regex": "(yes|no)"}
    allowed = _allowed(engine, fmt, [])
    assert 0 < allowed.sum() < 20 and not allowed[sorted(tok.eos_ids)].any()  # no end before the grammar can end
    ended = _allowed(engine, fmt, tok.encode("yes"))
    assert set(np.flatnonzero(ended)) == set(tok.eos_ids)  # complete: only an end-of-turn id may follow
    # Logits that favour a disallowed token hugely: every path still picks an allowed one, and top-p renormalises
    # over the allowed tokens only (so TopP(0.5) keeps a token although all allowed mass is tiny).
    logits = np.random.default_rng(0).normal(0, 1, vocab).astype(np.float32)
    logits[tok.encode(" maybe")[0]] = 50.0
    for profile in (SamplingProfile(temperature=0, response_format=fmt),
                    *(SamplingProfile(top_p=0.5, seed=s, response_format=fmt) for s in range(4))):
        s = Sampler(profile, vocab_size=vocab, eos_ids=tok.eos_ids,
                    constraint=constraint_for(profile.response_format, tok, vocab))
        assert repr(s.constraint) == "Regex((yes|no))" and s.describe() == profile.describe_chain()
        ids = []
        for _ in range(4):
            token, _ = s.step(mx.array(logits))
            ids.append(token.item())
            if ids[-1] in tok.eos_ids:
                break
        assert ids[-1] in tok.eos_ids and tok.decode(ids[:-1]) in ("yes", "no")


def test_replies_validate_the_trace_names_the_stage_and_a_cut_reply_is_length(engine: Engine) -> None:
    prompt = "Describe a person as JSON."
    greedy = engine.generate(prompt, profile=SamplingProfile(temperature=0, response_format=PERSON_FORMAT),
                             max_tokens=40, trace=5)
    assert greedy.finish_reason == "stop" and greedy.sampler == "JsonSchema(person) → greedy"
    jsonschema.validate(json.loads(greedy.text), PERSON)
    removed = {c.removed_by for t in greedy.traces for c in t.candidates}
    assert "JsonSchema(person)" in removed and greedy.traces[0].stages == ("processed", "JsonSchema(person)")
    m = greedy.metrics
    assert m.constraint_masks >= len(greedy.token_ids) and 0 < m.constraint_mask_s and m.constraint_compile_s > 0
    cut = engine.generate(prompt, profile=SamplingProfile(temperature=0, response_format=PERSON_FORMAT), max_tokens=2)
    assert cut.finish_reason == "length" and cut.text == greedy.text[:len(cut.text)]


# --- the CLI -----------------------------------------------------------------------------------------------------

def _cli(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *argv: str, stdin: str = "") -> tuple:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = e.code
    return (rc, *capsys.readouterr())


@pytest.mark.parametrize("argv, stdin, expected", [
    (["--json-schema", "-"], '{"type": "strin"}', "--json-schema -: type: 'strin' is not valid"),
    (["--json-schema", "-"], "{nope", "--json-schema -: not valid JSON: Expecting property name"),
    (["--json-schema", "/nonexistent.json"], "", "--json-schema /nonexistent.json: cannot read it (No such file"),
    (["--regex", "a("], "", "--regex: at 1(8): invalid regex"),
    (["--grammar", "-"], "start: foo", "--grammar -: at 1(8): unknown name"),
    (["--regex", "a", "--json-object"], "", "argument --json-object: not allowed with argument --regex"),
])
def test_bad_format_flags_are_one_line_before_the_model_loads(capsys, monkeypatch, argv, stdin, expected) -> None:
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model for nothing")))
    rc, out, err = _cli(capsys, monkeypatch, "generate", "hi", *argv, stdin=stdin)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and expected in err, err


def test_generate_with_format_flags(engine: Engine, capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: engine))
    (tmp_path / "city.json").write_text(json.dumps({"type": "object", "properties": {"ok": {"const": True}},
                                                    "required": ["ok"], "additionalProperties": False}))
    rc, out, _ = _cli(capsys, monkeypatch, "generate", "JSON please", "--json-schema", str(tmp_path / "city.json"),
                      "--temperature", "0", "--json")
    result = json.loads(out)
    assert rc == 0 and result["text"] == '{"ok": true}' and result["sampler"] == "JsonSchema(city) → greedy"
    assert result["finish_reason"] == "stop" and result["metrics"]["constraint_masks"] >= 4


# --- the TUI ------------------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_the_profile_form_carries_a_response_format_and_the_stats_line_says_constrained(
        tmp_path: Path, profile_app) -> None:
    from textual.widgets import Input, Static

    from mlxchat.app.formatting import stats_line

    app = profile_app(ProfileStore(tmp_path / "profiles"))
    async with app.run_test(size=(160, 50)) as pilot:
        picker = app.screen
        field = picker.query_one("#field-response_format", Input)
        field.value = '{"type": "regex", "regex": "a("}'
        await pilot.pause()
        assert str(picker.query_one("#error-response_format", Static).content).startswith("response_format.regex: ")
        field.value = '{"type": "json_object"}'
        await pilot.pause()
        assert picker.edited.response_format.type == "json_object" and "response_format" not in picker.errors
        assert str(picker.query_one("#profile-chain", Static).content).startswith("chain: JsonObject → ")
    line = stats_line({"completion_tokens": 9, "constraint_masks": 10, "constraint_mask_s": 0.002})
    assert "constrained (0.20 ms/mask)" in line and "constrained" not in stats_line({"completion_tokens": 9})


# --- the lab ------------------------------------------------------------------------------------------------------

LAB_SET = """
[[prompts]]
id = "ok"
text = "Is water wet? Answer in JSON."
[prompts.schema]
type = "object"
required = ["ok"]
additionalProperties = false
properties = { ok = { type = "boolean" } }

[[prompts]]
id = "free"
text = "Say hello."
constrain = false
schema = { type = "object", properties = { ok = { type = "boolean" } }, required = ["ok"] }
"""


def test_a_prompt_set_entry_carries_a_schema_and_schema_valid_counts(engine: Engine, tmp_path: Path) -> None:
    from mlxchat.lab import prompts as P
    from mlxchat.lab.runner import Experiment, Setting, cell_metrics

    (tmp_path / "json.toml").write_text(LAB_SET)
    prompt_set = P.load(str(tmp_path / "json.toml"))
    outputs: list = []
    Experiment(prompt_set, [Setting("greedy", SamplingProfile(temperature=0))], seeds=1, max_tokens=6).run(
        engine, outputs.append)
    assert [(o.prompt_id, o.schema_valid) for o in outputs] == [("ok", True), ("free", False)]
    assert cell_metrics(outputs)["schema_valid"]["mean"] == 0.5
    (tmp_path / "bad.toml").write_text(LAB_SET.replace('type = "boolean"', 'type = "bool"', 1))
    with pytest.raises(P.PromptSetError, match="prompt 'ok': schema.properties.ok.type: 'bool' is not valid"):
        P.load(str(tmp_path / "bad.toml"))


def test_the_bench_section_reports_its_targets() -> None:
    from mlxchat.bench import constrained as CD

    c = {
        "schemas": [{"schema": "enums", "seeds": 2, "stop": 2, "valid": 2, "invalid": [], "compile_ms": 0.7,
                     "mask_us_per_token": 400.0}], "stop_outputs": 2, "stop_valid": 2,
        "cost": {"tokens": 64, "repeats": 3, "median_tpot_s": {"plain": 0.030, "constrained": 0.036}, "ratio": 1.2,
                 "best_ratio": 1.05, "cpu_ratio": 1.04, "mask_us_per_token": 400.0}}
    valid, tpot = CD.targets(c)
    assert valid["passed"] is True and valid["detail"] == "2/2"
    assert tpot["passed"] is False and tpot["detail"] == "median 1.20x, best 1.05x, CPU time per token 1.04x"
    assert CD.targets(None)[0]["passed"] is None and "2/2 'stop' outputs valid" in CD.summary_lines(c)[0]


# --- compiled off the inference thread, cached by grammar ---------------------------------------------------------

def test_a_grammar_compiles_once_per_model_and_each_request_gets_its_own_matcher(engine: Engine, monkeypatch) -> None:
    tok, vocab = engine.model.tokenizer, engine.model.vocab_size
    fmt = SamplingProfile(response_format={"type": "regex", "regex": "(yes|no|maybe)"}).response_format
    first = constraint.prepare(fmt, tok, vocab)
    assert constraint.prepare(fmt, tok, vocab) is first and first.result().matcher is not None
    # Two requests under the same cached grammar: each its own matcher (a deep copy), the cached one untouched.
    a, b = constraint_for(fmt, tok, vocab), constraint_for(fmt, tok, vocab)
    a.replay(tok.encode("yes"))
    zeros = Candidates(mx.zeros(vocab), None)
    assert set(np.flatnonzero(np.asarray(a(zeros).logits) == 0)) == set(tok.eos_ids)
    assert not np.asarray(b(zeros).logits == 0)[sorted(tok.eos_ids)].any()
    assert not first.result().matcher.is_stopped()
    # The cache keeps the most recently used grammars.
    monkeypatch.setattr(constraint, "GRAMMAR_CACHE", 2)
    others = [SamplingProfile(response_format={"type": "regex", "regex": r}).response_format for r in ("a+", "b+")]
    a_plus = constraint.prepare(others[0], tok, vocab)
    a_plus.result()
    assert constraint.prepare(fmt, tok, vocab) is first  # used again: now the most recent
    constraint.prepare(others[1], tok, vocab).result()  # evicts "a+", the least recently used
    assert constraint.prepare(fmt, tok, vocab) is first and constraint.prepare(others[0], tok, vocab) is not a_plus
    # A grammar that does not compile on this tokenizer fails its request, with the field named, not the compile.
    monkeypatch.setattr(constraint, "_compile", lambda *a: constraint.Compiled(None, "boom", 0.0))
    bad = SamplingProfile(response_format={"type": "regex", "regex": "(never|compiled)"}).response_format
    with pytest.raises(ValueError, match=r"^response_format.regex: boom$"):
        constraint_for(bad, tok, vocab)


def test_a_batch_decodes_on_while_a_newcomer_grammar_compiles(engine: Engine, monkeypatch) -> None:
    """The newcomer's grammar compiles on the grammar pool (slowed to 1 s here) and the request is admitted only
    once it has: the row already decoding keeps producing tokens all along. (Before, the compile, and the first
    constrained request's llguidance tokenizer, ~0.5 s, ran at admission on the inference thread: every row
    waited.)"""
    compile_ = constraint._compile
    monkeypatch.setattr(constraint, "_compile", lambda *a: (time.sleep(1.0), compile_(*a))[1])
    tok = engine.model.tokenizer
    s = BatchScheduler(engine, max_batch=4, prefix_cache_bytes=0)
    stamps: list[float] = []
    events: queue.Queue = queue.Queue()

    def emit(event) -> None:
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
        events.put(event)

    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    story = s.submit(BatchRequest(chat("Write a long story about the sea."),
                                  SamplingProfile(temperature=0, min_tokens=400), emit, max_tokens=400))
    while len(stamps) < 3:
        time.sleep(0.01)
    schema = {"type": "object", "required": ["fresh_name"], "properties": {"fresh_name": {"type": "string",
                                                                                          "maxLength": 8}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "fresh", "schema": schema}}
    answers: queue.Queue = queue.Queue()
    submitted = time.perf_counter()
    s.submit(BatchRequest(chat("Reply with JSON."), SamplingProfile(temperature=0, response_format=fmt), answers.put,
                          max_tokens=30))
    assert s.load == (1, 1)  # it waits (compiling), outside the batch
    done = next(e for e in iter(lambda: answers.get(timeout=120), None) if isinstance(e, (Done, BaseException)))
    assert isinstance(done, Done) and done.result.finish_reason == "stop"
    jsonschema.validate(json.loads(done.result.text), schema)
    assert done.result.metrics.ttft_s >= 1.0  # it was admitted after its compile
    window = [t for t in stamps if submitted <= t <= submitted + 1.0]
    gaps = np.diff([t for t in stamps if submitted - 0.5 <= t <= submitted + 1.0])
    assert len(window) >= 10 and gaps.max() < 0.5, (len(window), gaps.max())
    story.cancel()
    assert next(e for e in iter(lambda: events.get(timeout=120), None) if isinstance(e, Done)).result.finish_reason \
        == "cancelled"


# --- the lazy order and the batch's masks ----------------------------------------------------------------------

@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 1.5, "seed": 5, "presence_penalty": 0.5}],
                         ids=["greedy", "t1", "t1.5-penalty"])
def test_the_lazy_order_draws_what_the_full_mask_draws(engine: Engine, monkeypatch, settings: dict) -> None:
    """Draw unmasked, check the token, mask only when it is refused: the same tokens as masking every step, on the
    model's replies (the check decides most steps) and on random logits (the mask decides most)."""
    from mlxchat.core.sampling import chain
    tok, vocab = engine.model.tokenizer, engine.model.vocab_size
    profile = SamplingProfile(**settings, response_format=PERSON_FORMAT)
    lazy = engine.generate("Describe a person as JSON.", profile=profile, max_tokens=40)
    logits = [mx.array(np.random.default_rng(i).normal(0, 3, vocab).astype(np.float32)) for i in range(30)]

    def draws() -> tuple[list[int], Sampler]:
        s = Sampler(profile, vocab_size=vocab, eos_ids=tok.eos_ids,
                    constraint=constraint_for(profile.response_format, tok, vocab))
        ids = []
        for x in logits:
            ids.append(s.step(x)[0].item())
            if ids[-1] in tok.eos_ids:
                break
        return ids, s

    lazy_ids, s = draws()
    assert s.lazy and s.constraint.checks < s.constraint.masks  # random logits: mostly refused, masked
    assert 0 < lazy.metrics.constraint_checks <= lazy.metrics.constraint_masks
    monkeypatch.setattr(chain, "LAZY_CONSTRAINT", False)
    full = engine.generate("Describe a person as JSON.", profile=profile, max_tokens=40)
    full_ids, s = draws()
    assert not s.lazy and s.constraint.checks == 0 and full.metrics.constraint_checks == 0
    assert lazy.token_ids == full.token_ids and lazy.text == full.text and lazy_ids == full_ids
    jsonschema.validate(json.loads(lazy.text), PERSON) if lazy.finish_reason == "stop" else None


def test_the_lazy_order_is_off_where_a_filter_would_cut_another_set(engine: Engine) -> None:
    tok, vocab = engine.model.tokenizer, engine.model.vocab_size
    for settings, lazy in (({"temperature": 0}, True), ({"temperature": 1.2}, True), ({"temperature": 0.7}, False),
                           ({"top_p": 0.9}, False), ({"min_p": 0.1}, False), ({"top_k": 40}, False)):
        profile = SamplingProfile(**settings, response_format=PERSON_FORMAT)
        s = Sampler(profile, vocab_size=vocab, eos_ids=tok.eos_ids,
                    constraint=constraint_for(profile.response_format, tok, vocab))
        assert s.lazy == lazy, profile


def test_the_check_of_one_token_agrees_with_the_mask(engine: Engine) -> None:
    """The lazy order's check against the full mask, on every token of the vocabulary, along replies of a JSON
    schema (forced keys and separators, free strings and numbers), a regex and the tools' "auto" grammar (text or
    calls, llguidance's lexeme negation)."""
    from mlxchat.core.decode.tools import ToolUse
    tok, vocab = engine.model.tokenizer, engine.model.vocab_size
    eos = sorted(tok.eos_ids)
    use = ToolUse.make([{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "auto", None)
    cases = [(SamplingProfile(response_format=PERSON_FORMAT).response_format,
              '{"name": "Ann Lee", "age": 31, "pets": ["cat", "dog"]}'),
             (SamplingProfile(response_format={"type": "regex", "regex": r"[a-z]+ \d{2,4}"}).response_format,
              "hello 123"),
             (use.response_format(), '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'),
             (use.response_format(), "It is sunny.")]
    rng = np.random.default_rng(0)
    for fmt, text in cases:
        reply = tok.encode(text)
        c = constraint_for(fmt, tok, vocab)
        for n in range(len(reply) + 1):
            allowed = np.asarray(c(Candidates(mx.zeros(vocab), None)).logits) == 0
            if not c._done():
                probe = constraint_for(fmt, tok, vocab)
                probe.replay(reply[:n])
                # The check's rule on every token (`Constraint.allows` without reading an MLX array per token), and
                # `allows` itself on a sample.
                m, forced = probe._matcher, probe._matcher.compute_ff_tokens()
                checked = np.zeros(vocab, bool)
                if forced:
                    checked[forced[0]] = True
                else:
                    checked[:] = [m.validate_tokens([t]) == 1 for t in range(vocab)]
                checked[eos] = False
                sample = rng.choice(vocab, 40).tolist() + np.flatnonzero(allowed)[:10].tolist()
                assert [probe.allows(mx.array(t)) for t in sample] == checked[sample].tolist()
                # Every token the check lets through is in the mask; at an end-of-turn id the mask decides.
                assert not (checked & ~allowed).any(), (text, n, np.flatnonzero(checked & ~allowed)[:5])
                missed = np.flatnonzero(allowed & ~checked)
                assert set(missed) <= set(eos) if not forced else allowed.sum() - len(missed) == 1, (text, n)
            if n < len(reply):
                c.replay([reply[n]])


def test_a_batch_fills_its_constrained_rows_masks_at_once(engine: Engine) -> None:
    tok, vocab = engine.model.tokenizer, engine.model.vocab_size
    fmt = SamplingProfile(response_format=PERSON_FORMAT).response_format
    prefixes = [tok.encode(t) for t in ('{"name": "A', '{"name": "Bo", "age": 3', '')]
    rows = [constraint_for(fmt, tok, vocab) for _ in prefixes]
    for c, p in zip(rows, prefixes):
        c.replay(p)
    constraint.fill_masks(rows, mx.zeros((3, vocab)))
    zeros = Candidates(mx.zeros(vocab), None)
    for c, p in zip(rows, prefixes):
        alone = constraint_for(fmt, tok, vocab)
        alone.replay(p)
        assert np.array_equal(np.asarray(c(zeros).logits), np.asarray(alone(zeros).logits))
    # In the scheduler: three rows sampled with top-p (no lazy order) give the tokens each gives alone.
    s = BatchScheduler(engine, max_batch=3, prefix_cache_bytes=0)
    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    profiles = [SamplingProfile(top_p=0.9, seed=i, response_format=PERSON_FORMAT) for i in range(3)]

    def run(p: SamplingProfile) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        s.submit(BatchRequest(chat("Describe a person as JSON."), p, q.put, max_tokens=24))
        return q

    def result(q: queue.Queue):
        return next(e for e in iter(lambda: q.get(timeout=120), None) if isinstance(e, Done)).result

    alone = [result(run(p)) for p in profiles]
    together = [result(q) for q in [run(p) for p in profiles]]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
