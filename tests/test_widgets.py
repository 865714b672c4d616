"""The input, the stats bar and the dialogs' plain logic, in a bare Textual app (no engine, no model): issue 12's
items 8, 9, 10, 11, 14 and 16 (MiB)."""

from __future__ import annotations

import pytest
from pathlib import Path

from textual.app import App, ComposeResult
from textual.widgets import Input, Markdown

from mlxchat.app.formatting import fmt_bytes, live_readouts, stats_line
from mlxchat.app.models import EMBEDDED, ModelPick, to_remember
from mlxchat.app.screens import ModelPicker
from mlxchat.app.widgets import ChatInput, StatsBar
from mlxchat.core.decode.events import Metrics
from mlxchat.core.sampling.profile import ProfileStore, SamplingProfile


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


# --- the stats bar -----------------------------------------------------------------------------------------------

METRICS = Metrics(prompt_tokens=5413, cached_tokens=1024, completion_tokens=312, ttft_s=1.98, tpot_s=0.0494,
                  prefill_s=1.5, decode_s=15.4, peak_memory_bytes=525 * 2**20, context_tokens=5725,
                  context_limit=8192, kv_window=4096)


class BarApp(App):
    CSS_PATH = "../app/app.tcss"  # the app's own widths for the bar's parts

    def compose(self) -> ComposeResult:
        yield StatsBar(id="stats")


def rendered(widget) -> str:
    """The text the widget draws, row by row, as the terminal would show it."""
    return "\n".join(strip.text for strip in widget.render_lines(widget.size.region))


@pytest.mark.anyio
@pytest.mark.parametrize("columns", [120, 80, 60])
async def test_every_readout_is_shown_at_narrow_widths(columns: int):
    app = BarApp()
    async with app.run_test(size=(columns, 6)) as pilot:
        bar = app.query_one(StatsBar)
        bar.show_profile("chat")
        bar.show_metrics(METRICS)
        await pilot.pause()
        shown = rendered(bar.query_one("#stats-readouts"))
        flat = " ".join(shown.split())
        for part in ("TTFT", "TPOT", "tok/s", "in 5413", "out 312", "ctx 5725/8192", "mem 525"):
            assert part in flat, (columns, part, shown)
        assert "MiB" in flat and "MB" not in flat.replace("MiB", "")
        assert ("\n" in shown.strip()) == (columns < 120)  # narrow bars wrap onto a second row, never cut
        bar.show_state("idle", "● ready", "SmolLM2 · context 8192")  # a new chat: the last reply's numbers go
        await pilot.pause()
        assert bar.metrics is None and bar.readouts == "SmolLM2 · context 8192"


def test_readouts_are_compact_only_when_the_full_form_does_not_fit():
    full = live_readouts(METRICS)
    assert full == live_readouts(METRICS, len(full))
    compact = live_readouts(METRICS, len(full) - 1)
    assert len(compact) < len(full) and "out 312" in compact and "mem 525MiB" in compact


@pytest.mark.anyio
async def test_prefill_progress_is_one_consistent_readout():
    app = BarApp()
    async with app.run_test(size=(120, 6)) as pilot:
        bar = app.query_one(StatsBar)
        bar.show_prefill(1024, 5413, cached=1024)  # nothing prefilled yet: the cached tokens are not progress
        await pilot.pause()
        state = str(bar.query_one("#stats-state").content)
        # "prefill" once: the state says it ("prefill 20% prefill 512/2513" read twice).
        assert state == "▷ prefill 0%" and bar.readouts == "0/4389 new tokens · 1024 cached · prompt 5413"
        bar.show_prefill(3219, 5413, cached=1024)
        assert str(bar.query_one("#stats-state").content) == "▷ prefill 50%"
        assert bar.readouts.startswith("2195/4389 new tokens")
        bar.show_prefill(300, 600)
        assert bar.readouts == "300/600 new tokens"


def test_memory_is_in_binary_units_everywhere():
    assert fmt_bytes(525 * 2**20) == "525 MiB" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 * 2**30) == "3.0 GiB"
    assert "peak 525 MiB" in stats_line(METRICS)


# --- the model picker (item 13, and item 17's F3 pull) -------------------------------------------------------------

class PickerApp(App):
    CSS_PATH = "../app/app.tcss"

    def __init__(self, saved: list[tuple[str, str]], current: str | None) -> None:
        super().__init__()
        self.saved, self.current, self.results = saved, current, []

    def on_mount(self) -> None:
        self.push_screen(ModelPicker(lambda: list(self.saved), self.saved.remove, self.current,
                                     scan_hf_cache=False), self.results.append)


@pytest.mark.anyio
async def test_the_picker_keeps_nothing_that_has_not_loaded_and_does_not_reload_the_current_model(tmp_path: Path):
    fake = tmp_path / "x.gguf"
    fake.write_text("just text\n")
    real = tmp_path / "real.gguf"
    real.write_bytes(b"GGUF" + bytes(28))  # the picker checks the magic; loading checks the rest
    app = PickerApp([], current=None)
    async with app.run_test(size=(100, 40)) as pilot:
        picker = app.screen
        field = picker.query_one("#model-path", Input)
        field.value = str(fake)
        picker.action_add()
        assert "not a GGUF file" in str(picker.query_one("#model-error").content)
        field.value = str(real)
        picker.action_add()
        assert [c.spec for c in picker.choices] == [None, str(real.resolve())]
        assert "kept once it loads" in picker.choices[1].detail
        assert app.saved == []  # nothing stored until the screen has loaded it
        picker.action_load()
        await pilot.pause()
        assert app.results == [ModelPick(picker.choices[1], already_loaded=False)]
    # The embedded model is loaded: choosing it again is a pick the screen ignores, not a reload.
    app = PickerApp([], current=None)
    async with app.run_test(size=(100, 40)) as pilot:
        app.screen.action_load()
        await pilot.pause()
        assert app.results == [ModelPick(EMBEDDED, already_loaded=True)]


def test_only_a_loaded_local_path_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    snapshot = tmp_path / "hub" / "models--a--b" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert to_remember(str(model)) == (str(model.resolve()), "m.gguf")
    assert to_remember(None) is None and to_remember("org/name") is None and to_remember(str(snapshot)) is None


@pytest.mark.anyio
async def test_a_pull_that_cannot_reach_the_hub_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    app = PickerApp([], current=None)
    async with app.run_test(size=(100, 40)) as pilot:
        picker = app.screen
        picker.query_one("#model-repo", Input).value = "mlxchat-test/absent"
        picker.action_pull()
        error = picker.query_one("#model-error")
        for _ in range(100):
            await pilot.pause(0.05)
            if "cannot be reached" in str(error.content):
                break
        assert str(error.content) == ("mlxchat-test/absent: the Hugging Face hub cannot be reached (offline?); "
                                      "try again with a network")
        assert not picker.query_one("#model-pull").disabled


# --- the profile dialog (items 14 and 16) --------------------------------------------------------------------------

@pytest.mark.anyio
async def test_the_profile_dialog_shows_every_error_at_once_wrapped_whole(tmp_path: Path, profile_app):
    app = profile_app(ProfileStore(tmp_path / "profiles"))
    async with app.run_test(size=(90, 50)) as pilot:
        picker = app.screen
        picker.query_one("#field-temperature", Input).value = "abc"
        picker.query_one("#field-top_k", Input).value = "-1"
        picker.query_one("#field-min_p", Input).value = "2"
        picker.query_one("#field-stop", Input).value = "[broken"
        await pilot.pause()
        assert set(picker.errors) == {"temperature", "top_k", "min_p", "stop"}
        for name in picker.errors:
            widget = picker.query_one(f"#error-{name}")
            shown = " ".join(rendered(widget).split())
            assert shown == " ".join(picker.errors[name].split()), (name, shown)  # every word, none cut
        assert picker.query_one("#error-min_p").size.height >= 2  # the long one wraps
        assert picker.edited is None and picker.query_one("#profile-use").disabled


@pytest.mark.anyio
async def test_the_profile_dialog_edits_llama_cpp_samplers_with_inline_errors(tmp_path: Path, profile_app):
    """Issue 39's parameters in the editor: bad values get the field, the value and the range next to the field;
    good ones reach the edited profile and its printed chain."""
    app = profile_app(ProfileStore(tmp_path / "profiles"))
    async with app.run_test(size=(90, 60)) as pilot:
        picker = app.screen
        picker.query_one("#field-dry_multiplier", Input).value = "-1"
        picker.query_one("#field-dry_base", Input).value = "1"
        picker.query_one("#field-mirostat_tau", Input).value = "0"
        picker.query_one("#field-dry_sequence_breakers", Input).value = '["\\n", 3]'
        await pilot.pause()
        assert picker.errors == {
            "dry_multiplier": "dry_multiplier must be at least 0 (0 disables), got -1.0",
            "dry_base": "dry_base must be greater than 1, got 1.0",
            "mirostat_tau": "mirostat_tau must be greater than 0, got 0.0",
            "dry_sequence_breakers": "dry_sequence_breakers must be a list of non-empty strings, got 3"}
        assert "got -1.0" in rendered(picker.query_one("#error-dry_multiplier"))
        for name, value in (("dry_multiplier", "0.8"), ("dry_base", "1.75"), ("mirostat_tau", "5"),
                            ("dry_sequence_breakers", '["\\n", ":"]'), ("top_n_sigma", "1.5")):
            picker.query_one(f"#field-{name}", Input).value = value
        await pilot.pause()
        assert not picker.errors
        assert picker.edited.dry_sequence_breakers == ["\n", ":"]
        assert "DRY(0.8, 1.75, 2, -1)" in rendered(picker.query_one("#profile-chain"))
        assert "TopNSigma(1.5)" in rendered(picker.query_one("#profile-chain"))


@pytest.mark.anyio
async def test_a_profile_saved_from_a_preset_does_not_claim_its_description(tmp_path: Path, profile_app):
    store = ProfileStore(tmp_path / "profiles")
    app = profile_app(store)
    async with app.run_test(size=(90, 50)) as pilot:
        picker = app.screen
        picker.query_one("#field-temperature", Input).value = "0.3"
        await pilot.pause()
        assert picker.edited.description == "based on the chat preset"
        picker.action_save_as()
        await pilot.pause()
        await pilot.press("enter")  # the suggested name
        await pilot.pause()
    (name,) = store.list()
    assert store.load(name).description == "based on the chat preset"
    assert SamplingProfile.preset("chat").description not in ("", "based on the chat preset")


@pytest.mark.anyio
async def test_a_preset_name_is_refused_in_the_form_and_a_free_one_proposed(tmp_path: Path, profile_app):
    """F2, edit `precise`, ctrl+s: the proposed name is not "precise" (a saved "precise" would sit in the list
    beside the preset and `--profile precise` would never use it); typing it anyway is refused in one line."""
    store = ProfileStore(tmp_path / "profiles")
    app = profile_app(store)
    async with app.run_test(size=(90, 50)) as pilot:
        picker = app.screen
        picker.load_form(SamplingProfile.preset("precise"))
        picker.query_one("#field-temperature", Input).value = "0.3"
        await pilot.pause()
        await pilot.press("ctrl+s")
        prompt = app.screen
        assert prompt.query_one(Input).value == "precise-2"
        prompt.query_one(Input).value = "precise"
        await pilot.press("enter")
        await pilot.pause()
        # Issue 37 item 12: the dialog stays open with the name and says what is wrong under it (it used to close and
        # lose the name, with a toast).
        assert app.screen is prompt and store.list() == [] and prompt.query_one(Input).value == "precise"
        refusal = str(prompt.query_one("#prompt-error").content)
        assert refusal == "'precise' is a preset's name; save it under another, e.g. 'precise-2'"
        prompt.query_one(Input).value = "my/profile"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is prompt and "got 'my/profile'" in str(prompt.query_one("#prompt-error").content)
        prompt.query_one(Input).value = "precise-2"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is picker
    assert store.list() == ["precise-2"] and store.load("precise-2").temperature == 0.3


@pytest.mark.anyio
async def test_tab_from_the_profile_list_goes_to_the_first_field(tmp_path: Path, profile_app):
    app = profile_app(ProfileStore(tmp_path / "profiles"))
    async with app.run_test(size=(90, 50)) as pilot:
        app.screen.query_one("#profile-list").focus()
        await pilot.press("tab")  # not an invisible stop (the scrolling form) first
        assert app.focused is app.screen.query_one("#field-temperature", Input)


@pytest.mark.anyio
async def test_ctrl_c_in_the_input_copies_a_selection_and_otherwise_only_says_how_to_quit():
    """Textual 8's ctrl+c, kept as it is (documented in the report): the terminal is in raw mode, so ctrl+c is a
    key, not SIGINT; it copies the selection, and with none the app says which key quits. It never quits."""
    app = InputApp()
    async with app.run_test() as pilot:
        box = app.query_one(ChatInput)
        box.focus()
        await pilot.press(*"hello")
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.is_running and any("to quit" in n.message for n in app._notifications)
        box.select_all()
        await pilot.press("ctrl+c")
        assert app.clipboard == "hello" and box.text == "hello"


# --- the streaming reply's Markdown --------------------------------------------------------------------------------

def test_a_streaming_replys_blocks_close_when_the_next_one_starts() -> None:
    from mlxchat.app.widgets.transcript import closed_length

    assert closed_length("A paragraph being writ") == 0
    assert closed_length("## Title\n\nA para") == len("## Title\n\n")
    assert closed_length("1. one\n\n2. two") == 0  # one list: its next item may still come
    assert closed_length("```python\nx = 1\n\ny = 2") == 0  # an open fence runs to the end, blank lines and all
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n\nAfter"
    assert text[:closed_length(text)].endswith("| 1 | 2 |\n\n")


class ReplyApp(App):
    """An app showing one assistant reply (with `text` so far), for the streaming tests."""

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self.reply_text = text

    def compose(self) -> ComposeResult:
        from mlxchat.app.widgets.transcript import MessageView

        yield MessageView("assistant", self.reply_text, streaming=True)


def _count_layouts(app: App) -> list[int]:
    """A one-item list counting the screen's layout passes from now on (Textual's private hook, for these tests)."""
    layouts = [0]
    refresh_layout = app.screen._refresh_layout

    def count(*a, **kw):
        layouts[0] += 1
        return refresh_layout(*a, **kw)

    app.screen._refresh_layout = count  # type: ignore[method-assign]
    return layouts


@pytest.mark.anyio
async def test_a_rich_reply_streams_without_a_layout_a_batch_and_ends_as_textuals_own_markdown():
    """Issue 37 item 11: a reply with a table and code blocks streamed into one Markdown widget re-rendered its open
    block on every batch. Now the open block is plain text that keeps room below it, closed blocks are mounted once
    (code blocks and tables as text, until the end), and the finished reply is Textual's Markdown of the whole."""
    from textual.widgets import Markdown

    from mlxchat.app.widgets.transcript import MessageView, OpenBlock
    from mlxchat.bench.cases import MARKDOWN_REPLY

    class SideBySide(App):
        def compose(self) -> ComposeResult:
            yield MessageView("assistant", "", streaming=True)
            yield Markdown(MARKDOWN_REPLY, id="plain")

    app = SideBySide()
    async with app.run_test(size=(80, 200)) as pilot:
        view = app.query_one(MessageView)
        layouts = _count_layouts(app)
        batches = [MARKDOWN_REPLY[i:i + 12] for i in range(0, len(MARKDOWN_REPLY), 12)]
        for batch in batches:
            await view.write(batch)
            await pilot.pause()
        assert layouts[0] < len(batches) / 3, (layouts[0], len(batches))
        closed = [w for w in view.query(".closed-block")]
        assert closed and any("closed-text" in w.classes for w in closed)  # a code block, as its text for now
        assert view.text == MARKDOWN_REPLY and MARKDOWN_REPLY.endswith(view.query_one(OpenBlock).text)
        await view.finish(MARKDOWN_REPLY, "stats")
        await pilot.pause()
        assert not view.query(OpenBlock) and not view.query(".closed-block")
        body, plain = view.query_one(".body", Markdown), app.query_one("#plain", Markdown)
        assert [type(b) for b in body.children] == [type(b) for b in plain.children]
        assert [rendered(b) for b in body.children] == [rendered(b) for b in plain.children]


@pytest.mark.anyio
async def test_a_reply_that_grows_needs_no_layout_in_its_room_and_one_past_it():
    """Textual lays the screen out again after a widget's size changes (and asked for a second pass after that):
    a streaming reply keeps room below its text, repaints in place while it fits, and needs one layout past it."""
    from mlxchat.app.widgets.transcript import MessageView, OpenBlock

    app = ReplyApp()
    async with app.run_test(size=(60, 30)) as pilot:
        view = app.query_one(MessageView)
        await view.write("One line.")
        await pilot.pause()
        layouts = _count_layouts(app)
        await view.write(" Then enough words to need a second line and a third one too, in sixty columns.")
        await pilot.pause()
        await pilot.pause()
        assert layouts[0] == 0 and view.text.startswith("One line. Then")
        room = view.query_one(OpenBlock).size.height
        assert room >= view.query_one(OpenBlock).slack() >= 2
        await view.write("\nA line of the same paragraph." * room)  # one block: nothing closes
        await pilot.pause()
        await pilot.pause()
        assert layouts[0] == 1 and view.query_one(OpenBlock).size.height > room


@pytest.mark.anyio
async def test_a_reply_streams_below_its_question_without_moving_the_screen_and_keeps_it_still_at_the_end():
    """Every line a reply added at the end of the transcript scrolled the screen: a layout and a full repaint, ~10 ms
    of the UI thread that decoding loses. Now the reply takes the screen below its question at once (the question
    at the top), fills it with no layout, and keeps that room after its end until the next message is sent."""
    from mlxchat.app.widgets.transcript import MessageView, OpenBlock, Transcript

    class Chat(App):
        CSS_PATH = "../app/app.tcss"

        def compose(self) -> ComposeResult:
            yield Transcript(id="transcript")

    app = Chat()
    async with app.run_test(size=(60, 24)) as pilot:
        transcript = app.query_one(Transcript)
        for n in range(6):  # an earlier exchange, taller than the screen
            await transcript.add(MessageView("user" if n % 2 == 0 else "assistant", f"Message {n}.\n" * 3))
        question = MessageView("user", "A question?")
        reply = MessageView("assistant", "", streaming=True)
        await transcript.append(question, reply)
        await pilot.pause()
        await pilot.pause()
        viewport = transcript.scrollable_content_region
        assert question.region.y == viewport.y  # the question at the top, the reply below it to the bottom
        assert reply.region.bottom <= viewport.bottom
        layouts = _count_layouts(app)
        lines = viewport.height - question.outer_size.height - 4  # fits below the question
        for n in range(lines):
            await reply.write(f"Line {n} of the reply.\n")
            await pilot.pause()
        assert layouts[0] == 0 and question.region.y == viewport.y
        block = reply.query_one(OpenBlock)
        assert block.text == reply.text and len(reply.text.splitlines()) == lines
        await pilot.resize_terminal(60, 23)  # a row less (the stats bar wraps at 80 columns once a reply decodes)
        await pilot.pause()
        await pilot.pause()
        assert question.region.y == transcript.scrollable_content_region.y  # measured again: the question stays
        await pilot.resize_terminal(60, 24)
        await pilot.pause()
        await pilot.pause()
        layouts[0] = 0
        for n in range(viewport.height):  # past the screen: a layout per third of the screen, not per line
            await reply.write(f"More {n}.\n")
            await pilot.pause()
        assert 1 <= layouts[0] <= 4
        await reply.finish(reply.text, "stats")
        await pilot.pause()
        viewport = transcript.scrollable_content_region
        assert reply.region.bottom <= viewport.bottom  # past the screen, it ends at the bottom: no room kept below
        short = MessageView("assistant", "", streaming=True)
        await transcript.append(MessageView("user", "Again?"), short)
        await pilot.pause()
        await pilot.pause()
        await short.write("A short reply.")
        await pilot.pause()
        height = short.outer_size.height
        await short.finish("A short reply.", "stats")
        await pilot.pause()
        assert short.outer_size.height == height  # a reply that fits keeps its room: the screen stays still
        await transcript.add(MessageView("user", "Next."))
        await pilot.pause()
        assert short.outer_size.height < height  # the next message takes the room back


@pytest.mark.anyio
async def test_a_reply_shown_again_mid_stream_keeps_what_came_and_appends_the_rest():
    """The chat screen rebuilds a streaming reply's view from its text so far, then streams on into it."""
    from mlxchat.app.widgets.transcript import MessageView, OpenBlock

    app = ReplyApp("Hello")
    async with app.run_test(size=(60, 20)):
        view = app.query_one(MessageView)
        for batch in (",", " world", "!"):
            await view.write(batch)
        assert view.text == "Hello, world!" == view.query_one(OpenBlock).text
        await view.write(" Again.")
        assert view.text == "Hello, world! Again."
        await view.finish(view.text, "")
        assert view.query_one(".body", Markdown).source == "Hello, world! Again."


@pytest.mark.anyio
async def test_a_streamed_reply_with_bracketed_text_is_measured_as_the_text_it_shows():
    """The open block shows its text plain (markup off) and must measure it so: read as markup, "[/b]" raised
    MarkupError mid-stream and `row["name"]` lost its brackets from the measured width."""
    from mlxchat.app.widgets.transcript import MessageView, OpenBlock

    app = ReplyApp()
    async with app.run_test(size=(40, 30)) as pilot:
        view = app.query_one(MessageView)
        await view.write("First.")
        await pilot.pause()
        text = 'First. Close a tag: [/b] and index it: print(row["name"], row["age"]) [bold]x'
        await view.write(text.removeprefix("First."))
        await pilot.pause()
        block = view.query_one(OpenBlock)
        assert block.text == text and block.size.height >= 3
