"""Screens that tools add to the TUI (F6: the lab), found through the entry-point group ``mlxchat.screens`` as their
subcommands are through ``mlxchat.commands`` (see cli.py): the app opens a tool's screen by name and never imports
the tool itself (docs/architecture.md §1)."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textual.screen import Screen

    from mlxchat.core import Engine

SCREENS_GROUP = "mlxchat.screens"


class ToolScreenUnavailable(LookupError):
    """No tool installed under that name, or its screen failed to load; the message is one line for the user."""


def open_tool_screen(name: str, engine: "Engine", data_dir: Path) -> "Screen":
    """The screen of the tool ``name`` on ``engine``, its files kept under ``data_dir``. An entry point in
    ``mlxchat.screens`` names a function ``open(engine, data_dir) -> Screen``; it is loaded (and its tool imported)
    here, when the key is pressed, not when the app starts."""
    # The same tool can be found twice on the path (an editable and a regular install): either will do.
    found = sorted((ep for ep in entry_points(group=SCREENS_GROUP) if ep.name == name), key=lambda ep: ep.value)
    if not found:
        raise ToolScreenUnavailable(f"the {name} screen is not installed (no entry point {name!r} in "
                                    f"{SCREENS_GROUP}): reinstall mlxchat")
    try:
        return found[0].load()(engine, data_dir)
    except Exception as e:  # noqa: BLE001 - a broken tool is reported in one line; the chat goes on
        raise ToolScreenUnavailable(f"the {name} screen could not be opened from {found[0].value} "
                                    f"({type(e).__name__}: {e})") from e
