"""The input, the stats bar and the dialogs' plain logic, in a bare Textual app (no engine, no model): issue 12's
items 8, 9, 10, 11, 14 and 16 (MiB)."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from mlxchat.app.formatting import fmt_bytes, live_readouts, stats_line
from mlxchat.app.widgets import ChatInput, StatsBar
from mlxchat.core.events import Metrics


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


class InputApp(App):
    def compose(self) -> ComposeResult:
        yield ChatInput(id="input", history=["first sent", "second sent"])


@pytest.mark.anyio
async def test_up_and_down_move_between_lines_and_reach_history_only_at_the_edges():
    app = InputApp()
    async with app.run_test() as pilot:
        box = app.query_one(ChatInput)
        box.focus()
        await pilot.press(*"one", "ctrl+j", *"two", "ctrl+j", *"three")
        assert box.cursor_location == (2, 5)
        await pilot.press("up")
        assert box.cursor_location[0] == 1 and box.text == "one\ntwo\nthree"  # a line up, not the history
        await pilot.press("up")
        assert box.cursor_location[0] == 0 and box.text == "one\ntwo\nthree"
        await pilot.press("down", "down")
        assert box.cursor_location[0] == 2 and box.text == "one\ntwo\nthree"
        await pilot.press("up", "up", "up")  # from the first line: the history
        assert box.text == "second sent"
        await pilot.press("down")  # back to the draft, whole
        assert box.text == "one\ntwo\nthree"
