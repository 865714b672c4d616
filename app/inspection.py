"""The sampler inspector's logic without Textual: which reply's traces the heat view and the token inspector show,
tracing a reply written untraced (F7), branching from a candidate token, switching branches, and what a replay (F9)
re-runs. It reads the conversation of a :class:`~mlxchat.app.conversation.ChatController` (the session's tree
through its turns) and changes it only through the controller's public methods (tests/test_conversation.py drives
it with the real engine and store; tests/test_tui_inspector.py through the screen).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxchat.core.chat.messages import ChatMessage

from .conversation import ChatController, Refused, Reply, Turn
from .replay import TRACE_K, ReplaySource

if TYPE_CHECKING:
    from mlxchat.core.decode.events import GenerationResult
    from mlxchat.core.sampling.trace import TokenTrace


class Inspection:
    """The inspector's side of one chat (the screen's): stateless over its controller."""

    def __init__(self, chat: ChatController) -> None:
        self.chat = chat

    @property
    def inspect_k(self) -> int:
        """Candidates per token when a trace is asked for (F7 on an untraced reply, a branch, a replay): the chat's
        own K when it traces every reply, else TRACE_K."""
        return self.chat.trace_k or TRACE_K

    def traces(self, turn: Turn | None) -> "tuple[TokenTrace, ...] | None":
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
        return source, int(turn.message.metrics.get("completion_tokens") or self.chat.max_tokens or 1024)

    def attach_traces(self, turn: Turn, result: "GenerationResult") -> "tuple[TokenTrace, ...]":
        """Keep the traces of ``retrace``'s run with ``turn`` if it wrote the same reply."""
        if result.text != turn.content or not result.traces:
            raise Refused("Written again with its seed, this reply came out different (another model, or a "
                          "near tie); F9 replays it side by side", "error")
        self.chat.set_traces(turn, result)
        return result.traces

    @staticmethod
    def branch_place(turn: Turn) -> tuple[int, int] | None:
        """(1-based number, count) of the alternative ``turn`` is at its place in the chat; None with one."""
        active, count = turn.branches
        return (active + 1, count) if count > 1 else None

    def branch(self, turn: Turn, token_index: int, token_id: int) -> Reply:
        """Continue ``turn`` (a reply) from its token ``token_index`` with ``token_id`` instead: a new alternative
        of that reply, which takes its place (and that of what followed it) in the chat; the old one stays a branch.
        The KV cache is trimmed to the kept tokens, not prefilled again."""
        self.chat.require_idle()
        if self.chat.session is None:
            raise Refused("The model is still loading")
        traces = self.traces(turn)
        if traces is None or not turn.token_ids:
            raise Refused("Trace this reply first (F7): a branch starts from one of its traced tokens")
        if traces[token_index].chosen.token_id == token_id:
            raise Refused("That is the token it chose: pick another candidate to branch from")
        limits = self.chat.limits(trace=self.inspect_k)
        return self.chat.start_alternative(
            turn, lambda session, index: session.branch(index, token_index, token_id, **limits))

    def switch_branch(self, turn: Turn, step: int) -> Turn:
        """Show the previous (-1) or next (+1) alternative at ``turn``'s place; return the turn now shown there."""
        self.chat.require_idle()
        active, count = turn.branches
        if count < 2:
            raise Refused("This reply has no other branch: Enter on a candidate in the inspector makes one")
        return self.chat.show_branch(turn, (active + step) % count)

    def replay_source(self, turn: Turn | None) -> ReplaySource:
        """What a replay of ``turn`` re-runs: the messages before it (system prompt first), its profile and seed."""
        chat = self.chat
        chat.require_idle()
        if chat.engine is None:
            raise Refused("No model is loaded: press F3 to pick one", "error")
        if turn is None or turn.role != "assistant" or turn.error is not None:
            raise Refused("No reply to replay yet")
        if turn not in chat.turns:
            raise Refused("That reply is no longer in the chat")
        before = chat.turns[:chat.turns.index(turn)]
        changes = [t.content for t in before if t.role == "system"]
        # The prompt in effect when it was written: the last one set before it, else the one the chat started with.
        system = changes[-1] if changes else (chat.record.system_prompt if chat.record else chat.system_prompt)
        messages = [ChatMessage("system", system)] if system else []
        messages += [t.message for t in before if t.in_history]
        return ReplaySource.of(messages, turn.message, dict(turn.message.profile) or chat.profile_dict(),
                               chat.max_tokens)
