"""The sampler inspector's logic without Textual: heat colours, the token strip, the candidates x stages table, and
the alignment of a replay with its original (issue 14).

Everything here works on :class:`~mlxchat.core.sampling.trace.TokenTrace` (the engine's per-token record) and returns
plain data or Rich ``Text``, so it is tested without a terminal; ``widgets/inspector.py`` only lays it out.

Colours: the heat palette is fixed colours of the xterm 256-colour cube (what a 256-colour terminal shows is the
same colour, not an approximation), always as a background with black text, so a shaded token reads the same on a
light and on a dark theme. Confident tokens (>= 90 %) are left unshaded: what stands out is the doubt.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text

from mlxchat.core.sampling.trace import Candidate, TokenTrace

# (upper bound of the chosen token's probability, background): xterm-256 colours 203, 215, 221 and 229.
HEAT_LEVELS: tuple[tuple[float, str], ...] = (
    (0.10, "#ff5f5f"),
    (0.30, "#ffaf5f"),
    (0.60, "#ffd75f"),
    (0.90, "#ffffaf"),
)
HEAT_TEXT = "#000000"  # on every shaded background (xterm-256 colour 16)
CURSOR_STYLE = Style(reverse=True, bold=True, underline=True)
DIVERGENCE_STYLE = Style(color="#ffffff", bgcolor="#af00d7", bold=True)  # xterm-256 128: no heat level uses it
BAR_WIDTH = 5
_EIGHTHS = " ▏▎▍▌▋▊▉█"
_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥"}


def heat_level(prob: float) -> int:
    """0 (confident, unshaded) .. len(HEAT_LEVELS) (least likely): the shade a token chosen with ``prob`` gets."""
    for i, (bound, _) in enumerate(HEAT_LEVELS):
        if prob < bound:
            return len(HEAT_LEVELS) - i
    return 0


def heat_style(prob: float) -> Style:
    """The style of a token chosen with probability ``prob`` (a plain style when it was confident)."""
    level = heat_level(prob)
    if level == 0:
        return Style()
    return Style(color=HEAT_TEXT, bgcolor=HEAT_LEVELS[len(HEAT_LEVELS) - level][1])


def heat_legend() -> Text:
    """One line saying what the shades mean."""
    text = Text("probability when chosen: ")
    low = 0.0
    for bound, colour in HEAT_LEVELS:
        text.append(f" {low * 100:.0f}–{bound * 100:.0f}% ", Style(color=HEAT_TEXT, bgcolor=colour))
        low = bound
    text.append(" ≥90% unshaded")
    return text


def visible(token: str) -> str:
    """A token's text with its whitespace made visible (a table cell of " " or "\\n" would look empty)."""
    return "".join(_VISIBLE.get(ch, ch) for ch in token) if token.strip() == "" or "\n" in token else token


@dataclass(frozen=True)
class TokenPiece:
    """One generated token as the heat strip shows it."""

    index: int
    text: str
    prob: float  # the probability it had in the distribution it was drawn from


def pieces(traces: Sequence[TokenTrace]) -> list[TokenPiece]:
    return [TokenPiece(i, t.chosen.text, t.chosen_prob) for i, t in enumerate(traces)]


def heat_text(tokens: Sequence[TokenPiece], *, cursor: int | None = None, marked: int | None = None) -> Text:
    """The reply as a strip of shaded tokens. Each span carries its index as the ``token`` meta (a click reports
    it); ``cursor`` is the token under the keyboard cursor, ``marked`` the one a replay parts at."""
    text = Text()
    for piece in tokens:
        style = heat_style(piece.prob)
        if piece.index == marked:
            style = DIVERGENCE_STYLE
        if piece.index == cursor:
            style += CURSOR_STYLE
        style += Style(meta={"token": piece.index})
        # A newline token is shown as ↵ before its line break, so it can be seen, shaded and clicked.
        shown = piece.text.replace("\n", "↵\n") if "\n" in piece.text else piece.text
        text.append(shown or "∅", style)
    return text


def bar(prob: float | None, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of ``width`` cells in eighths; blank for a candidate a stage removed."""
    if prob is None:
        return " " * width
    eighths = round(max(0.0, min(1.0, prob)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(width)


def percent(prob: float | None) -> str:
    if prob is None:
        return "cut"
    if 0 < prob < 0.001:
        return "<0.1%"
    return f"{prob * 100:.1f}%"


def cell(prob: float | None, bar_width: int = BAR_WIDTH) -> str:
    """A probability cell: bar (none when ``bar_width`` is 0) and percentage."""
    return f"{bar(prob, bar_width)} {percent(prob):>6}" if bar_width else f"{percent(prob):>6}"


# Stage names as the chain prints them ("Temperature(0.7)") are too wide for a table of 4-6 stages in 80-160
# columns: a narrow table names them short ("Temp 0.7"); the summary over it always prints the whole chain.
_SHORT_NAMES = {"processed": "proc", "Temperature": "Temp", "TypicalP": "Typ"}
_STAGE = re.compile(r"(\w+)\((.*)\)")


def short_stage(stage: str) -> str:
    """A stage's short label: "Temperature(0.7)" -> "Temp 0.7", "TopK(5)" -> "TopK 5", "processed" -> "proc"."""
    m = _STAGE.fullmatch(stage)
    if m is None:
        return _SHORT_NAMES.get(stage, stage)
    name, args = m.groups()
    return f"{_SHORT_NAMES.get(name, name)} {args.replace(', ', ',')}"


@dataclass(frozen=True)
class Density:
    """How much a table spends per stage: full or short stage names, and the width of the bars (0: none)."""

    short: bool
    bar_width: int
    why: bool = False  # the "why" column (why a stage cut the candidate; DRY's repeated sequence)

    def label(self, stage: str) -> str:
        return short_stage(stage) if self.short else stage


# From the widest to the narrowest; `fit` takes the first whose table fits the width it is given.
DENSITIES: tuple[Density, ...] = (Density(False, BAR_WIDTH, True), Density(False, BAR_WIDTH),
                                  Density(True, BAR_WIDTH), Density(True, 2), Density(True, 0))
FULL = DENSITIES[0]


@dataclass(frozen=True)
class InspectorRow:
    """One candidate of one step, as the inspector's table shows it."""

    rank: int  # 1-based, by processed probability (the chosen one may rank past the K listed)
    token_id: int
    token: str  # whitespace made visible
    logit: float  # raw, before any processor
    shift: float  # the total change the token penalties and the bias made to its logit
    stages: tuple[float | None, ...]  # "processed", then each transform's probability (None once removed)
    removed_by: str | None
    chosen: bool
    why: str = ""  # why a stage cut it, or what a processor saw (DRY: the repeated sequence)
    dry: float = 0.0  # DRY's change to its logit (a column of its own: a repeated phrase, not a repeated token)

    @property
    def final(self) -> float | None:
        """Its probability in the distribution that was sampled from."""
        return self.stages[-1]

    def cells(self, *, shifts: bool = True, dry: bool = False, density: Density = FULL) -> tuple[str, ...]:
        """The table row: marker, rank, token, raw logit, the penalties' shift (when the chain has penalties), DRY's
        (when it has DRY), one cell per stage, the stage that cut it and why."""
        shift = (f"{self.shift:+.2f}" if self.shift else "",) if shifts else ()
        repeat = (f"{self.dry:+.2f}" if self.dry else "",) if dry else ()
        cut_by = density.label(self.removed_by) if self.removed_by else ""
        return ("▶" if self.chosen else " ", str(self.rank), self.token, f"{self.logit:.2f}", *shift, *repeat,
                *(cell(p, density.bar_width) for p in self.stages), cut_by, *((self.why,) if density.why else ()))


def _is_dry(processor: str) -> bool:
    return processor.startswith("DRY(")


def has_shifts(trace: TokenTrace) -> bool:
    """Whether the chain has a token penalty or a bias (a processor other than DRY): else the table leaves the
    "penalty" column out."""
    return any(not _is_dry(k) for c in trace.candidates for k in c.shifts)


def has_dry(trace: TokenTrace) -> bool:
    """Whether the chain has DRY: then it has a column of its own."""
    return any(_is_dry(k) for c in trace.candidates for k in c.shifts)


def columns(trace: TokenTrace, density: Density = FULL) -> tuple[str, ...]:
    """The table's headers; the stage columns are named as ``Sampler.describe()`` prints them (the last one is the
    distribution sampled from), or short at a narrow ``density``."""
    return ("", "#", "token", "logit", *(("penalty",) if has_shifts(trace) else ()),
            *(("DRY",) if has_dry(trace) else ()), *(density.label(s) for s in trace.stages), "cut by",
            *(("why",) if density.why else ()))


def table_width(trace: TokenTrace, density: Density, padding: int = 1) -> int:
    """The cells the table takes at ``density``: each column as wide as its widest header or cell, plus
    ``padding`` cells on each side (a DataTable's ``cell_padding``)."""
    shifts, dry = has_shifts(trace), has_dry(trace)
    table = [columns(trace, density), *(r.cells(shifts=shifts, dry=dry, density=density) for r in rows(trace))]
    return sum(max(cell_len(row[i]) for row in table) + 2 * padding for i in range(len(table[0])))


def fit(traces: Sequence[TokenTrace], width: int, padding: int = 1) -> Density:
    """The widest density at which every one of ``traces`` fits ``width`` cells (the narrowest when none does):
    tables shown side by side or one over the other are laid out alike, so they read alike."""
    return next((d for d in DENSITIES if all(table_width(t, d, padding) <= width for t in traces)), DENSITIES[-1])


def rows(trace: TokenTrace) -> list[InspectorRow]:
    # A chosen token outside the top K is listed last; its rank is its own, not its place in the list.
    return [_row(trace.chosen_rank + 1 if c.chosen else i + 1, c, trace.stages)
            for i, c in enumerate(trace.candidates)]


# Why each kind of stage cuts a token, by the name it prints with (what the numbers in its column do not say).
_CUT_REASONS = {
    "TopK": "not among the k likeliest", "TopP": "outside the nucleus", "TypicalP": "too far from typical",
    "MinP": "below min-p × the best", "XTC": "a top choice excluded", "TopNSigma": "more than nσ below the best logit",
    "Mirostat": "outside Mirostat's k for μ", "MirostatV2": "surprise above μ", "processed": "banned by a processor",
}


def why(c: Candidate) -> str:
    """A candidate's "why": the notes stages left (DRY's repeated sequence), then the reason its stage cut it."""
    parts = list(c.notes.values())
    if c.removed_by is not None:
        m = _STAGE.fullmatch(c.removed_by)
        parts.append(_CUT_REASONS.get(m.group(1) if m else c.removed_by, ""))
    return "; ".join(p for p in parts if p)


def _row(rank: int, c: Candidate, stages: Sequence[str]) -> InspectorRow:
    return InspectorRow(rank, c.token_id, visible(c.text), c.logit,
                        sum(v for k, v in c.shifts.items() if not _is_dry(k)), tuple(c.probs.get(s) for s in stages),
                        c.removed_by, c.chosen, why(c), sum(v for k, v in c.shifts.items() if _is_dry(k)))


def summary(trace: TokenTrace, *, index: int, seed: int | None, profile: str | None, sampler: str | None) -> str:
    """The line over the table: which token, entropy before and after the chain, its rank, seed, profile, chain."""
    chosen = trace.chosen
    parts = [f"token {index + 1}: {visible(chosen.text)!r} "
             f"({percent(trace.chosen_prob)}, rank {trace.chosen_rank + 1})",
             f"entropy {trace.entropy_before:.2f} → {trace.entropy_after:.2f} nats",
             f"seed {seed if seed is not None else '–'}", f"profile {profile or 'custom'}"]
    if sampler:
        parts.append(sampler)
    return " · ".join(parts)


def perplexity(traces: Sequence[TokenTrace]) -> float:
    """exp of the mean surprise of the chosen tokens: a one-number "how sure was it" for the legend line."""
    probs = [max(t.chosen_prob, 1e-12) for t in traces]
    return math.exp(-sum(math.log(p) for p in probs) / len(probs)) if probs else 0.0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first token index where two replies' ids part (the shorter one's end counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
