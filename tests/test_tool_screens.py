"""Tools' screens found through the `mlxchat.screens` entry points (app/tool_screens.py): a missing or broken one is
one line for the user, never a traceback. The installed lab is opened by F6 in tests/test_lab_tui.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxchat.app.tool_screens import SCREENS_GROUP, ToolScreenUnavailable, open_tool_screen


def _install(site: Path, entry_point: str) -> None:
    """A distribution on ``site`` whose only entry point is ``entry_point`` in the screens group."""
    info = site / "broken_tool-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-tool\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{SCREENS_GROUP}]\n{entry_point}\n")


def test_a_screen_no_tool_provides_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ToolScreenUnavailable) as caught:
        open_tool_screen("no-such-tool", None, tmp_path)  # type: ignore[arg-type] - never reaches an engine
    assert str(caught.value) == ("the no-such-tool screen is not installed (no entry point 'no-such-tool' in "
                                 "mlxchat.screens): reinstall mlxchat")


@pytest.mark.parametrize(("target", "error"), [
    ("mlxchat_no_such_module:open_screen", "ModuleNotFoundError"),  # the tool cannot be imported
    ("json:loads", "TypeError"),  # it loads, but opening the screen fails
])
def test_a_broken_tool_screen_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str,
                                          error: str) -> None:
    _install(tmp_path, f"broken = {target}")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ToolScreenUnavailable) as caught:
        open_tool_screen("broken", None, tmp_path)  # type: ignore[arg-type] - never reaches an engine
    message = str(caught.value)
    assert message.startswith(f"the broken screen could not be opened from {target} ({error}: ")
    assert "\n" not in message
