"""The sampler chain's steps and every sampler parameter, each declared once (issue 38 item 4).

A step (:data:`STEPS`) says whether a profile turns it on and how it prints; its object is a class of
``core.sampling.chain`` under the same name. A parameter's declaration (:data:`PARAMS`) says what the parameter is
(name, type, default, allowed range, the chain step it sets) and how each surface shows it (the CLI's flag and help, the
TUI's hint, its name in Ollama's options, whether Anthropic's Messages API and OpenAI's own API define it).
Everything else is derived from :data:`PARAMS`:

* ``core.sampling.profile.SamplingProfile``: a field per parameter, its type, default and range check (whose error names
  the field, the value and the range);
* ``mlxchat chat`` / ``generate``: a flag per parameter (app/cli.py);
* the TUI's profile picker (its fields, in this order) and a profile's one-line summary (app/);
* the server's request fields: every parameter on OpenAI's ``/v1`` routes under its own name (OpenAI's, else vLLM's
  and llama.cpp server's top-level extension names, which are the profile's), the ones with an Ollama name among
  ``options`` on ``/api/*``, the ones marked ``anthropic`` on ``/v1/messages`` (server/);
* what the lab sends to another server (lab/endpoint.py).

So a new sampler is its declarations here (its step and its parameters) and its class in ``core.sampling.chain``.
Request settings that are not a sampler's (seed, stop, max_tokens, logit_bias, the order, the response format) are
``SamplingProfile``'s own fields: each API spells and checks them in its own way.

This module imports nothing but the standard library: the CLI builds its parser from it without loading MLX
(`mlxchat --help` stays fast; core's package loads its engine only when asked; app/sampler_flags.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


def format_number(x: float) -> str:
    """How a number prints in the chain and in range errors: 0.9, 40, 1e-05."""
    return str(x) if isinstance(x, int) else f"{x:g}"


_n = format_number


@dataclass(frozen=True)
class Range:
    """The values a number may take: [lo, hi], (lo, hi] with ``lo_open``, either end open-ended when None.
    ``note`` ends the error message, e.g. " (0 disables)"."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    note: str = ""

    def text(self) -> str:
        """The range as an error states it: "between 0 and 2 (0 means greedy)"."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            text = (f"greater than {format_number(lo)} and at most {format_number(hi)}" if self.lo_open
                    else f"between {format_number(lo)} and {format_number(hi)}")
        elif lo is not None:
            text = f"greater than {format_number(lo)}" if self.lo_open else f"at least {format_number(lo)}"
        else:
            text = f"at most {format_number(hi)}"
        return text + self.note

    def contains(self, value: float) -> bool:
        # Written as "inside" so that NaN is outside every range.
        lo, hi = self.lo, self.hi
        return ((lo is None or (value > lo if self.lo_open else value >= lo))
                and (hi is None or value <= hi))


@dataclass(frozen=True)
class SamplerParam:
    """One sampler parameter. ``name`` is the profile's field, its TOML key and its JSON field on every API that takes
    it under that name; ``type`` is float, int, bool or list (of non-empty strings)."""

    name: str
    type: type
    default: Any
    range: Range | None
    step: str | None  # the chain step it sets (core.sampling.profile.STEPS); None: the history every penalty looks at
    hint: str  # the TUI's placeholder: the range in brief, and the value that turns the sampler off
    help: str  # the CLI's help
    # The parameter that turns this one's sampler on (e.g. dry_base goes with dry_multiplier); None: it acts alone.
    goes_with: str | None = None
    openai: bool = False  # in OpenAI's own API (the others are extensions on /v1, sent only when on)
    ollama: str | None = None  # its name among Ollama's options (None: not one)
    anthropic: bool = False  # taken on /v1/messages (Anthropic's three, and llama.cpp's samplers of issue 39)

    @property
    def flag(self) -> str:
        """The CLI's flag: the name with dashes; a list's flag is repeatable, so it is singular."""
        return "--" + (self.name.removesuffix("s") if self.type is list else self.name).replace("_", "-")

    def defaults(self) -> Any:
        """A fresh default (a list is copied, so no two profiles share one)."""
        return list(self.default) if self.type is list else self.default


# llama.cpp's defaults: DRY breaks repeated sequences at newlines, colons, quotes and asterisks.
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")
_UNIT = Range(0, 1)
_UNIT_OPEN = Range(0, 1, lo_open=True)
_PENALTY = Range(-2, 2)

PARAMS: dict[str, SamplerParam] = {p.name: p for p in (
    SamplerParam("temperature", float, 1.0, Range(0, 2, note=" (0 means greedy)"), "temperature",
                 "0–2, 0 = greedy", "0 = greedy (default: the profile's)",
                 openai=True, ollama="temperature", anthropic=True),
    SamplerParam("top_k", int, 0, Range(0, None, note=" (0 disables)"), "top_k", "≥ 0, 0 = off",
                 "keep the k likeliest tokens (0 = off)", ollama="top_k", anthropic=True),
    SamplerParam("top_p", float, 1.0, _UNIT_OPEN, "top_p", "(0, 1], 1 = off",
                 "nucleus: keep the likeliest tokens up to this probability (1 = off)",
                 openai=True, ollama="top_p", anthropic=True),
    SamplerParam("min_p", float, 0.0, _UNIT, "min_p", "0–1, 0 = off",
                 "keep tokens at least this fraction as likely as the best (0 = off)", ollama="min_p"),
    SamplerParam("typical_p", float, 1.0, _UNIT_OPEN, "typical_p", "(0, 1], 1 = off",
                 "locally typical sampling: keep this much probability closest to the entropy (1 = off)",
                 ollama="typical_p"),
    # XTC ("exclude top choices"): with probability xtc_probability, drop every token whose probability is at least
    # xtc_threshold except the least likely of them. Probability 0 disables; a threshold above 0.5 cannot act.
    SamplerParam("xtc_threshold", float, 0.1, _UNIT, "xtc", "0–1, e.g. 0.1",
                 "XTC: tokens at least this likely are dropped, all but the least of them (default 0.1)",
                 goes_with="xtc_probability"),
    SamplerParam("xtc_probability", float, 0.0, _UNIT, "xtc", "0–1, 0 = off",
                 "XTC: how often to drop the likeliest tokens above --xtc-threshold (0 = off)"),
    # top-nσ: keep the tokens whose logit is within n standard deviations (of the live logits) of the largest;
    # a cut in logit space, so the temperature does not move it. ≤ 0 disables (llama.cpp's default is -1).
    SamplerParam("top_n_sigma", float, -1.0, Range(-1, None, note=" (0 or below disables)"), "top_n_sigma",
                 "≤ 0 = off, e.g. 1", "keep tokens within n standard deviations of the best logit (<= 0 = off)",
                 ollama="top_n_sigma", anthropic=True),
    # Dynamic temperature (llama.cpp's temp-ext): temperature ± dynatemp_range, scaled by the normalised entropy
    # raised to dynatemp_exponent. 0 disables.
    SamplerParam("dynatemp_range", float, 0.0, Range(0, 2, note=" (0 disables)"), "temperature", "0–2, 0 = off",
                 "dynamic temperature: temperature ± this, by the entropy (0 = off)",
                 ollama="dynatemp_range", anthropic=True),
    SamplerParam("dynatemp_exponent", float, 1.0, Range(0, 10), "temperature", "0–10",
                 "dynamic temperature's exponent (default 1)",
                 goes_with="dynatemp_range", ollama="dynatemp_exponent", anthropic=True),
    # Mirostat (1 or 2; 0 disables): replaces the transforms with temperature, then a cut that steers the surprise
    # of the chosen tokens towards mirostat_tau (bits), learning at rate mirostat_eta.
    SamplerParam("mirostat", int, 0, Range(0, 2, note=" (0 disables, 1 or 2 picks the version)"), "mirostat",
                 "0 = off, 1 or 2", "Mirostat 1 or 2: steer the surprise to --mirostat-tau (0 = off)",
                 ollama="mirostat", anthropic=True),
    SamplerParam("mirostat_tau", float, 5.0, Range(0, None, lo_open=True), "mirostat", "> 0 (bits)",
                 "Mirostat's target surprise in bits (default 5)",
                 goes_with="mirostat", ollama="mirostat_tau", anthropic=True),
    SamplerParam("mirostat_eta", float, 0.1, _UNIT_OPEN, "mirostat", "(0, 1]",
                 "Mirostat's learning rate (default 0.1)",
                 goes_with="mirostat", ollama="mirostat_eta", anthropic=True),
    # Adaptive-p (llama.cpp's llama_sampler_init_adaptive_p): favour tokens near a target probability, adapted by
    # an exponential moving average of the chosen tokens' probabilities. A negative target disables.
    SamplerParam("adaptive_p_target", float, -1.0, Range(-1, 1, note=" (negative disables)"), "adaptive_p",
                 "-1…1, negative = off", "adaptive-p: favour tokens near this probability (negative = off)",
                 ollama="adaptive_p_target", anthropic=True),
    SamplerParam("adaptive_p_decay", float, 0.9, Range(0, 0.99), "adaptive_p", "0–0.99",
                 "adaptive-p: the moving average's decay (0-0.99, default 0.9)",
                 goes_with="adaptive_p_target", ollama="adaptive_p_decay", anthropic=True),
    SamplerParam("frequency_penalty", float, 0.0, _PENALTY, "frequency_penalty", "−2…2",
                 "lower a token's logit by this times its count so far (0 = off)",
                 openai=True, ollama="frequency_penalty"),
    SamplerParam("presence_penalty", float, 0.0, _PENALTY, "presence_penalty", "−2…2",
                 "lower the logit of every token seen so far by this (0 = off)",
                 openai=True, ollama="presence_penalty"),
    SamplerParam("repetition_penalty", float, 1.0, Range(0, None, lo_open=True, note=" (1 disables)"),
                 "repetition_penalty", "> 0, 1 = off",
                 "divide a seen token's positive logit by this, multiply a negative one (1 = off)",
                 ollama="repeat_penalty"),
    # DRY: a token that would extend a sequence of n ≥ dry_allowed_length tokens already in the last
    # dry_penalty_last_n (-1: all; 0 disables) loses dry_multiplier × dry_base^(n - dry_allowed_length) from its
    # logit; a sequence breaker (tokenised on the model's vocabulary) ends every sequence.
    SamplerParam("dry_multiplier", float, 0.0, Range(0, None, note=" (0 disables)"), "dry",
                 "≥ 0, 0 = off, e.g. 0.8",
                 "DRY: penalise extending a repeated sequence (0 = off; llama.cpp suggests 0.8)",
                 ollama="dry_multiplier", anthropic=True),
    SamplerParam("dry_base", float, 1.75, Range(1, None, lo_open=True), "dry", "> 1",
                 "DRY: the penalty's growth per extra repeated token (> 1, default 1.75)",
                 goes_with="dry_multiplier", ollama="dry_base", anthropic=True),
    SamplerParam("dry_allowed_length", int, 2, Range(1, None), "dry", "≥ 1",
                 "DRY: repeats this long go unpenalised (default 2)",
                 goes_with="dry_multiplier", ollama="dry_allowed_length", anthropic=True),
    SamplerParam("dry_penalty_last_n", int, -1, Range(-1, None, note=" (-1 means the whole context, 0 disables)"),
                 "dry", "-1 = all, 0 = off", "DRY: tokens of history to look at (-1 = all, the default; 0 = off)",
                 goes_with="dry_multiplier", ollama="dry_penalty_last_n", anthropic=True),
    SamplerParam("dry_sequence_breakers", list, DRY_SEQUENCE_BREAKERS, None, "dry", 'e.g. ["\\n", ":"]',
                 "DRY: a string that ends every repeated sequence (repeatable; replaces the default \\n : \" *)",
                 goes_with="dry_multiplier", ollama="dry_sequence_breakers", anthropic=True),
    SamplerParam("min_tokens", int, 0, Range(0, None), "min_tokens", "≥ 0",
                 "no end of turn before this many tokens (0 = off)"),
    # The history the three penalties look at (Ollama's repeat_last_n is this with Ollama's values: server/ollama.py).
    SamplerParam("penalty_window", int, 0, Range(0, None, note=" (0 means all generated tokens)"), None,
                 "≥ 0, 0 = all", "the penalties look at the last N tokens (0 = all, the default)"),
    SamplerParam("penalize_prompt", bool, False, None, None, "true or false",
                 "the penalties and DRY count the prompt's tokens too"),
)}


@dataclass(frozen=True)
class ChainStep:
    """One step of the sampler chain, described once: its name (the profile field or ``sampler_order`` entry), whether
    a profile's setting would change anything, how it prints, and the arguments it is built from: its parameters
    (those of :data:`PARAMS` whose step it is, in their order; a list, DRY's breakers, arrives tokenised), or
    ``from_profile`` where they are not. ``profile`` is a ``core.sampling.profile.SamplingProfile``, built on this
    module.

    ``core.sampling.chain`` builds each step's object from ``args(profile)``, and the object prints itself with
    ``label(*args)``, so the printed chain comes from this one place (llama.cpp's ``common_sampler_print``).
    Processors always run first, in registry order; transforms run in the profile's ``sampler_order``."""

    name: str
    kind: Literal["processor", "transform"]
    active: Callable[[Any], bool]
    label: Callable[..., str]
    from_profile: Callable[[Any], tuple] | None = None

    def args(self, profile: Any) -> tuple:
        if self.from_profile is not None:
            return self.from_profile(profile)
        return tuple(getattr(profile, n) for n, p in PARAMS.items() if p.step == self.name and p.type is not list)

    def describe(self, profile: Any) -> str:
        return self.label(*self.args(profile))


def _temperature_label(t: float, spread: float, exponent: float) -> str:
    if spread > 0:
        return f"DynaTemp({_n(max(0.0, t - spread))}..{_n(t + spread)}, {_n(exponent)})"
    return f"Temperature({_n(t)})"


STEPS: dict[str, ChainStep] = {s.name: s for s in (
    ChainStep("repetition_penalty", "processor", lambda p: p.repetition_penalty != 1,
              lambda r: f"RepetitionPenalty({_n(r)})"),
    ChainStep("frequency_penalty", "processor", lambda p: p.frequency_penalty != 0,
              lambda f: f"FrequencyPenalty({_n(f)})"),
    ChainStep("presence_penalty", "processor", lambda p: p.presence_penalty != 0,
              lambda v: f"PresencePenalty({_n(v)})"),
    # DRY ("don't repeat yourself", llama.cpp's port of koboldcpp's): penalises a token that would extend a sequence
    # already in the history, after the token penalties as in llama.cpp's order. A processor, so greedy sees it too.
    ChainStep("dry", "processor", lambda p: p.dry_multiplier > 0 and p.dry_penalty_last_n != 0,
              lambda m, b, n, last: f"DRY({_n(m)}, {_n(b)}, {n}, {last})"),
    ChainStep("logit_bias", "processor", lambda p: bool(p.logit_bias), lambda b: f"LogitBias({len(b)} tokens)",
              from_profile=lambda p: (p.logit_bias,)),
    ChainStep("min_tokens", "processor", lambda p: p.min_tokens > 0, lambda n: f"MinTokens({n})"),
    # Transforms, in the default order: llama.cpp's common sampler order (penalties, DRY, top_n_sigma, top_k,
    # typical_p, top_p, min_p, xtc, temperature, then the terminal adaptive-p). Filters cut the untempered
    # distribution and temperature comes last (as llama.cpp does, and as mlx-lm does for temperature), so a filter's
    # cut does not move with the temperature.
    ChainStep("top_n_sigma", "transform", lambda p: p.top_n_sigma > 0, lambda n: f"TopNSigma({_n(n)})"),
    ChainStep("top_k", "transform", lambda p: p.top_k > 0, lambda k: f"TopK({k})"),
    ChainStep("typical_p", "transform", lambda p: p.typical_p < 1, lambda v: f"TypicalP({_n(v)})"),
    ChainStep("top_p", "transform", lambda p: p.top_p < 1, lambda v: f"TopP({_n(v)})"),
    ChainStep("min_p", "transform", lambda p: p.min_p > 0, lambda v: f"MinP({_n(v)})"),
    ChainStep("xtc", "transform", lambda p: p.xtc_probability > 0 and p.xtc_threshold <= 0.5,
              lambda t, q: f"XTC({_n(t)}, {_n(q)})"),
    # llama.cpp's temp-ext: dynatemp_range > 0 scales the temperature by the candidates' normalised entropy.
    # (Mirostat's chain takes a plain temperature, as llama.cpp's does.)
    ChainStep("temperature", "transform",
              lambda p: p.temperature != 1 or (p.dynatemp_range > 0 and not p.mirostat), _temperature_label,
              from_profile=lambda p: (p.temperature, 0.0 if p.mirostat else p.dynatemp_range, p.dynatemp_exponent)),
    # The terminal samplers: adaptive-p reshapes what is left towards a target probability (last by default);
    # Mirostat replaces the chain (temperature, then Mirostat), as in llama.cpp, so it is in no order.
    ChainStep("adaptive_p", "transform", lambda p: p.adaptive_p_target >= 0,
              lambda t, d: f"AdaptiveP({_n(t)}, {_n(d)})"),
    ChainStep("mirostat", "transform", lambda p: p.mirostat > 0,
              lambda v, tau, eta: f"Mirostat{'V2' if v == 2 else ''}({_n(tau)}, {_n(eta)})"),
)}


__all__ = ["DRY_SEQUENCE_BREAKERS", "PARAMS", "STEPS", "ChainStep", "Range", "SamplerParam", "format_number"]
