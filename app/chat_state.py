"""One chat as the controller holds it, and what keeps its parts in step; the actions on it (sending, the bridge's
reports, opening and clearing chats, settings) are :class:`~mlxchat.app.conversation.ChatController`'s.

The parts: the ChatSession, whose tree of replies is the conversation (the source of truth: the app never copies a
message's fields); the turns, the transcript's view onto that tree plus what only the view has (a reply in flight,
a failed one, a refused message, a system prompt set mid-chat); and the chat's record in the store (record.py),
which persists the tree. A turn finds its message in the session by identity, never by comparing text. No Textual.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxchat.core.chat.messages import ChatMessage, ContextPolicy
from mlxchat.core.sampling.profile import SamplingProfile

from .record import ChatRecord
from .store import Conversation, Store
from .turns import Notify, Refused, Reply, State, Turn

if TYPE_CHECKING:
    from mlxchat.core import ChatSession, Engine, Stream

    from .chat_tools import ChatTools
    from mlxchat.core.decode.events import GenerationResult


class ChatState:
    """The chat the screen shows: its session, turns, record and reply in flight. Use it from one thread (the UI's)."""

    def __init__(self, store: Store, *, default_profile: Callable[[], SamplingProfile], default_system: str,
                 max_tokens: int | None = None, kv_window: int | None = None,
                 context_policy: ContextPolicy = "truncate", exports: Path | None = None,
                 notify: Notify | None = None, clock: Callable[[], float] = time.monotonic, trace_k: int = 0,
                 speculative: str = "off", reasoning_budget: int | None = None,
                 enable_thinking: bool | None = None, tools: "ChatTools | None" = None) -> None:
        self.store = store
        # A thinking model's budget and switch for every reply (config.toml's reasoning_budget, enable_thinking).
        self.reasoning_budget, self.enable_thinking = reasoning_budget, enable_thinking
        self.tools = tools if tools is not None and tools.configured else None  # MCP servers (app/chat_tools.py)
        self.trace_k = trace_k  # candidates recorded per token of every reply (0: replies are not traced)
        self.speculative = speculative  # speculative decoding of the replies (config.toml's speculative)
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
        self.saved = ChatRecord(store, self.notify)  # where this chat is saved, and the writes that save it
        self.turns: list[Turn] = []
        self.profile: SamplingProfile = default_profile()
        self.system_prompt = default_system
        self.reply: Reply | None = None  # the current conversation's reply in flight
        self.last_result: GenerationResult | None = None  # of the last reply of this chat that finished
        self._replies: dict[Stream, Reply] = {}  # every reply still streaming, current or left behind

    @property
    def busy(self) -> bool:
        return self.state is not State.IDLE

    @property
    def record(self) -> Conversation | None:
        """This chat's row in the store (None until its first message is saved)."""
        return self.saved.conversation

    @property
    def title(self) -> str:
        return self.record.title if self.record else "new chat"

    def require_idle(self) -> None:
        if self.busy:
            raise Refused("A reply is still coming: Esc stops it")

    # --- the session: the conversation itself ---------------------------------------------------------------------

    def _new_session(self) -> None:
        """A fresh ChatSession (another system prompt, model or context policy) holding the conversation: the tree
        the last session held, or with none (a chat just opened or cleared), the turns shown and the branches the
        store keeps. Its KV cache re-matches the conversation by prefix on the next turn."""
        if self.engine is None:
            self.session = None
            return
        if self.session is not None:
            history, forks = self.session.history()
        else:
            waiting = self.reply.answers if self.state is State.LOADING and self.reply else None
            history = [t.message for t in self.turns if t.in_history and t is not waiting]
            forks = self.saved.forks(self.turns)
        self.session = self.engine.chat(system=self.system_prompt or None, profile=self.profile,
                                        max_kv_size=self.kv_window if self.context_policy == "rotate" else None,
                                        context_policy=self.context_policy,
                                        # A rotating window cannot be trimmed: its replies decode plainly.
                                        speculative="off" if self.context_policy == "rotate" else self.speculative,
                                        reasoning_budget=self.reasoning_budget, enable_thinking=self.enable_thinking,
                                        **self._tool_options())
        self.session.replace_history(history, forks)

    def save_tools(self) -> None:
        """Keep this chat's tool settings (on/off, always allowed, the choice) with its conversation."""
        if self.tools is not None and self.record is not None:
            self.saved.write(lambda: self.store.set_setting(f"chat_tools.{self.record.id}", self.tools.state()))

    def load_tools(self, conversation_id: int | None) -> None:
        """This chat's saved tool settings (a new chat: the defaults)."""
        if self.tools is not None:
            self.tools.restore(None if conversation_id is None else
                               self.store.get_setting(f"chat_tools.{conversation_id}"))

    def _tool_options(self) -> dict:
        """engine.chat's tool arguments: the app's toolbox, the chat's choice, the UI's approval."""
        if self.tools is None:
            return {}
        return {"tools": self.tools.toolbox, "tool_choice": self.tools.tool_choice, "approve": self.tools.approve}

    def index_of(self, turn: Turn) -> int | None:
        """Where ``turn``'s message is in the session's messages (system prompt first); None if it holds none."""
        if self.session is None:
            return None
        return next((i for i, m in enumerate(self.session.messages) if m is turn.message), None)

    def _refresh_branches(self, turns: list[Turn]) -> None:
        """Read the alternatives at each reply's place from the session (what ``< 2/3 >`` shows)."""
        for turn in turns:
            if turn.role != "system" and (index := self.index_of(turn)) is not None:
                assert self.session is not None
                turn.branches = (self.session.active_branch(index), len(self.session.alternatives(index)))

    def _last_sent(self) -> ChatMessage:
        """The message `send`/`edit_last` just put in the session (its reply can only come after it)."""
        assert self.session is not None
        return next(m for m in reversed(self.session.messages) if m.role == "user")

    def limits(self, *, trace: int | None = None) -> dict[str, int | None]:
        """What every reply of this chat is started with: its length cap and how many candidates to trace."""
        return {"max_tokens": self.max_tokens, "trace": self.trace_k if trace is None else trace}

    def _call(self, start: Callable[[], "Stream"]) -> "Stream":
        try:
            return start()
        except ValueError as e:  # checked before anything is queued (an empty message, beam search, max_tokens)
            raise Refused(str(e), "error") from None

    # --- the reply in flight --------------------------------------------------------------------------------------

    def _new_reply(self, answers: Turn | None) -> Reply:
        self.reply = Reply(self._add(self._reply_turn()), answers, self.record.id if self.record else None)
        return self.reply

    def _reply_turn(self, **view: Any) -> Turn:
        """The turn of a reply about to stream, saved as stopped ("cancelled") until it ends."""
        name = self.engine.name if self.engine else None
        return Turn(ChatMessage("assistant", "", "cancelled", model=name), streaming=True, **view)

    def _started(self, reply: Reply, stream: "Stream") -> Reply:
        reply.stream, reply.session = stream, self.session
        reply.turn.message.model = self.engine.name if self.engine else reply.turn.message.model
        self._replies[stream] = reply
        self.state = State.STARTING
        return reply

    def _drop_waiting(self) -> Reply | None:
        if self.state is not State.LOADING or self.reply is None:
            return None
        reply, self.reply = self.reply, None
        self.turns.remove(reply.turn)
        self.state = State.IDLE
        return reply

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

    # --- the turns and the store ----------------------------------------------------------------------------------

    def _add(self, turn: Turn) -> Turn:
        self.turns.append(turn)
        self._persist()
        return turn

    def _last(self, role: str) -> Turn | None:
        return next((t for t in reversed(self.turns) if t.role == role), None)

    def _truncate(self, turn: Turn) -> None:
        """Drop ``turn`` and what followed it (edit, regenerate). System prompts set meanwhile stay, after."""
        i = self.turns.index(turn)
        dropped = self.turns[i:]
        saved = [t.position for t in dropped if t.position is not None]
        if saved and self.record is not None:
            self.saved.delete_from(self.record.id, min(saved))
        kept = [dataclasses.replace(t, position=None) for t in dropped if t.role == "system"]
        self.turns = self.turns[:i] + kept

    def _persist(self) -> bool:
        """Bring the store up to the turns (the conversation's row first, made from the first message)."""
        saved = self.saved.save(self.turns, self._new_record)
        if self.record is not None and self.reply is not None and self.reply.conversation_id is None:
            self.reply.conversation_id = self.record.id
        return saved

    def _new_record(self) -> Conversation:
        first = next((t.content for t in self.turns if t.role == "user"), "New chat")
        title = " ".join(first.split())
        title = title if len(title) <= 48 else title[:47] + "…"
        model = self.engine.name if self.engine else (self.model_spec or None)
        return self.store.create_conversation(title, system_prompt=self.system_prompt, profile=self.profile_dict(),
                                              model=model)

    def _checkpoint(self, reply: Reply) -> None:
        """Save the reply so far, marked as stopped ("cancelled") until its end rewrites it."""
        if reply.discard or not reply.turn.content:
            return
        reply.turn.message.metrics = reply.metrics.as_dict() if reply.metrics is not None else {}
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
        conversation_id = reply.conversation_id
        lead = reply.lead if reply.lead is not None and reply.lead.position is None else None
        try:
            for turn in (lead, reply.turn) if lead else (reply.turn,):  # an edit's new message before its reply
                if not self.saved.write(lambda turn=turn: self.saved.write_turn(conversation_id, turn)):
                    return
        except ValueError:  # its conversation was deleted meanwhile (foreign key)
            pass

    def profile_dict(self) -> dict[str, Any]:
        return self.profile.model_dump(mode="json")

    # --- branches (the inspector starts and switches them, see inspection.py) -------------------------------------

    def branchable(self, turn: Turn) -> bool:
        """Whether a new alternative can take ``turn``'s place: it is shown, saved and in the session."""
        return turn in self.turns and turn.position is not None and self.record is not None and \
            self.index_of(turn) is not None

    def start_alternative(self, turn: Turn, start: "Callable[[ChatSession, int], Stream]", *,
                          lead: Turn | None = None) -> Reply:
        """Start a new alternative of ``turn`` (a saved message): ``start(session, index)`` begins it at ``turn``'s
        index in the session; ``lead`` is the new message an edit puts in ``turn``'s place before the reply. Until
        the reply ends they take the place of ``turn`` and what followed (a failure gives them back); then they are
        the alternative shown there, and the old one a branch."""
        self.require_idle()
        if self.session is None:
            raise Refused("The model is still loading")
        if not self.branchable(turn):
            raise Refused("This reply is not saved yet, so it cannot be branched", "error")
        session, index = self.session, self.index_of(turn)
        assert index is not None
        stream = self._call(lambda: start(session, index))
        i = self.turns.index(turn)
        replaced = self.turns[i:]
        branches = (turn.branches[1], turn.branches[1] + 1)
        if lead is not None:
            lead.branches, lead.branch_at = branches, turn.position
            new = self._reply_turn()
            self.turns[i:] = [lead, new]
            answers = lead
        else:
            new = self._reply_turn(branches=branches, branch_at=turn.position)
            self.turns[i:] = [new]
            answers = next((t for t in reversed(self.turns[:i]) if t.role == "user"), None)
        self.reply = Reply(new, answers, self.record.id if self.record else None, replaced=replaced, index=index,
                           lead=lead)
        return self._started(self.reply, stream)

    def show_branch(self, turn: Turn, target: int) -> Turn:
        """Show alternative ``target`` at ``turn``'s place (in the store, then the session, which goes on from it);
        return the turn now shown there."""
        self.require_idle()
        index = self.index_of(turn)
        if turn.position is None or self.record is None or turn not in self.turns:
            raise Refused("This reply is not saved yet", "error")
        if self.session is None or index is None:
            raise Refused("The model is still loading")
        record, position = self.record, turn.position
        if not self.saved.write(lambda: self.store.select_branch(record.id, position, target)):
            raise Refused("The branch was not switched: the database cannot be written", "error")
        self.session.select_branch(index, target)
        # The store's rows give the places (and the system prompts set in that branch), the session the messages.
        held = iter(self.session.messages[index:])
        i = self.turns.index(turn)
        self.turns[i:] = [Turn(m if m.role == "system" else next(held, m), m.position)
                          for m in self.store.messages(record.id) if m.position >= position]
        self._refresh_branches(self.turns[i:])
        return self.turns[i]

    def set_traces(self, turn: Turn, result: "GenerationResult") -> None:
        """Keep the ids and traces of a rewrite of ``turn`` (F7 on an untraced reply) with it, in the session (so
        it can be branched) and the store (so the heat view survives a restart)."""
        # The session's own message, changed in place: its place in the tree and its text stay.
        turn.message.token_ids, turn.message.traces = tuple(result.token_ids), tuple(result.traces)
        if turn.position is not None:
            turn.dirty = True
            self._persist()
