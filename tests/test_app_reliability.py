"""The app under bad data, bad models and engine errors (issue 7), driven with Textual's Pilot on the real
embedded model. No engine or database mocks.

- A database the app must not use (garbage, another program's SQLite file, a newer mlxchat's schema): one error
  line in the app naming the file; the file and its folder are left byte for byte as they were; the app chats on
  an in-memory database.
- A read-only data folder (chmod 0o555, or ``chattr +i`` when running as root, where chmod does not stop writes)
  and a data folder that cannot exist (its parent is a regular file): reported in one line, the app chats; a
  read-only config folder: saving a profile is reported, the picker stays open.
- A model file that is not a GGUF, or is truncated: one line naming the file and the cause, the app stays usable,
  and the notice's "Load the embedded model" button loads the embedded model, which then answers.
- A prompt longer than the context: one line; the rejected message leaves the session and the store, so the next
  message of the same chat is answered (before, every later turn failed the same way, also after a restart).
- Stopping 50 replies in prefill and 50 in decode through the app's engine worker: the session stays usable and
  active memory flat.
"""

from __future__ import annotations

import queue
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import pytest

from mlxchat.app.app import MlxChatApp
from mlxchat.app.engine_worker import EngineWorker
from mlxchat.app.screens import ProfilePicker, TextPrompt
from mlxchat.app.store import Store
from mlxchat.core.chat.messages import ChatMessage
from mlxchat.app.widgets import Notice
from mlxchat.core import SamplingProfile
from mlxchat.core.model.loader import embedded_model_path

MAX_TOKENS = 4
SIZE = (110, 32)


def errors(app: MlxChatApp) -> list[str]:
    return [n.message for n in app._notifications if n.severity == "error"]


def one_line(text: str) -> bool:
    return "\n" not in text and "Traceback" not in text


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# --- databases the app must not use ----------------------------------------------------------------------------

def _garbage(db: Path) -> None:
    db.write_bytes(b"this is not a database\n" * 200)


def _foreign(db: Path) -> None:
    c = sqlite3.connect(db)
    c.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    c.execute("INSERT INTO notes (body) VALUES ('keep me')")
    c.commit()
    c.close()


def _newer(db: Path) -> None:
    store = Store(db)
    c = store.create_conversation("from a newer mlxchat")
    store.add_message(c.id, ChatMessage("user", "keep me"))
    store._c.execute("UPDATE schema_version SET version = 99")
    store._c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()


@pytest.mark.anyio
@pytest.mark.parametrize("make, says", [(_garbage, "not an SQLite database"),
                                        (_foreign, "not mlxchat's"),
                                        (_newer, "newer mlxchat (schema version 99")],
                         ids=["garbage", "foreign-sqlite", "newer-schema"])
async def test_unusable_database_is_reported_left_alone_and_the_app_chats(tmp_path, engine, make, says, new_app,
                                                                          wait_for, reply):
    data = tmp_path / "data"
    data.mkdir()
    db = data / "conversations.db"
    make(db)
    before = snapshot(data)
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        (line,) = [m for m in errors(app) if "conversations.db" in m]
        assert says in line and str(db) in line and "left untouched" in line and one_line(line)
        assert "not saved in this session" in line
        assert app.store.path == ":memory:"
        result = await reply(pilot, "Hi")  # still a working chat, on a throwaway database
        assert result.finish_reason in ("stop", "length")
        assert [m.role for m in app.store.messages(screen.controller.record.id)] == ["user", "assistant"]
    assert snapshot(data) == before  # byte for byte, and nothing added next to it (no backup, WAL or journal)


# --- folders the app cannot write ------------------------------------------------------------------------------

def _writable(folder: Path) -> bool:
    probe = folder / ".write-probe"
    try:
        probe.write_text("x")
    except OSError:
        return False
    probe.unlink()
    return True


def make_read_only(folder: Path) -> str:
    """Make ``folder`` read-only in a way that holds for this user; return how, or skip if impossible."""
    folder.chmod(0o555)
    if not _writable(folder):
        return "chmod"
    folder.chmod(0o755)  # root ignores the mode bits: try the immutable attribute instead
    if shutil.which("chattr"):
        files = [str(p) for p in folder.iterdir()]
        done = subprocess.run(["chattr", "+i", *files, str(folder)], capture_output=True)
        if done.returncode == 0 and not _writable(folder):
            return "chattr"
        subprocess.run(["chattr", "-i", *files, str(folder)], capture_output=True)
    pytest.skip("cannot make a folder read-only here (root without chattr +i support)")


def make_writable(folder: Path, how: str) -> None:
    if how == "chattr":
        subprocess.run(["chattr", "-i", str(folder), *[str(p) for p in folder.iterdir()]], capture_output=True)
    folder.chmod(0o755)


@pytest.mark.anyio
async def test_read_only_data_and_config_folders_are_reported_and_the_app_chats(tmp_path, engine, new_app, wait_for,
                                                                                reply):
    data, config = tmp_path / "data", tmp_path / "config"
    store = Store(data / "conversations.db")
    old = store.create_conversation("my history")
    store.add_message(old.id, ChatMessage("user", "keep me"))
    store._c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    for name in ("conversations.db-wal", "conversations.db-shm"):
        (data / name).unlink(missing_ok=True)
    config.mkdir()
    before = snapshot(data)
    how = make_read_only(data)
    make_read_only(config)
    try:
        app = new_app()
        async with app.run_test(size=SIZE) as pilot:
            screen = app.chat_screen
            await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
            (line,) = [m for m in errors(app) if "conversations.db" in m]
            assert "read-only" in line and str(data) in line and one_line(line), line
            assert "not saved in this session" in line
            result = await reply(pilot, "Hi")
            assert result.finish_reason in ("stop", "length")
            # Saving a profile into the read-only config folder: one line under the name, which stays to retry.
            await pilot.press("f2")
            picker = app.screen
            assert isinstance(picker, ProfilePicker)
            await pilot.press("ctrl+s")
            prompt = app.screen
            assert isinstance(prompt, TextPrompt)
            await pilot.press("enter")
            await pilot.pause()
            saved = str(prompt.query_one("#prompt-error").content)
            assert app.screen is prompt and "Cannot save the profile" in saved and str(config) in saved
            assert one_line(saved)
            await pilot.press("escape", "escape")
            assert app.screen is screen
        assert snapshot(data) == before
    finally:
        make_writable(data, how)
        make_writable(config, how)
    store = Store(data / "conversations.db")  # writable again: the history is there, as it was
    assert [m.content for m in store.messages(old.id)] == ["keep me"]
    store.close()


@pytest.mark.anyio
async def test_data_folder_that_cannot_be_created_is_reported_and_the_app_chats(tmp_path, engine, new_app, wait_for,
                                                                                reply):
    (tmp_path / "file").write_text("a regular file where a folder should be")
    app = new_app(data_dir=tmp_path / "file" / "data")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        (line,) = errors(app)
        assert "cannot create the data folder" in line and "Not a directory" in line and one_line(line)
        result = await reply(pilot, "Hi")
        assert result.finish_reason in ("stop", "length")


@pytest.mark.anyio
async def test_a_database_that_stops_writing_mid_session_is_one_line_and_the_chat_goes_on(new_app, wait_for, reply):
    """Issue 12 item 5: a failing write (here: the connection turned read-only, as a full disk or a read-only
    file does) raised a StoreError out of the chat screen. Now: one line, the chat stays in memory and is written
    once the database takes writes again."""
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        first = await reply(pilot, "Hi")
        cid = screen.controller.record.id
        app.store._c.execute("PRAGMA query_only = ON")  # fault injection: every write now fails
        second = await reply(pilot, "And again?")
        third = await reply(pilot, "Once more")
        (line,) = [m for m in errors(app) if "Cannot save" in m]
        assert "read-only" in line and "kept here" in line and one_line(line)
        assert [v.text for v in screen.transcript.messages] == ["Hi", first.text, "And again?", second.text,
                                                               "Once more", third.text]
        assert len(app.store.messages(cid)) == 2
        app.store._c.execute("PRAGMA query_only = OFF")
        fourth = await reply(pilot, "Saved now?")
        assert [m.content for m in app.store.messages(cid)] == [v.text for v in screen.transcript.messages]
        assert fourth.text == app.store.messages(cid)[-1].content


# --- models that do not load -----------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_bad_model_files_are_reported_and_the_embedded_model_loads_from_the_notice(tmp_path, new_app, wait_for,
                                                                                         reply):
    text_file = tmp_path / "notes.gguf"
    text_file.write_text("hello, I am not a model\n" * 10)
    truncated = tmp_path / "truncated.gguf"
    with embedded_model_path().open("rb") as f:
        truncated.write_bytes(f.read(300_000))  # the real model's first 300 kB: ends inside the header
    for bad, cause in ((text_file, "not a GGUF file"), (truncated, "truncated")):
        app = new_app(engine=None, model=str(bad))
        async with app.run_test(size=SIZE) as pilot:
            screen = app.chat_screen
            await wait_for(pilot, lambda: bool(screen.query("#notice-load_embedded")), timeout=30,
                           what="the load error")
            notice = screen.query_one(Notice)
            assert str(bad) in notice.text and cause in notice.text and one_line(notice.text)
            (line,) = errors(app)
            assert str(bad) in line and one_line(line)
            assert screen.stats.state == "error"
            await pilot.press(*"Hi", "enter")  # usable: it says what to do, keeps the text
            assert any("No model is loaded" in m for m in errors(app)) and screen.input.text == "Hi"
            if bad is truncated:  # the offered way out: the embedded model (a real load, ~7 s)
                await pilot.click("#notice-load_embedded")
                await wait_for(pilot, lambda: screen.controller.session is not None, timeout=120,
                               what="the embedded model")
                assert not screen.query(Notice) and screen.controller.engine.name.startswith("SmolLM2")
                screen.input.clear()
                result = await reply(pilot, "Hi")
                assert result.finish_reason in ("stop", "length")


# --- engine errors ---------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_prompt_longer_than_the_context_is_refused_and_the_same_chat_goes_on(engine, new_app, wait_for, reply):
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        first = await reply(pilot, "Hi")
        cid = screen.controller.record.id
        huge = "word " * 9000  # about 9000 tokens; the context is 8192
        screen.input.load_text(huge)
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.busy and screen.stats.state == "error", what="the failure")
        (line,) = [m for m in errors(app) if "context" in m]
        assert "context of 8192" in line and "not sent" in line and one_line(line)
        unsent = screen.transcript.last("user")
        assert unsent.has_class("unsent") and unsent.text == huge
        assert [m.content for m in screen.controller.session.messages if m.role == "user"] == ["Hi"]
        assert [m.content for m in app.store.messages(cid)] == ["Hi", first.text]
        await pilot.press("ctrl+r")  # regenerate would answer the message before it: refused, with the way out
        assert any("ctrl+t" in n.message for n in app._notifications if n.severity == "warning")
        assert not screen.busy
        # ctrl+t edits the refused message; the shorter one is sent (not an edit of the earlier "Hi").
        await pilot.press("ctrl+t")
        assert screen.input.text == huge
        screen.input.clear()
        second = await reply(pilot, "Say hello")
        assert second.finish_reason in ("stop", "length")
        assert [(m.role, m.content) for m in app.store.messages(cid)] == [
            ("user", "Hi"), ("assistant", first.text), ("user", "Say hello"), ("assistant", second.text)]
        # Refused again, then simply another message: answered in the same chat.
        screen.input.load_text(huge)
        await pilot.press("enter")
        await wait_for(pilot, lambda: not screen.busy and screen.stats.state == "error", what="the failure")
        screen.input.clear()
        third = await reply(pilot, "Thanks")
        assert third.finish_reason in ("stop", "length")
        assert [m.content for m in app.store.messages(cid)][-2:] == ["Thanks", third.text]
        assert huge not in [m.content for m in app.store.messages(cid)]

    app = new_app()  # after a restart the chat goes on too: the refused text was never stored
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        await screen.open_conversation(cid)
        result = await reply(pilot, "Bye")
        assert result.finish_reason in ("stop", "length")


# --- stopping, many times --------------------------------------------------------------------------------------

class Inbox:
    """What the worker posts to (the chat screen, in the app): kept in a thread-safe queue for the test to read."""

    def __init__(self) -> None:
        self.messages: queue.Queue = queue.Queue()

    def post_message(self, message) -> bool:
        self.messages.put(message)
        return True

    def next(self, *kinds: type, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            message = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            assert not isinstance(message, EngineWorker.Failed), message.error
            if isinstance(message, kinds):
                return message


CYCLES = 50


def test_stopping_50_times_in_prefill_and_50_in_decode_through_the_worker_keeps_memory_flat(engine):
    """The app's path for Esc (Stream.cancel while EngineWorker.follow iterates it), with the real engine;
    the Pilot-driven single stops are in test_tui.py. Small prefill chunks make "during prefill" cheap to hit: each
    turn edits the first message at its start, so nothing is cached, and the stop goes in at the first chunk."""
    old_step = engine.prefill_step
    engine.prefill_step = 16
    inbox = Inbox()
    worker = EngineWorker(inbox)
    chat = engine.chat(system="You are a helpful assistant.", profile=SamplingProfile(temperature=0))
    body = " Tell me a long story about the sea and the ships on it." * 8
    memory: list[int] = []
    try:
        for i in range(CYCLES):
            text = f"{i}{body}"
            stream = chat.edit_last(text, max_tokens=200) if i else chat.send(text, max_tokens=200)
            worker.follow(stream)
            assert inbox.next(EngineWorker.Prefill).stream is stream  # prefill has begun
            stream.cancel()
            result = inbox.next(EngineWorker.Finished).result
            m = result.metrics
            assert result.finish_reason == "cancelled" and result.text == "" and m.completion_tokens == 0
            # Stopped inside the prefill: a cancel lands between layers, so often inside the first chunk (nothing kept)
            assert m.cached_tokens <= m.context_tokens < m.prompt_tokens
            memory.append(mx.get_active_memory())
        for _ in range(CYCLES):
            stream = chat.regenerate(max_tokens=200)
            worker.follow(stream)
            inbox.next(EngineWorker.Tokens)  # decoding
            stream.cancel()
            result = inbox.next(EngineWorker.Finished).result
            assert result.finish_reason == "cancelled" and 1 <= result.metrics.completion_tokens < 50
            memory.append(mx.get_active_memory())
        assert [m.role for m in chat.messages] == ["system", "user", "assistant"]  # nothing piled up
        base = memory[CYCLES // 5]
        growth = max(memory[CYCLES // 2:CYCLES]) - base, max(memory[CYCLES + CYCLES // 2:]) - base
        assert max(growth) < 16 * 2**20, f"active memory grew by {max(growth) / 2**20:.1f} MiB"
        engine.prefill_step = old_step
        worker.follow(chat.send("Hi", max_tokens=8))  # and the session still answers
        result = inbox.next(EngineWorker.Finished).result
        assert result.finish_reason in ("stop", "length") and result.text
    finally:
        engine.prefill_step = old_step
        worker.close()
