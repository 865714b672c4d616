"""The chat's logic without Textual: what the user and the engine's bridge do to one chat (chat_state.py holds it:
its ChatSession, whose tree is the conversation, the turns the transcript shows, its record in the store).

The chat screen composes widgets and routes messages; everything it decides lives here and is tested without a
terminal (tests/test_conversation.py drives this class with the real engine and the real store):

- one explicit :class:`State` instead of "busy" flags;
- the store mirrors the session's tree (record.py): a write that fails (disk full, database turned read-only) is
  reported once and retried with the next write, and the conversation stays whole in memory meanwhile;
- a streaming reply saved about every second (a ``kill -9`` loses at most that), and on quit, marked ``cancelled``;
- the compensation for a prompt the engine refused (it leaves the session and the store, and stays shown, unsent);
- replies that outlive navigation: stopped, they land in the conversation they belong to.

Starting a reply (``ChatSession.send`` and friends) does not block: it queues the turn on the engine's thread and
returns its ``Stream``, which the UI's bridge thread (``EngineWorker.follow``) iterates. The bridge's messages come
back here through ``on_prefill``/``on_tokens``/``on_finished``/``on_failed``, keyed by that stream. The sampler
inspector's logic (traces, branches, replays) is inspection.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from mlxchat.core.errors import ContextLengthError
from mlxchat.core.chat.messages import ChatMessage, ContextPolicy
from mlxchat.core.sampling.profile import SamplingProfile

from . import export
from .chat_state import ChatState
from .store import Conversation
from .turns import Refused, Reply, State, Turn, keeps

if TYPE_CHECKING:
    from mlxchat.core import ChatSession, Engine, Stream
    from mlxchat.core.decode.events import GenerationResult, Metrics

__all__ = ["CHECKPOINT_S", "ChatController", "Refused", "Reply", "State", "Turn", "keeps"]

CHECKPOINT_S = 1.0  # a streaming reply is saved at its first tokens and then at most this long apart


class ChatController(ChatState):
    """The conversation the chat screen shows, and what is done to it. Use it from one thread (the UI's)."""

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
            self.saved.write(lambda: self.store.update_conversation(self.record.id, model=engine.name))
        reply = self.reply if self.state is State.LOADING else None
        if reply is not None:
            assert self.session is not None and reply.answers is not None
            self._start(reply, lambda chat: chat.send(reply.answers.content, **self.limits()))
        elif self.record is not None and self.session is not None:
            self.session.warm()  # a chat opened before the model was ready: its saved KV cache, in the background
        return old, reply

    def load_failed(self) -> Reply | None:
        """The model did not load. Returns the reply that was waiting for it, now dropped (its message stays,
        unanswered: ctrl+r answers it once a model is loaded)."""
        self.loading = False
        return self._drop_waiting()

    def set_context_policy(self, policy: ContextPolicy) -> None:
        """What a chat longer than the context does from its next turn on (config.toml's ``context_policy``)."""
        self.require_idle()
        self.context_policy = policy
        self._new_session()

    # --- sending -------------------------------------------------------------------------------------------------

    def send(self, text: str) -> Reply:
        """Send a message. The reply's stream is None while the model loads (it starts when it is ready)."""
        self.require_idle()
        if self.engine is None and not self.loading:
            raise Refused("No model is loaded: press F3 to pick one", "error")
        if self.session is None:  # the model is loading: the message waits for it
            user = self._add(Turn(ChatMessage("user", text)))
            reply = self._new_reply(user)
            self.state = State.LOADING
            return reply
        stream = self._call(lambda: self.session.send(text, **self.limits()))
        return self._started(self._new_reply(self._add(Turn(self._last_sent()))), stream)

    def resend(self, text: str) -> Reply:
        """Replace the last user message (and what followed) with ``text`` and answer it. The old message and its
        reply stay a branch (``< 1/2 >`` on the message) when they were saved and no system prompt was set since
        (the new message is written under it); else they are dropped."""
        self.require_idle()
        if self.session is None:
            raise Refused("The model is still loading")
        last = self._last("user")
        if last is None:
            return self.send(text)
        after = self.turns[self.turns.index(last) + 1:]
        if not last.unsent and self.branchable(last) and all(t.role != "system" for t in after):
            limits = self.limits()
            return self.start_alternative(last, lambda session, _: session.edit_last(text, keep=True, **limits),
                                          lead=Turn(ChatMessage("user", text)))
        # A refused (unsent) message is in neither the session nor the store: send the new text, edit nothing.
        start = self.session.send if last.unsent else self.session.edit_last
        stream = self._call(lambda: start(text, **self.limits()))
        self._truncate(last)
        return self._started(self._new_reply(self._add(Turn(self._last_sent()))), stream)

    def regenerate(self) -> Reply:
        """Answer the last user message again. The reply it had stays a branch (``< 1/2 >``, as the inspector's
        branches do) when it was saved; one never saved, or followed by a system prompt set since (which the new
        reply is written under), is dropped."""
        self.require_idle()
        if self.session is None:
            raise Refused("The model is still loading")
        user = self._last("user")
        if user is None:
            raise Refused("Nothing to regenerate yet")
        if user.unsent:
            raise Refused("Your last message was not sent: ctrl+t edits it")
        after = self.turns[self.turns.index(user) + 1:]
        if len(after) == 1 and after[0].role == "assistant" and self.branchable(after[0]):
            limits = self.limits()
            return self.start_alternative(after[0], lambda session, _: session.regenerate(keep=True, **limits))
        stream = self._call(lambda: self.session.regenerate(**self.limits()))
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

    def _start(self, reply: Reply, start: Callable[["ChatSession"], "Stream"]) -> None:
        assert self.session is not None
        session = self.session
        try:
            stream = start(session)
        except ValueError as e:
            self._drop_waiting()
            self.notify(str(e), "error")
            return
        if reply.answers is not None:  # the waiting message is the session's now
            reply.answers.message = self._last_sent()
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

    def on_tokens(self, stream: "Stream", text: str, count: int, metrics: "Metrics | None",
                  reasoning: str = "") -> Reply | None:
        reply = self._replies.get(stream)
        if reply is None:
            return None
        reply.tokens += count
        reply.turn.message.content += text
        reply.turn.message.reasoning += reasoning
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
        turn.streaming, turn.dirty = False, True
        if reply.kept:  # the session's record of it from now on (it joins the session before its Done is posted)
            assert reply.session is not None
            turn.message = reply.session.messages[-1]
            if reply.lead is not None:  # and of the edited message it answers
                reply.lead.message = reply.session.messages[-2]
        current = reply is self.reply
        if not reply.kept:
            self._drop_reply_turn(reply)
        elif current:
            if reply.session is not self.session and self.session is not None:  # a model loaded meanwhile
                self.session.replace_history(*reply.session.history())
            self._refresh_branches([t for t in (reply.lead, turn) if t is not None])
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
            self.saved.delete_from(reply.conversation_id, turn.position)
            turn.position = None
        if reply is self.reply:
            if reply.replaced is not None:  # a failed branch: the reply it was to replace comes back
                self._drop_reply_turn(reply)
                if reply.lead is not None:
                    message += " · your message was not sent: ctrl+t edits it, or send another one"
            elif reply.tokens == 0 and reply.answers is not None:
                message += self._unsend(reply.answers)
            self.reply, self.state = None, State.IDLE
        return reply, message

    def _drop_reply_turn(self, reply: Reply) -> None:
        """Take a reply that came to nothing out of the turns; a branch gives back the turns it had replaced."""
        if reply.turn not in self.turns:
            return
        i = self.turns.index(reply.turn)
        if reply.lead is not None:  # an edit that came to nothing: its message is shown after the old one, unsent
            i -= 1
            reply.lead.unsent, reply.lead.branch_at = True, None
        self.turns[i:i + 2 if reply.lead else i + 1] = reply.replaced or []
        if reply.lead is not None:
            self.turns.append(reply.lead)
        if reply.replaced and reply.session is not None and reply.index is not None:
            # The session follows the reply shown again (a branch that ended before it failed here is in its tree).
            old = reply.replaced[0].message
            alternatives = reply.session.alternatives(reply.index)
            at = next((n for n, m in enumerate(alternatives) if m is old), None)
            if at is not None:
                reply.session.select_branch(reply.index, at)

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
        held = self.session.messages if self.session is not None else []
        if held and held[-1] is user.message:
            self.session.drop_last_user()
        if user.position is not None and self.record is not None:
            self.saved.delete_from(self.record.id, user.position)
            user.position = None
        user.unsent = True
        return " · your message was not sent: ctrl+t edits it, or send another one"

    # --- conversations -------------------------------------------------------------------------------------------

    def new_chat(self) -> None:
        self.save_tools()
        self._leave()
        self.saved.conversation, self.turns, self.last_result = None, [], None
        self.profile, self.system_prompt = self.default_profile(), self.default_system
        self.session = None
        self.load_tools(None)  # tools on/off, "always" and the tool choice are per chat
        self._new_session()

    def open(self, conversation_id: int) -> None:
        """Restore a saved conversation: its messages (with their stats), system prompt and profile."""
        record = self.store.conversation(conversation_id)
        self.save_tools()
        self._leave()
        try:
            profile = SamplingProfile.model_validate(record.profile) if record.profile else None
        except ValidationError as e:
            self.notify(f"The saved profile is no longer valid ({e.errors()[0]['msg']}); using the default",
                        "warning")
            profile = None
        self.saved.conversation, self.last_result = record, None
        self.turns = self.saved.turns(conversation_id)
        self.profile = profile or self.default_profile()
        changes = [t.content for t in self.turns if t.role == "system"]
        self.system_prompt = changes[-1] if changes else (record.system_prompt or "")
        self.session = None
        self.load_tools(conversation_id)
        self._new_session()
        if self.session is not None:
            self.session.warm()  # its KV cache saved on disk is loaded in the background: the next turn starts warm

    def clear(self) -> None:
        """Delete the messages of this chat (the conversation and its settings stay)."""
        if self.record is not None:
            record = self.record
            if not self.saved.write(lambda: self.store.clear_messages(record.id)):
                raise Refused("The chat was not cleared: the database cannot be written", "error")
            if record.system_prompt != self.system_prompt:  # the prompt in effect now is where it starts
                self.saved.write(lambda: self.store.update_conversation(record.id, system_prompt=self.system_prompt))
                self.saved.conversation = dataclasses.replace(record, system_prompt=self.system_prompt)
        self._leave(discard=True)
        self.turns, self.last_result = [], None
        self.session = None
        self._new_session()

    def rename(self, conversation_id: int, title: str) -> None:
        if self.saved.write(lambda: self.store.rename_conversation(conversation_id, title)) and \
                self.record is not None and self.record.id == conversation_id:
            self.saved.conversation = self.store.conversation(conversation_id)

    def delete(self, conversation_id: int) -> bool:
        for reply in self._replies.values():
            if reply.conversation_id == conversation_id:
                reply.discard = True
        if self.record is not None and self.record.id == conversation_id:
            self.new_chat()
        return self.saved.write(lambda: self.store.delete_conversation(conversation_id))

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
            self.saved.write(lambda: self.store.update_conversation(record.id, profile=self.profile_dict()))

    def set_system_prompt(self, text: str) -> None:
        """Use ``text`` as the system prompt from the next turn on. Set after messages, it is recorded where it
        was set (a system turn), so the export shows it in place; the conversation's own system prompt stays the
        one it started with."""
        self.require_idle()
        self.system_prompt = text
        if any(t.role != "system" for t in self.turns):
            self._add(Turn(ChatMessage("system", text)))
        elif self.record is not None:
            record = self.record
            self.saved.write(lambda: self.store.update_conversation(record.id, system_prompt=text))
            self.saved.conversation = dataclasses.replace(record, system_prompt=text)
        self._new_session()

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
