"""Comparing two runs: per-metric deltas with intervals, the prompts whose outputs moved most, regression bounds."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from . import metrics as M
from .runner import METRICS
from .store import Run

_BOUND = re.compile(r"^\s*(\w+)\s*([<>])\s*([+-]?(?:\d+\.?\d*|\.\d+))\s*$")


@dataclass(frozen=True)
class Bound:
    """`--fail-on "pass_rate<-0.05"`: fail when the metric's delta (run - baseline) is below -0.05."""

    metric: str
    op: str
    limit: float

    @classmethod
    def parse(cls, text: str) -> Bound:
        m = _BOUND.match(text)
        if not m:
            raise ValueError(f"--fail-on {text!r}: write METRIC<DELTA or METRIC>DELTA, e.g. \"pass_rate<-0.05\"")
        if m[1] not in METRICS:
            raise ValueError(f"--fail-on {text!r}: unknown metric {m[1]!r}; metrics: {', '.join(METRICS)}")
        return cls(m[1], m[2], float(m[3]))

    def violated(self, delta: float) -> bool:
        return delta < self.limit if self.op == "<" else delta > self.limit

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.limit:+g}"


def metric_deltas(a: Run, b: Run) -> list[dict[str, Any]]:
    """For each setting label in both runs and each metric: B - A, with a 95% interval ±√(hA² + hB²) (the two runs'
    intervals taken as independent)."""
    cells_a = {c["label"]: c["metrics"] for c in a.cells()}
    rows = []
    for cell in b.cells():
        ma = cells_a.get(cell["label"])
        if ma is None:
            continue
        for name in METRICS:
            ea, eb = ma.get(name), cell["metrics"].get(name)
            if not ea or not eb:
                continue
            h = math.hypot((ea["high"] - ea["low"]) / 2, (eb["high"] - eb["low"]) / 2)
            d = eb["mean"] - ea["mean"]
            rows.append({"setting": cell["label"], "metric": name, "a": ea["mean"], "b": eb["mean"], "delta": d,
                         "low": d - h, "high": d + h})
    return rows


def changed_prompts(a: Run, b: Run, top: int = 5) -> list[dict[str, Any]]:
    """Prompts ranked by how much their outputs changed: 1 - BLEU of B's output against A's, same setting label
    and seed, averaged."""
    index = {(a.settings[o.cell]["label"], o.prompt_id, o.seed): o.text for o in a.outputs}
    change: dict[str, list[float]] = {}
    for o in b.outputs:
        old = index.get((b.settings[o.cell]["label"], o.prompt_id, o.seed))
        if old is not None:
            same = 1.0 if old == o.text else M.bleu(o.text, [old])
            change.setdefault(o.prompt_id, []).append(1.0 - same)
    ranked = sorted(((sum(v) / len(v), pid) for pid, v in change.items()), reverse=True)
    return [{"prompt_id": pid, "change": c, "prompt": b.prompts.get(pid, "")} for c, pid in ranked[:top] if c > 0]


def check_comparable(baseline: Run, prompt_ids: list[str], prompt_set_hash: str, labels: list[str]) -> None:
    """A regression gate compares like with like: the same prompts (same file, same --limit) and settings."""
    if prompt_set_hash != baseline.prompt_set_hash or list(baseline.prompts) != prompt_ids:
        raise ValueError(f"--baseline run {baseline.id} used other prompts ({baseline.prompt_set}, "
                         f"{len(baseline.prompts)} prompts, hash {baseline.prompt_set_hash[:8]}); gate against a run "
                         "of the same --prompts and --limit")
    known = {s["label"] for s in baseline.settings}
    missing = [label for label in labels if label not in known]
    if missing:
        raise ValueError(f"--baseline run {baseline.id} has no setting {missing[0]!r} (it has "
                         f"{', '.join(sorted(known))}); compare runs of the same settings")


def check_bounds(baseline: Run, run: Run, bounds: list[Bound]) -> list[str]:
    """One line per violated bound; empty when the run stays inside every bound."""
    check_comparable(baseline, list(run.prompts), run.prompt_set_hash, [s["label"] for s in run.settings])
    failures = []
    for row in metric_deltas(baseline, run):
        for bound in bounds:
            if row["metric"] == bound.metric and bound.violated(row["delta"]):
                failures.append(f"{row['setting']}: {row['metric']} moved {row['delta']:+.3f} "
                                f"({row['a']:.3f} -> {row['b']:.3f}), past {bound}")
    return failures
