"""What the chat screen shows and the controller tracks besides the conversation itself: a turn of the
transcript (a view onto one message), a reply in flight, the controller's state, and a refusal to act now.
No Textual, no store."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Literal

from mlxchat.core.chat.messages import ChatMessage

if TYPE_CHECKING:
    from mlxchat.core import ChatSession, Stream
    from mlxchat.core.decode.events import GenerationResult, Metrics
    from mlxchat.core.sampling.trace import TokenTrace

Severity = Literal["information", "warning", "error"]
Notify = Callable[[str, Severity], None]


def keeps(result: "GenerationResult") -> bool:
    """Whether a finished reply stays in the chat: not when it was stopped before its first token (what the
    ChatSession keeps, too)."""
    return bool(result.text) or bool(result.reasoning) or result.finish_reason != "cancelled"


def step_to(count: int, current: int | None, step: int) -> int | None:
    """The message the transcript's ↑/↓ move to among `count`: from `current` by `step`, or, from none (the
    transcript itself has the focus), the last one going up and the first going down; None past either end."""
    if not count:
        return None
    target = (count - 1 if step < 0 else 0) if current is None else current + step
    return target if 0 <= target < count else None


def first_reply(turns: "Iterable[Turn]") -> "Turn | None":
    """The chat's first assistant turn (its stats line says "system prompt cached" for what came from disk)."""
    return next((t for t in turns if t.role == "assistant"), None)


def last_reply(turns: "Iterable[Turn]") -> "Turn | None":
    """The last finished reply shown: the state line shows its numbers once another branch is shown."""
    return next((t for t in reversed(list(turns)) if t.role == "assistant" and t.in_history), None)


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
    """One message as the transcript shows it: the message, and what only the view knows about it.

    ``message`` is the ChatSession's own ChatMessage once the message is in the conversation: the session's tree is
    the conversation, and a turn reads it, never a copy. Before that, and for what the session never holds, the
    message is the turn's own: a message waiting for the model, the reply in flight (its text grows as tokens
    arrive), a reply that failed, a message the engine refused, a system prompt set mid-chat."""

    message: ChatMessage
    position: int | None = None  # in the store, once saved
    unsent: bool = False  # refused by the engine: in neither the session nor the store (ctrl+t edits it)
    error: str | None = None  # the reply failed mid-way: shown, not stored, not in the session
    streaming: bool = False
    dirty: bool = False  # saved, but changed since (a reply saved while it streamed)
    branches: tuple[int, int] = (0, 1)  # (which one, how many): the alternatives at this place of the chat
    branch_at: int | None = None  # a branch not saved yet: the store position it becomes an alternative at

    @property
    def role(self) -> str:
        return self.message.role

    @property
    def content(self) -> str:
        return self.message.content

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.message.token_ids

    @property
    def seed(self) -> int | None:
        return self.message.seed

    @property
    def traces(self) -> "tuple[TokenTrace, ...] | None":
        """One per token id when the reply was traced, else None."""
        return self.message.traces or None

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
    session: "ChatSession | None" = None  # the session writing it (it holds the reply once it is done)
    cached: int | None = None  # prompt tokens found in the KV cache (from the first prefill report)
    tokens: int = 0  # tokens streamed so far
    metrics: "Metrics | None" = None  # the last live snapshot
    discard: bool = False  # its conversation was cleared or deleted meanwhile: never store it
    saved_at: float | None = None
    kept: bool = True  # after it finished: False when stopped before its first token (nothing to keep)
    replaced: "list[Turn] | None" = None  # a branch: the turns it took the place of (back if it comes to nothing)
    index: int | None = None  # a branch: its place in the session's messages
    lead: Turn | None = None  # an edit kept as a branch: the new message (shown before its reply), saved with it
