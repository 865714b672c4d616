"""`lab tune`: compare samplers at their best, each given the same budget of settings.

Comparing min-p at one value with top-p at another says more about the values picked than about the samplers (the
min-p debate). Here each sampler gets ``budget`` values of its parameter, evenly spaced over the range people use
(`RANGES`), all in one run over the same prompts and seeds. Each sampler's best value is chosen on the prompts at
even positions of the set and the chosen values are compared on the prompts at odd positions, which the choice did
not see: choosing on the same prompts it is judged on would flatter whichever sampler had the noisiest scores.
The comparison is paired (per held-out prompt, averaged over seeds) and reports n, a bootstrap interval and a sign
test (`metrics.paired_comparison`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from mlxchat.core import SamplingProfile

from . import metrics as M
from .runner import PER_OUTPUT, Output, Setting
from .runner import RANGES as RANGES_OF_METRICS
from .store import Run

# Each sampler's parameter, the range its budget of values spreads over, and the settings that go along with it.
RANGES: dict[str, tuple[str, float, float, dict[str, Any]]] = {
    "temperature": ("temperature", 0.3, 1.5, {}),
    "top_k": ("top_k", 5, 100, {}),
    "top_p": ("top_p", 0.5, 0.99, {}),
    "min_p": ("min_p", 0.02, 0.3, {}),
    "typical_p": ("typical_p", 0.5, 0.99, {}),
    "top_n_sigma": ("top_n_sigma", 0.5, 3.0, {}),
    "xtc": ("xtc_probability", 0.1, 0.9, {}),
    "dry": ("dry_multiplier", 0.2, 1.6, {}),
    "dynatemp": ("dynatemp_range", 0.1, 1.0, {}),
    "mirostat": ("mirostat_tau", 2.0, 8.0, {"mirostat": 2}),
    "adaptive_p": ("adaptive_p_target", 0.1, 0.9, {}),
}
# What a best is chosen by: the per-output metrics (lab/runner.py) and the pass rate; less is better for some.
TUNE_METRICS = ("pass_rate", *PER_OUTPUT)
LOWER_IS_BETTER = {"rep_4", "ttft_s", "tpot_s"}


def budget_values(sampler: str, budget: int) -> list[float | int]:
    """`budget` values of the sampler's parameter, evenly spaced over its range (ends included)."""
    if sampler not in RANGES:
        raise ValueError(f"--sampler {sampler!r}: unknown; samplers: {', '.join(RANGES)}")
    if budget < 1:
        raise ValueError(f"--budget must be at least 1, got {budget}")
    field, lo, hi, _ = RANGES[sampler]
    values = [lo + (hi - lo) * i / (budget - 1) for i in range(budget)] if budget > 1 else [(lo + hi) / 2]
    if isinstance(lo, int):
        return sorted({round(v) for v in values})
    return [round(v, 4) for v in values]


def tune_settings(samplers: list[str], budget: int, base: SamplingProfile) -> list[Setting]:
    """The run's settings: each sampler's budget of values over `base`, labelled "sampler:field=value"."""
    if len(set(samplers)) != len(samplers) or len(samplers) < 2:
        raise ValueError("give at least two different --sampler names to compare")
    settings = []
    for sampler in samplers:
        field, _, _, extra = RANGES[sampler]
        for value in budget_values(sampler, budget):
            profile = SamplingProfile.model_validate({**base.model_dump(), **extra, field: value})
            settings.append(Setting(f"{sampler}:{field}={value:g}", profile, "tune"))
    return settings


@dataclass(frozen=True)
class Best:
    sampler: str
    cell: int
    label: str
    selection: float  # its mean metric on the selection prompts


def _per_prompt(outputs: list[Output], metric: str) -> dict[str, float]:
    """The metric per prompt, averaged over seeds (pass_rate: the share of seeds whose output passed)."""
    values: dict[str, list[float]] = defaultdict(list)
    for o in outputs:
        v = (None if o.passed is None else float(o.passed)) if metric == "pass_rate" else getattr(o, metric)
        if v is not None:
            values[o.prompt_id].append(float(v))
    return {p: sum(v) / len(v) for p, v in values.items()}


def _interval(values: list[float], metric: str) -> dict[str, float | int] | None:
    """The mean over prompts with its 95% interval, clipped to the values the metric can take."""
    est = M.mean_interval(values)
    if est is None:
        return None
    lo, hi = RANGES_OF_METRICS.get(metric, (float("-inf"), float("inf")))
    return {**est.as_dict(), "low": max(lo, est.low), "high": min(hi, est.high)}


def split_prompts(run: Run) -> tuple[list[str], list[str]]:
    """(selection, held-out): the set's prompts at even and at odd positions."""
    ids = list(run.prompts)
    return ids[0::2], ids[1::2]


def choose(run: Run, metric: str) -> list[Best]:
    """Each sampler's best setting by `metric` over the selection prompts (ties: the first tried)."""
    selection, _ = split_prompts(run)
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
    best: dict[str, Best] = {}
    for cell, s in enumerate(run.settings):
        sampler = s["label"].split(":", 1)[0]
        scores = _per_prompt(run.outputs_of(cell), metric)
        chosen = [scores[p] for p in selection if p in scores]
        if not chosen:
            continue
        mean = sum(chosen) / len(chosen)
        if sampler not in best or sign * mean > sign * best[sampler].selection:
            best[sampler] = Best(sampler, cell, s["label"], mean)
    return list(best.values())


def compare_best(run: Run, bests: list[Best], metric: str) -> list[dict[str, Any]]:
    """Every pair of chosen settings on the held-out prompts: A's score per prompt is 1 when A's metric is better,
    0.5 when equal, 0 when worse; with n, a bootstrap interval and a sign test."""
    _, held_out = split_prompts(run)
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
    per = {b.sampler: _per_prompt(run.outputs_of(b.cell), metric) for b in bests}
    rows = []
    for i, a in enumerate(bests):
        for b in bests[i + 1:]:
            both = [p for p in held_out if p in per[a.sampler] and p in per[b.sampler]]
            scores = [0.5 if per[a.sampler][p] == per[b.sampler][p] else
                      float(sign * per[a.sampler][p] > sign * per[b.sampler][p]) for p in both]
            rows.append({"a": a.label, "b": b.label, "metric": metric,
                         "held_out_a": _interval([per[a.sampler][p] for p in both], metric),
                         "held_out_b": _interval([per[b.sampler][p] for p in both], metric),
                         **M.paired_comparison(scores)})
    return rows


__all__ = ["RANGES", "TUNE_METRICS", "Best", "budget_values", "choose", "compare_best", "split_prompts",
           "tune_settings"]
