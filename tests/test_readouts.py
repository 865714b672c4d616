"""Issue 27 items 6 and 8, without the model: the stats line under a reply (a one-token prefill, wrapping between
fields only), the profile form (fields that stay put, a description that follows the edits) and how a copy is
made and said."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Input, Static

from mlxchat.app import clipboard
from mlxchat.app.formatting import stats_line, wrap_fields
from mlxchat.app.widgets import MessageView
from mlxchat.core.sampling.profile import ProfileStore, SamplingProfile


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


METRICS = {"prompt_tokens": 30, "cached_tokens": 29, "completion_tokens": 12, "ttft_s": 0.14, "tpot_s": 0.03,
           "prefill_s": 0.14, "peak_memory_bytes": 118 * 2**20, "context_tokens": 42, "context_limit": 8192}


def test_a_one_token_prefill_has_no_rate():
    line = stats_line(METRICS, "stop")
    assert "prompt 30 tok (29 cached, 1 new token)" in line and "tok/s ·" not in line.split("prompt")[1]
    assert "(1 new token)" in stats_line({**METRICS, "prompt_tokens": 1, "cached_tokens": 0})
    assert "prompt 30 tok (20 cached) at 71 tok/s" in stats_line({**METRICS, "cached_tokens": 20, "prefill_s": 0.14})


def test_a_stats_line_wraps_only_between_fields():
    line = stats_line(METRICS, "stop", "chat")
    for width in range(12, len(line) + 1):
        rows = wrap_fields(line, width)
        assert " · ".join(rows) == line
        fields = [field for row in rows for field in row.split(" · ")]
        assert fields == line.split(" · ") and "peak 118 MiB" in fields  # each field whole, on one row
        assert all(len(r) <= width or " · " not in r for r in rows), width  # only a lone field may be wider
    assert wrap_fields(line, len(line)) == [line]


class ReplyApp(App):
    def compose(self) -> ComposeResult:
        yield MessageView("assistant", "Hi.", stats=stats_line(METRICS, "stop", "chat"))


@pytest.mark.anyio
async def test_the_saved_stats_line_keeps_each_value_with_its_unit():
    app = ReplyApp()
    async with app.run_test(size=(40, 20)) as pilot:
        await pilot.pause()
        stats = app.query_one(MessageView).query_one(".stats")
        # What the terminal shows, row by row: every field whole on one row.
        shown = [strip.text.rstrip() for strip in stats.render_lines(stats.size.region)]
        assert len(shown) > 1 and " · ".join(shown) == stats_line(METRICS, "stop", "chat")
        assert any(row.endswith("peak 118 MiB") or "peak 118 MiB ·" in row for row in shown)


@pytest.mark.anyio
async def test_the_profile_form_stays_put_when_an_error_shows(tmp_path: Path, profile_app):
    app = profile_app(ProfileStore(tmp_path / "profiles"))
    async with app.run_test(size=(180, 50)) as pilot:  # wide enough for the error on one row
        picker = app.screen
        await pilot.pause()
        before = {name: picker.query_one(f"#field-{name}").region.y for name in ("top_p", "stop")}
        picker.query_one("#field-temperature", Input).value = "abc"
        await pilot.pause()
        assert "temperature" in picker.errors and picker.query_one("#error-temperature").size.height == 1
        assert {name: picker.query_one(f"#field-{name}").region.y for name in ("top_p", "stop")} == before


@pytest.mark.anyio
async def test_the_profile_description_follows_the_edits(tmp_path: Path, profile_app):
    app = profile_app(ProfileStore(tmp_path / "profiles"))
    preset = SamplingProfile.preset("chat")
    async with app.run_test(size=(120, 50)) as pilot:
        picker = app.screen
        description = picker.query_one("#profile-description", Static)
        await pilot.pause()
        assert str(description.content) == f"chat: {preset.description}"
        picker.query_one("#field-temperature", Input).value = "0.3"
        await pilot.pause()
        assert str(description.content) == "chat edited: based on the chat preset"
        picker.query_one("#field-temperature", Input).value = "abc"  # edited, not valid: still not the preset's
        await pilot.pause()
        assert str(description.content) == "chat edited: based on the chat preset"
        picker.query_one("#field-temperature", Input).value = f"{preset.temperature:g}"  # back to the preset
        await pilot.pause()
        assert str(description.content) == f"chat: {preset.description}"


class CopyApp(App):
    pass


@pytest.mark.anyio
async def test_a_copy_says_how_it_was_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in ("WAYLAND_DISPLAY", "DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    app = CopyApp()
    async with app.run_test():
        assert clipboard.copy(app, "one") == clipboard.THROUGH_TERMINAL and app.clipboard == "one"
        assert "OSC 52" in clipboard.THROUGH_TERMINAL and "set-clipboard on" in clipboard.THROUGH_TERMINAL
        # A system tool on PATH (here a stand-in for macOS's pbcopy that keeps what it is given) gets the text too.
        tool = tmp_path / "pbcopy"
        tool.write_text(f"#!/bin/sh\n/bin/cat > {tmp_path / 'copied'}\n")
        tool.chmod(0o755)
        assert clipboard.copy(app, "two") == "to the clipboard with pbcopy"
        assert (tmp_path / "copied").read_text() == "two" and app.clipboard == "two"
