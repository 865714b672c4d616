"""`mlxchat lab`: run experiments, list/show/compare stored runs. `add_arguments(parser)` sets up the subcommand,
`run(args)` executes it and returns the exit code. Nothing here imports MLX until a run starts."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import metrics as M
from . import prompts as P
from .metrics import SMALL_N

if TYPE_CHECKING:  # imported where a run starts: nothing here imports MLX before
    from .runner import Experiment
    from .store import LabStore

SUMMARY = ("pass_rate", "distinct_2", "rep_4", "self_bleu", "mean_logprob", "length")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``mlxchat lab`` to the command's parser (entry point ``mlxchat.commands``, see app/cli.py)."""
    parser = sub.add_parser("lab", help="tune sampling on fixed prompt sets: runs, metrics, comparisons")
    add_arguments(parser)
    parser.set_defaults(command_runner=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab_command", metavar="{run,tune,list,show,compare,judge}")
    sub.required = True
    r = sub.add_parser("run", help="run prompts x settings x seeds and store the outputs and metrics")
    # Named without reading the user's folder: building the parser must not import the engine (see app/cli.py).
    r.add_argument("--prompts", required=True, help="prompt set: precise, factual, chat, creative, completion, one "
                                                    "of yours in <config folder>/prompts/NAME.toml, or a .toml path")
    r.add_argument("--profile", action="append", default=[], help="a preset or saved profile (repeatable)")
    r.add_argument("--sweep", help="PARAM=v1,v2,...: one field of --base at several values")
    r.add_argument("--base", help="the profile a sweep starts from (default: the default profile)")
    r.add_argument("--seeds", type=int, default=3, help="seeds per prompt and setting: 0..K-1 (default 3)")
    r.add_argument("--max-tokens", type=int, default=64, help="tokens per output (default 64)")
    r.add_argument("--limit", type=int, help="use only the first N prompts of the set")
    r.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded model); with "
                                   "--target, the model name to ask the server for (default: the first it lists)")
    r.add_argument("--target", metavar="URL", help="run against this OpenAI-compatible server instead of a local "
                                                   "model (mlxchat serve, llama.cpp, Ollama, a hosted API)")
    r.add_argument("--api-key", help="the --target server's API key")
    r.add_argument("--json", type=Path, help="also write the run as JSON to FILE")
    r.add_argument("--report", type=Path, help="write report.md and PNG plots into DIR")
    r.add_argument("--baseline", help="a stored run (id or 'last') to compare with, for --fail-on")
    r.add_argument("--fail-on", action="append", default=[],
                   help='exit 1 when a metric moves past a bound vs --baseline, e.g. "pass_rate<-0.05" (repeatable)')
    t = sub.add_parser("tune", help="samplers at their best: the same budget of settings each, the best chosen on half "
                                    "the prompts and compared on the other half")
    t.add_argument("--prompts", required=True, help="prompt set, as for `lab run`")
    t.add_argument("--sampler", action="append", default=[], required=True,
                   help="a sampler to tune (repeatable, at least two): temperature, top_k, top_p, min_p, typical_p, "
                        "top_n_sigma, xtc, dry, dynatemp, mirostat, adaptive_p")
    t.add_argument("--budget", type=int, default=4, help="settings tried per sampler (default 4)")
    t.add_argument("--metric", default="pass_rate", help="what the best is chosen by: pass_rate (the default) or a "
                                                         "per-output metric (distinct_2, rep_4, mean_logprob, ...)")
    t.add_argument("--base", help="the profile each setting starts from (default: the default profile)")
    t.add_argument("--seeds", type=int, default=2, help="seeds per prompt and setting (default 2)")
    t.add_argument("--max-tokens", type=int, default=64, help="tokens per output (default 64)")
    t.add_argument("--limit", type=int, help="use only the first N prompts of the set (at least 4)")
    t.add_argument("--model", help="GGUF file, MLX/HF folder or HF repo id (default: the embedded model)")
    t.add_argument("--json", type=Path, help="also write the choices and comparisons as JSON to FILE (- for stdout)")
    s = sub.add_parser("show", help="one stored run: settings and metrics with 95%% intervals")
    s.add_argument("run", help="run id or 'last'")
    s.add_argument("--json", type=Path, help="write the run as JSON to FILE (- for stdout)")
    s.add_argument("--report", type=Path, help="write report.md and PNG plots into DIR")
    sub.add_parser("list", help="stored runs")
    c = sub.add_parser("compare", help="per-metric deltas B - A with intervals, and the prompts that changed most")
    c.add_argument("run_a")
    c.add_argument("run_b")
    j = sub.add_parser("judge", help="an LLM judges two settings' outputs pair by pair (both orders, ties allowed)")
    j.add_argument("run", help="run id or 'last'")
    j.add_argument("--a", required=True, metavar="SETTING", help="a setting's label in the run (see `lab show`)")
    j.add_argument("--b", required=True, metavar="SETTING", help="the other setting's label")
    j.add_argument("--judge", metavar="MODEL", help="the judge: a model mlxchat loads (default: the embedded one, "
                                                    "a weak judge); with --judge-url, the model name to ask for")
    j.add_argument("--judge-url", metavar="URL", help="an OpenAI-compatible endpoint as the judge")
    j.add_argument("--judge-api-key", metavar="KEY", help="the --judge-url endpoint's API key")
    j.add_argument("--judge-max-tokens", type=int, default=16, metavar="N", help="tokens per judge answer (default 16)")
    j.add_argument("--rubric", type=Path, metavar="FILE", help="a rubric TOML (default: the prompt set's)")
    j.add_argument("--json", type=Path, metavar="FILE", help="write the verdicts as JSON to FILE (- for stdout)")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from mlxchat.core.errors import MlxChatError

    try:
        return {"run": _run, "tune": _tune, "list": _list, "show": _show, "compare": _compare,
                "judge": _judge}[args.lab_command](args)
    except ValidationError as e:
        print(f"mlxchat lab: error: {e.errors()[0]['msg']}", file=sys.stderr)
    except (MlxChatError, ValueError, OSError) as e:
        print(f"mlxchat lab: error: {e}", file=sys.stderr)
    return 2


@contextmanager
def _stop_on_ctrl_c() -> Iterator[threading.Event]:
    """The first Ctrl-C sets the event: the loop stops after the current item (the generation in flight is
    cancelled; a judge's answer in flight is awaited) and what finished stays stored. A second one goes to the handler
    that was there before (mlxchat's main leaves at once, exit 130). Signals reach only the main thread."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.getsignal(signal.SIGINT)

    def first(signum: int, frame: Any) -> None:
        stop.set()
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, first)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


# --- run -------------------------------------------------------------------------------------------------------

def _run(args: argparse.Namespace) -> int:
    from .compare import Bound, check_bounds, check_comparable
    from .runner import Experiment
    from .settings import build_settings
    from .store import LabStore

    bounds = [Bound.parse(b) for b in args.fail_on]
    if bounds and not args.baseline:
        raise ValueError("--fail-on needs --baseline RUN (the run to compare with)")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    prompt_set = P.load(args.prompts).limited(args.limit)
    experiment = Experiment(prompt_set, build_settings(args.profile, args.sweep, args.base), args.seeds,
                            args.max_tokens)
    store = LabStore()
    baseline = store.load(args.baseline) if args.baseline else None
    if baseline is not None:  # fail before loading the model
        check_comparable(baseline, [p.id for p in prompt_set.prompts], prompt_set.digest,
                         [s.label for s in experiment.settings])

    if args.api_key and not args.target:
        raise ValueError("--api-key goes with --target URL")
    if args.target:
        from .target import Target

        engine = Target(args.target, args.api_key, args.model)
    else:
        from mlxchat.core import Engine

        engine = Engine.load(args.model)
    run_id, status = _run_experiment(experiment, engine, store)
    result = store.load(run_id)
    _outputs(result, args.json, args.report)
    print(_summary(result))
    if status == "cancelled":
        print(f"cancelled: kept {len(result.outputs)} of {len(experiment.jobs())} outputs in run {run_id}",
              file=sys.stderr)
        return 130
    if baseline is not None:
        failures = check_bounds(baseline, result, bounds)
        for line in failures:
            print(f"regression: {line}", file=sys.stderr)
        if failures:
            return 1
        if bounds:
            print(f"within bounds vs run {baseline.id}: {', '.join(map(str, bounds))}", file=sys.stderr)
    return 0


# --- tune ------------------------------------------------------------------------------------------------------

def _tune(args: argparse.Namespace) -> int:
    from .runner import Experiment
    from .settings import named_profile
    from .store import LabStore
    from . import tune as T

    if args.metric not in T.TUNE_METRICS:
        raise ValueError(f"--metric {args.metric!r}: choose one of {', '.join(T.TUNE_METRICS)}")
    prompt_set = P.load(args.prompts).limited(args.limit)
    if len(prompt_set.prompts) < 4:
        raise ValueError(f"lab tune needs at least 4 prompts (half choose, half compare); {prompt_set.name} has "
                         f"{len(prompt_set.prompts)}")
    from mlxchat.core import SamplingProfile

    base = named_profile(args.base) if args.base else SamplingProfile()
    experiment = Experiment(prompt_set, T.tune_settings(args.sampler, args.budget, base), args.seeds,
                            args.max_tokens)
    from mlxchat.core import Engine

    engine = Engine.load(args.model)
    store = LabStore()
    run_id, status = _run_experiment(experiment, engine, store)
    run = store.load(run_id)
    bests = T.choose(run, args.metric)
    rows = T.compare_best(run, bests, args.metric)
    selection, held_out = T.split_prompts(run)
    lines = [f"run {run_id} ({status}): {len(args.sampler)} samplers x {args.budget} settings, {args.seeds} seeds; "
             f"best by {args.metric} on {len(selection)} prompts, compared on the other {len(held_out)}"]
    lines += [f"  {b.sampler}: best {b.label} ({args.metric} {b.selection:.3f} where chosen)" for b in bests]
    for r in rows:
        ea, eb = r["held_out_a"], r["held_out_b"]
        lines.append(f"  {r['a']} vs {r['b']} on held-out prompts: {args.metric} {_rate(ea)} vs {_rate(eb)}; "
                     f"{r['a']} better on a share of prompts: " + _fairness(r))
    to_stdout = args.json is None or str(args.json) != "-"
    print("\n".join(lines), file=sys.stdout if to_stdout else sys.stderr)
    if args.json is not None:
        text = json.dumps({"run_id": run_id, "metric": args.metric, "selection_prompts": selection,
                           "held_out_prompts": held_out, "best": [b.__dict__ for b in bests], "comparisons": rows},
                          ensure_ascii=False, indent=1)
        if str(args.json) == "-":
            print(text)
        else:
            args.json.write_text(text, encoding="utf-8")
    return 130 if status == "cancelled" else 0


def _run_experiment(experiment: Experiment, engine: Any, store: LabStore) -> tuple[str, str]:
    """Store a new run of `experiment` and execute it on `engine` (closed after): its id and final status. A run that
    fails is marked so; what finished stays stored and listed."""
    prompt_set = experiment.prompt_set
    run_id = store.create(model=engine.name, prompt_set=prompt_set.name, prompt_set_hash=prompt_set.digest,
                          settings=[s.record() for s in experiment.settings],
                          prompts={p.id: p.text for p in prompt_set.prompts}, seeds=len(experiment.seeds),
                          max_tokens=experiment.max_tokens)
    try:
        status = _execute(experiment, engine, store, run_id)
    except BaseException:
        store.finish(run_id, "failed")
        raise
    finally:
        engine.close()
    return run_id, status


def _execute(experiment: Any, engine: Any, store: Any, run_id: int) -> str:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"run {run_id}", total=len(experiment.jobs()))

        def done(output: Any) -> None:
            store.add_output(run_id, output)
            bar.update(task, advance=1, description=f"run {run_id} {experiment.settings[output.cell].label}")

        with _stop_on_ctrl_c() as stop:
            try:
                finished = experiment.run(engine, done, stop)
            except KeyboardInterrupt:  # a second Ctrl-C, where Python's default handler was there before
                finished = False
    status = "done" if finished else "cancelled"
    store.finish(run_id, status)
    return status


def _outputs(run: Any, json_path: Path | None, report_dir: Path | None, evaluations: list[str] = ()) -> None:
    if json_path is not None:
        text = json.dumps(run.as_json(), ensure_ascii=False, indent=1)
        if str(json_path) == "-":
            print(text)
        else:
            json_path.write_text(text, encoding="utf-8")
            print(f"wrote {json_path}", file=sys.stderr)
    if report_dir is not None:
        from .report import write

        print(f"wrote {write(run, report_dir, list(evaluations))}", file=sys.stderr)


def _num(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 100 else f"{x:.0f}"


def _est(e: dict[str, Any] | None) -> str:
    """A metric as mean [low, high]: clipped to the metric's range, its interval need not be symmetric."""
    return f"{_num(e['mean'])} [{_num(e['low'])}, {_num(e['high'])}]" if e else "n/a"


def _rate(e: dict[str, Any] | None) -> str:
    """A rate with its (asymmetric) Wilson interval."""
    return f"{e['mean']:.2f} [{e['low']:.2f}, {e['high']:.2f}]" if e else "n/a"


def _summary(run: Any) -> str:
    head = (f"run {run.id} · {run.prompt_set} ({len(run.prompts)} prompts, hash {run.prompt_set_hash[:8]}) · "
            f"{run.model} · {run.seeds} seed(s) · max {run.max_tokens} tok · {run.status} · code {run.code_version}")
    rows = [["setting", *SUMMARY, "finish"]]
    for c in run.cells():
        m = c["metrics"]
        rows.append([c["label"], *(_est(m.get(n)) for n in SUMMARY),
                     " ".join(f"{k}:{v}" for k, v in sorted(m["finish_reasons"].items()))])
    return head + "\n" + _table(rows) + _few_prompts_note(run)


def _few_prompts_note(run: Any) -> str:
    """Intervals are over prompts: with fewer than SMALL_N of them they are too wide (or too lucky) to lean on."""
    n = len({o.prompt_id for o in run.outputs})
    return (f"\nnote: 95% intervals over n={n} prompt(s); below {SMALL_N} they say little (use more prompts)"
            if 0 < n < SMALL_N else "")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# --- list / show / compare -------------------------------------------------------------------------------------

def _list(args: argparse.Namespace) -> int:
    from .store import LabStore

    runs = LabStore().list()
    if not runs:
        print("no lab runs yet; start one with `mlxchat lab run --prompts precise --profile precise`")
        return 0
    rows = [["id", "created", "set", "settings", "outputs", "status", "model"]]
    rows += [[str(r["id"]), r["created"], r["prompt_set"], ",".join(r["settings"]), str(r["outputs"]), r["status"],
              r["model"]] for r in runs]
    print(_table(rows))
    return 0


def _show(args: argparse.Namespace) -> int:
    from .store import LabStore

    store = LabStore()
    run = store.load(args.run)
    from mlxchat.core import SamplingProfile

    defaults = SamplingProfile().model_dump(mode="json")
    lines = [_summary(run)]
    bases = {s["base"] for s in run.settings if s.get("base")}
    if bases:
        lines.append(f"a sweep from the base profile {', '.join(sorted(bases))}; each setting vs the default profile:")
    for s in run.settings:  # what each setting changes from the default profile
        changed = {k: v for k, v in s["setting"].items() if k != "description" and defaults.get(k) != v}
        lines.append(f"  {s['label']}: {json.dumps(changed)}")
    evaluations = _evaluations(store, run)
    # With --json -, stdout carries the JSON alone (for a pipe into jq); the readable summary goes to stderr.
    print("\n".join(lines + evaluations), file=sys.stderr if str(args.json) == "-" else sys.stdout)
    _outputs(run, args.json, args.report, evaluations)
    return 0


def _evaluations(store: Any, run: Any) -> list[str]:
    """The blind A/B tallies, the judge's tallies, and where both exist their agreement (Cohen's kappa)."""
    from .ab import tally, winner
    from .judge import agreement

    label = [s["label"] for s in run.settings]
    lines = []
    votes = store.votes(run.id)
    for a, b in sorted({(v["cell_a"], v["cell_b"]) for v in votes}):
        won = [winner(v["choice"], v["a_on_left"]) for v in votes if (v["cell_a"], v["cell_b"]) == (a, b)]
        t = tally(won)
        n = t["a"] + t["b"] + t["tie"]
        lines.append(f"blind A/B {label[a]} vs {label[b]}: {t['a']} wins, {t['b']} losses, {t['tie']} ties, "
                     f"{t['skip']} skipped; win rate {_rate(t['win_rate_a'])} (Wilson 95%, n={n})" + _small_n_note(n))
        lines.append("  " + _fairness(M.paired_comparison([{"a": 1.0, "b": 0.0, "tie": 0.5}[w] for w in won
                                                           if w != "skip"])))
    judged = store.judgements(run.id)
    for key in sorted({(j["cell_a"], j["cell_b"], j["judge"], j["rubric_version"]) for j in judged}):
        t = tally([j["verdict"] if j["verdict"] != "unparsed" else "skip" for j in judged
                   if (j["cell_a"], j["cell_b"], j["judge"], j["rubric_version"]) == key])
        n = t["a"] + t["b"] + t["tie"]
        lines.append(f"judge {key[2]} (rubric {key[3]}) {label[key[0]]} vs {label[key[1]]}: {t['a']} wins, "
                     f"{t['b']} losses, {t['tie']} ties, {t['skip']} unparsed; win rate {_rate(t['win_rate_a'])} "
                     f"(Wilson 95%, n={n})" + _small_n_note(n))
    for k in agreement(judged, votes):
        kappa = "n/a (both gave one and the same verdict throughout)" if k["kappa"] is None else f"{k['kappa']:.2f}"
        lines.append(f"judge vs blind A/B, {label[k['cell_a']]} vs {label[k['cell_b']]} ({k['judge']}, rubric "
                     f"{k['rubric_version']}): Cohen's kappa {kappa}, raw agreement {k['agreement']:.2f}, "
                     f"n={k['n']}" + _small_n_note(k["n"]))
    return lines


def _compare(args: argparse.Namespace) -> int:
    from .compare import changed_prompts, metric_deltas
    from .runner import METRICS
    from .store import LabStore

    store = LabStore()
    a, b = store.load(args.run_a), store.load(args.run_b)
    notes = []
    if a.prompt_set_hash != b.prompt_set_hash:
        notes.append("the prompt sets differ")
    if a.model != b.model:
        notes.append(f"the models differ ({a.model} vs {b.model})")
    print(f"run {b.id} - run {a.id}" + (f" (note: {'; '.join(notes)})" if notes else ""))
    deltas = metric_deltas(a, b)
    if not deltas:
        print("no setting label in common: nothing to compare metric by metric")
    rows = [["setting", "metric", f"run {a.id}", f"run {b.id}", "delta", "95% interval"]]
    rows += [[d["setting"], d["metric"], f"{d['a']:.3f}", f"{d['b']:.3f}", f"{d['delta']:+.3f}",
              f"[{d['low']:+.3f}, {d['high']:+.3f}]"] for d in deltas if d["metric"] in METRICS]
    print(_table(rows))
    changed = changed_prompts(a, b)
    if changed:
        print("\nprompts whose outputs changed most (1 - BLEU, same setting and seed):")
        for c in changed:
            print(f"  {c['change']:.2f}  {c['prompt_id']}: {c['prompt'][:70]!r}")
    return 0


# --- judge -----------------------------------------------------------------------------------------------------

def _cell(run: Any, label: str, flag: str) -> int:
    labels = [s["label"] for s in run.settings]
    if label not in labels:
        raise ValueError(f"{flag} {label!r}: run {run.id} has no such setting; its settings: {', '.join(labels)}")
    return labels.index(label)


def _make_judge(args: argparse.Namespace) -> Any:
    from . import judge as J

    if args.judge_max_tokens < 1:
        raise ValueError(f"--judge-max-tokens must be at least 1, got {args.judge_max_tokens}")
    if args.judge_api_key and not args.judge_url:
        raise ValueError("--judge-api-key goes with --judge-url URL")
    if args.judge_url:
        from .endpoint import Endpoint

        endpoint = Endpoint(args.judge_url, args.judge_api_key)
        return J.EndpointJudge(endpoint, args.judge or endpoint.default_model(), args.judge_max_tokens)
    from mlxchat.core import Engine
    from mlxchat.core.model.loader import EMBEDDED_FILE

    return J.EngineJudge(args.judge or EMBEDDED_FILE.removesuffix(".gguf"), lambda: Engine.load(args.judge),
                         args.judge_max_tokens)


def _judge(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from . import judge as J
    from .store import LabStore

    store = LabStore()
    run = store.load(args.run)
    cell_a, cell_b = _cell(run, args.a, "--a"), _cell(run, args.b, "--b")
    if cell_a == cell_b:
        raise ValueError("--a and --b name the same setting; judge two different ones")
    rubric = J.load_rubric(run.prompt_set, args.rubric)
    jobs = J.pair_jobs(run, cell_a, cell_b)
    if not jobs:
        raise ValueError(f"run {run.id} has no outputs of {args.a!r} and {args.b!r} with the same prompt and seed")
    judging = J.Judging(store, run, cell_a, cell_b, _make_judge(args), rubric)
    pairs: list[dict[str, Any]] = []
    cancelled = False
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    try:  # every pair judged is stored at once, and each answer cached: a stop keeps them
        with Progress(*columns, console=Console(stderr=True)) as bar, _stop_on_ctrl_c() as stop:
            task = bar.add_task(f"judging run {run.id}", total=len(jobs))
            for job in jobs:
                if stop.is_set():
                    cancelled = True
                    break
                pairs.append(judging.judge_pair(job))
                bar.update(task, advance=1)
    except KeyboardInterrupt:  # a second Ctrl-C, where Python's default handler was there before
        cancelled = True
    finally:
        judging.judge.close()
    result = {"run_id": run.id, "a": args.a, "b": args.b, **J.summary(pairs, judging.judge.name, rubric)}
    _judge_outputs(result, judging.asked, len(jobs), args.json)
    if cancelled:
        print(f"cancelled: kept {len(pairs)} of {len(jobs)} pairs (rerun to judge the rest; judged ones are cached)",
              file=sys.stderr)
        return 130
    return 0


def _judge_outputs(result: dict[str, Any], asked: int, total: int, json_path: Path | None) -> None:
    a, b, w = result["a"], result["b"], result["win_rate_a"]
    rate = f"{_rate(w)} (Wilson 95%, n={w['n']})" if w else "n/a"
    lines = [f"judge {result['judge']} · rubric {result['rubric_version']} · {asked} judge call(s), "
             f"{2 * result['pairs'] - asked} from the cache",
             f"{a} vs {b}: {result['pairs']} of {total} pairs, {result['swapped']} asked both ways; {a} won "
             f"{result['wins_a']}, {b} won {result['wins_b']}, ties {result['ties']}, unparsed {result['unparsed']}; "
             f"the two orders agreed on {result['consistent']}",
             f"win rate of {a}: {rate}" + (_small_n_note(w["n"]) if w else ""),
             _fairness(result)]
    to_stdout = json_path is None or str(json_path) != "-"
    print("\n".join(lines), file=sys.stdout if to_stdout else sys.stderr)
    if json_path is not None:
        text = json.dumps(result, ensure_ascii=False, indent=1)
        if str(json_path) == "-":
            print(text)
        else:
            json_path.write_text(text, encoding="utf-8")
            print(f"wrote {json_path}", file=sys.stderr)


def _fairness(c: dict[str, Any]) -> str:
    """The line every comparison carries (issue 39): n, the bootstrap interval, the paired test, and for a judge its
    order-flip rate and the length-controlled win rate next to the raw one."""
    boot, p = c.get("win_rate_bootstrap"), c.get("sign_test_p")
    parts = [f"n={c['n']}", f"bootstrap 95% {_rate(boot)}" if boot else "bootstrap n/a",
             f"sign test p={p:.3g}" if p is not None else "sign test n/a (all ties)"]
    if "order_flip_rate" in c:
        flip = c["order_flip_rate"]
        parts.append(f"order-flip rate {flip:.0%} of {c['both_parsed']}" if flip is not None else "order-flip n/a")
    if c.get("lc_win_rate") is not None:
        parts.append(f"length-controlled win rate {c['lc_win_rate']:.2f} (raw {boot['mean']:.2f})")
    return "; ".join(parts)


def _small_n_note(n: int) -> str:
    return f" — n={n} is too small to mean much" if n < SMALL_N else ""
