"""The sampler inspector's plain logic (app/inspector.py, app/replay.py): heat colours, the token strip, table
rows, replay alignment and the replay's change. No terminal and no model: traces are built by hand in the shape
core/sampling/trace.py promises."""

from __future__ import annotations

import dataclasses

import pytest
from rich.color import Color, ColorType

from mlxchat.app import inspector
from mlxchat.app.replay import ReplayError, ReplaySource
from mlxchat.core.chat.messages import ChatMessage
from mlxchat.core.sampling.trace import Candidate, TokenTrace

STAGES = ("processed", "TopK(3)", "TopP(0.5)", "Temperature(0.7)")


def make_trace(chosen: int = 0, *, texts: tuple[str, ...] = (" Paris", " Lyon", " the", "\n")) -> TokenTrace:
    """Four candidates through TopK(3) -> TopP(0.5) -> Temperature(0.7): TopK cuts the 4th, TopP the 2nd and 3rd."""
    processed = [0.6, 0.25, 0.1, 0.05]
    probs = [
        {"processed": 0.6, "TopK(3)": 0.632, "TopP(0.5)": 1.0, "Temperature(0.7)": 1.0},
        {"processed": 0.25, "TopK(3)": 0.263, "TopP(0.5)": None, "Temperature(0.7)": None},
        {"processed": 0.1, "TopK(3)": 0.105, "TopP(0.5)": None, "Temperature(0.7)": None},
        {"processed": 0.05, "TopK(3)": None, "TopP(0.5)": None, "Temperature(0.7)": None},
    ]
    removed = [None, "TopP(0.5)", "TopP(0.5)", "TopK(3)"]
    cands = [Candidate(10 + i, texts[i], 5.0 - i, probs[i], removed[i], i == chosen,
                       {"RepetitionPenalty(1.1)": -0.4} if i == 2 else {}) for i in range(4)]
    assert processed[0] == cands[0].probs["processed"]
    return TokenTrace(cands, entropy_before=1.07, entropy_after=0.0, chosen_rank=chosen, stages=STAGES)


def test_heat_levels_shade_the_doubt_and_leave_confident_tokens_plain():
    assert inspector.heat_level(0.99) == 0 and inspector.heat_level(0.9) == 0
    assert inspector.heat_level(0.89) == 1 and inspector.heat_level(0.5) == 2
    assert inspector.heat_level(0.2) == 3 and inspector.heat_level(0.01) == 4
    assert inspector.heat_style(0.95) == inspector.heat_style(1.0)  # unshaded: the theme's own colours
    assert inspector.heat_style(0.95).bgcolor is None


def test_heat_colours_are_exact_in_a_256_colour_terminal_and_readable_on_light_and_dark():
    for _, colour in inspector.HEAT_LEVELS:
        downgraded = Color.parse(colour).downgrade(ColorType.EIGHT_BIT)
        # The 256-colour terminal shows exactly this colour (it is a cube entry), not the nearest of many.
        assert downgraded.get_truecolor() == Color.parse(colour).get_truecolor()
    for prob in (0.05, 0.2, 0.5, 0.8):
        style = inspector.heat_style(prob)
        # Text colour is set with the background, so neither depends on the theme; and it is dark on light shades.
        assert style.color is not None and style.bgcolor is not None
        fg, bg = style.color.get_truecolor(), style.bgcolor.get_truecolor()
        assert _luminance(bg) - _luminance(fg) > 0.4
    # Shades get darker (more alarming) as the probability drops.
    lums = [_luminance(Color.parse(c).get_truecolor()) for _, c in inspector.HEAT_LEVELS]
    assert lums == sorted(lums)


def _luminance(rgb) -> float:
    r, g, b = (c / 255 for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_heat_text_carries_each_token_index_and_marks_the_cursor():
    traces = [make_trace(0), make_trace(1), make_trace(0, texts=("\n", "a", "b", "c"))]
    strip = inspector.pieces(traces)
    assert [p.prob for p in strip] == [1.0, 0.0, 1.0]  # the final stage's probability (cut -> 0)
    text = inspector.heat_text(strip, cursor=1)
    assert text.plain == " Paris Lyon↵\n"
    spans = {text.plain[s.start:s.end]: s.style for s in text.spans}
    assert spans[" Lyon"].meta["token"] == 1 and spans[" Lyon"].reverse
    assert spans[" Lyon"].bgcolor is not None  # shaded: it was unlikely
    assert spans[" Paris"].meta["token"] == 0 and not spans[" Paris"].reverse
    marked = inspector.heat_text(strip, marked=2)
    assert {marked.plain[s.start:s.end]: s.style for s in marked.spans}["↵\n"].bgcolor.name == "#af00d7"


def test_rows_hold_every_stage_and_the_stage_that_cut_each_candidate():
    trace = make_trace(0)
    assert inspector.columns(trace) == ("", "#", "token", "logit", "penalty", "processed", "TopK(3)",
                                        "TopP(0.5)", "Temperature(0.7)", "cut by", "why")
    rows = inspector.rows(trace)
    assert [r.rank for r in rows] == [1, 2, 3, 4]
    assert rows[0].chosen and rows[0].final == 1.0 and rows[0].removed_by is None
    assert rows[1].stages == (0.25, 0.263, None, None) and rows[1].removed_by == "TopP(0.5)"
    assert rows[3].removed_by == "TopK(3)" and rows[3].token == "↵"
    assert rows[2].shift == -0.4
    cells = rows[1].cells()
    assert len(cells) == len(inspector.columns(trace))
    assert cells[0] == " " and cells[2] == " Lyon" and cells[-2] == "TopP(0.5)" and cells[-1] == "outside the nucleus"
    assert cells[5].endswith("25.0%") and cells[7].endswith("cut")
    assert inspector.rows(trace)[0].cells()[0] == "▶" and rows[2].cells()[4] == "-0.40"
    # A chosen token ranked past the K listed comes last, with its own rank.
    late = TokenTrace([dataclasses.replace(trace.candidates[0], chosen=False), *trace.candidates[1:3],
                       dataclasses.replace(trace.candidates[3], chosen=True)], 1.0, 0.5, 10, STAGES)
    assert [r.rank for r in inspector.rows(late)] == [1, 2, 3, 11]
    # With no processor in the chain, the penalty column is left out (of the headers and of every row).
    plain = TokenTrace([dataclasses.replace(c, shifts={}) for c in trace.candidates], 1.0, 0.0, 0, STAGES)
    assert not inspector.has_shifts(plain) and "penalty" not in inspector.columns(plain)
    assert len(inspector.rows(plain)[0].cells(shifts=False)) == len(inspector.columns(plain))


def test_short_stage_names():
    assert [inspector.short_stage(s) for s in STAGES] == ["proc", "TopK 3", "TopP 0.5", "Temp 0.7"]
    assert inspector.short_stage("XTC(0.1, 0.5)") == "XTC 0.1,0.5"
    assert inspector.short_stage("TypicalP(0.9)") == "Typ 0.9"


def test_the_table_fits_the_width_it_is_given():
    """Full stage names and bars when they fit; short names, shorter bars, then none as the panel narrows (issue
    27: at 100 columns "Temperatu…" and "cut by" were cut). The chosen layout fits, and the wider ones do not."""
    trace = make_trace(3)
    widths = [inspector.table_width(trace, d) for d in inspector.DENSITIES]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    for width in range(40, 120):
        density = inspector.fit([trace], width)
        i = inspector.DENSITIES.index(density)
        assert inspector.table_width(trace, density) <= width or density == inspector.DENSITIES[-1]
        assert all(inspector.table_width(trace, d) > width for d in inspector.DENSITIES[:i])
    # Two tables shown together take the layout the wider one fits: here the one with a penalty column.
    plain = TokenTrace([dataclasses.replace(c, shifts={}) for c in trace.candidates], 1.0, 0.0, 3, STAGES)
    width = inspector.table_width(trace, inspector.FULL) - 1
    assert inspector.fit([plain], width) == inspector.FULL and inspector.fit([plain, trace], width) != inspector.FULL
    short = inspector.DENSITIES[-1]
    assert inspector.columns(trace, short)[-4:] == ("TopK 3", "TopP 0.5", "Temp 0.7", "cut by")
    cells = inspector.rows(trace)[1].cells(density=short)
    assert cells[5] == " 25.0%" and cells[-1] == "TopP 0.5"  # no bar; the stage that cut it, short


def test_bars_and_percentages():
    assert inspector.bar(1.0) == "█" * inspector.BAR_WIDTH
    assert inspector.bar(0.0) == " " * inspector.BAR_WIDTH
    assert inspector.bar(None) == " " * inspector.BAR_WIDTH
    assert inspector.bar(0.5, 4) == "██  "
    assert inspector.bar(0.5, 1) == "▌" and inspector.bar(0.04, 4) == "▏   "
    assert inspector.percent(0.0004) == "<0.1%" and inspector.percent(0.5) == "50.0%"
    assert inspector.visible(" ") == "␣" and inspector.visible("\n\n") == "↵↵" and inspector.visible(" a") == " a"


def test_summary_names_entropy_seed_profile_and_chain():
    line = inspector.summary(make_trace(0), index=2, seed=7, profile="chat", sampler="TopK(3) -> sample")
    assert line.startswith("token 3: ' Paris' (100.0%, rank 1)")
    assert "entropy 1.07 → 0.00 nats" in line and "seed 7" in line and "profile chat" in line
    assert line.endswith("TopK(3) -> sample")
    assert "seed –" in inspector.summary(make_trace(0), index=0, seed=None, profile=None, sampler=None)


def test_first_divergence():
    assert inspector.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert inspector.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert inspector.first_divergence([1, 2], [1, 2, 3]) == 2
    assert inspector.first_divergence([], []) is None


def test_perplexity():
    assert inspector.perplexity([make_trace(0)]) == 1.0
    assert inspector.perplexity([]) == 0.0


# --- the replay's plan (app/replay.py) ---------------------------------------------------------------------------

def _source(profile: dict | None = None, seed: int | None = 42) -> ReplaySource:
    return ReplaySource((ChatMessage("system", "Be terse."), ChatMessage("user", "Hi")),
                        profile if profile is not None else {"name": "chat", "temperature": 0.8, "top_p": 0.9},
                        seed, 16)


def test_a_replay_keeps_the_seed_and_changes_one_parameter():
    plan = _source().plan("top_k = 5")
    assert plan.original.seed == plan.changed.seed == 42
    assert plan.original.top_k == 0 and plan.changed.top_k == 5 and plan.change == "top_k=5"
    assert plan.changed.temperature == plan.original.temperature == 0.8
    assert [m.role for m in plan.messages] == ["system", "user"] and plan.max_tokens == 16
    assert _source({"temperature": 0.0}).suggestion() == "temperature=0.8"
    assert _source().suggestion() == "temperature=1.3"


def test_a_bad_change_is_one_line_naming_it():
    for change, says in (("temperature", "name=value"), ("temprature=1", "not a sampling parameter"),
                         ("temperature=9", "temperature must be between 0 and 2"), ("seed=3", "keeps the seed"),
                         ("top_p=0.9", "already")):
        with pytest.raises(ReplayError, match=says):
            _source().plan(change)
    with pytest.raises(ReplayError, match="no longer valid"):
        _source({"temperature": 7}).plan("top_k=2")
