"""Experiment execution: every prompt x setting x seed through the engine's public surface, one Output each, and
the per-setting aggregation of their metrics."""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from mlxchat.core import Engine, SamplingProfile

from . import metrics as M
from .prompts import Prompt, PromptSet

# Fields a run sets per generation (seed) or for measuring (logprobs); they are not part of a setting.
RUN_FIELDS = {"seed", "logprobs", "top_logprobs"}
# Per-output numbers averaged into a setting's metrics (each is first averaged over the seeds of one prompt).
PER_OUTPUT = ("distinct_1", "distinct_2", "rep_4", "mean_logprob", "length", "words", "ttft_s", "tpot_s")
METRICS = ("pass_rate", "schema_valid", "self_bleu", *PER_OUTPUT)
# The values each metric can take: its interval is clipped to them (a t-interval over few prompts runs past them).
RANGES = {"pass_rate": (0.0, 1.0), "schema_valid": (0.0, 1.0), "self_bleu": (0.0, 1.0), "distinct_1": (0.0, 1.0), "distinct_2": (0.0, 1.0),
          "rep_4": (0.0, 1.0), "mean_logprob": (-math.inf, 0.0), "length": (0.0, math.inf), "words": (0.0, math.inf),
          "ttft_s": (0.0, math.inf), "tpot_s": (0.0, math.inf)}


@dataclass(frozen=True)
class Setting:
    """One column of an experiment: a label ("chat", "temperature=0.7") and the full validated profile."""

    label: str
    profile: SamplingProfile
    base: str | None = None  # for a sweep: the profile it started from ("default" when --base was not given)

    def fields(self) -> dict[str, Any]:
        return self.profile.model_dump(mode="json", exclude=RUN_FIELDS)

    def record(self) -> dict[str, Any]:
        """How a run stores this setting (lab/store.py)."""
        return {"label": self.label, "setting": self.fields(), **({"base": self.base} if self.base else {})}


@dataclass(frozen=True)
class Output:
    cell: int  # index of the setting
    prompt_id: str
    seed: int
    text: str
    finish_reason: str
    length: int  # generated tokens
    words: int
    mean_logprob: float | None
    ttft_s: float
    tpot_s: float
    passed: bool | None
    distinct_1: float
    distinct_2: float
    rep_4: float
    schema_valid: bool | None = None  # JSON valid under the prompt's schema (None: the prompt has none)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_output(cell: int, prompt: Prompt, seed: int, result: Any) -> Output:  # result: core GenerationResult
    return scored_output(cell, prompt, seed, result.text, result.finish_reason, result.metrics.completion_tokens,
                         [lp.logprob for lp in result.logprobs], result.metrics.ttft_s, result.metrics.tpot_s)


def scored_output(cell: int, prompt: Prompt, seed: int, text: str, finish_reason: str, length: int,
                  logprobs: Sequence[float], ttft_s: float, tpot_s: float) -> Output:
    """An output with its checks and per-output metrics, whether the engine or a server (lab/target.py) made it."""
    return Output(cell=cell, prompt_id=prompt.id, seed=seed, text=text, finish_reason=finish_reason, length=length,
                  words=len(text.split()), mean_logprob=M.mean_logprob(logprobs), ttft_s=ttft_s, tpot_s=tpot_s,
                  passed=prompt.check(text), distinct_1=M.distinct_n(text, 1), distinct_2=M.distinct_n(text, 2),
                  rep_4=M.seq_rep_n(text, 4), schema_valid=prompt.schema_valid(text))


def cell_metrics(outputs: Sequence[Output]) -> dict[str, Any]:
    """A setting's metrics: each per-output number averaged over the seeds of a prompt, then mean and 95% interval
    over prompts (seeds of one prompt are not independent samples); self-BLEU is one value per prompt."""
    by_prompt: dict[str, list[Output]] = defaultdict(list)
    for o in outputs:
        by_prompt[o.prompt_id].append(o)

    def over_prompts(name: str, values_of: Callable[[list[Output]], list[float]]) -> dict[str, float | int] | None:
        per_prompt = [sum(v) / len(v) for v in (values_of(os) for os in by_prompt.values()) if v]
        est = M.mean_interval(per_prompt)
        if est is None:
            return None
        lo, hi = RANGES[name]
        return {**est.as_dict(), "low": max(lo, est.low), "high": min(hi, est.high)}

    out: dict[str, Any] = {
        "pass_rate": over_prompts("pass_rate", lambda os: [float(o.passed) for o in os if o.passed is not None]),
        "schema_valid": over_prompts("schema_valid", lambda os: [float(o.schema_valid) for o in os
                                                                 if o.schema_valid is not None]),
        "self_bleu": over_prompts("self_bleu", lambda os: [b] if (b := M.self_bleu([o.text for o in os])) is not None
                                  else []),
    }
    for name in PER_OUTPUT:
        out[name] = over_prompts(name, lambda os, name=name: [getattr(o, name) for o in os
                                                              if getattr(o, name) is not None])
    out["finish_reasons"] = dict(Counter(o.finish_reason for o in outputs))
    out["outputs"] = len(outputs)
    return out


class Remote(Protocol):
    """A server in an engine's place (lab/target.py's `Target`): it makes each whole output itself."""

    name: str

    def generate(self, cell: int, prompt: Prompt, profile: SamplingProfile, max_tokens: int) -> Output: ...


class Experiment:
    """The jobs of one run, executed in a fixed order (setting, prompt, seed) so a cancelled run is a prefix."""

    def __init__(self, prompt_set: PromptSet, settings: Sequence[Setting], seeds: int, max_tokens: int) -> None:
        if seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {seeds}")
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        if not settings:
            raise ValueError("give at least one --profile or a --sweep")
        self.prompt_set = prompt_set
        self.settings = list(settings)
        self.seeds = list(range(seeds))
        self.max_tokens = max_tokens

    def jobs(self) -> list[tuple[int, Prompt, int]]:
        return [(c, p, s) for c in range(len(self.settings)) for p in self.prompt_set.prompts for s in self.seeds]

    def generate(self, engine: Engine | Remote, cell: int, prompt: Prompt, seed: int,
                 cancelled: threading.Event | None = None) -> Output | None:
        """One generation; None when `cancelled` is set before it finishes (the partial output is dropped).
        `engine` may instead be a server (lab/target.py), which makes the whole output itself."""
        update = {"seed": seed, "logprobs": True}
        if prompt.response_format is not None:  # a prompt with a schema is generated under it
            update["response_format"] = prompt.response_format
        profile = SamplingProfile.model_validate({**self.settings[cell].profile.model_dump(), **update})
        if not isinstance(engine, Engine):
            return engine.generate(cell, prompt, profile, self.max_tokens)
        stream = engine.stream(prompt.text, profile=profile, max_tokens=self.max_tokens,
                               stop=[prompt.stop] if prompt.stop else None, system=prompt.system)
        for _event in stream:
            if cancelled is not None and cancelled.is_set():
                stream.cancel()
                return None
        return make_output(cell, prompt, seed, stream.result)

    def run(self, engine: Engine | Remote, on_output: Callable[[Output], None],
            cancelled: threading.Event | None = None) -> bool:
        """Run every job, calling `on_output` after each; False when cancelled before the end.
        KeyboardInterrupt propagates (the engine's stream cancels itself when left early)."""
        for cell, prompt, seed in self.jobs():
            if cancelled is not None and cancelled.is_set():
                return False
            out = self.generate(engine, cell, prompt, seed, cancelled)
            if out is None:
                return False
            on_output(out)
        return True
