"""How the chat screen fits the terminal (issue 37 item 10): the plain functions the screen asks on each resize.
The screen itself at 80, 120 and 200 columns: tests/test_tui.py (assertions and snapshots)."""

from __future__ import annotations

from pathlib import Path

from mlxchat.app.layout import fit_fields, fit_path, sidebar_shown

STATE = ["SmolLM2-135M-Instruct.Q4_1", "llama Q4_1", "context 8192", "native q4/q8 (avx512-vnni fixed24, 2 threads)",
         "decode: 30/30 layers fused"]


def test_the_sidebar_shows_where_there_is_room_unless_ctrl_b_said_otherwise() -> None:
    assert sidebar_shown(120, True, None) and not sidebar_shown(80, True, None)
    assert not sidebar_shown(200, False, None)
    assert sidebar_shown(80, True, True) and not sidebar_shown(200, True, False)


def test_the_state_line_drops_details_then_fields_and_never_cuts_a_word() -> None:
    assert fit_fields(STATE, 200) == " · ".join(STATE)
    # At 120 columns the line was cut mid-word ("native q4/q8 (avx512-vnni fixed24, 2"): the details go first.
    assert fit_fields(STATE, 105) == ("SmolLM2-135M-Instruct.Q4_1 · llama Q4_1 · context 8192 · native q4/q8 · "
                                      "decode: 30/30 layers fused")
    assert fit_fields(STATE, 70) == "SmolLM2-135M-Instruct.Q4_1 · llama Q4_1 · context 8192 · native q4/q8"
    assert fit_fields(STATE, 50) == "SmolLM2-135M-Instruct.Q4_1 · llama Q4_1"
    assert fit_fields(["a very long model name indeed"], 16) == "a very long…"
    words = set(" · ".join(STATE).split())  # every word whole, never a piece of one
    for width in range(len(STATE[0]), 140):  # narrower, the name alone is cut (with "…")
        line = fit_fields(STATE, width)
        assert len(line) <= width and set(line.rstrip("…").split()) <= words | {"native", "q4/q8"}


def test_a_path_in_a_toast_keeps_its_file_name_whole(tmp_path: Path) -> None:
    home = Path.home()
    path = home / ".local/share/mlxchat/exports/capital-of-france-20261203-101500.md"
    assert fit_path(path, 80) == "~/.local/share/mlxchat/exports/capital-of-france-20261203-101500.md"
    short = fit_path(path, 50)
    assert len(short) <= 50 and short.endswith("/capital-of-france-20261203-101500.md") and short.startswith("…/")
    assert fit_path(Path("/tmp/x.md"), 50) == "/tmp/x.md"
