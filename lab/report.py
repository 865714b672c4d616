"""`--report DIR`: a Markdown summary and PNG plots that read without the app."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .metrics import SMALL_N
from .runner import METRICS
from .store import Run

PLOTTED = ("pass_rate", "distinct_2", "rep_4", "self_bleu", "mean_logprob", "length")


def fmt(est: dict[str, Any] | None, digits: int = 3) -> str:
    if not est:
        return "n/a"
    return f"{est['mean']:.{digits}f} [{est['low']:.{digits}f}, {est['high']:.{digits}f}]"


def verdict(passed: bool | None) -> str:
    return "no check" if passed is None else "pass" if passed else "fail"


def metrics_table(cells: list[dict[str, Any]], names: tuple[str, ...] = METRICS) -> str:
    lines = ["| setting | " + " | ".join(names) + " | finish |", "|---" * (len(names) + 2) + "|"]
    for c in cells:
        finish = ", ".join(f"{k} {v}" for k, v in sorted(c["metrics"]["finish_reasons"].items()))
        lines.append(f"| {c['label']} | " + " | ".join(fmt(c["metrics"].get(n)) for n in names) + f" | {finish} |")
    return "\n".join(lines)


def swept(run: Run) -> tuple[str, list[float]] | None:
    """The field a sweep changed and its values, when every setting label is FIELD=VALUE of one field."""
    parts = [s["label"].partition("=") for s in run.settings]
    if len(parts) < 2 or any(not sep for _, sep, _ in parts) or len({f for f, _, _ in parts}) != 1:
        return None
    field = parts[0][0]
    values = [s["setting"].get(field) for s in run.settings]
    return (field, values) if all(isinstance(v, (int, float)) for v in values) else None


def write(run: Run, folder: Path, evaluations: list[str] | None = None) -> Path:
    """report.md and the plots; `evaluations`: the blind A/B, judge and agreement lines of `lab show`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    cells = run.cells()
    md = [f"# Lab run {run.id}: {run.prompt_set}", "",
          f"model `{run.model}` · code {run.code_version} · prompt set hash `{run.prompt_set_hash[:12]}` · "
          f"{run.seeds} seed(s) · max {run.max_tokens} tokens · {run.status} · {run.created}", "",
          "Each cell: mean [95% interval over prompts, clipped to the values the metric can take]; n/a: the metric "
          "does not apply (no checks in the set, or one seed for self-BLEU). See docs/lab.md for the formulas.", "",
          metrics_table(cells), ""]
    n = len({o.prompt_id for o in run.outputs})
    if 0 < n < SMALL_N:
        md += [f"**Note:** the intervals are over {n} prompt(s); below {SMALL_N} they say little.", ""]
    if evaluations:
        md += ["## Blind A/B and the judge", "", *(f"- {line}" for line in evaluations), ""]

    sweep = swept(run)
    if sweep:
        field, values = sweep
        fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
        for ax, name in zip(axes.flat, PLOTTED):
            pts = [(v, c["metrics"].get(name)) for v, c in zip(values, cells) if c["metrics"].get(name)]
            if pts:
                xs = [p[0] for p in pts]
                ys = [p[1]["mean"] for p in pts]
                err = [[p[1]["mean"] - p[1]["low"] for p in pts], [p[1]["high"] - p[1]["mean"] for p in pts]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4)
            ax.set_title(name)
            ax.set_xlabel(field)
        fig.suptitle(f"run {run.id}: metrics vs {field} (95% intervals)")
        fig.tight_layout()
        fig.savefig(folder / "sweep.png", dpi=110)
        plt.close(fig)
        md += ["## Metrics vs " + field, "", "![metrics vs swept value](sweep.png)", ""]

    # Per-prompt grid: distinct-2 (diversity) and, where the set has checks, pass rate, per prompt x setting.
    prompt_ids = list(run.prompts)
    grids = [("distinct_2", "distinct-2"), ("passed", "pass rate")]
    fig, axes = plt.subplots(1, len(grids), figsize=(6 * len(grids), 0.35 * len(prompt_ids) + 2), squeeze=False)
    for ax, (attr, title) in zip(axes[0], grids):
        grid = []
        for pid in prompt_ids:
            row = []
            for i in range(len(cells)):
                vals = [float(getattr(o, attr)) for o in run.outputs_of(i)
                        if o.prompt_id == pid and getattr(o, attr) is not None]
                row.append(sum(vals) / len(vals) if vals else float("nan"))
            grid.append(row)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(prompt_ids)), prompt_ids, fontsize=7)
        ax.set_xticks(range(len(cells)), [c["label"] for c in cells], rotation=30, ha="right", fontsize=7)
        ax.set_title(title + " per prompt")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(folder / "prompts.png", dpi=110)
    plt.close(fig)
    md += ["## Per prompt", "", "![per-prompt grid](prompts.png)", "", "## Outputs (first seed)", ""]

    for pid, text in run.prompts.items():
        md += [f"### {pid}", "", f"> {text.replace(chr(10), ' ')}", ""]
        for i, c in enumerate(cells):
            first = next((o for o in run.outputs_of(i) if o.prompt_id == pid), None)
            if first is not None:
                body = first.text.strip().replace("\n", "\n    ") or "(empty)"
                md += [f"**{c['label']}** (seed {first.seed}, {first.finish_reason}, {verdict(first.passed)}):", "",
                       "    " + body, ""]
    path = folder / "report.md"
    path.write_text("\n".join(md), encoding="utf-8")
    return path
