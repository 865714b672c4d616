"""Copying text: to the terminal's clipboard through OSC 52 (which a terminal, or tmux by default, may ignore
without a word), and to the system clipboard through its command-line tool when one is installed; the returned
phrase says which, so the notice never claims a copy it cannot know happened."""

from __future__ import annotations

import os
import shutil
import subprocess

from textual.app import App

# (tool, its command line, the variable its display needs: None for none)
TOOLS: list[tuple[list[str], str | None]] = [
    (["wl-copy"], "WAYLAND_DISPLAY"),
    (["xclip", "-selection", "clipboard"], "DISPLAY"),
    (["xsel", "--clipboard", "--input"], "DISPLAY"),
    (["pbcopy"], None),
]
THROUGH_TERMINAL = "to the clipboard through the terminal (OSC 52); in tmux, `set -g set-clipboard on`"


def system_tool() -> list[str] | None:
    """The first clipboard tool installed whose display is there, as a command line."""
    for command, display in TOOLS:
        if shutil.which(command[0]) and (display is None or os.environ.get(display)):
            return command
    return None


def copy(app: App, text: str) -> str:
    """Copy ``text`` through the terminal and with the system's tool when there is one; return how, e.g. "to the
    clipboard with xclip", for the notice."""
    app.copy_to_clipboard(text)
    if (command := system_tool()) is not None:
        try:
            # No pipes kept: xclip and wl-copy leave a child behind that serves the selection.
            subprocess.run(command, input=text.encode(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=5, check=True)
            return f"to the clipboard with {command[0]}"
        except (OSError, subprocess.SubprocessError):
            pass  # the terminal's copy is still there
    return THROUGH_TERMINAL
