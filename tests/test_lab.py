"""mlxchat lab without the model: metric formulas against values computed by hand, prompt sets and their checks,
the store, regression bounds, comparisons and blind A/B tallies."""

from __future__ import annotations

import json
import math
import random

import pytest

from mlxchat.lab import metrics as M
from mlxchat.lab import prompts as P
from mlxchat.lab.ab import BlindAB, tally, winner
from mlxchat.lab.compare import Bound, changed_prompts, check_bounds, metric_deltas
from mlxchat.lab.runner import Output, cell_metrics
from mlxchat.lab.store import LabStore, RunNotFound


@pytest.fixture(autouse=True)
def folders(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


# --- metrics ---------------------------------------------------------------------------------------------------

def test_words_split_punctuation_and_lowercase():
    assert M.words("Hi, Bob!") == ["hi", ",", "bob", "!"]


def test_distinct_n_by_hand():
    # words a b a b: unigrams {a, b} of 4; bigrams ab, ba, ab -> 2 distinct of 3
    assert M.distinct_n("a b a b", 1) == 0.5
    assert M.distinct_n("a b a b", 2) == pytest.approx(2 / 3)
    assert M.distinct_n("a", 2) == 0.0


def test_seq_rep_4_by_hand():
    # 8 words -> 5 four-grams: abcd bcda cdab dabc abcd; 4 distinct -> 1 - 4/5
    assert M.seq_rep_n("a b c d a b c d", 4) == pytest.approx(0.2)
    assert M.seq_rep_n("one two three four five", 4) == 0.0
    assert M.seq_rep_n("x " * 20, 4) == pytest.approx(1 - 1 / 17)


def test_bleu_by_hand():
    assert M.bleu("the cat sat", ["the cat sat"]) == pytest.approx(1.0)
    # p1 = 2/3; p2 = (1+1)/(2+1); p3 = (0+1)/(1+1); p4 = (0+1)/(0+1); equal lengths: no brevity penalty
    assert M.bleu("the cat sat", ["the cat ran"]) == pytest.approx((2 / 3 * 2 / 3 * 1 / 2 * 1) ** 0.25)
    # every precision 1, hypothesis 2 words vs reference 4: BP = exp(1 - 4/2)
    assert M.bleu("the cat", ["the cat sat on"]) == pytest.approx(math.exp(-1))
    assert M.bleu("dog", ["the cat"]) == 0.0


def test_self_bleu():
    assert M.self_bleu(["x y z", "x y z", "x y z"]) == pytest.approx(1.0)
    assert M.self_bleu(["only one"]) is None
    # two texts sharing nothing: each scores 0 against the other
    assert M.self_bleu(["a b", "c d"]) == 0.0


def test_mean_interval_by_hand():
    est = M.mean_interval([1.0, 2.0, 3.0])  # s = 1, t(0.975, 2) = 4.303
    assert est.mean == 2.0 and est.n == 3
    assert est.half_width == pytest.approx(4.303 / math.sqrt(3))
    assert M.mean_interval([]) is None
    assert M.mean_interval([0.5]).low == 0.5


def test_wilson_by_hand():
    est = M.wilson(5, 10)  # the textbook value for 5/10
    assert (est.low, est.high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert M.wilson(0, 10).low == 0.0 and M.wilson(0, 10).high > 0.2
    assert M.wilson(0, 0) is None


# --- prompt sets ---------------------------------------------------------------------------------------------------

def test_builtin_sets_load_with_8_to_20_prompts():
    assert P.available() == ["chat", "completion", "creative", "factual", "precise"]
    for name in P.available():
        s = P.load(name)
        assert 8 <= len(s.prompts) <= 20, name
        assert len(s.digest) == 64
    assert all(p.has_check for p in P.load("precise").prompts)
    assert all(p.stop for p in P.load("completion").prompts)


def test_checks():
    p = P.Prompt("x", "What is 2+3?", answer="5")
    assert p.check("2 + 3 = 5.") is True
    assert p.check("It is 15") is False  # a whole word, not a digit inside a number
    assert P.Prompt("x", "t", expect=r"def add\(").check("def add(a, b)") is True
    assert P.Prompt("x", "t", max_words=3).check("one two three four") is False
    assert P.Prompt("x", "t").check("anything") is None


def test_user_set_and_bad_file_one_line(folders):
    d = folders / "config" / "prompts"
    d.mkdir(parents=True)
    (d / "mine.toml").write_text('[[prompts]]\nid = "a"\ntext = "Say hi"\nmax_words = 5\n')
    (d / "broken.toml").write_text("[[prompts]\nid=")
    (d / "wrong.toml").write_text('[[prompts]]\nid = "a"\ntext = "x"\nexpected = "y"\n')
    assert "mine" in P.available()
    assert P.load("mine").prompts[0].max_words == 5
    for name, fragment in (("broken", "not valid TOML"), ("wrong", "unknown key 'expected'"),
                           ("nope", "unknown prompt set 'nope'")):
        with pytest.raises(P.PromptSetError) as e:
            P.load(name)
        assert fragment in str(e.value) and "\n" not in str(e.value)


# --- store, compare, bounds, A/B -------------------------------------------------------------------------------

def out(cell: int, pid: str, seed: int, text: str, passed: bool | None = None, length: int = 5) -> Output:
    return Output(cell=cell, prompt_id=pid, seed=seed, text=text, finish_reason="stop", length=length,
                  words=len(text.split()), mean_logprob=-1.0, ttft_s=0.1, tpot_s=0.01, passed=passed,
                  distinct_1=M.distinct_n(text, 1), distinct_2=M.distinct_n(text, 2), rep_4=M.seq_rep_n(text, 4))


def stored_run(store: LabStore, texts: dict[tuple[int, str, int], tuple[str, bool]]) -> int:
    run_id = store.create(model="m", prompt_set="s", prompt_set_hash="h" * 64,
                          settings=[{"label": "A", "setting": {"temperature": 0.0}},
                                    {"label": "B", "setting": {"temperature": 1.0}}],
                          prompts={"p1": "first", "p2": "second"}, seeds=2, max_tokens=8)
    for (cell, pid, seed), (text, passed) in texts.items():
        store.add_output(run_id, out(cell, pid, seed, text, passed))
    store.finish(run_id, "done")
    return run_id


def test_cell_metrics_average_seeds_then_prompts():
    outs = [out(0, "p1", 0, "a b", True), out(0, "p1", 1, "a b", False), out(0, "p2", 0, "c d", True),
            out(0, "p2", 1, "c d", True)]
    m = cell_metrics(outs)
    assert m["pass_rate"]["mean"] == pytest.approx(0.75)  # prompts 0.5 and 1.0
    assert m["pass_rate"]["n"] == 2
    assert m["self_bleu"]["mean"] == pytest.approx(1.0)
    assert m["finish_reasons"] == {"stop": 4}


def test_store_roundtrip_compare_and_bounds():
    store = LabStore()
    base = {(c, p, s): ("the same words here", True) for c in (0, 1) for p in ("p1", "p2") for s in (0, 1)}
    a = stored_run(store, base)
    changed = dict(base)
    changed[(1, "p2", 0)] = ("something else entirely now", False)
    changed[(1, "p2", 1)] = ("something else entirely now", False)
    b = stored_run(store, changed)
    run_a, run_b = store.load(str(a)), store.load("last")
    assert run_b.id == b and len(run_b.outputs) == 8 and run_b.status == "done"
    assert json.loads(json.dumps(run_b.as_json()))["cells"][1]["metrics"]["pass_rate"]["mean"] == 0.5
    deltas = {(d["setting"], d["metric"]): d for d in metric_deltas(run_a, run_b)}
    assert deltas[("A", "pass_rate")]["delta"] == 0
    assert deltas[("B", "pass_rate")]["delta"] == pytest.approx(-0.5)
    assert [c["prompt_id"] for c in changed_prompts(run_a, run_b)] == ["p2"]
    failures = check_bounds(run_a, run_b, [Bound.parse("pass_rate<-0.05"), Bound.parse("rep_4>+0.1")])
    assert len(failures) == 1 and failures[0].startswith("B: pass_rate moved -0.500")
    assert check_bounds(run_a, run_a, [Bound.parse("pass_rate<-0.05")]) == []
    fewer = store.create(model="m", prompt_set="s", prompt_set_hash="h" * 64, settings=run_b.settings,
                         prompts={"p1": "first"}, seeds=2, max_tokens=8)
    with pytest.raises(ValueError, match="used other prompts"):  # e.g. another --limit: not like with like
        check_bounds(run_a, store.load(fewer), [Bound.parse("pass_rate<-0.05")])
    with pytest.raises(RunNotFound):
        store.load("99")


def test_bound_parse_errors_are_one_line():
    assert Bound.parse(" rep_4 > +0.1 ") == Bound("rep_4", ">", 0.1)
    for bad, fragment in (("pass_rate<=0.1", "write METRIC<DELTA"), ("speed<0", "unknown metric 'speed'")):
        with pytest.raises(ValueError, match=fragment):
            Bound.parse(bad)


def test_blind_ab_maps_sides_back_to_settings():
    store = LabStore()
    run_id = stored_run(store, {(c, p, s): (f"text {c}", None) for c in (0, 1) for p in ("p1", "p2")
                                for s in (0, 1)})
    ab = BlindAB(store.load(run_id), 0, 1, random.Random(3))
    assert len(ab.pairs) == 4
    assert {ab.pairs[0].left, ab.pairs[0].right} == {"text 0", "text 1"}
    sides = [p.a_on_left for p in ab.pairs]
    assert True in sides and False in sides  # the order is really randomised
    for _ in range(3):  # always vote for setting A's text, wherever it is shown
        pair = ab.current
        assert ab.vote("left" if pair.left == "text 0" else "right")[1] == "a"
    ab.vote("skip")
    assert ab.current is None
    r = ab.result()
    assert (r["a"], r["b"], r["skip"]) == (3, 0, 1)
    assert r["win_rate_a"]["mean"] == 1.0 and r["win_rate_a"]["low"] == pytest.approx(0.4385, abs=1e-3)
    with pytest.raises(ValueError):
        ab.vote("left")
    assert winner("left", False) == "b" and tally(["a", "tie"])["win_rate_a"]["mean"] == 0.75


# --- fair comparisons (issue 39, point 5) --------------------------------------------------------------------------

def test_sign_test_and_bootstrap_by_hand():
    # 8 wins and 2 losses: P(X <= 2 | n = 10, p = 1/2) = (1 + 10 + 45) / 1024, two-sided twice that
    assert M.sign_test(8, 2) == pytest.approx(2 * 56 / 1024)
    assert M.sign_test(5, 5) == 1.0 and M.sign_test(0, 0) is None
    est = M.bootstrap_mean([1.0] * 6 + [0.0] * 2 + [0.5] * 2)
    assert est.mean == pytest.approx(0.7) and est.low < 0.7 < est.high and est.n == 10
    assert M.bootstrap_mean([1.0, 1.0]).low == 1.0  # every resample of a clean sweep is a sweep
    assert M.bootstrap_mean([]) is None


def test_length_controlled_win_rate_removes_a_length_preference():
    rng = random.Random(3)

    def judged(b0: float, b1: float, longer: float) -> tuple[list[float], list[int]]:
        """400 pairs from a judge who prefers A with log-odds b0 + b1·tanh(Δ / 30); A is longer a `longer` share."""
        diffs = [(1 if rng.random() < longer else -1) * rng.randint(5, 60) for _ in range(400)]
        scores = [1.0 if rng.random() < 1 / (1 + math.exp(-(b0 + b1 * math.tanh(d / 30)))) else 0.0 for d in diffs]
        return scores, diffs

    # A judge with no preference but for length, and A longer 80% of the time: raw ~0.7, at equal length a coin.
    scores, diffs = judged(0.0, 2.5, 0.8)
    assert sum(scores) / len(scores) > 0.65
    assert M.length_controlled(scores, diffs) == pytest.approx(0.5, abs=0.1)
    # A judge who prefers A at any length: the length control leaves the win rate as it is.
    scores, diffs = judged(math.log(0.7 / 0.3), 0.0, 0.5)
    assert M.length_controlled(scores, diffs) == pytest.approx(sum(scores) / len(scores), abs=0.05)
    # No length difference at all: the raw win rate.
    assert M.length_controlled([1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0]) == pytest.approx(0.75, abs=0.01)
    assert M.length_controlled([1.0], [3]) is None


def test_paired_comparison_reports_n_interval_test_and_length_control():
    c = M.paired_comparison([1.0, 1.0, 0.0, 0.5], [10, 5, -3, 0])
    assert c["n"] == 4 and c["win_rate_bootstrap"]["mean"] == pytest.approx(0.625)
    assert c["sign_test_p"] == 1.0  # 2 wins, 1 loss (the tie left out): 2 * (1 + 3) / 8, capped at 1
    assert c["lc_win_rate"] is not None


def test_tune_gives_each_sampler_the_same_budget_and_judges_the_best_on_held_out_prompts():
    from mlxchat.core import SamplingProfile
    from mlxchat.lab import tune as T
    from mlxchat.lab.store import Run

    assert T.budget_values("min_p", 4) == [0.02, 0.1133, 0.2067, 0.3]
    assert T.budget_values("top_k", 3) == [5, 52, 100]
    settings = T.tune_settings(["min_p", "dry", "mirostat"], 2, SamplingProfile(temperature=0.9))
    assert [s.label for s in settings] == ["min_p:min_p=0.02", "min_p:min_p=0.3", "dry:dry_multiplier=0.2",
                                           "dry:dry_multiplier=1.6", "mirostat:mirostat_tau=2",
                                           "mirostat:mirostat_tau=8"]
    assert settings[4].profile.mirostat == 2 and all(s.profile.temperature == 0.9 for s in settings)
    with pytest.raises(ValueError, match="at least two different --sampler"):
        T.tune_settings(["min_p"], 2, SamplingProfile())
    with pytest.raises(ValueError, match="unknown; samplers: temperature"):
        T.budget_values("beam", 2)

    # Four prompts: p0 and p2 choose, p1 and p3 judge. min_p=0.3 passes both choosing prompts (0.02 one), top_p=0.5
    # one of them (0.99 none); on the held-out prompts both chosen settings pass everything.
    passed = {0: {"p0"}, 1: {"p0", "p1", "p2", "p3"}, 2: set(), 3: {"p0", "p1", "p3"}}
    labels = ["min_p:min_p=0.02", "min_p:min_p=0.3", "top_p:top_p=0.99", "top_p:top_p=0.5"]
    outputs = [Output(cell=c, prompt_id=p, seed=0, text="x", finish_reason="stop", length=1, words=1,
                      mean_logprob=None, ttft_s=0.1, tpot_s=0.1, passed=p in passed[c], distinct_1=1.0,
                      distinct_2=1.0, rep_4=0.0) for c in range(4) for p in ("p0", "p1", "p2", "p3")]
    run = Run(1, "now", "m", "set", "h", "v", [{"label": lb, "setting": {}} for lb in labels],
              {f"p{i}": "" for i in range(4)}, 1, 16, "done", outputs)
    assert T.split_prompts(run) == (["p0", "p2"], ["p1", "p3"])
    bests = T.choose(run, "pass_rate")
    assert [(b.sampler, b.label, b.selection) for b in bests] == [("min_p", "min_p:min_p=0.3", 1.0),
                                                                   ("top_p", "top_p:top_p=0.5", 0.5)]
    (row,) = T.compare_best(run, bests, "pass_rate")
    assert (row["a"], row["b"], row["n"]) == ("min_p:min_p=0.3", "top_p:top_p=0.5", 2)
    assert row["win_rate_bootstrap"]["mean"] == 0.5 and row["sign_test_p"] is None  # both pass p1 and p3: ties
    assert row["held_out_a"]["mean"] == 1.0 and row["held_out_a"]["high"] <= 1.0
