"""Conversations in SQLite: a schema version table with step-wise migrations, WAL, a busy timeout, and one
transaction per message.

The database is the user's history, so it is never overwritten: a file that is not an SQLite database (or fails
its integrity check), an SQLite file that is not mlxchat's, or one written by a newer schema raises
:class:`StoreError` (one line: the file, what is wrong, what to do) and the file is left exactly as it was.

Schema (version 4)::

    schema_version(version)                                  -- one row
    conversations(id, title, system_prompt, profile JSON, model, created_at, updated_at)
    messages(id, conversation_id → conversations ON DELETE CASCADE, position, role, content, created_at,
             finish_reason, metrics JSON, profile JSON, sampler, seed, model,
             token_ids JSON, traces JSON,                    -- a reply's ids and per-token traces (v3)
             reasoning)                                      -- a thinking model's reasoning, apart (v4)
    models(path, label, added_at)                            -- local model files/folders the user added (v2)
    settings(key, value)                                     -- small UI state, e.g. the theme (v2)
    forks(conversation_id → conversations ON DELETE CASCADE, position, active, tails JSON)   -- branches (v3)

**Branches** (a conversation is a tree of replies, core.chat.messages.ReplyTree): ``messages`` holds the active path, so
every position is unique and the code that appends, rewrites and trims by position is unchanged. A position with
alternatives has a ``forks`` row: ``tails`` lists, per alternative, what follows that position in it (its messages
as JSON objects, and the forks further down it); the active alternative's entry is ``null`` since it lives in
``messages``. Switching a branch moves the active tail into JSON and the chosen one into rows, in one transaction.
Traces are stored whole (``TokenTrace.as_dict``, compact JSON: about 0.5 kB per token at K = 5), so the heat view and
the inspector survive a restart.

One concern, the SQLite file, in one module (over 500 lines): opening and migrating it, and reading and writing its
rows, share the connection, its transactions and the column layout. ChatMessage goes in and comes out
(``StoredMessage`` is a ChatMessage that knows its row).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxchat.core.chat.messages import ChatMessage, Fork, Tail
from mlxchat.core.sampling.trace import TokenTrace

SCHEMA_VERSION = 5
BUSY_TIMEOUT_MS = 5000


def _locked(e: sqlite3.Error) -> bool:
    return isinstance(e, sqlite3.OperationalError) and "database is locked" in str(e)


class StoreError(Exception):
    """The conversations database cannot be used. One line, naming the file."""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str | None
    profile: dict[str, Any]
    model: str | None
    created_at: float
    updated_at: float


@dataclass(kw_only=True)
class StoredMessage(ChatMessage):
    """A message read back: the ChatMessage as it was saved, and where its row is (``position`` in the
    conversation's active path)."""

    id: int = 0
    conversation_id: int = 0
    position: int = 0
    created_at: float = 0.0


@dataclass(frozen=True)
class Branches:
    """The alternatives at one position: the first message of each, oldest first, and which one is active. Only
    the active one has a row (its ``id``); the others are kept in the fork's JSON and have ``id`` 0."""

    active: int
    messages: list[StoredMessage]


# --- migrations: MIGRATIONS[n] takes a database at version n to n + 1 ------------------------------------------

def _to_v1(c: sqlite3.Connection) -> None:
    # Statement by statement: executescript() would commit the surrounding transaction first.
    _script(c, """
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version (version) VALUES (0);
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system_prompt TEXT,
            profile TEXT NOT NULL DEFAULT '{}',
            model TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            created_at REAL NOT NULL,
            finish_reason TEXT,
            metrics TEXT,
            profile TEXT,
            sampler TEXT,
            seed TEXT,  -- a 64-bit unsigned seed does not fit SQLite's signed INTEGER
            UNIQUE (conversation_id, position)
        );
        CREATE INDEX conversations_by_update ON conversations (updated_at DESC);
    """)


def _script(c: sqlite3.Connection, script: str) -> None:
    for statement in script.split(";"):
        if statement.strip():
            c.execute(statement)


def _to_v2(c: sqlite3.Connection) -> None:
    c.execute("ALTER TABLE messages ADD COLUMN model TEXT")
    c.execute("UPDATE messages SET model = (SELECT model FROM conversations WHERE conversations.id = "
              "messages.conversation_id) WHERE role = 'assistant'")
    c.execute("CREATE TABLE models (path TEXT PRIMARY KEY, label TEXT NOT NULL, added_at REAL NOT NULL)")
    c.execute("CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _to_v3(c: sqlite3.Connection) -> None:
    # Added columns are NULL in the rows already there: an older reply has no ids to branch from, and no traces.
    c.execute("ALTER TABLE messages ADD COLUMN token_ids TEXT")
    c.execute("ALTER TABLE messages ADD COLUMN traces TEXT")
    c.execute("CREATE TABLE forks (conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE, "
              "position INTEGER NOT NULL, active INTEGER NOT NULL, tails TEXT NOT NULL, "
              "PRIMARY KEY (conversation_id, position))")


def _to_v4(c: sqlite3.Connection) -> None:
    # A thinking model's reasoning apart from the answer (core/decode/reasoning.py); NULL in the rows already there
    # (their content is kept as it was: a reply saved before carried no reasoning apart).
    c.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT")


def _to_v5(c: sqlite3.Connection) -> None:
    # A reply's tool calls and their results (core/chat/tool_loop.py), as JSON; NULL in the rows already there, and
    # missing from the alternatives saved before in forks' tails (`_full` reads them as NULL).
    c.execute("ALTER TABLE messages ADD COLUMN tool_calls TEXT")


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_to_v1, _to_v2, _to_v3, _to_v4, _to_v5]
assert len(MIGRATIONS) == SCHEMA_VERSION


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _compact(value: Any) -> str | None:
    """Token ids and traces: large, written once, never compared, so no sorting or spaces."""
    return None if not value else json.dumps(value, separators=(",", ":"), allow_nan=False)


_MESSAGE_COLUMNS = ("role, content, created_at, finish_reason, metrics, profile, sampler, seed, model, token_ids, "
                    "traces, reasoning, tool_calls")
_COLUMN_COUNT = _MESSAGE_COLUMNS.count(",") + 1


def _full(values: Sequence[Any]) -> list[Any]:
    """A message's column values, the columns added since they were saved (in a fork's tail: reasoning in v4,
    tool_calls in v5) as NULL."""
    return [*values, *[None] * (_COLUMN_COUNT - len(values))]


def _message_values(message: ChatMessage, created_at: float) -> tuple:
    """A message's column values, in _MESSAGE_COLUMNS order (an empty metrics or profile is stored as NULL)."""
    m = message
    return (m.role, m.content, created_at, m.finish_reason, _dumps(m.metrics or None), _dumps(m.profile or None),
            m.sampler, None if m.seed is None else str(m.seed), m.model, _compact(list(m.token_ids)),
            _compact([t.as_dict() for t in m.traces]), m.reasoning or None, _compact(list(m.tool_calls)))


def _message_fields(values: Sequence[Any]) -> tuple[tuple, float]:
    """Column values (in _MESSAGE_COLUMNS order) as ChatMessage's positional fields, and the row's created_at."""
    role, content, created, finish, metrics, profile, sampler, seed, model, ids, traces, reasoning, calls = \
        _full(values)
    return ((role, content, finish, _loads(metrics) or {}, _loads(profile) or {}, tuple(_loads(ids) or ()),
             None if seed is None else int(seed), tuple(TokenTrace.from_dict(t) for t in _loads(traces) or ()),
             sampler, model, reasoning or "", tuple(_loads(calls) or ())), created)


def _stored(id_: int, conversation_id: int, position: int, values: Sequence[Any]) -> StoredMessage:
    fields, created = _message_fields(values)
    return StoredMessage(*fields, id=id_, conversation_id=conversation_id, position=position, created_at=created)


def _fork_from_json(fork: dict[str, Any]) -> Fork:
    return Fork(fork["active"], [None if t is None else Tail(
        [ChatMessage(*_message_fields(m)[0]) for m in t["messages"]],
        {int(p): _fork_from_json(f) for p, f in t["forks"].items()}) for t in fork["tails"]])


class Store:
    """One connection to the conversations database. Use it from one thread (the UI's)."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time,
                 target_version: int = SCHEMA_VERSION) -> None:
        self.path = path if path == ":memory:" else Path(path)
        self.clock = clock
        if isinstance(self.path, Path):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # e.g. a parent that is a regular file, or a folder we may not write in
                raise StoreError(f"{self.path}: cannot create the data folder {self.path.parent} "
                                 f"({e.strerror or e}); set MLXCHAT_DATA_DIR to a folder you can write to") from None
        try:
            self._c = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as e:
            raise self._unwritable(e) or StoreError(
                f"{self.path}: cannot open the conversations database ({e})") from None
        try:
            self._open_waiting(target_version)
        except sqlite3.Error as e:  # anything not explained by _open itself: still one line, never a traceback
            self._c.close()
            raise self._unwritable(e) or self._fail(f"cannot be used ({e})") from None
        except BaseException:
            self._c.close()
            raise

    # --- opening and migrating ------------------------------------------------------------------------------------

    def _fail(self, problem: str) -> StoreError:
        return StoreError(f"{self.path}: {problem}; the file was left untouched (move it away to start a new "
                          "history)")

    def _unwritable(self, e: sqlite3.Error) -> StoreError | None:
        """The error as a one-line 'cannot write here' StoreError, if that is what it means (else None)."""
        name = getattr(e, "sqlite_errorname", None) or ""
        if not name.startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_PERM", "SQLITE_AUTH")):
            return None
        where = self.path.parent if isinstance(self.path, Path) else self.path
        if isinstance(self.path, Path) and not self.path.exists():
            return StoreError(f"{self.path}: cannot create the conversations database ({e}): is {where} "
                              "read-only? Set MLXCHAT_DATA_DIR to a folder you can write to")
        return StoreError(f"{self.path}: cannot write to the conversations database ({e}): is it, or the folder "
                          f"{where}, read-only? The file was left untouched")

    def _open_waiting(self, target: int) -> None:
        """`_open`, again while another connection's first open holds the file: some of what opening does (switching
        to WAL, reading a WAL file another connection is setting up) answers "database is locked" at once rather than
        through busy_timeout (4 processes opening a new history together failed one in a loaded test run). Every step
        of `_open` can run twice: migrations check the version inside their own transactions."""
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                return self._open(target)
            except sqlite3.OperationalError as e:
                if not _locked(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _open(self, target: int) -> None:
        c = self._c
        c.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        try:
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as e:
            if _locked(e):
                raise  # another connection is opening it: _open_waiting tries again
            raise self._unwritable(e) or self._fail(f"not an SQLite database or damaged ({e})") from None
        version = self._version() if "schema_version" in tables else None
        if version is None and tables:
            raise self._fail("an SQLite database, but not mlxchat's (no schema_version table)")
        if version is not None and version > SCHEMA_VERSION:
            raise self._fail(f"written by a newer mlxchat (schema version {version}; this one reads up to "
                             f"{SCHEMA_VERSION}): upgrade mlxchat")
        if version is not None:
            try:
                check = c.execute("PRAGMA quick_check(1)").fetchall()[0][0]
            except sqlite3.DatabaseError as e:
                if _locked(e):
                    raise
                check = str(e)
            if check != "ok":
                raise self._fail(f"damaged (integrity check: {check})")
        if self.path != ":memory:":
            mode = c.execute("PRAGMA journal_mode = WAL").fetchall()[0][0]
            if mode.lower() != "wal":
                raise self._fail(f"cannot switch to WAL journaling (got {mode})")
        c.execute("PRAGMA foreign_keys = ON")
        c.execute("PRAGMA synchronous = NORMAL")
        if (version or 0) < target and version and isinstance(self.path, Path):
            # Keep the last copy of the older schema, in case an upgrade step ever goes wrong.
            backup = sqlite3.connect(self.path.with_name(f"{self.path.name}.v{version}.bak"))
            try:
                c.backup(backup)
            finally:
                backup.close()
        self.migrate(target)
        # A file or folder we may read but not write opens fine and fails at the first message: find out now.
        # (This statement writes nothing; it only asks SQLite for a write transaction.)
        with self._tx() as c:
            c.execute("UPDATE schema_version SET version = version WHERE 0")

    def _version(self) -> int:
        rows = self._c.execute("SELECT version FROM schema_version").fetchall()
        row = rows[0] if rows else None
        if row is None:
            raise self._fail("its schema_version table is empty")
        return int(row[0])

    def migrate(self, target: int = SCHEMA_VERSION) -> None:
        """Apply the missing steps, each in its own transaction with its version bump."""
        while True:
            with self._tx() as c:
                tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                version = self._version() if "schema_version" in tables else 0
                if version >= target:
                    return
                MIGRATIONS[version](c)
                c.execute("UPDATE schema_version SET version = ?", (version + 1,))

    @property
    def version(self) -> int:
        return self._version()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taking the write lock up front (so busy_timeout applies, no upgrade deadlock)."""
        c = self._c
        try:
            c.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise self._unwritable(e) or StoreError(
                f"{self.path}: the database is busy ({e}); is another mlxchat writing to it?") from None
        try:
            yield c
            c.execute("COMMIT")
        except sqlite3.OperationalError as e:  # e.g. the disk is full, or the file became read-only
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise self._unwritable(e) or StoreError(f"{self.path}: cannot save ({e})") from None
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._c.close()

    # --- conversations -------------------------------------------------------------------------------------------

    @staticmethod
    def _conversation(row: tuple) -> Conversation:
        id_, title, system, profile, model, created, updated = row
        return Conversation(id_, title, system, _loads(profile) or {}, model, created, updated)

    _CONV = "SELECT id, title, system_prompt, profile, model, created_at, updated_at FROM conversations"

    def create_conversation(self, title: str, *, system_prompt: str | None = None,
                            profile: dict[str, Any] | None = None, model: str | None = None) -> Conversation:
        now = self.clock()
        with self._tx() as c:
            cur = c.execute("INSERT INTO conversations (title, system_prompt, profile, model, created_at, updated_at)"
                            " VALUES (?, ?, ?, ?, ?, ?)",
                            (title.strip() or "New chat", system_prompt, _dumps(profile or {}), model, now, now))
            return Conversation(cur.lastrowid, title.strip() or "New chat", system_prompt, profile or {}, model,
                                now, now)

    def conversations(self) -> list[Conversation]:
        """Newest first (by last activity)."""
        return [self._conversation(r) for r in self._c.execute(self._CONV + " ORDER BY updated_at DESC, id DESC")]

    def conversation(self, conversation_id: int) -> Conversation:
        row = self._c.execute(self._CONV + " WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return self._conversation(row)

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        if not title.strip():
            raise ValueError("a conversation title cannot be empty")
        with self._tx() as c:
            c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title.strip(), conversation_id))

    def update_conversation(self, conversation_id: int, **fields: Any) -> None:
        """Change system_prompt, profile (a dict) or model."""
        allowed = {"system_prompt", "profile", "model"}
        if unknown := set(fields) - allowed:
            raise ValueError(f"cannot update {', '.join(sorted(unknown))}")
        if not fields:
            return
        values = [_dumps(v) if k == "profile" else v for k, v in fields.items()]
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as c:
            c.execute(f"UPDATE conversations SET {sets}, updated_at = ? WHERE id = ?",
                      (*values, self.clock(), conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # --- messages ------------------------------------------------------------------------------------------------

    def add_message(self, conversation_id: int, message: ChatMessage) -> StoredMessage:
        """Append one message (with its stats, and for a reply its token ids and traces, which branching and the
        heat view need) and touch the conversation, in one transaction."""
        with self._tx() as c:
            (position,) = c.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE conversation_id = ?",
                                    (conversation_id,)).fetchone()
            return self._insert(c, conversation_id, position, message)

    def _insert(self, c: sqlite3.Connection, conversation_id: int, position: int,
                message: ChatMessage) -> StoredMessage:
        now = self.clock()
        values = _message_values(message, now)
        try:
            cur = c.execute(f"INSERT INTO messages (conversation_id, position, {_MESSAGE_COLUMNS}) "
                            f"VALUES ({', '.join('?' * (len(values) + 2))})", (conversation_id, position, *values))
        except sqlite3.IntegrityError as e:
            raise ValueError(f"cannot store the message: {e}") from None
        c.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return _stored(cur.lastrowid, conversation_id, position, values)

    def update_message(self, conversation_id: int, position: int, message: ChatMessage) -> None:
        """Rewrite the message at ``position`` (a reply saved while it streamed, now longer or final); its role,
        model and creation time stay."""
        _, content, _, *rest = _message_values(message, 0.0)
        finish, metrics, profile, sampler, seed, _, ids, traces, reasoning, calls = rest
        with self._tx() as c:
            c.execute("UPDATE messages SET content = ?, finish_reason = ?, metrics = ?, profile = ?, sampler = ?, "
                      "seed = ?, token_ids = ?, traces = ?, reasoning = ?, tool_calls = ? WHERE conversation_id = ? "
                      "AND position = ?",
                      (content, finish, metrics, profile, sampler, seed, ids, traces, reasoning, calls, conversation_id,
                       position))
            c.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (self.clock(), conversation_id))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The active path of the conversation (see `branches` for the alternatives along it)."""
        rows = self._c.execute(f"SELECT id, conversation_id, position, {_MESSAGE_COLUMNS} FROM messages "
                               "WHERE conversation_id = ? ORDER BY position", (conversation_id,))
        return [_stored(r[0], r[1], r[2], r[3:]) for r in rows]

    def recent_user_messages(self, limit: int = 200) -> list[str]:
        """What the user sent lately, oldest first (the input's up/down history)."""
        rows = self._c.execute("SELECT content FROM messages WHERE role = 'user' ORDER BY created_at DESC, id DESC "
                               "LIMIT ?", (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]

    def delete_messages_from(self, conversation_id: int, position: int) -> None:
        """Drop the message at ``position`` and every later one (regenerate, edit and resend), with the alternatives
        at those positions."""
        with self._tx() as c:
            c.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (conversation_id, position))
            c.execute("DELETE FROM forks WHERE conversation_id = ? AND position >= ?", (conversation_id, position))

    # --- branches ------------------------------------------------------------------------------------------------

    def add_branch(self, conversation_id: int, position: int, message: ChatMessage) -> StoredMessage:
        """Save a new alternative at ``position`` (e.g. `ChatSession.branch`'s reply) and make it the active one:
        the message there and everything after it move into the fork's JSON, the new message takes ``position``.
        One transaction."""
        with self._tx() as c:
            fork = self._fork(c, conversation_id, position) or {"active": 0, "tails": [None]}
            tail = self._cut(c, conversation_id, position)
            if not tail["messages"]:
                raise ValueError(f"there is no message at position {position} to branch from")
            fork["tails"][fork["active"]] = tail
            fork["tails"].append(None)
            fork["active"] = len(fork["tails"]) - 1
            self._put_fork(c, conversation_id, position, fork)
            return self._insert(c, conversation_id, position, message)

    def branches(self, conversation_id: int, position: int) -> Branches:
        """The alternatives at ``position`` (what a ``< 2/3 >`` switch shows); one when it was never branched."""
        fork = self._fork(self._c, conversation_id, position)
        live = [_stored(r[0], conversation_id, position, r[1:]) for r in self._c.execute(
            f"SELECT id, {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND position = ?",
            (conversation_id, position))]
        if fork is None:
            return Branches(0, live)
        return Branches(fork["active"], [live[0] if t is None else _stored(0, conversation_id, position,
                                                                           t["messages"][0])
                                         for t in fork["tails"]])

    def select_branch(self, conversation_id: int, position: int, index: int) -> None:
        """Make alternative ``index`` at ``position`` the active one: `messages` then continues with it and what
        followed it. One transaction."""
        with self._tx() as c:
            fork = self._fork(c, conversation_id, position)
            count = 1 if fork is None else len(fork["tails"])
            if not 0 <= index < count:
                raise ValueError(f"branch index must be between 0 and {count - 1} at position {position}, got {index}")
            if fork is None or index == fork["active"]:
                return
            fork["tails"][fork["active"]] = self._cut(c, conversation_id, position)
            chosen, fork["tails"][index], fork["active"] = fork["tails"][index], None, index
            self._paste(c, conversation_id, position, chosen)
            self._put_fork(c, conversation_id, position, fork)

    def forks(self, conversation_id: int) -> dict[int, Fork]:
        """Every fork along the active path, by position, as `ChatSession.replace_history(messages, forks)` takes
        them (restoring the whole tree of a reopened conversation)."""
        rows = self._c.execute("SELECT position, active, tails FROM forks WHERE conversation_id = ?",
                               (conversation_id,))
        return {p: _fork_from_json({"active": a, "tails": json.loads(t)}) for p, a, t in rows}

    @staticmethod
    def _fork(c: sqlite3.Connection, conversation_id: int, position: int) -> dict[str, Any] | None:
        row = c.execute("SELECT active, tails FROM forks WHERE conversation_id = ? AND position = ?",
                        (conversation_id, position)).fetchone()
        return None if row is None else {"active": row[0], "tails": json.loads(row[1])}

    @staticmethod
    def _put_fork(c: sqlite3.Connection, conversation_id: int, position: int, fork: dict[str, Any]) -> None:
        c.execute("INSERT OR REPLACE INTO forks (conversation_id, position, active, tails) VALUES (?, ?, ?, ?)",
                  (conversation_id, position, fork["active"], _compact(fork["tails"])))

    def _cut(self, c: sqlite3.Connection, conversation_id: int, position: int) -> dict[str, Any]:
        """Remove the active path from ``position`` on (and the forks below it) and return it as a tail."""
        rows = c.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND position >= ? "
                         "ORDER BY position", (conversation_id, position)).fetchall()
        forks = {str(p): {"active": a, "tails": json.loads(t)} for p, a, t in c.execute(
            "SELECT position, active, tails FROM forks WHERE conversation_id = ? AND position > ?",
            (conversation_id, position))}
        c.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (conversation_id, position))
        c.execute("DELETE FROM forks WHERE conversation_id = ? AND position > ?", (conversation_id, position))
        return {"messages": [list(r) for r in rows], "forks": forks}

    def _paste(self, c: sqlite3.Connection, conversation_id: int, position: int, tail: dict[str, Any]) -> None:
        """Write a tail back as the active path from ``position`` on."""
        for i, values in enumerate(tail["messages"]):
            values = _full(values)  # saved before v4 / v5
            c.execute(f"INSERT INTO messages (conversation_id, position, {_MESSAGE_COLUMNS}) "
                      f"VALUES ({', '.join('?' * (len(values) + 2))})", (conversation_id, position + i, *values))
        for p, fork in tail["forks"].items():
            self._put_fork(c, conversation_id, int(p), fork)

    def clear_messages(self, conversation_id: int) -> None:
        self.delete_messages_from(conversation_id, 0)

    # --- models and settings -------------------------------------------------------------------------------------

    def add_model(self, path: str, label: str | None = None) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO models (path, label, added_at) VALUES (?, ?, ?)",
                      (path, label or Path(path).name, self.clock()))

    def remove_model(self, path: str) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM models WHERE path = ?", (path,))

    def models(self) -> list[tuple[str, str]]:
        """(path, label), most recently added first."""
        return [(p, lbl) for p, lbl in self._c.execute("SELECT path, label FROM models ORDER BY added_at DESC")]

    def get_setting(self, key: str, default: str | None = None) -> str | None:
        row = self._c.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return default if row is None else row[0]

    def set_setting(self, key: str, value: str) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, value))
