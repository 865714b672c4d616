"""The conversations database: schema, migrations, refusal to touch foreign/corrupt/newer files, WAL, concurrency."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from mlxchat.app.store import MIGRATIONS, SCHEMA_VERSION, Store, StoreError
from mlxchat.core.chat.messages import ChatMessage


@pytest.fixture
def db(tmp_path):
    return tmp_path / "data" / "conversations.db"


def test_fresh_database_is_created_at_the_current_version_in_wal_mode(db):
    store = Store(db)
    assert store.version == SCHEMA_VERSION
    assert store._c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._c.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
    assert store._c.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    store.close()
    assert Store(db).version == SCHEMA_VERSION  # reopening is a no-op


def test_conversations_and_messages_round_trip_with_stats(db):
    clock = iter(range(100, 200))
    store = Store(db, clock=lambda: float(next(clock)))
    a = store.create_conversation("first", system_prompt="be terse", profile={"name": "chat", "temperature": 0.8},
                                  model="m")
    b = store.create_conversation("second")
    store.add_message(a.id, ChatMessage("user", "hi"))
    metrics = {"ttft_s": 0.2, "tpot_s": 0.07, "completion_tokens": 5, "peak_memory_bytes": 123}
    seed = 2**64 - 1  # unsigned 64-bit seeds do not fit SQLite INTEGER; they must survive anyway
    m = store.add_message(a.id, ChatMessage("assistant", "hello", finish_reason="stop", metrics=metrics,
                          profile={"name": "chat"}, sampler="TopP(0.9) → Temperature(0.8) → sample", seed=seed,
                          model="m"))
    assert m.position == 1
    # newest first: `a` got the latest message
    assert [c.title for c in store.conversations()] == ["first", "second"]
    got = store.messages(a.id)
    assert [(x.role, x.content) for x in got] == [("user", "hi"), ("assistant", "hello")]
    assert got[1].metrics == metrics and got[1].seed == seed and got[1].finish_reason == "stop"
    assert got[1].metrics == metrics
    assert store.conversation(a.id).profile == {"name": "chat", "temperature": 0.8}
    assert store.conversation(a.id).system_prompt == "be terse"
    assert store.recent_user_messages() == ["hi"]

    store.rename_conversation(b.id, "renamed")
    assert store.conversation(b.id).title == "renamed"
    with pytest.raises(ValueError):
        store.rename_conversation(b.id, "  ")
    store.update_conversation(a.id, profile={"name": "precise"}, system_prompt="x")
    assert store.conversation(a.id).profile == {"name": "precise"}

    store.delete_messages_from(a.id, 1)
    assert [x.content for x in store.messages(a.id)] == ["hi"]
    store.delete_conversation(a.id)
    assert [c.id for c in store.conversations()] == [b.id]
    assert store._c.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascaded


def test_each_message_is_its_own_transaction(db):
    store = Store(db)
    c = store.create_conversation("t")
    store.add_message(c.id, ChatMessage("user", "one"))
    with pytest.raises(ValueError):
        store.add_message(c.id, ChatMessage("robot", "bad role"))  # CHECK constraint: rolled back, nothing half-written
    store.add_message(c.id, ChatMessage("user", "two"))
    assert [m.content for m in store.messages(c.id)] == ["one", "two"]
    # another connection sees every committed message at once
    other = sqlite3.connect(db)
    assert other.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 2


def test_migrates_step_by_step_from_version_1_keeping_data_and_a_backup(db):
    db.parent.mkdir(parents=True)
    c = sqlite3.connect(db, isolation_level=None)
    MIGRATIONS[0](c)
    c.execute("UPDATE schema_version SET version = 1")
    c.execute("INSERT INTO conversations (title, model, created_at, updated_at) VALUES ('old', 'smol', 1, 1)")
    c.execute("INSERT INTO messages (conversation_id, position, role, content, created_at, seed) "
              "VALUES (1, 0, 'assistant', 'kept', 1, '7')")
    c.close()
    store = Store(db)
    assert store.version == SCHEMA_VERSION == 5
    [m] = store.messages(1)
    assert m.content == "kept" and m.model == "smol" and m.seed == 7  # v2 filled the new column
    store.add_model("/models/x.gguf")  # a v2 table
    assert store.models() == [("/models/x.gguf", "x.gguf")]
    assert (db.parent / "conversations.db.v1.bak").exists()


def test_migrating_to_an_intermediate_version_then_on(db):
    store = Store(db, target_version=1)
    assert store.version == 1
    store.close()
    assert Store(db).version == SCHEMA_VERSION


def test_corrupt_file_is_refused_and_left_untouched(db):
    db.parent.mkdir(parents=True)
    garbage = b"this is not a database" * 100
    db.write_bytes(garbage)
    with pytest.raises(StoreError, match="not an SQLite database or damaged") as e:
        Store(db)
    assert str(db) in str(e.value) and "\n" not in str(e.value)
    assert db.read_bytes() == garbage


def test_damaged_pages_fail_the_integrity_check(db):
    store = Store(db)
    c = store.create_conversation("x")
    for i in range(300):
        store.add_message(c.id, ChatMessage("user", f"message {i} " * 20))
    store._c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    data = bytearray(db.read_bytes())
    page = 4096
    for offset in range(2 * page, len(data) - page, page):  # scribble over every page but the header page
        data[offset + 8:offset + 200] = b"\xff" * 192
    db.write_bytes(bytes(data))
    before = db.read_bytes()
    with pytest.raises(StoreError, match="damaged|not an SQLite"):
        Store(db)
    assert db.read_bytes() == before


def test_foreign_sqlite_database_is_refused(db):
    db.parent.mkdir(parents=True)
    c = sqlite3.connect(db)
    c.execute("CREATE TABLE something (x)")
    c.commit()
    c.close()
    with pytest.raises(StoreError, match="not mlxchat's"):
        Store(db)


def test_newer_schema_is_refused_and_left_untouched(db):
    store = Store(db)
    store._c.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    store._c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match=rf"newer mlxchat \(schema version {SCHEMA_VERSION + 1}"):
        Store(db)
    assert db.read_bytes() == before


def test_empty_file_becomes_a_new_database(db):
    db.parent.mkdir(parents=True)
    db.touch()
    assert Store(db).version == SCHEMA_VERSION


def test_second_connection_reads_and_writes_concurrently(db):
    a, b = Store(db), Store(db)
    conv = a.create_conversation("shared")
    b.add_message(conv.id, ChatMessage("user", "from b"))
    assert [m.content for m in a.messages(conv.id)] == ["from b"]
    # A long read on one connection does not block writes on the other (WAL).
    reader = sqlite3.connect(db)
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 1
    a.add_message(conv.id, ChatMessage("user", "while b reads"))
    assert reader.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 1  # its snapshot
    reader.rollback()
    # A writer holding the lock briefly makes the other wait (busy_timeout), not fail.
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, lambda: holder.execute("COMMIT")).start()
    t = time.perf_counter()
    b.add_message(conv.id, ChatMessage("user", "after the wait"))
    assert time.perf_counter() - t >= 0.2
    assert len(a.messages(conv.id)) == 3


def test_concurrent_first_open_migrates_once(db):
    errors = []

    def open_it():
        try:
            Store(db).close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert Store(db).version == SCHEMA_VERSION


def test_models_and_settings(db):
    store = Store(db)
    store.set_setting("theme", "textual-light")
    assert store.get_setting("theme") == "textual-light"
    assert store.get_setting("missing", "d") == "d"
    store.add_model("/a.gguf", "a")
    store.remove_model("/a.gguf")
    assert store.models() == []


def test_in_memory_store_for_when_the_file_cannot_be_used():
    store = Store(":memory:")
    c = store.create_conversation("tmp")
    store.add_message(c.id, ChatMessage("user", "x"))
    assert store.messages(c.id)[0].content == "x"
