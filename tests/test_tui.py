"""The full-screen chat, driven with Textual's Pilot on the real embedded model (no engine mocks).

One Engine is loaded for the module (about 7 s) and handed to every app through the factory; each test gets its own
data and config folders. Replies are capped at a few tokens to keep the module near a minute on two cores.
Snapshot tests (pytest-textual-snapshot) cover the main screen, the profile picker and the help screen; they show
stored data only (fixed clock, UTC), never live model output or timings, so they are deterministic. Snapshots live
in tests/snapshots/test_tui/; refresh them with `pytest tests/test_tui.py --snapshot-update`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from textual.widgets import Button, Input, OptionList

from mlxchat.app.app import make_app
from mlxchat.app.screens import Confirm, HelpScreen, ModelPicker, ProfilePicker, TextPrompt
from mlxchat.app.store import Store
from mlxchat.app.widgets import ChatInput, ConversationList, MessageView, Notice
from mlxchat.core import SamplingProfile
from mlxchat.core.chat.messages import ChatMessage
from mlxchat.core.sampling.profile import ProfileStore
from tests.markers import needs_native

MAX_TOKENS = 12
# Pilot types a message a key at a time and waits for the app to go idle after each (~0.1 s a key on two cores):
# the messages are short.
LONG_REPLY = "Tell me a long story"  # asks for a reply that streams on long enough to be stopped
# The chat preset cannot end that reply before MIN_REPLY tokens: with a random seed, a story sometimes ended on its own
# before a loaded machine delivered the key that was to stop it (finish reason "stop", not "cancelled"). 300 tokens
# (~3 s at this machine's decode speed) still lost that race in 2 of 4 clean-clone runs under the full suite; 3,000
# are ~30 s, which no delivery takes, and cost nothing when the key stops the reply as it should.
MIN_REPLY = 3000
UNSTOPPABLE = SamplingProfile.preset("chat").model_copy(update={"min_tokens": MIN_REPLY})
SIZE = (110, 32)


# --- chat ------------------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_send_streams_a_reply_with_live_readouts_and_stores_it(engine, new_app, wait_for, send, reply,
                                                                     monkeypatch):
    app = new_app(max_tokens=MAX_TOKENS)
    written: list[str] = []  # every batch the transcript was given, in order (the real write runs)
    write = MessageView.write

    async def recorded(view: MessageView, text: str) -> None:
        written.append(text)
        await write(view, text)

    monkeypatch.setattr(MessageView, "write", recorded)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        await send(pilot, "Hi")
        assert screen.input.text == ""
        views = screen.transcript.messages
        assert [v.role for v in views] == ["user", "assistant"] and views[0].text == "Hi"
        reply_view = views[1]
        await wait_for(pilot, lambda: screen.controller.last_result is not None and not screen.busy, what="the reply")
        result = screen.controller.last_result
        assert result is not None and result.finish_reason in ("stop", "length")
        # It streamed: text arrived in several batches, and nothing was dropped.
        assert len([batch for batch in written if batch]) >= 2 and screen.worker.batches_posted >= 2
        assert "".join(written) == result.text == reply_view.text
        assert reply_view.query_one(".body").source == result.text  # the final re-parse
        # Readouts: non-zero TTFT and TPOT, shown in the stats bar and under the message.
        m = screen.stats.metrics
        assert m.ttft_s > 0 and m.tpot_s > 0 and m.completion_tokens >= 2
        readouts = screen.stats.readouts
        assert "TTFT" in readouts and "TTFT –" not in readouts and "tok/s" in readouts and "ctx" in readouts
        assert "tok/s" in reply_view.stats and "to first token" in reply_view.stats
        # Stored with its stats and profile, one conversation titled by the first message.
        [conv] = app.store.conversations()
        assert conv.title == "Hi"
        stored = app.store.messages(conv.id)
        assert [s.role for s in stored] == ["user", "assistant"]
        assert stored[1].content == result.text
        assert stored[1].metrics["ttft_s"] == pytest.approx(result.metrics.ttft_s)
        assert stored[1].profile["name"] == "chat" and stored[1].sampler == result.sampler
        assert screen.controller.session.messages[-1].content == result.text
        # The sidebar lists it; copying the reply puts it on the clipboard.
        assert screen.query_one(ConversationList).option_count == 1
        await pilot.press("f5")
        assert app.clipboard == result.text


@pytest.mark.anyio
async def test_escape_stops_the_reply(engine, new_app, wait_for, send, reply):
    app = new_app(max_tokens=MIN_REPLY + 100)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        screen.set_profile(UNSTOPPABLE)
        await send(pilot, LONG_REPLY)
        await wait_for(pilot, lambda: screen.stats.metrics is not None and screen.stats.metrics.completion_tokens >= 2,
                       what="the first tokens")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.busy, timeout=20, what="the stop")
        result = screen.controller.last_result
        assert result.finish_reason == "cancelled"
        assert 2 <= result.metrics.completion_tokens < 400
        last = screen.transcript.messages[-1]
        assert last.text == result.text and "stopped by you" in last.stats
        # The partial reply is kept (in the session and the store), and the app goes on working.
        stored = app.store.messages(screen.controller.record.id)
        assert stored[-1].finish_reason == "cancelled" and stored[-1].content == result.text


@pytest.mark.anyio
async def test_escape_during_prefill(engine, new_app, wait_for, reply):
    app = new_app(max_tokens=50)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        screen.input.load_text("Summarise: " + "the cat sat on the mat. " * 12)
        # Enter and Esc back to back, as a terminal delivers them in one read (Pilot.press would wait for the app
        # to go idle between the keys, and it is not idle while a reply streams).
        screen.input.action_submit()
        screen.input.action_stop()
        await wait_for(pilot, lambda: screen.controller.last_result is not None and not screen.busy, timeout=30,
                       what="the stop")
        result = screen.controller.last_result
        # The stop reached the engine with the request: nothing was generated, no reply is shown or stored, and
        # the user message stays and can be answered again.
        assert result.finish_reason == "cancelled" and result.metrics.completion_tokens == 0 and result.text == ""
        assert [v.role for v in screen.transcript.messages] == ["user"]
        assert [m.role for m in app.store.messages(screen.controller.record.id)] == ["user"]
        assert any("ctrl+r asks again" in n.message for n in app._notifications)


@pytest.mark.anyio
async def test_profile_picker_validates_inline_and_the_switch_reaches_the_engine(tmp_path, engine, new_app, wait_for,
                                                                                 reply):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text("kv_window = 256\n")  # a rotating KV window, shown live
    app = new_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        assert screen.controller.session.profile.name == "chat"
        await pilot.press("f2")
        picker = app.screen
        assert isinstance(picker, ProfilePicker)
        names = [picker.query_one(OptionList).get_option_at_index(i).id
                 for i in range(picker.query_one(OptionList).option_count)]
        assert names[:6] == ["preset:chat", "preset:completion", "preset:creative", "preset:factual",
                             "preset:longform", "preset:precise"]
        # An out-of-range value: SamplingProfile's own message, inline, and Use is disabled.
        field = picker.query_one("#field-temperature", Input)
        field.value = "5"
        await pilot.pause()
        assert "temperature must be between 0 and 2" in str(picker.query_one("#error-temperature").content)
        assert "got 5" in str(picker.query_one("#error-temperature").content)
        assert picker.query_one("#profile-use", Button).disabled
        field.value = "abc"
        await pilot.pause()
        assert "temperature" in str(picker.query_one("#error-temperature").content)
        field.value = "0.3"
        await pilot.pause()
        assert str(picker.query_one("#error-temperature").content) == ""
        assert not picker.query_one("#profile-use", Button).disabled
        assert picker.edited.temperature == 0.3 and picker.edited.name == "chat edited"
        # Pick the greedy preset from the list instead.
        options = picker.query_one(OptionList)
        options.focus()
        options.highlighted = names.index("preset:precise")
        await pilot.pause()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen, what="the picker to close")
        assert screen.controller.session.profile.name == "precise" and screen.controller.profile.temperature == 0
        assert "profile precise" in str(screen.stats.query_one("#stats-profile").content)
        result = await reply(pilot, "Hi")
        assert result.profile["name"] == "precise" and result.profile["temperature"] == 0
        assert result.sampler == "greedy"
        assert result.metrics.kv_window == 256 and "(window 256)" in screen.stats.readouts
        assert app.store.conversation(screen.controller.record.id).profile["name"] == "precise"


@pytest.mark.anyio
async def test_regenerate_and_edit_last(engine, new_app, wait_for, reply):
    app = new_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        await reply(pilot, "Hi")
        conv = screen.controller.record.id
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not screen.busy, what="the regenerated reply")
        assert [v.role for v in screen.transcript.messages] == ["user", "assistant"]
        assert "< 2/2 >" in screen.transcript.last("assistant").label  # the old reply stays a branch
        # [ on the reply shows the old one, and the state line its numbers (it kept the new one's).
        screen.transcript.last("assistant").focus()
        await pilot.press("left_square_bracket")
        shown = screen.transcript.last("assistant")
        assert "< 1/2 >" in shown.label and screen.stats.metrics == shown.turn.message.metrics
        await pilot.press("right_square_bracket")
        shown = screen.transcript.last("assistant")
        assert "< 2/2 >" in shown.label and screen.stats.metrics == shown.turn.message.metrics
        stored = app.store.messages(conv)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[1].content == screen.controller.last_result.text
        # Edit and resend: the input gets the last message; Enter replaces it and what followed.
        await pilot.press("ctrl+t")
        assert screen.editing and screen.input.text == "Hi"
        await pilot.press("backspace", "backspace", *"Hello")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.busy, what="the edited reply")
        assert not screen.editing
        assert [(v.role, v.text) for v in screen.transcript.messages][0] == ("user", "Hello")
        assert "< 2/2 >" in screen.transcript.messages[0].label  # the old message and its reply stay a branch
        assert [m.content for m in app.store.messages(conv)][0] == "Hello"
        assert len(app.store.messages(conv)) == 2
        assert [m.role for m in screen.controller.session.messages] == ["system", "user", "assistant"]
        assert screen.controller.session.messages[1].content == "Hello"
        # History: up brings back what was sent.
        await pilot.press("up")
        assert screen.input.text == "Hello"
        await pilot.press("up")
        assert screen.input.text == "Hi"
        await pilot.press("down", "down")
        assert screen.input.text == ""
        # Clear asks first (Enter alone keeps the chat); yes: the transcript, the stored messages and the
        # session's history go; the conversation stays.
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, Confirm) and "2 messages" in app.screen.question
        await pilot.press("enter")
        await pilot.pause()
        assert len(app.store.messages(conv)) == 2 and len(screen.transcript.messages) == 2
        await pilot.press("ctrl+l")
        await pilot.press("y")
        await pilot.pause()
        assert screen.transcript.messages == [] and app.store.messages(conv) == []
        assert [m.role for m in screen.controller.session.messages] == ["system"]
        assert screen.controller.record.id == conv


@pytest.mark.anyio
async def test_a_new_chats_first_reply_says_its_system_prompt_was_cached(engine, tmp_path, new_app, ready, reply):
    """The KV cache on disk gives a new chat only what every chat starts with (saved by another chat): its first
    reply's stats line says "system prompt cached", not "14 tokens from disk"."""
    app = new_app(max_tokens=4, engine=engine.with_kv_cache(tmp_path / "kv"))
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        await reply(pilot, "Hi")
        screen.controller.engine.flush_kv_cache()  # the first chat's cache is on disk
        await screen.action_new_chat()
        result = await reply(pilot, "Name a colour.")
        stats = screen.transcript.last("assistant").stats
        assert result.metrics.disk_tokens > 0 and "system prompt cached" in stats and "from disk" not in stats


@pytest.mark.anyio
async def test_conversation_survives_a_restart_and_exports(tmp_path, engine, new_app, wait_for, reply):
    FIRST = "Capital of France?"
    app = new_app(max_tokens=6, profile="factual")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        first = await reply(pilot, FIRST)
        conversation_id = screen.controller.record.id

    app = new_app(max_tokens=4)  # the same data folder
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        listed = screen.query_one(ConversationList)
        assert listed.option_count == 1
        listed.focus()
        listed.highlighted = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.controller.record is not None, what="the conversation to open")
        assert screen.controller.record.id == conversation_id
        views = screen.transcript.messages
        assert [(v.role, v.text) for v in views] == [("user", FIRST),
                                                    ("assistant", first.text)]
        assert "to first token" in views[1].stats  # the stored stats line
        assert screen.controller.profile.name == "factual" and screen.controller.session.profile.name == "factual"
        assert [m.content for m in screen.controller.session.messages[1:]] == [FIRST,
                                                                               first.text]
        assert screen.input.sent[-1] == FIRST  # history from the store
        # The restored conversation goes on, on the same session.
        screen.input.focus()
        second = await reply(pilot, "And of Italy?")
        assert second.profile["name"] == "factual"
        assert len(app.store.messages(conversation_id)) == 4

        # Export to the default place in the data folder.
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, TextPrompt)
        default = Path(app.screen.query_one(Input).value)
        assert default.parent == tmp_path / "data" / "exports"
        await pilot.press("enter")
        await wait_for(pilot, lambda: default.exists(), what="the export")
        text = default.read_text()
        assert text.startswith("# " + FIRST)
        assert "## You\n\nAnd of Italy?" in text and second.text.strip() in text and "to first token" in text
        # The toast keeps the file's name whole on a line of its own (it wrapped the path mid-name).
        (toast,) = [n.message for n in app._notifications if n.title == "Export"]
        assert toast.splitlines()[0] == "Exported to" and toast.splitlines()[1].endswith("/exports/" + default.name)
        # ...or to a chosen path.
        chosen = tmp_path / "elsewhere" / "chat.md"
        await pilot.press("ctrl+s")
        app.screen.query_one(Input).value = str(chosen)
        await pilot.press("enter")
        await wait_for(pilot, lambda: chosen.exists(), what="the export")
        assert "## You\n\nAnd of Italy?" in chosen.read_text()


@pytest.mark.anyio
async def test_rename_delete_and_copy_a_code_block(tmp_path, new_app):
    store = Store(tmp_path / "data" / "conversations.db")
    c = store.create_conversation("code")
    store.add_message(c.id, ChatMessage("user", "show code"))
    store.add_message(c.id, ChatMessage(
                      "assistant", "Here:\n\n```python\nprint('hi')\n```\n\nThen:\n\n```sh\nls -l\n```\n",
                      finish_reason="stop", metrics={"ttft_s": 0.1, "tpot_s": 0.05, "completion_tokens": 9}))
    other = store.create_conversation("other")
    store.close()
    app = new_app(max_tokens=MAX_TOKENS)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await screen.open_conversation(c.id)
        await pilot.pause()
        assert screen.transcript.messages[1].code_blocks() == ["print('hi')", "ls -l"]
        await pilot.press("f8")  # the last code block of the chat (issue 12 item 15: it copied the first)
        assert app.clipboard == "ls -l"
        await pilot.press("f8")
        assert app.clipboard == "ls -l"
        view = screen.transcript.messages[1]
        view.focus()
        await pilot.press("c")
        assert app.clipboard == view.text
        # Rename and delete from the sidebar.
        listed = screen.query_one(ConversationList)
        listed.focus()
        listed.highlighted = listed.get_option_index(str(other.id))
        await pilot.press("ctrl+e")
        assert isinstance(app.screen, TextPrompt)
        app.screen.query_one(Input).value = "renamed"
        await pilot.press("enter")
        await pilot.pause()
        assert app.store.conversation(other.id).title == "renamed"
        listed.highlighted = listed.get_option_index(str(c.id))
        await pilot.press("delete")
        await pilot.press("y")
        await pilot.pause()
        assert [x.title for x in app.store.conversations()] == ["renamed"]
        assert screen.controller.record is None and screen.transcript.messages == []


@pytest.mark.anyio
async def test_opening_a_chat_focuses_the_input_and_typed_text_never_deletes_or_renames(tmp_path, new_app, wait_for):
    """Issue 12 item 2: typing "do it" + Enter with the sidebar focused deleted the chat (d, then Enter)."""
    store = Store(tmp_path / "data" / "conversations.db")
    kept = store.create_conversation("keep me")
    store.add_message(kept.id, ChatMessage("user", "hello"))
    store.close()
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        listed = screen.query_one(ConversationList)
        listed.focus()
        listed.highlighted = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.controller.record is not None, what="the chat to open")
        assert screen.input.has_focus
        # With the list focused, typed words are not commands: no dialog, nothing deleted or renamed.
        listed.focus()
        await pilot.press(*"do it", "space", *"right", "enter")
        assert app.screen is screen and app.store.conversation(kept.id).title == "keep me"
        # The keys that rename or delete are not letters, and a confirmation does not take Enter alone.
        listed.focus()
        listed.highlighted = 0
        await pilot.press("delete")
        assert isinstance(app.screen, Confirm)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen, what="the dialog to close")
        assert [c.title for c in app.store.conversations()] == ["keep me"]


@pytest.mark.anyio
async def test_a_new_or_another_chat_starts_with_a_clean_stats_line(new_app, wait_for, reply):
    """Issue 12 item 10: the stats line kept the previous chat's numbers after ctrl+n or opening another chat."""
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        await reply(pilot, "Hi")
        first = screen.controller.record.id
        assert screen.stats.metrics is not None and "TTFT" in screen.stats.readouts
        await pilot.press("ctrl+n")
        assert screen.stats.metrics is None and "TTFT" not in screen.stats.readouts
        assert screen.stats.state == "idle" and "context 8192" in screen.stats.readouts
        # The state line names the decode path that runs (issue 24), as --stats does, in what the width allows:
        # its details, then its last fields, go first (issue 37 item 10).
        path = screen.controller.engine.decode_path().split(" · ")
        assert path[0].split(" (")[0] in screen.stats.readouts
        await reply(pilot, "Hello")
        assert "TTFT" in screen.stats.readouts
        await screen.open_conversation(first)
        assert screen.stats.metrics is None and "TTFT" not in screen.stats.readouts


@pytest.mark.anyio
async def test_the_title_bar_names_the_chat_once_its_first_message_is_sent(new_app, ready, reply):
    """Issue 27 item 6: the header kept "new chat" after the first message."""
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        assert screen.sub_title == "new chat"
        await reply(pilot, "Hi there")
        assert screen.sub_title == "Hi there" == screen.controller.record.title


@pytest.mark.anyio
async def test_tab_goes_sidebar_to_input_and_enter_opens_the_first_chat(tmp_path, new_app, ready, wait_for):
    """Issue 27 item 8: Enter in the sidebar did nothing until Down was pressed; Tab stopped at every message."""
    store = Store(tmp_path / "data" / "conversations.db")
    saved = store.create_conversation("saved chat")
    for i in range(3):
        store.add_message(saved.id, ChatMessage("user", f"question {i}"))
        store.add_message(saved.id, ChatMessage("assistant", f"answer {i}", finish_reason="stop"))
    store.close()
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await ready(pilot)
        listed = screen.query_one(ConversationList)
        for _ in range(4):  # back from the input to the sidebar, whatever lies between
            await pilot.press("shift+tab")
            if listed.has_focus:
                break
        assert listed.has_focus and listed.highlighted == 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.controller.record is not None, what="the chat to open")
        assert screen.controller.record.id == saved.id and len(screen.transcript.messages) == 6
        listed.focus()
        seen = []
        for _ in range(4):
            await pilot.press("tab")
            seen.append(app.focused)
            if screen.input.has_focus:
                break
        assert screen.input.has_focus and not any(isinstance(w, MessageView) for w in seen), seen
        # A message clicked (focused) still copies, and Tab goes on from it.
        screen.transcript.messages[1].focus()
        await pilot.press("tab")
        assert not isinstance(app.focused, MessageView)
        # Issue 37 item 4: the keyboard reaches the messages too. Tab to the transcript; ↑ focuses the last message,
        # ↑/↓ go from one to the next (their keys then work: c copies), and stop at either end.
        views = screen.transcript.messages
        screen.transcript.focus()
        await pilot.press("up")
        assert app.focused is views[-1]
        await pilot.press("up", "up")
        assert app.focused is views[-3]
        await pilot.press("down")
        assert app.focused is views[-2]
        await pilot.press("c")
        assert "Copied the message" in str([n.message for n in app._notifications])
        await pilot.press(*["down"] * 5)
        assert app.focused is views[-1]


@pytest.mark.anyio
async def test_quitting_while_a_reply_streams_saves_it_as_stopped(tmp_path, new_app, wait_for, send, reply):
    """Issue 12 item 4: ctrl+q mid-reply lost the reply; it is saved as far as it got, marked stopped."""
    app = new_app(max_tokens=MIN_REPLY + 100)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        screen.set_profile(UNSTOPPABLE)
        await send(pilot, LONG_REPLY)
        await wait_for(pilot, lambda: screen.controller.reply is not None and screen.controller.reply.tokens >= 3,
                       what="the first tokens")
        conversation = screen.controller.record.id
        view = screen.transcript.messages[-1]  # quitting removes the screen's widgets; the view keeps its text
        await pilot.press("ctrl+q")
        shown = view.text
    store = Store(tmp_path / "data" / "conversations.db")
    try:
        stored = store.messages(conversation)
    finally:
        store.close()
    assert [m.role for m in stored] == ["user", "assistant"]
    saved = stored[1].content
    # The transcript paints at most once a frame, so tokens that arrived while quitting may be saved but not shown.
    assert stored[1].finish_reason == "cancelled" and shown and saved.startswith(shown.rstrip())


# --- failures --------------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_engine_error_mid_stream_is_shown_and_the_app_stays_usable(engine, new_app, wait_for, reply):
    app = new_app(max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        screen.input.load_text("word " * 9000)  # longer than the model's 8192-token context
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.busy, what="the failure")
        failed = screen.transcript.messages[-1]
        assert failed.has_class("failed") and "context of 8192" in failed.stats
        assert screen.stats.state == "error"
        assert any("context" in n.message for n in app._notifications)
        screen.input.focus()
        await pilot.press("ctrl+n")
        result = await reply(pilot, "Hi")
        assert result.finish_reason in ("stop", "length")


@pytest.mark.anyio
async def test_an_edit_the_engine_refuses_gives_the_old_message_back_and_shows_the_new_one_unsent(new_app, wait_for,
                                                                                                    reply):
    app = new_app(max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        first = await reply(pilot, "Hi")
        await pilot.press("ctrl+t")
        screen.input.load_text("word " * 9000)  # longer than the model's 8192-token context
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.busy, what="the refusal")
        views = screen.transcript.messages
        assert [(v.role, v.text) for v in views[:2]] == [("user", "Hi"), ("assistant", first.text)]
        assert views[2].role == "user" and views[2].has_class("unsent") and len(views) == 3


@pytest.mark.anyio
async def test_model_that_fails_to_load_is_reported_and_offers_the_embedded_one(tmp_path, new_app, wait_for, send):
    app = new_app(engine=None, model=str(tmp_path / "missing.gguf"))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: bool(screen.query("#notice-load_embedded")), timeout=30, what="the load error")
        notice = screen.query_one(Notice)
        assert "missing.gguf" in notice.text and "no such file" in notice.text
        assert notice.query_one("#notice-load_embedded", Button).label.plain == "Load the embedded model"
        assert screen.stats.state == "error"
        await send(pilot, "Hi")  # usable: it says what to do instead of failing
        assert any("No model is loaded" in n.message for n in app._notifications)
        assert screen.input.text == "Hi"


@pytest.mark.anyio
async def test_model_picker_adds_a_local_model_and_a_failed_switch_keeps_the_current_one(tmp_path, engine, new_app,
                                                                                         wait_for):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    app = new_app(max_tokens=MAX_TOKENS)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        await pilot.press("f3")
        picker = app.screen
        assert isinstance(picker, ModelPicker)
        assert picker.choices[0].spec is None and picker.choices[0].source == "embedded"
        path_input = picker.query_one("#model-path", Input)
        path_input.value = str(tmp_path / "nothere.gguf")
        picker.action_add()
        assert "no such file" in str(picker.query_one("#model-error").content)
        path_input.value = str(broken)
        picker.action_add()
        assert [c.spec for c in picker.choices] == [None, str(broken)]
        assert app.store.models() == []  # offered for this visit; remembered only once it has loaded
        picker.query_one("#model-list", OptionList).highlighted = 1
        picker.action_load()
        await wait_for(pilot, lambda: any("did not load" in (n.title or "") for n in app._notifications),
                       timeout=30, what="the load failure")
        # Still usable on the old model.
        assert screen.controller.engine is engine and screen.controller.session is not None
        assert not screen.query(Notice)  # no "no model" banner: a model is loaded
        assert app.store.models() == []  # a model that failed to load is not kept in the list


@pytest.mark.anyio
async def test_config_remaps_keys_and_bad_config_falls_back(tmp_path, new_app, wait_for, send):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text('theme = "textual-light"\n[keys]\nregenerate = "f9"\n'
                                                     'nonsense = "f7"\n')
    app = new_app(max_tokens=MAX_TOKENS)
    async with app.run_test(size=SIZE) as pilot:
        rows = {row[3]: row[0] for row in app.binding_rows()}
        assert rows["regenerate"] == "f9" and rows["send"] == "enter"
        await pilot.press("f9")  # the remapped key reaches the action
        assert any("Nothing to regenerate" in n.message for n in app._notifications)
        assert app.theme == "textual-light"
        assert any("nonsense" in n.message for n in app._notifications)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("f10")
        assert app.theme == "textual-dark"
        # The command palette offers the profiles (presets and saved ones) with their values.
        await pilot.press("ctrl+p")
        await pilot.press(*"creative")
        await wait_for(pilot, lambda: bool(app.screen.query("CommandList Option, CommandList")), what="palette")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat_screen.controller.profile.name == "creative", what="the palette switch")
        assert app.chat_screen.controller.session.profile.name == "creative"

    app = new_app(max_tokens=MAX_TOKENS)  # the F10 choice is remembered over the (unchanged) config's theme
    async with app.run_test(size=SIZE) as pilot:
        assert app.theme == "textual-dark"

    (tmp_path / "config" / "config.toml").write_text("max_tokens = -1\n")
    app = new_app(max_tokens=MAX_TOKENS)
    async with app.run_test(size=SIZE) as pilot:
        assert app.settings.max_tokens == 1024
        assert any("max_tokens" in n.message for n in app._notifications)


@pytest.mark.anyio
async def test_corrupt_database_is_reported_and_left_alone(tmp_path, new_app):
    (tmp_path / "data").mkdir()
    db = tmp_path / "data" / "conversations.db"
    db.write_bytes(b"not sqlite at all" * 64)
    app = new_app(max_tokens=MAX_TOKENS)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.store_error and "not an SQLite database" in app.store_error
        assert any("not saved" in n.message for n in app._notifications)
    assert db.read_bytes() == b"not sqlite at all" * 64


# --- snapshots -------------------------------------------------------------------------------------------------

SNAP_DIR = Path("/tmp/mlxchat-snapshot-dirs")  # fixed paths: the help screen shows the config file's path
# Prose longer than a reading width and a code line longer than 80 columns: the layout at every width shows on them.
SNAP_REPLY = ("The capital of France is **Paris**. It has been the capital for centuries, and it is known for its "
              "museums, its cafés and the Seine, which runs through the middle of the city.\n\n```python\n"
              "print('Paris is the capital of France, and this line is longer than eighty columns')\n```")


@pytest.fixture
def snap_app(engine, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    shutil.rmtree(SNAP_DIR, ignore_errors=True)
    clock = iter(float(1_780_000_000 + 3600 * i) for i in range(100))
    store = Store(SNAP_DIR / "data" / "conversations.db", clock=lambda: next(clock))
    a = store.create_conversation("Capital of France", system_prompt="You are a helpful assistant.",
                                  profile={"name": "chat", "temperature": 0.8, "top_p": 0.9})
    store.add_message(a.id, ChatMessage("user", "What is the capital of France?"))
    store.add_message(a.id, ChatMessage(
                      "assistant", SNAP_REPLY,
                      finish_reason="stop", model=engine.name, profile={"name": "chat"},
                      metrics={"prompt_tokens": 27, "cached_tokens": 0, "completion_tokens": 9, "ttft_s": 0.31,
                               "tpot_s": 0.082, "prefill_s": 0.3, "decode_s": 0.66,
                               "peak_memory_bytes": 551_000_000, "context_tokens": 36, "context_limit": 8192}))
    store.create_conversation("A haiku about autumn")
    store.close()
    ProfileStore(SNAP_DIR / "config" / "profiles").save(
        SamplingProfile(name="mine", description="Saved by the user.", temperature=0.5, min_p=0.05))
    app = make_app(data_dir=SNAP_DIR / "data", config_dir=SNAP_DIR / "config", engine=engine, max_tokens=8,
                   scan_hf_cache=False)
    yield app, a.id
    shutil.rmtree(SNAP_DIR, ignore_errors=True)
    monkeypatch.delenv("TZ")
    time.tzset()


async def _settle(pilot, wait_for) -> None:
    screen = pilot.app.chat_screen
    await wait_for(pilot, lambda: bool(screen.query(ChatInput)) and screen.controller.session is not None,
                   what="the screen")
    screen.input.cursor_blink = False
    await pilot.pause()


# The screens show the weight path (native kernel or fp32 fallback): the snapshots were taken on the native one,
# so they are skipped on the fallback.
def _opened(app, conversation_id, wait_for):
    """A snapshot's run_before: the conversation open and the input focused, once the app has settled."""
    async def run_before(pilot) -> None:
        await _settle(pilot, wait_for)
        await app.chat_screen.open_conversation(conversation_id)
        await pilot.pause()
        app.chat_screen.input.focus()
        await pilot.pause()
    return run_before


@needs_native
def test_snapshot_main_screen(snap_compare, snap_app, wait_for):
    app, conversation_id = snap_app

    assert snap_compare(app, terminal_size=SIZE, run_before=_opened(app, conversation_id, wait_for))


# Issue 37 item 10: 80x24 (the sidebar collapsed, a compact footer), 120 and 200 columns (a reading width).
@needs_native
@pytest.mark.parametrize("size", [(80, 24), (120, 32), (200, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_snapshot_main_screen_at_each_width(snap_compare, snap_app, wait_for, size):
    app, conversation_id = snap_app

    assert snap_compare(app, terminal_size=size, run_before=_opened(app, conversation_id, wait_for))


@pytest.mark.anyio
@pytest.mark.parametrize("columns", [80, 120, 200])
async def test_the_chat_fits_80_to_200_columns(snap_app, wait_for, columns):
    """Nothing is cut: the footer's keys, the state line's words, a code line; the sidebar folds away below 100
    columns (ctrl+b brings it back) and a message keeps a reading width."""
    from textual.widgets import Footer, Label
    from textual.widgets.markdown import MarkdownFence

    app, conversation_id = snap_app
    async with app.run_test(size=(columns, 24 if columns == 80 else 32)) as pilot:
        await _settle(pilot, wait_for)
        screen = app.chat_screen
        await screen.open_conversation(conversation_id)
        await pilot.pause()
        sidebar = screen.query_one("#sidebar")
        assert sidebar.display == (columns >= 100)
        footer = screen.query_one(Footer)
        assert sum(key.outer_size.width for key in footer.children) <= columns  # every key whole
        shown = str(screen.stats.query_one("#stats-readouts").content).split(" · ")
        engine = screen.controller.engine
        whole = [engine.name, engine.model_kind(), f"context {engine.context_length}",
                 *engine.decode_path().split(" · ")]
        assert shown[:2] == whole[:2] and all(f in whole or f + " (" in " ".join(whole) for f in shown)  # no cut
        assert len(shown) >= (4 if columns >= 120 else 2)
        [reply] = [v for v in screen.transcript.messages if v.role == "assistant"]
        assert reply.outer_size.width <= 106  # a reading width (and the border)
        code = reply.query_one(MarkdownFence).query_one(Label)
        lines = [strip.text.rstrip() for strip in code.render_lines(code.size.region)]
        assert "columns')" in " ".join(lines)  # the end of the long code line is on screen, wrapped
        if columns < 100:
            await pilot.press("ctrl+b")
            assert sidebar.display


@needs_native
def test_snapshot_profile_picker(snap_compare, snap_app, wait_for):
    app, _ = snap_app

    async def run_before(pilot) -> None:
        await _settle(pilot, wait_for)
        await pilot.press("f2")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


@needs_native
def test_snapshot_help_screen(snap_compare, snap_app, wait_for):
    app, _ = snap_app

    async def run_before(pilot) -> None:
        await _settle(pilot, wait_for)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
