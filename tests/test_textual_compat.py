"""app/textual_compat.py: the Textual internals the app uses, behind one module that checks the installed Textual
against the range it was written for (pyproject.toml's pin) and degrades where a helper's internal is gone."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import textual
from textual.app import App
from textual.widget import Widget

from mlxchat.app import textual_compat as compat


@pytest.mark.parametrize(("version", "parsed"), [("8.2.6", (8, 2, 6)), ("9.0.0rc1", (9, 0, 0)), ("8.3", (8, 3, 0)),
                                                 ("8.10.1+local.2", (8, 10, 1))])
def test_release_reads_the_numbers_of_a_version(version: str, parsed: tuple[int, int, int]) -> None:
    assert compat.release(version) == parsed


@pytest.mark.parametrize("version", ["8.2.6", "8.2.8", "8.10.0"])
def test_the_pinned_major_version_is_accepted(version: str) -> None:
    compat.check_version(version)


@pytest.mark.parametrize("version", ["8.2.5", "7.5.0", "9.0.0", "9.0.0rc1", "10.1.0"])
def test_a_textual_outside_the_pin_is_refused_with_what_to_install(version: str) -> None:
    with pytest.raises(compat.TextualVersionError) as caught:
        compat.check_version(version)
    assert str(caught.value) == (f"mlxchat's TUI needs textual>=8.2.6,<9 (app/textual_compat.py uses Textual "
                                 f"internals written for it); found textual {version}: pip install "
                                 f"'textual>=8.2.6,<9'")


def test_the_installed_textual_is_in_range_and_the_range_is_pyprojects_pin() -> None:
    compat.check_version(textual.__version__)
    low, high = compat.SUPPORTED
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert f"textual>={'.'.join(map(str, low))},<{high[0]}" in project["dependencies"]


def test_one_layout_applies_only_while_size_updated_takes_the_layout_flag() -> None:
    class Renamed:
        def _size_updated(self, size: Any, virtual_size: Any, container_size: Any) -> bool:
            return True

    assert compat.size_updated_takes_layout(Widget)
    assert not compat.size_updated_takes_layout(Renamed)
    assert not compat.size_updated_takes_layout(object)
    assert "_size_updated" in vars(compat.OneLayout)  # on the installed Textual the override is in place


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_keymap_reads_what_set_keymap_put_in_force() -> None:
    app = App()
    async with app.run_test():
        assert compat.keymap(app) == {}
        app.set_keymap({"send": "ctrl+s"})
        assert compat.keymap(app) == {"send": "ctrl+s"}
        app.update_keymap({"stop": "f12"})
        assert compat.keymap(app) == {"send": "ctrl+s", "stop": "f12"}
