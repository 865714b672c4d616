"""How the chat screen fits the terminal's width (80x24 up to 200+ columns): what shows and how long a line gets.
No Textual: the screen asks these functions on each resize, and the tests ask them directly."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from rich.cells import cell_len

from .formatting import FIELD_SEP

SIDEBAR_MIN_COLUMNS = 100  # narrower, the conversation list (30 columns) would leave the chat too little room
COMPACT_FOOTER_COLUMNS = 120  # narrower, the footer's keys are written compactly (or they are cut off)
PALETTE_IN_FOOTER_COLUMNS = 100  # narrower, the footer leaves out "^p palette" to keep its keys whole
_PARENTHESES = re.compile(r" \([^()]*\)")


def sidebar_shown(columns: int, configured: bool, toggled: bool | None) -> bool:
    """Whether the conversation list shows: as ctrl+b last set it, else config.toml's `sidebar` where the terminal
    is wide enough for it."""
    return toggled if toggled is not None else configured and columns >= SIDEBAR_MIN_COLUMNS


def fit_fields(fields: Sequence[str], width: int) -> str:
    """`fields` (most important first) joined by " · " in at most `width` cells, never cut mid-word: first their
    parenthesised details go ("native q4/q8 (avx2, 2 threads)" -> "native q4/q8"), then the last fields. A first
    field wider than `width` alone is cut at a word and ends with "…"."""
    fields = [f for f in fields if f]
    for candidate in (fields, [_PARENTHESES.sub("", f) for f in fields]):
        line = FIELD_SEP.join(candidate)
        if cell_len(line) <= width:
            return line
    short = [_PARENTHESES.sub("", f) for f in fields]
    while len(short) > 1:
        short.pop()
        line = FIELD_SEP.join(short)
        if cell_len(line) <= width:
            return line
    return _cut_at_word(short[0], width) if short else ""


def _cut_at_word(text: str, width: int) -> str:
    if cell_len(text) <= width:
        return text
    words, out = text.split(" "), ""
    for word in words:
        if cell_len(f"{out} {word}".strip() + "…") > width:
            break
        out = f"{out} {word}".strip()
    return (out or text[:max(width - 1, 0)]) + "…"


def fit_path(path: Path, width: int) -> str:
    """A path in at most `width` cells for a notification: the home folder as ~, the file's name whole, and as much
    of the folder as fits, from its end ("…/mlxchat/exports/chat.md"), so a toast never wraps it mid-name."""
    text = str(path)
    home = str(Path.home())
    if text == home or text.startswith(home + "/"):
        text = "~" + text[len(home):]
    if cell_len(text) <= width:
        return text
    parts = text.split("/")
    kept = [parts[-1]]
    for part in reversed(parts[:-1]):
        if cell_len("…/" + "/".join([part, *kept])) > width:
            break
        kept.insert(0, part)
    return "…/" + "/".join(kept)
