"""The tree of replies in SQLite (issue 14): branches saved, listed and switched, traces kept, and a database made by
the previous schema (version 2) opening with its data unchanged."""

from __future__ import annotations

import sqlite3

import pytest

from mlxchat.app.store import MIGRATIONS, SCHEMA_VERSION, Store, StoredMessage
from mlxchat.core.chat.messages import ChatMessage, ReplyTree
from mlxchat.core.sampling.trace import Candidate, TokenTrace


@pytest.fixture
def db(tmp_path):
    return tmp_path / "data" / "conversations.db"


def _trace(token_id: int) -> TokenTrace:
    stages = ("processed", "TopK(2)")
    return TokenTrace([Candidate(token_id, "a", 1.5, {"processed": 0.6, "TopK(2)": 0.7}, None, True,
                                 {"MinTokens(1)": 0.0}),
                       Candidate(9, "b", 1.0, {"processed": 0.3, "TopK(2)": None}, "TopK(2)", False,
                                 {"MinTokens(1)": float("-inf")})], 1.0, 0.5, 0, stages)


def test_a_version_2_database_opens_unchanged_and_gains_branches(db):
    # Written as version 2 wrote it (its migrations, then its INSERT statements), not by this code.
    db.parent.mkdir(parents=True)
    c = sqlite3.connect(db, isolation_level=None)
    MIGRATIONS[0](c)
    MIGRATIONS[1](c)
    c.execute("UPDATE schema_version SET version = 2")
    c.execute("INSERT INTO conversations (title, profile, model, created_at, updated_at) "
              "VALUES ('kept', '{}', 'smol', 1, 1)")
    c.execute("INSERT INTO messages (conversation_id, position, role, content, created_at) VALUES (1, 0, 'user', "
              "'hi', 1)")
    c.execute("INSERT INTO messages (conversation_id, position, role, content, created_at, finish_reason, metrics, "
              "seed, model) VALUES (1, 1, 'assistant', 'hello', 2, 'stop', '{\"ttft_s\": 0.1}', ?, 'smol')",
              (str(2**64 - 1),))
    c.close()
    store = Store(db)
    conv = store.conversation(1)
    before = [StoredMessage("user", "hi", id=1, conversation_id=1, position=0, created_at=1),
              StoredMessage("assistant", "hello", "stop", {"ttft_s": 0.1}, seed=2**64 - 1, model="smol", id=2,
                            conversation_id=1, position=1, created_at=2)]
    assert store.version == SCHEMA_VERSION == 5
    assert store.messages(conv.id) == before  # same rows, fields, ids; no token ids or traces
    assert store.messages(conv.id)[1].token_ids == () and store.branches(conv.id, 1).messages == before[1:]
    assert (db.parent / "conversations.db.v2.bak").exists()
    store.add_branch(conv.id, 1, ChatMessage("assistant", "hey", token_ids=[5, 6], seed=3))
    assert [m.content for m in store.branches(conv.id, 1).messages] == ["hello", "hey"]


def test_branches_are_saved_listed_and_switched_with_what_followed_them(db):
    store = Store(db)
    cid = store.create_conversation("t").id
    store.add_message(cid, ChatMessage("user", "q"))
    store.add_message(cid, ChatMessage("assistant", "a1", token_ids=[1, 2], traces=[_trace(1), _trace(2)], seed=7))
    store.add_message(cid, ChatMessage("user", "q2"))
    store.add_message(cid, ChatMessage("assistant", "b1"))
    new = store.add_branch(cid, 1, ChatMessage("assistant", "a2", token_ids=[1, 3], traces=[_trace(1), _trace(3)],
                                                seed=7))
    assert new.position == 1 and [m.content for m in store.messages(cid)] == ["q", "a2"]
    store.add_message(cid, ChatMessage("user", "q3"))
    store.add_message(cid, ChatMessage("assistant", "c1"))
    store.add_branch(cid, 3, ChatMessage("assistant", "c2"))  # a fork inside the second branch
    branches = store.branches(cid, 1)
    assert branches.active == 1 and [m.content for m in branches.messages] == ["a1", "a2"]
    assert branches.messages[0].traces == (_trace(1), _trace(2))  # traces kept in an inactive branch too
    store.select_branch(cid, 1, 0)
    assert [m.content for m in store.messages(cid)] == ["q", "a1", "q2", "b1"]
    assert store.messages(cid)[1].token_ids == (1, 2) and store.messages(cid)[1].seed == 7
    assert store.messages(cid)[1].traces[1].candidates[1].shifts["MinTokens(1)"] == float("-inf")
    store.close()
    store = Store(db)  # every branch survives a restart
    store.select_branch(cid, 1, 1)
    assert [m.content for m in store.messages(cid)] == ["q", "a2", "q3", "c2"]
    assert store.branches(cid, 3).active == 1
    with pytest.raises(ValueError, match="branch index must be between 0 and 1 at position 1, got 2"):
        store.select_branch(cid, 1, 2)
    # The stored tree restores a session's tree: the same alternatives at the same positions.
    tree = ReplyTree(store.messages(cid), store.forks(cid))
    assert [m.content for m in tree.alternatives(1)] == ["a1", "a2"]
    tree.select(1, 0)
    assert [m.content for m in tree.path] == ["q", "a1", "q2", "b1"]
    assert isinstance(tree.path[1], ChatMessage) and tree.path[1].traces == (_trace(1), _trace(2))
    store.delete_messages_from(cid, 1)  # trimming the path drops the forks there
    assert store.forks(cid) == {} and [m.content for m in store.messages(cid)] == ["q"]
