"""One chat's record in the store: its conversation row, and the writes that keep the store up to the turns shown.

The session's tree is the conversation; the store persists it (``messages`` the active path, ``forks`` the other
branches, schema v3 in store.py), ChatMessage in and out. What is written: each turn once it is part of the
conversation, a reply while it streams (the controller checkpoints it about every second) and when it ends. A write
that fails (disk full, the database turned read-only) is reported once, until a write succeeds again, and never
raised: the chat stays whole in memory and the next write saves what was missed (tests/test_crash_safety.py,
tests/test_app_reliability.py). No Textual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxchat.core.chat.messages import Fork, Tail

from .store import Conversation, Store, StoreError
from .turns import Notify, Turn


def held_forks(stored: dict[int, Fork], marks: list[int]) -> dict[int, Fork]:
    """The store's forks (keyed by row position) as a ChatSession holds them: keyed by position among the messages
    it renders, without the system prompts set mid-chat, which only the store and the transcript keep. ``marks``
    are the row positions of those system prompts on the path to the forks."""
    held = {}
    for position, fork in stored.items():
        before = [m for m in marks if m < position]
        tails: list[Tail | None] = []
        for tail in fork.tails:
            if tail is None:
                tails.append(None)
                continue
            own = [position + i for i, m in enumerate(tail.messages) if m.role == "system"]
            tails.append(Tail([m for m in tail.messages if m.role != "system"], held_forks(tail.forks, before + own)))
        held[position - len(before)] = Fork(fork.active, tails)
    return held


def _to_save(turn: Turn) -> bool:
    """Not saved yet, or changed since; never a message the session does not have (refused, failed), nor a reply
    still streaming unless it is checkpointed."""
    if turn.unsent or turn.error is not None or (turn.streaming and not turn.dirty):
        return False
    return turn.position is None or turn.dirty


class ChatRecord:
    """Where the chat the controller shows is saved (``conversation``: None until its first message is).
    Use it from one thread (the UI's)."""

    def __init__(self, store: Store, notify: Notify) -> None:
        self.store, self.notify = store, notify
        self.conversation: Conversation | None = None
        self._failed = False

    def write(self, fn: Callable[[], Any]) -> bool:
        """Run one store write; a failure is reported once (until a write succeeds again) and never raised."""
        try:
            fn()
        except StoreError as e:
            if not self._failed:
                self.notify(f"Cannot save ({e}); the chat is kept here and saved once the database can be "
                            "written again", "error")
            self._failed = True
            return False
        if self._failed:
            self._failed = False
            self.notify("The chat is saved again", "information")
        return True

    def save(self, turns: list[Turn], create: Callable[[], Conversation]) -> bool:
        """Bring the store up to ``turns``: the conversation's row first (``create`` makes it), then the unsaved
        turns in order, and the changed ones rewritten."""
        if not any(_to_save(t) for t in turns):
            return True

        def new() -> None:
            self.conversation = create()

        if self.conversation is None and not self.write(new):
            return False
        assert self.conversation is not None
        conversation_id = self.conversation.id
        return all(self.write(lambda turn=turn: self.write_turn(conversation_id, turn)) for turn in turns
                   if _to_save(turn))

    def write_turn(self, conversation_id: int, turn: Turn) -> None:
        """Add ``turn`` (a new message, or a new alternative at ``branch_at``) or rewrite it; raises StoreError."""
        if turn.position is None and turn.branch_at is not None:
            # A new alternative: what was at that position (and after it) moves into the store's fork.
            turn.position = self.store.add_branch(conversation_id, turn.branch_at, turn.message).position
            turn.branch_at = None
        elif turn.position is None:
            turn.position = self.store.add_message(conversation_id, turn.message).position
        else:
            self.store.update_message(conversation_id, turn.position, turn.message)
        turn.dirty = False

    def delete_from(self, conversation_id: int | None, position: int) -> None:
        if conversation_id is not None:
            self.write(lambda: self.store.delete_messages_from(conversation_id, position))

    def turns(self, conversation_id: int) -> list[Turn]:
        """The saved messages of a conversation as turns (each the stored ChatMessage), each reply with its place
        among its alternatives."""
        forks = self.store.forks(conversation_id)
        turns = []
        for m in self.store.messages(conversation_id):
            turn = Turn(m, m.position)
            if (fork := forks.get(m.position)) is not None:
                turn.branches = (fork.active, len(fork.tails))
            turns.append(turn)
        return turns

    def forks(self, turns: list[Turn]) -> dict[int, Fork]:
        """This chat's branches as a ChatSession holds them (see `held_forks`); ``turns`` are its saved turns."""
        if self.conversation is None:
            return {}
        marks = [t.position for t in turns if t.role == "system" and t.position is not None]
        return held_forks(self.store.forks(self.conversation.id), marks)
