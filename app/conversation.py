"""The chat's logic without Textual: one conversation, its engine session, its stored record, and the reply in flight.

The chat screen composes widgets and routes messages; everything it decides lives here and is tested without a
terminal (tests/test_conversation.py drives this class with the real engine and the real store):

- one explicit :class:`State` instead of "busy" flags;
- the turns of the conversation (what the transcript shows and the export writes), with their place in the store;
- the store as a mirror of the turns: a write that fails (disk full, database turned read-only) is reported once
  and retried with the next write, and the conversation stays whole in memory meanwhile;
- a streaming reply saved about every second (a ``kill -9`` loses at most that), and on quit, marked ``cancelled``;
- the compensation for a prompt the engine refused (it leaves the session and the store, and stays shown, unsent);
- replies that outlive navigation: stopped, they land in the conversation they belong to.

Starting a reply (``ChatSession.send`` and friends) does not block: it queues the turn on the engine's thread and
returns its ``Stream``, which the UI's bridge thread (``EngineWorker.follow``) iterates. The bridge's messages come
back here through ``on_prefill``/``on_tokens``/``on_finished``/``on_failed``, keyed by that stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from mlxchat.core.errors import ContextLengthError
from mlxchat.core.messages import ChatMessage, ContextPolicy
from mlxchat.core.profile import SamplingProfile

from . import export
from .replay import TRACE_K, ReplaySource
from .store import Conversation, Store, StoredMessage, StoreError

if TYPE_CHECKING:
    from mlxchat.core import ChatSession, Engine, Stream
    from mlxchat.core.events import GenerationResult, Metrics
    from mlxchat.core.trace import TokenTrace

Severity = Literal["information", "warning", "error"]
Notify = Callable[[str, Severity], None]

CHECKPOINT_S = 1.0  # a streaming reply is saved at its first tokens and then at most this long apart


def keeps(result: "GenerationResult") -> bool:
    """Whether a finished reply stays in the chat: not when it was stopped before its first token (what the
    ChatSession keeps, too)."""
    return bool(result.text) or result.finish_reason != "cancelled"


class State(Enum):
    IDLE = "idle"  # nothing in flight: send, regenerate, edit, switch chats
    LOADING = "loading"  # a message waits for the model to finish loading
    STARTING = "starting"  # the reply is with the engine (queued or prefilling), no token yet
    STREAMING = "streaming"  # tokens arrive


class Refused(Exception):
    """The action cannot be done now; the message says why and what to do (one line, for a notification)."""

    def __init__(self, message: str, severity: Severity = "warning") -> None:
        super().__init__(message)
        self.severity = severity


@dataclass(eq=False)
class Turn:
    """One message of the conversation, as shown and stored. A ``system`` turn is a system prompt set mid-chat."""

    role: Literal["system", "user", "assistant"]
    content: str
    position: int | None = None  # in the store, once saved
    finish_reason: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    sampler: str | None = None
    seed: int | None = None
    model: str | None = None
    unsent: bool = False  # refused by the engine: in neither the session nor the store (ctrl+t edits it)
    error: str | None = None  # the reply failed mid-way: shown, not stored, not in the session
    streaming: bool = False
    dirty: bool = False  # saved, but changed since (a reply saved while it streamed)
    token_ids: tuple[int, ...] = ()  # a reply's ids: what branching from one of its tokens needs
    traces: "list[TokenTrace] | None" = None  # per token id, when the reply was traced
    branches: tuple[int, int] = (0, 1)  # (which one, how many): the alternatives at this place of the chat
    branch_at: int | None = None  # a branch not saved yet: the store position it becomes an alternative at

    @property
    def in_history(self) -> bool:
        """Part of what the model sees (and what the store keeps)."""
        return self.role != "system" and not self.unsent and self.error is None and not self.streaming


@dataclass(eq=False)
class Reply:
    """A reply in flight: its turn, the stream it comes from, and the conversation it belongs to."""

    turn: Turn
    answers: Turn | None  # the user turn it answers
    conversation_id: int | None
    stream: "Stream | None" = None  # None while the message waits for the model
    cached: int | None = None  # prompt tokens found in the KV cache (from the first prefill report)
    tokens: int = 0  # tokens streamed so far
    metrics: "Metrics | None" = None  # the last live snapshot
    discard: bool = False  # its conversation was cleared or deleted meanwhile: never store it
    saved_at: float | None = None
    kept: bool = True  # after it finished: False when stopped before its first token (nothing to keep)
    replaced: "list[Turn] | None" = None  # a branch: the turns it took the place of (back if it comes to nothing)


class ChatController:
    """The conversation the chat screen shows. Use it from one thread (the UI's)."""

    def __init__(self, store: Store, *, default_profile: Callable[[], SamplingProfile], default_system: str,
                 max_tokens: int | None = None, kv_window: int | None = None,
                 context_policy: ContextPolicy = "truncate", exports: Path | None = None,
                 notify: Notify | None = None, clock: Callable[[], float] = time.monotonic, trace_k: int = 0) -> None:
        self.store = store
        self.trace_k = trace_k  # candidates recorded per token of every reply (0: replies are not traced)
        self.default_profile, self.default_system = default_profile, default_system
        self.max_tokens, self.kv_window, self.context_policy = max_tokens, kv_window, context_policy
        self.exports = exports or Path("exports")
        self.notify: Notify = notify or (lambda message, severity: None)
        self.clock = clock
        self.state = State.IDLE
        self.engine: Engine | None = None
        self.owns_engine = False
        self.model_spec: str | None = None
        self.loading: str | bool = False  # the spec being loaded ("embedded" for None), or False
        self.session: ChatSession | None = None
        self.record: Conversation | None = None
        self.turns: list[Turn] = []
        self.profile: SamplingProfile = default_profile()
        self.system_prompt = default_system
        self.reply: Reply | None = None  # the current conversation's reply in flight
        self.last_result: GenerationResult | None = None  # of the last reply of this chat that finished
        self._replies: dict[Stream, Reply] = {}  # every reply still streaming, current or left behind
        self._save_failed = False

    @property
    def busy(self) -> bool:
        return self.state is not State.IDLE

    @property
    def title(self) -> str:
        return self.record.title if self.record else "new chat"

    def _require_idle(self) -> None:
        if self.busy:
            raise Refused("A reply is still coming: Esc stops it")

    # --- the engine ----------------------------------------------------------------------------------------------

    def model_loading(self, spec: str | None) -> None:
        self.loading = spec or "embedded"

    def engine_ready(self, engine: "Engine", spec: str | None, *, owned: bool) -> tuple["Engine | None", Reply | None]:
        """Use ``engine`` from now on. Returns the engine it replaces if that one is ours to close, and the reply
        to a message that waited for the model (now started: follow its stream)."""
        old = self.engine if self.owns_engine and self.engine is not engine else None
        self.engine, self.owns_engine, self.model_spec, self.loading = engine, owned, spec, False
        self._new_session()
        if self.record is not None:
            self._write(lambda: self.store.update_conversation(self.record.id, model=engine.name))
        reply = self.reply if self.state is State.LOADING else None
        if reply is not None:
            assert self.session is not None and reply.answers is not None
            self._start(reply, lambda chat: chat.send(reply.answers.content, **self._limits()))
        return old, reply

    def load_failed(self) -> Reply | None:
        """The model did not load. Returns the reply that was waiting for it, now dropped (its message stays,
        unanswered: ctrl+r answers it once a model is loaded)."""
        self.loading = False
        return self._drop_waiting()

    def _drop_waiting(self) -> Reply | None:
        if self.state is not State.LOADING or self.reply is None:
            return None
        reply, self.reply = self.reply, None
        self.turns.remove(reply.turn)
        self.state = State.IDLE
        return reply

    def _history(self) -> list[ChatMessage]:
        waiting = self.reply.answers if self.state is State.LOADING and self.reply else None
        return [self._message(t) for t in self.turns if t.in_history and t is not waiting]

    @staticmethod
    def _message(turn: Turn) -> ChatMessage:
        """A turn as the session holds it: a reply with its ids, seed and traces, so it can be branched."""
        return ChatMessage(turn.role, turn.content, turn.finish_reason, dict(turn.metrics),  # type: ignore[arg-type]
                           dict(turn.profile), turn.token_ids, turn.seed, tuple(turn.traces or ()))

    def _new_session(self) -> None:
        """A fresh ChatSession holding the conversation; its KV cache re-matches it by prefix on the next turn."""
        if self.engine is None:
            self.session = None
            return
        self.session = self.engine.chat(system=self.system_prompt or None, profile=self.profile,
                                        max_kv_size=self.kv_window if self.context_policy == "rotate" else None,
                                        context_policy=self.context_policy)
        self.session.replace_history(self._history())

    def set_context_policy(self, policy: ContextPolicy) -> None:
        """What a chat longer than the context does from its next turn on (config.toml's ``context_policy``)."""
        self._require_idle()
        self.context_policy = policy
        self._new_session()

    # --- sending -------------------------------------------------------------------------------------------------

    def send(self, text: str) -> Reply:
        """Send a message. The reply's stream is None while the model loads (it starts when it is ready)."""
        self._require_idle()
        if self.engine is None and not self.loading:
            raise Refused("No model is loaded: press F3 to pick one", "error")
        if self.session is None:  # the model is loading: the message waits for it
            user = self._add(Turn("user", text))
            reply = self._new_reply(user)
            self.state = State.LOADING
            return reply
        stream = self._call(lambda: self.session.send(text, **self._limits()))
        return self._started(self._new_reply(self._add(Turn("user", text))), stream)

    def resend(self, text: str) -> Reply:
        """Replace the last user message (and what followed) with ``text`` and answer it."""
        self._require_idle()
        if self.session is None:
            raise Refused("The model is still loading")
        last = self._last("user")
        if last is None:
            return self.send(text)
        # A refused (unsent) message is in neither the session nor the store: send the new text, edit nothing.
        start = self.session.send if last.unsent else self.session.edit_last
        stream = self._call(lambda: start(text, **self._limits()))
        self._truncate(last)
        return self._started(self._new_reply(self._add(Turn("user", text))), stream)

    def regenerate(self) -> Reply:
        """Answer the last user message again (dropping the reply it had)."""
        self._require_idle()
        if self.session is None:
            raise Refused("The model is still loading")
        user = self._last("user")
        if user is None:
            raise Refused("Nothing to regenerate yet")
        if user.unsent:
            raise Refused("Your last message was not sent: ctrl+t edits it")
        stream = self._call(lambda: self.session.regenerate(**self._limits()))
        after = self.turns[self.turns.index(user) + 1:]
        if after:
            self._truncate(after[0])
        return self._started(self._new_reply(user), stream)

    def stop(self) -> str:
        """Esc: "dropped" (a message waiting for the model no longer waits), "stopping" (the reply stops at its
        next token), or "" (nothing was in flight)."""
        if self._drop_waiting() is not None:
            return "dropped"
        if self.reply is not None and self.reply.stream is not None:
            self.reply.stream.cancel()
            return "stopping"
        return ""

    def _limits(self, *, trace: int | None = None) -> dict[str, int | None]:
        """What every reply of this chat is started with: its length cap and how many candidates to trace."""
        return {"max_tokens": self.max_tokens, "trace": self.trace_k if trace is None else trace}

    def _call(self, start: Callable[[], "Stream"]) -> "Stream":
        try:
            return start()
        except ValueError as e:  # checked before anything is queued (an empty message, beam search, max_tokens)
            raise Refused(str(e), "error") from None

    def _new_reply(self, answers: Turn | None) -> Reply:
        name = self.engine.name if self.engine else None
        turn = self._add(Turn("assistant", "", model=name, streaming=True, finish_reason="cancelled"))
        self.reply = Reply(turn, answers, self.record.id if self.record else None)
        return self.reply

    def _started(self, reply: Reply, stream: "Stream") -> Reply:
        reply.stream = stream
        reply.turn.model = self.engine.name if self.engine else reply.turn.model
        self._replies[stream] = reply
        self.state = State.STARTING
        return reply

    def _start(self, reply: Reply, start: Callable[["ChatSession"], "Stream"]) -> None:
        assert self.session is not None
        session = self.session
        try:
            stream = start(session)
        except ValueError as e:
            self._drop_waiting()
            self.notify(str(e), "error")
            return
        self._started(reply, stream)

    # --- what the bridge reports ---------------------------------------------------------------------------------

    def reply_for(self, stream: "Stream") -> Reply | None:
        """The reply ``stream`` belongs to, while it is in flight."""
        return self._replies.get(stream)

    def on_prefill(self, stream: "Stream", done: int, total: int) -> Reply | None:
        reply = self._replies.get(stream)
        if reply is not None and reply.cached is None:
            reply.cached = done  # the first report counts what the cache already held
        return reply

    def on_tokens(self, stream: "Stream", text: str, count: int, metrics: "Metrics | None") -> Reply | None:
        reply = self._replies.get(stream)
        if reply is None:
            return None
        reply.tokens += count
        reply.turn.content += text
        reply.metrics = metrics or reply.metrics
        if reply is self.reply:
            self.state = State.STREAMING
        now = self.clock()
        # A branch is saved when it ends (or on quit): saving it mid-way would already move the reply it replaces
        # into the store's fork, which a failure would then have to undo.
        if reply.replaced is None and (reply.saved_at is None or now - reply.saved_at >= CHECKPOINT_S):
            reply.saved_at = now
            self._checkpoint(reply)
        return reply

    def on_finished(self, stream: "Stream", result: "GenerationResult") -> Reply | None:
        reply = self._replies.pop(stream, None)
        if reply is None:
            return None
        turn = reply.turn
        reply.kept = keeps(result)
        turn.content, turn.finish_reason = result.text, result.finish_reason
        turn.metrics, turn.profile = result.metrics.as_dict(), dict(result.profile)
        turn.sampler, turn.seed, turn.streaming, turn.dirty = result.sampler, result.seed, False, True
        turn.token_ids, turn.traces = tuple(result.token_ids), list(result.traces) or None
        current = reply is self.reply
        if not reply.kept:
            self._drop_reply_turn(reply)
        elif current:
            self._persist()
        elif not reply.discard:
            self._save_elsewhere(reply)
        if current:
            self.reply, self.state, self.last_result = None, State.IDLE, result
        return reply

    def on_failed(self, stream: "Stream", error: BaseException) -> tuple[Reply | None, str]:
        """The reply failed. Returns it and the line to show; a prompt the engine refused before any token (e.g.
        longer than the context) is taken out of the session and the store, and stays shown, unsent."""
        reply = self._replies.pop(stream, None)
        if reply is None:
            return None, ""
        message = str(error) or type(error).__name__
        if isinstance(error, ContextLengthError):
            message += self._context_advice()
        turn = reply.turn
        turn.streaming, turn.error = False, message
        if turn.position is not None and not reply.discard:  # a partial save: the session does not have it
            self._delete_from(reply.conversation_id, turn.position)
            turn.position = None
        if reply is self.reply:
            if reply.replaced is not None:  # a failed branch: the reply it was to replace comes back
                self._drop_reply_turn(reply)
            elif reply.tokens == 0 and reply.answers is not None:
                message += self._unsend(reply.answers)
            self.reply, self.state = None, State.IDLE
        return reply, message

    def _drop_reply_turn(self, reply: Reply) -> None:
        """Take a reply that came to nothing out of the turns; a branch gives back the turns it had replaced."""
        if reply.turn not in self.turns:
            return
        i = self.turns.index(reply.turn)
        self.turns[i:i + 1] = reply.replaced or []
        if reply.replaced and self.session is not None:  # the session follows the turns shown again
            self.session.replace_history(self._history())

    def _context_advice(self) -> str:
        """What to change here (the TUI's setting, not a CLI flag) when a turn does not fit the context."""
        where = "(palette: Context policy, or context_policy in config.toml)"
        if self.context_policy == "rotate":  # a window never refuses a conversation; only a model call can
            return ""
        if self.context_policy == "error":
            return (f": shorten it, or set context_policy to truncate (drop the oldest turns) or rotate (a rotating "
                    f"window of kv_window tokens) {where}")
        return (f": shorten the message, or set context_policy to rotate (a rotating window of kv_window tokens) "
                f"{where}")

    def _unsend(self, user: Turn) -> str:
        """Core's ChatSession already drops a refused ``send``/``edit_last`` message; a refused ``regenerate``
        keeps it, and every later turn of this chat (also after a restart) would fail the same way."""
        if user.unsent:
            return ""
        if self.session is not None:
            last = self.session.messages[-1] if self.session.messages else None
            if last is not None and last.role == "user" and last.content == user.content:
                self.session.drop_last_user()
        if user.position is not None and self.record is not None:
            self._delete_from(self.record.id, user.position)
            user.position = None
        user.unsent = True
        return " · your message was not sent: ctrl+t edits it, or send another one"

    # --- saving --------------------------------------------------------------------------------------------------

    def _write(self, fn: Callable[[], Any]) -> bool:
        """Run one store write; a failure is reported once (until a write succeeds again) and never raised."""
        try:
            fn()
        except StoreError as e:
            if not self._save_failed:
                self.notify(f"Cannot save ({e}); the chat is kept here and saved once the database can be "
                            "written again", "error")
            self._save_failed = True
            return False
        if self._save_failed:
            self._save_failed = False
            self.notify("The chat is saved again", "information")
        return True

    def _ensure_record(self) -> bool:
        if self.record is not None:
            return True
        first = next((t.content for t in self.turns if t.role == "user"), "New chat")
        title = " ".join(first.split())
        title = title if len(title) <= 48 else title[:47] + "…"
        model = self.engine.name if self.engine else (self.model_spec or None)

        def create() -> None:
            self.record = self.store.create_conversation(title, system_prompt=self.system_prompt,
                                                         profile=self._profile_dict(), model=model)

        if not self._write(create):
            return False
        if self.reply is not None and self.reply.conversation_id is None:
            self.reply.conversation_id = self.record.id
        return True

    def _persist(self) -> bool:
        """Bring the store up to the turns: add the unsaved ones (in order), rewrite the changed ones."""
        if not any(self._to_save(t) for t in self.turns):
            return True
        if not self._ensure_record():
            return False
        assert self.record is not None
        for turn in self.turns:
            if self._to_save(turn) and not self._write(lambda turn=turn: self._write_turn(self.record.id, turn)):
                return False
        return True

    def _to_save(self, turn: Turn) -> bool:
        if turn.unsent or turn.error is not None or (turn.streaming and not turn.dirty):
            return False
        return turn.position is None or turn.dirty

    def _write_turn(self, conversation_id: int, turn: Turn) -> None:
        fields: dict[str, Any] = dict(finish_reason=turn.finish_reason, metrics=turn.metrics or None,
                                      profile=turn.profile or None, sampler=turn.sampler, seed=turn.seed,
                                      token_ids=turn.token_ids, traces=tuple(turn.traces or ()))
        if turn.position is None and turn.branch_at is not None:
            # A new alternative: what was at that position (and after it) moves into the store's fork.
            stored = self.store.add_branch(conversation_id, turn.branch_at, turn.role, turn.content, model=turn.model,
                                           **fields)
            turn.position, turn.branch_at = stored.position, None
        elif turn.position is None:
            stored = self.store.add_message(conversation_id, turn.role, turn.content, model=turn.model, **fields)
            turn.position = stored.position
        else:
            self.store.update_message(conversation_id, turn.position, turn.content, **fields)
        turn.dirty = False

    def _checkpoint(self, reply: Reply) -> None:
        """Save the reply so far, marked as stopped ("cancelled") until its end rewrites it."""
        if reply.discard or not reply.turn.content:
            return
        reply.turn.metrics = reply.metrics.as_dict() if reply.metrics is not None else {}
        reply.turn.dirty = True
        if reply is self.reply:
            self._persist()
        else:
            self._save_elsewhere(reply)

    def _save_elsewhere(self, reply: Reply) -> None:
        """A reply left behind by navigation lands in its own conversation."""
        if reply.conversation_id is None:
            self.notify("A reply of a chat that was never saved was lost", "warning")
            return
        try:
            self._write(lambda: self._write_turn(reply.conversation_id, reply.turn))
        except ValueError:  # its conversation was deleted meanwhile (foreign key)
            pass

    def _delete_from(self, conversation_id: int | None, position: int) -> None:
        if conversation_id is not None:
            self._write(lambda: self.store.delete_messages_from(conversation_id, position))

    def _truncate(self, turn: Turn) -> None:
        """Drop ``turn`` and what followed it (edit, regenerate). System prompts set meanwhile stay, after."""
        i = self.turns.index(turn)
        dropped = self.turns[i:]
        saved = [t.position for t in dropped if t.position is not None]
        if saved and self.record is not None:
            self._delete_from(self.record.id, min(saved))
        kept = [dataclasses.replace(t, position=None) for t in dropped if t.role == "system"]
        self.turns = self.turns[:i] + kept

    def _last(self, role: str) -> Turn | None:
        return next((t for t in reversed(self.turns) if t.role == role), None)

    def _add(self, turn: Turn) -> Turn:
        self.turns.append(turn)
        self._persist()
        return turn

    def _profile_dict(self) -> dict[str, Any]:
        return self.profile.model_dump(mode="json")

    # --- conversations -------------------------------------------------------------------------------------------

    def _leave(self, *, discard: bool = False) -> None:
        """Stop what is in flight before the conversation changes; a stopped reply still lands in its own
        conversation (unless ``discard``: its conversation was cleared)."""
        self._drop_waiting()
        if self.reply is not None:
            self.reply.discard = discard
            if self.reply.stream is not None:
                self.reply.stream.cancel()
            self.reply = None
        self.state = State.IDLE

    def new_chat(self) -> None:
        self._leave()
        self.record, self.turns, self.last_result = None, [], None
        self.profile, self.system_prompt = self.default_profile(), self.default_system
        self._new_session()

    def open(self, conversation_id: int) -> None:
        """Restore a saved conversation: its messages (with their stats), system prompt and profile."""
        record = self.store.conversation(conversation_id)
        stored = self.store.messages(conversation_id)
        self._leave()
        try:
            profile = SamplingProfile.model_validate(record.profile) if record.profile else None
        except ValidationError as e:
            self.notify(f"The saved profile is no longer valid ({e.errors()[0]['msg']}); using the default",
                        "warning")
            profile = None
        self.record, self.last_result = record, None
        self.turns = self._turns(conversation_id, stored)
        self.profile = profile or self.default_profile()
        changes = [t.content for t in self.turns if t.role == "system"]
        self.system_prompt = changes[-1] if changes else (record.system_prompt or "")
        self._new_session()

    def _turns(self, conversation_id: int, stored: "list[StoredMessage]") -> list[Turn]:
        """Stored messages as turns, each reply with its ids and traces and its place among its alternatives."""
        forks = self.store.forks(conversation_id)
        turns = []
        for m in stored:
            turn = Turn(m.role, m.content, m.position, m.finish_reason, m.metrics or {},  # type: ignore[arg-type]
                        m.profile or {}, m.sampler, m.seed, m.model, token_ids=m.token_ids,
                        traces=list(m.traces) or None)
            if (fork := forks.get(m.position)) is not None:
                turn.branches = (fork.active, len(fork.tails))
            turns.append(turn)
        return turns

    def clear(self) -> None:
        """Delete the messages of this chat (the conversation and its settings stay)."""
        if self.record is not None:
            record = self.record
            if not self._write(lambda: self.store.clear_messages(record.id)):
                raise Refused("The chat was not cleared: the database cannot be written", "error")
            if record.system_prompt != self.system_prompt:  # the prompt in effect now is where it starts
                self._write(lambda: self.store.update_conversation(record.id, system_prompt=self.system_prompt))
                self.record = dataclasses.replace(record, system_prompt=self.system_prompt)
        self._leave(discard=True)
        self.turns, self.last_result = [], None
        self._new_session()

    def rename(self, conversation_id: int, title: str) -> None:
        if self._write(lambda: self.store.rename_conversation(conversation_id, title)) and \
                self.record is not None and self.record.id == conversation_id:
            self.record = self.store.conversation(conversation_id)

    def delete(self, conversation_id: int) -> bool:
        for reply in self._replies.values():
            if reply.conversation_id == conversation_id:
                reply.discard = True
        if self.record is not None and self.record.id == conversation_id:
            self.new_chat()
        return self._write(lambda: self.store.delete_conversation(conversation_id))

    def conversations(self) -> list[Conversation]:
        return self.store.conversations()

    # --- settings of this chat -----------------------------------------------------------------------------------

    def set_profile(self, profile: SamplingProfile) -> None:
        """Use ``profile`` from the next turn on (and remember it with the conversation)."""
        self.profile = profile
        if self.session is not None:
            self.session.profile = profile
        if self.record is not None:
            record = self.record
            self._write(lambda: self.store.update_conversation(record.id, profile=self._profile_dict()))

    def set_system_prompt(self, text: str) -> None:
        """Use ``text`` as the system prompt from the next turn on. Set after messages, it is recorded where it
        was set (a system turn), so the export shows it in place; the conversation's own system prompt stays the
        one it started with."""
        self._require_idle()
        self.system_prompt = text
        if any(t.role != "system" for t in self.turns):
            self._add(Turn("system", text))
        elif self.record is not None:
            record = self.record
            self._write(lambda: self.store.update_conversation(record.id, system_prompt=text))
            self.record = dataclasses.replace(record, system_prompt=text)
        self._new_session()

    # --- the sampler inspector ----------------------------------------------------------------------------------

    @property
    def inspect_k(self) -> int:
        """Candidates per token when a trace is asked for (F7 on an untraced reply, a branch, a replay): the chat's
        own K when it traces every reply, else TRACE_K."""
        return self.trace_k or TRACE_K

    def traces(self, turn: Turn | None) -> "list[TokenTrace] | None":
        """The per-token traces of a reply, for the heat view and the inspector; None when it was written untraced
        (``retrace`` records them)."""
        if turn is None or turn.role != "assistant":
            raise Refused("Pick a reply: the heat view shows a reply's tokens")
        if turn.streaming:
            raise Refused("The reply is still coming: its heat view opens once it is done")
        if turn.error is not None or not turn.content:
            raise Refused("This reply failed: it has no tokens to show")
        return turn.traces

    def retrace(self, turn: Turn) -> tuple[ReplaySource, int]:
        """How to record the traces of a reply written untraced: write it again with the same messages, profile and
        seed, capped at its own length (the source, and that cap)."""
        source = self.replay_source(turn)
        return source, int(turn.metrics.get("completion_tokens") or self.max_tokens or 1024)

    def attach_traces(self, turn: Turn, result: "GenerationResult") -> "list[TokenTrace]":
        """Keep the traces of ``retrace``'s run on ``turn`` if it wrote the same reply."""
        if result.text != turn.content or not result.traces:
            raise Refused("Written again with its seed, this reply came out different (another model, or a "
                          "near tie); F9 replays it side by side", "error")
        turn.token_ids, turn.traces = tuple(result.token_ids), list(result.traces)
        if turn.position is not None:  # saved with them: the heat view and branching survive a restart
            turn.dirty = True
            self._persist()
        if self.session is not None:
            self.session.replace_history(self._history())  # the session can branch it now
        return turn.traces

    def branch_place(self, turn: Turn) -> tuple[int, int] | None:
        """(1-based number, count) of the alternative ``turn`` is at its place in the chat; None with one."""
        active, count = turn.branches
        return (active + 1, count) if count > 1 else None

    def branch(self, turn: Turn, token_index: int, token_id: int) -> Reply:
        """Continue ``turn`` (a reply) from its token ``token_index`` with ``token_id`` instead: a new alternative
        of that reply, which takes its place (and that of what followed it) in the chat; the old one stays a branch.
        The KV cache is trimmed to the kept tokens, not prefilled again."""
        self._require_idle()
        if self.session is None:
            raise Refused("The model is still loading")
        traces = self.traces(turn)
        if traces is None or not turn.token_ids:
            raise Refused("Trace this reply first (F7): a branch starts from one of its traced tokens")
        if turn not in self.turns or turn.position is None or self.record is None:
            raise Refused("This reply is not saved yet, so it cannot be branched", "error")
        if traces[token_index].chosen.token_id == token_id:
            raise Refused("That is the token it chose: pick another candidate to branch from")
        index = self._session_index(turn)
        stream = self._call(lambda: self.session.branch(index, token_index, token_id,
                                                        **self._limits(trace=self.inspect_k)))
        i = self.turns.index(turn)
        replaced = self.turns[i:]
        count = turn.branches[1]
        new = Turn("assistant", "", model=self.engine.name if self.engine else None, streaming=True,
                   finish_reason="cancelled", branches=(count, count + 1), branch_at=turn.position)
        self.turns[i:] = [new]
        answers = next((t for t in reversed(self.turns[:i]) if t.role == "user"), None)
        self.reply = Reply(new, answers, self.record.id, replaced=replaced)
        return self._started(self.reply, stream)

    def switch_branch(self, turn: Turn, step: int) -> Turn:
        """Show the previous (-1) or next (+1) alternative at ``turn``'s place; return the turn now shown there."""
        self._require_idle()
        active, count = turn.branches
        if count < 2:
            raise Refused("This reply has no other branch: Enter on a candidate in the inspector makes one")
        if turn.position is None or self.record is None or turn not in self.turns:
            raise Refused("This reply is not saved yet", "error")
        target = (active + step) % count
        record, position = self.record, turn.position
        if not self._write(lambda: self.store.select_branch(record.id, position, target)):
            raise Refused("The branch was not switched: the database cannot be written", "error")
        i = self.turns.index(turn)
        self.turns[i:] = self._turns(record.id, [m for m in self.store.messages(record.id) if m.position >= position])
        if self.session is not None:
            self.session.replace_history(self._history())  # the model goes on from the branch shown
        return self.turns[i]

    def _session_index(self, turn: Turn) -> int:
        """Where ``turn`` is in the session's messages (system prompt first)."""
        assert self.session is not None
        before = sum(t.in_history for t in self.turns[:self.turns.index(turn)])
        index = before + (1 if self.session.system else 0)
        messages = self.session.messages
        if index >= len(messages) or messages[index].content != turn.content:
            raise Refused("The chat changed under this reply: reopen the chat and branch again", "error")
        return index

    def replay_source(self, turn: Turn | None) -> ReplaySource:
        """What a replay of ``turn`` re-runs: the messages before it (system prompt first), its profile and seed."""
        self._require_idle()
        if self.engine is None:
            raise Refused("No model is loaded: press F3 to pick one", "error")
        if turn is None or turn.role != "assistant" or turn.error is not None:
            raise Refused("No reply to replay yet")
        if turn not in self.turns:
            raise Refused("That reply is no longer in the chat")
        before = self.turns[:self.turns.index(turn)]
        changes = [t.content for t in before if t.role == "system"]
        # The prompt in effect when it was written: the last one set before it, else the one the chat started with.
        system = changes[-1] if changes else (self.record.system_prompt if self.record else self.system_prompt)
        messages = [ChatMessage("system", system)] if system else []
        messages += [ChatMessage(t.role, t.content) for t in before if t.in_history]  # type: ignore[arg-type]
        return ReplaySource(tuple(messages), dict(turn.profile) or self._profile_dict(), turn.seed, self.max_tokens)

    # --- export and quitting -------------------------------------------------------------------------------------

    def default_export_path(self) -> Path:
        return export.default_path(self.exports, self.title if self.record else "chat")

    def export_markdown(self, path: str | Path | None = None) -> Path:
        """Write the chat as Markdown (to ``path``, or a new file in the exports folder)."""
        target = Path(path).expanduser() if path else self.default_export_path()
        started_with = self.record.system_prompt if self.record else self.system_prompt
        text = export.markdown(self.record.title if self.record else "New chat", self.turns,
                               system_prompt=started_with or "", model=self.engine.name if self.engine else None,
                               profile=self.profile)
        return export.write(target, text)

    def close(self) -> None:
        """Quitting: stop every reply in flight and save what it said so far, marked ``cancelled``."""
        self._drop_waiting()
        for reply in list(self._replies.values()):
            if reply.stream is not None:
                reply.stream.cancel()
            reply.saved_at = None
            self._checkpoint(reply)
        self.reply = None
        self.state = State.IDLE
