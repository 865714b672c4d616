"""The lab's judge, `lab run --target`, and a lab that reads: verdict parsing, pair verdicts and kappa by hand,
rubrics, `lab show --json -`, clipped intervals, the F6 form at 80 columns (no model); then a real `mlxchat serve`
as the target and the judge, and the embedded model as a local judge (few pairs, a few tokens each)."""

from __future__ import annotations

import json

import pytest

from mlxchat.app.cli import main
from mlxchat.lab import judge as J
from mlxchat.lab import metrics as M
from mlxchat.lab.runner import Output, cell_metrics
from mlxchat.lab.settings import build_settings
from mlxchat.lab.store import LabStore


@pytest.fixture(autouse=True)
def folders(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


def out(cell: int, pid: str, seed: int, text: str, passed: bool | None = None, logprob: float = -1.0) -> Output:
    return Output(cell=cell, prompt_id=pid, seed=seed, text=text, finish_reason="stop", length=len(text.split()),
                  words=len(text.split()), mean_logprob=logprob, ttft_s=0.1, tpot_s=0.01, passed=passed,
                  distinct_1=M.distinct_n(text, 1), distinct_2=M.distinct_n(text, 2), rep_4=M.seq_rep_n(text, 4))


def stored(store: LabStore, outputs: list[Output], settings: list[dict] | None = None, name: str = "chat") -> int:
    settings = settings or [{"label": "A", "setting": {"temperature": 0.0}},
                            {"label": "B", "setting": {"temperature": 1.0}}]
    run_id = store.create(model="m", prompt_set=name, prompt_set_hash="h" * 64, settings=settings,
                          prompts={"p1": "Say hi.", "p2": "Name a colour."}, seeds=1, max_tokens=4)
    for o in outputs:
        store.add_output(run_id, o)
    store.finish(run_id, "done")
    return run_id


# --- no model ------------------------------------------------------------------------------------------------------

def test_verdict_parsing_takes_a_clear_answer_and_records_the_rest_as_unparsed():
    for answer, said in (("A", "A"), ("B.", "B"), ("**A**", "A"), ("[[B]]", "B"), ("Verdict: A", "A"),
                         ("TIE", "tie"), ("Tie.", "tie"), ("Reply B is better", "B"), ("B\n\nbecause", "B"),
                         ("A (shorter)", "A")):
        assert J.parse_verdict(answer) == said, answer
    # the 135M judge's habits: echoing the options, an article, prose; none is a verdict
    for answer in ("A, B, or TIE.", "A or B", "a tie", "A better reply is B", "I think A", "Apple", "", "Both"):
        assert J.parse_verdict(answer) is None, answer


def test_pair_verdicts_win_rate_and_kappa_by_hand():
    def pair(*verdicts: str) -> dict:
        return {"verdict": J.combine([{"verdict": v} for v in verdicts]),
                "orders": [{"verdict": v} for v in verdicts]}

    # a win needs both orders; a split or a tie in either is a tie; one parsed order decides alone
    pairs = [pair("a", "a"), pair("a", "b"), pair("b", "tie"), pair("unparsed", "b"), pair("unparsed", "unparsed")]
    assert [p["verdict"] for p in pairs] == ["a", "tie", "tie", "b", "unparsed"]
    s = J.summary(pairs, "judge", J.load_rubric("chat"))
    assert (s["pairs"], s["swapped"], s["wins_a"], s["wins_b"], s["ties"], s["unparsed"]) == (5, 5, 1, 1, 2, 1)
    assert s["win_rate_a"]["mean"] == pytest.approx(0.5) and 0 <= s["win_rate_a"]["low"] < s["win_rate_a"]["high"] <= 1
    assert s["consistent"] == 1 and s["rubric_version"].startswith("chat v1 (")
    # the fair-comparison fields: of the 3 pairs both orders parsed, 2 flipped with the order
    assert s["order_flip_rate"] == pytest.approx(2 / 3) and s["both_parsed"] == 3
    assert s["n"] == 4 and s["sign_test_p"] == 1.0 and s["lc_win_rate"] is None  # these pairs carry no lengths
    # p_o = 3/4; rater 1 a, a, b, tie and rater 2 a, a, b, a: p_e = (2/4)(3/4) + (1/4)(1/4) + (1/4)(0) = 7/16
    # -> kappa = (12/16 - 7/16) / (9/16) = 5/9
    k = J.cohen_kappa([("a", "a"), ("a", "a"), ("b", "b"), ("tie", "a")])
    assert k["kappa"] == pytest.approx(5 / 9) and k["n"] == 4
    assert J.cohen_kappa([("a", "a")])["kappa"] is None and J.cohen_kappa([]) is None
    # a judgement of B vs A meets the votes of A vs B: verdicts are turned round, skips and unparsed left out
    votes = [{"cell_a": 0, "cell_b": 1, "prompt_id": "p1", "seed": 0, "a_on_left": True, "choice": "left"},
             {"cell_a": 0, "cell_b": 1, "prompt_id": "p2", "seed": 0, "a_on_left": False, "choice": "left"},
             {"cell_a": 0, "cell_b": 1, "prompt_id": "p3", "seed": 0, "a_on_left": True, "choice": "skip"}]
    judged = [{"cell_a": 1, "cell_b": 0, "prompt_id": p, "seed": 0, "judge": "j", "rubric_version": "r", "verdict": v}
              for p, v in (("p1", "b"), ("p2", "a"), ("p3", "a"))]
    (agree,) = J.agreement(judged, votes)
    assert (agree["cell_a"], agree["cell_b"], agree["n"], agree["agreement"]) == (0, 1, 2, 1.0)


def test_rubrics_per_prompt_set_versioned_and_overridable(folders):
    from mlxchat.lab import prompts as P

    for name in P.available():
        r = J.load_rubric(name)
        assert r.name == name and r.version >= 1 and r.criteria.strip()
    assert J.load_rubric("my-own-set").name == "default"
    user = folders / "config" / "rubrics"
    user.mkdir(parents=True)
    (user / "chat.toml").write_text('version = 3\ncriteria = "Shorter is better."\n')
    assert J.load_rubric("chat").tag.startswith("chat v3 (")
    (folders / "bad.toml").write_text('criteria = "no version"\n')
    with pytest.raises(J.RubricError, match="needs version"):
        J.load_rubric("chat", folders / "bad.toml")


def test_intervals_clip_to_the_metric_and_show_names_the_sweep_base(capsys, folders):
    # two prompts with far-apart values: a t-interval (t = 12.7 at n = 2) runs far past 0 either way
    outs = [out(0, "p1", 0, "one two three four five six", True, -0.1), out(0, "p2", 0, "x", False, -3.0)]
    m = cell_metrics(outs)
    assert m["mean_logprob"]["high"] == 0.0 and m["words"]["low"] == 0.0
    assert m["pass_rate"]["low"] == 0.0 and m["pass_rate"]["high"] == 1.0

    store = LabStore()
    settings = [s.record() for s in build_settings([], "temperature=0,0.5", "chat")]
    assert settings[0]["base"] == "chat" and settings[1]["label"] == "temperature=0.5"
    # labels that are no FIELD=VALUE spare the report its sweep plot (seconds of matplotlib)
    settings = [{**s, "label": label} for s, label in zip(settings, ("cold", "warm"))]
    run_id = stored(store, [*outs, out(1, "p1", 0, "hi", True), out(1, "p2", 0, "red", None)], settings)
    store.add_vote(run_id, "p1", 0, 0, 1, True, "left")
    store.add_judgement(run_id, 0, 1, "p1", 0, "a judge", "chat v1", {"verdict": "a"})
    assert main(["lab", "show", str(run_id), "--json", "-", "--report", str(folders / "rep")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["run_id"] == run_id  # stdout is the JSON alone
    assert "sweep from the base profile chat" in captured.err
    assert "Cohen's kappa n/a" in captured.err and "n=1 is too small" in captured.err
    assert "n=2 prompt(s); below 10 they say little" in captured.err
    report = (folders / "rep" / "report.md").read_text()
    assert "Cohen's kappa" in report and "| n/a |" in report and "–" not in report
    assert ", pass):" in report and ", fail):" in report and ", no check):" in report and "True" not in report


def test_judge_and_target_flags_fail_in_one_line(capsys):
    store = LabStore()
    run_id = stored(store, [out(0, "p1", 0, "hi"), out(1, "p1", 0, "hello")])
    for argv, fragment in (
            (["judge", str(run_id), "--a", "A", "--b", "C"], "--b 'C': run 1 has no such setting; its settings: A, B"),
            (["judge", str(run_id), "--a", "A", "--b", "A"], "--a and --b name the same setting"),
            (["judge", str(run_id), "--a", "A", "--b", "B", "--judge-api-key", "k"], "--judge-api-key goes with"),
            (["judge", str(run_id), "--a", "A", "--b", "B", "--judge-url", "http://127.0.0.1:1"], "cannot reach"),
            (["run", "--prompts", "chat", "--profile", "chat", "--target", "127.0.0.1:1"], "give the server's URL"),
            (["run", "--prompts", "chat", "--profile", "chat", "--target", "http://127.0.0.1:1"], "cannot reach")):
        assert main(["lab", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert fragment in err and "\n" not in err, err


def test_a_setting_goes_to_a_server_as_openai_fields_plus_the_extras_it_turns_on():
    from mlxchat.core import SamplingProfile
    from mlxchat.lab.endpoint import request_body

    plain = request_body(SamplingProfile(seed=3), 8, None)
    assert plain == {"temperature": 1.0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                     "max_tokens": 8, "seed": 3}  # nothing a hosted API would refuse
    xtc = request_body(SamplingProfile(top_k=40, xtc_probability=0.5, stop=["END"]), 8, ["\n\n"])
    assert (xtc["top_k"], xtc["xtc_probability"], xtc["xtc_threshold"]) == (40, 0.5, 0.1)
    assert xtc["stop"] == ["END", "\n\n"]  # the profile's stops and the prompt's, as the engine takes them
    # llama.cpp's samplers go under llama.cpp server's names, each with the settings that go along with it.
    dry = request_body(SamplingProfile(dry_multiplier=0.8, mirostat=2), 8, None)
    assert {k: dry[k] for k in ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                                "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta")} == {
        "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1}
    assert "top_n_sigma" not in dry and "dynatemp_range" not in dry


def test_llama_cpp_samplers_can_be_swept() -> None:
    from mlxchat.lab.settings import sweep_settings

    settings = sweep_settings("dry_multiplier=0,0.8", "longform")
    assert [(s.label, s.profile.dry_multiplier, s.profile.min_p) for s in settings] == [
        ("dry_multiplier=0", 0.0, 0.05), ("dry_multiplier=0.8", 0.8, 0.05)]
    assert [s.profile.top_n_sigma for s in sweep_settings("top_n_sigma=-1,1,2", None)] == [-1.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"--sweep dry_base=1: dry_base must be greater than 1, got 1"):
        sweep_settings("dry_base=1.75,1", None)
    with pytest.raises(ValueError, match="'dry_sequence_breakers' cannot be swept"):
        sweep_settings("dry_sequence_breakers=a,b", None)


@pytest.mark.anyio
async def test_f6_form_has_whole_labels_and_hints_in_80_columns(tmp_path):
    from textual.app import App
    from textual.widgets import Label, Static

    from mlxchat.lab.screen import LabScreen

    class LabApp(App):
        def on_mount(self) -> None:
            self.push_screen(LabScreen(None, LabStore(tmp_path / "lab.db")))  # no run: no engine needed

    async with LabApp().run_test(size=(80, 30)) as pilot:
        await pilot.pause()
        screen = pilot.app.screen
        labels = {str(w.render()): w.region for w in screen.query(Label)}
        assert {"prompt set", "setting A", "setting B", "seeds", "max tokens", "prompts used"} <= set(labels)
        for text, region in labels.items():
            assert region.width >= len(text) and region.right <= 80, (text, region)
        for wid in ("#set", "#profile_a", "#profile_b", "#sweep", "#seeds", "#max_tokens", "#limit", "#run"):
            assert screen.query_one(wid).region.right <= 80, wid
        hint = screen.query_one("#hint", Static)
        assert hint.region.height >= 2  # the key hints wrap rather than run off the screen


# --- a real server and the embedded model --------------------------------------------------------------------------

def test_target_run_then_judge_url_against_serve(serve, engine, capsys, folders):
    import os
    import re
    import signal
    import threading

    from mlxchat.lab import prompts as P
    from mlxchat.lab.runner import Experiment

    url = serve()
    assert main(["lab", "run", "--target", url, "--prompts", "factual", "--profile", "precise", "--profile", "chat",
                 "--seeds", "2", "--limit", "1", "--max-tokens", "4", "--json", str(folders / "run.json")]) == 0
    run = json.loads((folders / "run.json").read_text())
    assert run["model"] == f"{engine.name} at {url}/v1"
    served = [o for c in run["cells"] for o in c["outputs"]]
    assert len(served) == 4 and all(0 < o["length"] <= 4 and o["ttft_s"] > 0 for o in served)
    assert all(o["mean_logprob"] is not None for o in served)  # mlxchat serve sends logprobs
    # a sampled setting and its seed through the server as on the engine: the same text
    local = []
    Experiment(P.load("factual").limited(1), build_settings(["chat"], None, None), 1, 4).run(engine, local.append)
    assert [o["text"] for o in run["cells"][1]["outputs"] if o["seed"] == 0] == [local[0].text]

    judge_json = folders / "judge.json"
    argv = ["lab", "judge", "last", "--a", "precise", "--b", "chat", "--judge-url", url, "--judge-max-tokens", "3",
            "--json", str(judge_json)]
    store = LabStore()

    def ctrl_c_once_lab_judge_handles_it() -> None:  # before that, mlxchat's main would leave the process at once
        while getattr(signal.getsignal(signal.SIGINT), "__name__", "") != "first":
            threading.Event().wait(0.002)
        os.kill(os.getpid(), signal.SIGINT)  # lands while the first pair is asked (two requests)

    threading.Thread(target=ctrl_c_once_lab_judge_handles_it, daemon=True).start()
    assert main(argv) == 130  # stopped after the pair in flight; what was judged is stored and written
    assert "cancelled: kept 1 of 2 pairs" in capsys.readouterr().err
    first = json.loads(judge_json.read_text())
    kept = first["pairs"]
    assert kept == 1 and len(store.judgements(1)) == 1
    assert set(first) >= {"pairs", "swapped", "wins_a", "wins_b", "ties", "win_rate_a", "judge", "rubric_version"}
    assert first["swapped"] == kept and first["wins_a"] + first["wins_b"] + first["ties"] + first["unparsed"] == kept
    pair = first["verdicts"][0]
    assert [o["first"] for o in pair["orders"]] == ["a", "b"] and not any(o["cached"] for o in pair["orders"])
    assert all(isinstance(o["answer"], str) and o["parsed"] in ("A", "B", "tie", None) for o in pair["orders"])
    assert first["rubric_version"].startswith("factual v1 (") and url in first["judge"]

    # The rest: what was judged comes from the cache, and so does a question met twice (a greedy setting's seeds
    # give one text).
    assert main(argv) == 0
    asked, from_cache = map(int, re.search(r"(\d+) judge call\(s\), (\d+) from the cache",
                                           capsys.readouterr().out).groups())
    assert asked + from_cache == 4 and from_cache >= 2
    assert main(argv) == 0  # all of it again: the judge is asked nothing
    assert "0 judge call(s), 4 from the cache" in capsys.readouterr().out
    again = json.loads(judge_json.read_text())
    assert again["pairs"] == 2 and all(o["cached"] for p in again["verdicts"] for o in p["orders"])
    assert [o["answer"] for o in again["verdicts"][0]["orders"]] == [o["answer"] for o in pair["orders"]]


def test_local_judge_answers_are_kept_raw_and_cached(engine, tmp_path):
    store = LabStore(tmp_path / "lab.db")
    run = store.load(stored(store, [out(0, "p1", 0, "Hi there!"), out(1, "p1", 0, "hi hi hi hi")]))
    rubric = J.load_rubric("chat")
    (job,) = J.pair_jobs(run, 0, 1)
    judging = J.Judging(store, run, 0, 1, J.EngineJudge(engine.name, lambda: engine, 3), rubric)
    pair = judging.judge_pair(job)
    assert judging.asked == 2 and [o["cached"] for o in pair["orders"]] == [False, False]
    assert pair["verdict"] in ("a", "b", "tie", "unparsed")
    for o in pair["orders"]:  # the raw answer is kept, and the verdict is what it says or "unparsed"
        assert o["verdict"] == "unparsed" if J.parse_verdict(o["answer"]) is None else o["parsed"] is not None
    assert [j["verdict"] for j in store.judgements(run.id)] == [pair["verdict"]]

    def no_load():
        raise AssertionError("the judge was asked although every answer is cached")

    cached = J.Judging(store, run, 0, 1, J.EngineJudge(engine.name, no_load, 3), rubric)
    assert cached.judge_pair(job)["orders"] == [{**o, "cached": True} for o in pair["orders"]] and cached.asked == 0
    # another rubric version is another question: asked afresh
    other = J.Judging(store, run, 0, 1, J.EngineJudge(engine.name, no_load, 3), J.load_rubric("creative"))
    with pytest.raises(AssertionError, match="although every answer is cached"):
        other.judge_pair(job)
