"""Crash safety of the conversation history (issue 7), with real processes, the real TUI and the real model.

- ``kill -9`` of the app while a reply streams: a subprocess runs the real app headless (Textual's ``run_test``,
  the embedded model, a temporary data folder), completes two exchanges, starts a long reply and is SIGKILLed
  mid-stream. The database (still in WAL, never checkpointed) must pass ``PRAGMA integrity_check``, hold every
  earlier message (through app/store.py) and the reply in flight as far as it had streamed about a second before
  the kill, marked stopped, and reopen in a fresh app that can answer the message again.
- Two writer processes (each appending messages to its own conversation through app/store.py) and an app instance
  chatting, all on one data folder at once: every message is there, in order, and the file is intact (WAL, busy
  timeout, one transaction per message).

No engine or database mocks. The subprocess loads its own copy of the model (~7 s); the whole module is ~25 s.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlxchat.app.app import make_app
from mlxchat.app.store import Store

ROOT = Path(__file__).resolve().parent.parent
SIZE = (110, 32)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def integrity(db: Path) -> str:
    c = sqlite3.connect(db)
    try:
        return c.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        c.close()


# --- kill -9 while a reply streams -----------------------------------------------------------------------------

# The real app, headless, in its own process: two short exchanges, then a long reply it never finishes.
DRIVER = r'''
import asyncio, json, sys, time
from mlxchat.app.app import make_app

LONG = ["Count from 1 to 500.", "Write a long story about a dragon and a knight.", "List 100 animals, one per line."]

async def until(pilot, condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            print("TIMEOUT", what, flush=True)
            sys.exit(3)
        await pilot.pause(0.02)

async def send(pilot, text):
    print("SENT", json.dumps(text), flush=True)
    await pilot.press(*text)
    await pilot.press("enter")

async def main(data, config):
    app = make_app(data_dir=data, config_dir=config, max_tokens=6, scan_hf_cache=False, profile="precise")
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await until(pilot, lambda: screen.controller.session is not None, 180, "the model")
        for text in ("Hello", "What is 2+2?"):
            before = screen.controller.last_result
            await send(pilot, text)
            await until(pilot, lambda: screen.controller.last_result is not before and not screen.busy, 120, "a reply")
            print("REPLIED", flush=True)
        screen.controller.max_tokens = 4000  # the in-flight reply: long enough never to end before the kill
        for text in LONG:  # (greedy: the first one streams on; the others are there in case a change of model
            before = screen.controller.last_result  # or template makes it answer in a few words)
            await send(pilot, text)
            shown = lambda: screen.controller.reply.turn.content if screen.controller.reply else ""
            streaming = lambda: len(shown()) >= 8
            await until(pilot, lambda: streaming() or screen.controller.last_result is not before, 120, "streaming")
            if streaming():
                print("SHOWN", json.dumps(shown()), flush=True)  # what the screen showed 1.5 s before the kill
                await pilot.pause(1.5)
                if streaming():
                    print("STREAMING", flush=True)
                    await asyncio.sleep(600)  # streaming on; the test kills this process now
            await until(pilot, lambda: not screen.busy, 120, "the short reply")
            print("REPLIED", flush=True)
        print("TIMEOUT no long reply", flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
'''


@pytest.mark.anyio
async def test_kill_9_while_a_reply_streams_loses_at_most_that_reply(tmp_path, engine, wait_for, reply):
    data, config = tmp_path / "data", tmp_path / "config"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    stderr = (tmp_path / "driver.err").open("w")
    proc = subprocess.Popen([sys.executable, str(driver), str(data), str(config)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    watchdog = threading.Timer(240, proc.kill)  # never hang the suite
    watchdog.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith(("STREAMING", "TIMEOUT")):
                break
        alive = proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)  # kill -9, mid-stream
        proc.wait(30)
    finally:
        watchdog.cancel()
        stderr.close()
    err = (tmp_path / "driver.err").read_text()[-3000:]
    assert lines and lines[-1] == "STREAMING", f"driver said {lines}; stderr: {err}"
    assert alive and proc.returncode == -signal.SIGKILL
    sent = [json.loads(x.removeprefix("SENT ")) for x in lines if x.startswith("SENT ")]
    completed = sum(x == "REPLIED" for x in lines)
    assert completed >= 2 and len(sent) == completed + 1

    db = data / "conversations.db"
    wal = db.with_name(db.name + "-wal")
    assert wal.exists() and wal.stat().st_size > 0  # the messages are only in the WAL: recovery is exercised
    assert integrity(db) == "ok"

    store = Store(db)  # the app's own reader (it runs quick_check too)
    try:
        (conversation,) = store.conversations()
        stored = store.messages(conversation.id)
    finally:
        store.close()
    # Every completed exchange is there, with its stats; the reply in flight is there up to about a second before
    # the kill (saved while it streamed), marked as stopped.
    assert [m.role for m in stored] == ["user", "assistant"] * (completed + 1)
    assert [m.content for m in stored if m.role == "user"] == sent
    for m in stored[1:-1:2]:
        assert m.finish_reason in ("stop", "length") and "completion_tokens" in m.metrics
    shown = json.loads([x for x in lines if x.startswith("SHOWN ")][-1].removeprefix("SHOWN "))
    partial = stored[-1]
    assert partial.finish_reason == "cancelled" and partial.content.startswith(shown), (partial.content, shown)
    assert partial.metrics["completion_tokens"] >= 1
    assert [m.position for m in stored] == list(range(len(stored)))
    assert integrity(db) == "ok"

    # A fresh app opens the history as it was and answers the message the killed one never answered.
    app = make_app(data_dir=data, config_dir=config, engine=engine, max_tokens=4, scan_hf_cache=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        assert app.store_error is None and not app.problems
        await screen.open_conversation(conversation.id)
        await pilot.pause()
        assert [(v.role, v.text) for v in screen.transcript.messages] == [(m.role, m.content) for m in stored]
        assert "stopped by you" in screen.transcript.messages[-1].stats
        before = screen.controller.last_result
        await pilot.press("ctrl+r")  # answer again the message the killed app was answering
        await wait_for(pilot, lambda: screen.controller.last_result is not before and not screen.busy,
                       what="the answer")
        assert screen.controller.last_result.finish_reason in ("stop", "length")
        assert [m.role for m in app.store.messages(conversation.id)] == ["user", "assistant"] * (completed + 1)
        assert app.store.messages(conversation.id)[-1].content == screen.controller.last_result.text
    assert integrity(db) == "ok"


# --- concurrent writers on one data folder ---------------------------------------------------------------------

WRITER = r'''
import sys, time
from pathlib import Path
from mlxchat.app.store import Store
from mlxchat.core.chat.messages import ChatMessage

db, name, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
store = Store(db)
conversation = store.create_conversation(name)
print("READY", conversation.id, flush=True)
while not go.exists():
    time.sleep(0.002)
for i in range(n):
    role = "user" if i % 2 == 0 else "assistant"
    metrics = {"i": i} if role == "assistant" else {}
    store.add_message(conversation.id, ChatMessage(role, f"{name} {i}", metrics=metrics))
    if i % 20 == 0:  # read in between, as an app does
        store.conversations()
        store.messages(conversation.id)
store.close()
print("DONE", flush=True)
'''

N = 300


@pytest.mark.anyio
async def test_two_writer_processes_and_an_app_on_one_data_folder(tmp_path, engine, wait_for, reply):
    data = tmp_path / "data"
    writer = tmp_path / "writer.py"
    writer.write_text(WRITER)
    go = tmp_path / "go"
    app = make_app(data_dir=data, config_dir=tmp_path / "config", engine=engine, max_tokens=4, scan_hf_cache=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_for(pilot, lambda: screen.controller.session is not None, what="the engine")
        procs = [subprocess.Popen([sys.executable, str(writer), str(data / "conversations.db"), name, str(N), str(go)],
                                  cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name in ("alpha", "beta")]
        try:
            ids = {}
            for name, p in zip(("alpha", "beta"), procs):
                line = p.stdout.readline()
                assert line.startswith("READY"), p.stderr.read()
                ids[name] = int(line.split()[1])
            go.touch()  # all at once: both processes append while the app chats
            first = await reply(pilot, "Hi")
            second = await reply(pilot, "And again?")
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0 and out.strip().endswith("DONE"), err[-2000:]
        assert first.finish_reason in ("stop", "length") and second.finish_reason in ("stop", "length")
        screen.refresh_sidebar()  # the app sees the other writers' conversations
        assert len(app.store.conversations()) == 3
        mine = screen.controller.record.id

    assert integrity(data / "conversations.db") == "ok"
    store = Store(data / "conversations.db")
    try:
        for name, cid in ids.items():
            stored = store.messages(cid)
            assert [m.content for m in stored] == [f"{name} {i}" for i in range(N)]  # all there, in order
            assert [m.position for m in stored] == list(range(N))
            assert all(m.metrics == {"i": m.position} for m in stored if m.role == "assistant")
        assert [m.role for m in store.messages(mine)] == ["user", "assistant"] * 2
        assert store.conversation(mine).title == "Hi"
    finally:
        store.close()
