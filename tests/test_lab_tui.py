"""The lab screen in a Pilot: a real run on the embedded model with live progress, the metrics table, browsing,
and blind A/B votes stored with the run; and F6 opening it in the app through its entry point."""

from __future__ import annotations

import random

import pytest
from textual.app import App
from textual.widgets import DataTable, Input, ProgressBar, Select, Static

from mlxchat.lab.screen import LabScreen
from mlxchat.lab.store import LabStore


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_lab_screen_runs_browses_and_votes(engine, tmp_path):
    store = LabStore(tmp_path / "lab.db")
    screen = LabScreen(engine, store)

    class LabApp(App):
        def on_mount(self) -> None:
            self.push_screen(screen)

    async with LabApp().run_test(size=(120, 45)) as pilot:
        screen.query_one("#set", Select).value = "factual"
        screen.query_one("#seeds", Input).value = "1"
        screen.query_one("#max_tokens", Input).value = "6"
        screen.query_one("#limit", Input).value = "2"
        screen.query_one("#seeds", Input).value = "x"
        await pilot.press("ctrl+r")
        assert "whole numbers" in str(screen.query_one("#status", Static).render())
        screen.query_one("#seeds", Input).value = "1"
        await pilot.press("ctrl+r")
        await screen.workers.wait_for_complete()
        await pilot.pause()
        assert not screen.running
        run = screen.session.run
        assert run.status == "done" and len(run.outputs) == 4  # 2 prompts x 2 profiles x 1 seed
        assert screen.query_one(ProgressBar).progress == 4
        table = screen.query_one("#metrics", DataTable)
        assert table.row_count == 2
        assert str(table.get_row_at(0)[0]) == "precise"
        assert table.virtual_size.width <= table.size.width  # issue 37: every column, interval and finish, at 120
        assert "capital-france" in str(screen.query_one("#prompt", Static).render())
        await pilot.press("right_square_bracket")
        assert "capital-japan" in str(screen.query_one("#prompt", Static).render())

        screen.session.start_ab(random.Random(1))
        screen.show_pair("blind")
        await pilot.press("f1", "f4")
        votes = store.votes(run.id)
        assert [v["choice"] for v in votes] == ["left", "skip"]
        assert "win rate" in str(screen.query_one("#status", Static).render())


@pytest.mark.anyio
async def test_f6_opens_the_lab_through_its_entry_point(tmp_path, new_app, ready):
    app = new_app()
    async with app.run_test(size=(160, 45)) as pilot:
        chat = await ready(pilot)
        assert app.focused is chat.input  # F6 from the input too (where TextArea binds it to "select line")
        await pilot.press("f6")
        await pilot.pause()
        assert isinstance(app.screen, LabScreen)
        assert app.screen.engine is chat.controller.engine
        assert app.screen.session.store.path == tmp_path / "data" / "lab.db"  # the app's data folder
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is chat
