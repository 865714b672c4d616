"""The conversation list, newest first, with open, rename and delete."""

from __future__ import annotations

import time

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from ..store import Conversation


class ConversationList(OptionList):
    # No single-letter keys: text typed while the list has focus must never rename or delete a chat.
    BINDINGS = [
        Binding("ctrl+e", "rename", "Rename", id="rename_conversation"),
        Binding("delete,ctrl+d", "delete", "Delete", id="delete_conversation"),
    ]

    class Opened(Message):
        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    class RenameRequested(Message):
        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    class DeleteRequested(Message):
        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    def show(self, conversations: list[Conversation], current: int | None = None) -> None:
        self.clear_options()
        for c in conversations:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
            prompt = Content.assemble(Content(c.title), "\n", (when, "dim"))
            self.add_option(Option(prompt, id=str(c.id)))
        if current is not None:
            self.select(current)

    def on_focus(self) -> None:
        # Enter opens the highlighted chat: with none highlighted (a new chat is not listed yet) it did nothing
        # until an arrow key was pressed.
        if self.highlighted is None and self.option_count:
            self.highlighted = 0

    def select(self, conversation_id: int | None) -> None:
        if conversation_id is None:
            self.highlighted = None
            return
        try:
            self.highlighted = self.get_option_index(str(conversation_id))
        except Exception:  # noqa: BLE001 - not listed (yet)
            self.highlighted = None

    def _highlighted_id(self) -> int | None:
        if self.highlighted is None:
            return None
        option = self.get_option_at_index(self.highlighted)
        return int(option.id) if option.id else None

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id:
            self.post_message(self.Opened(int(event.option.id)))

    def action_rename(self) -> None:
        if (cid := self._highlighted_id()) is not None:
            self.post_message(self.RenameRequested(cid))

    def action_delete(self) -> None:
        if (cid := self._highlighted_id()) is not None:
            self.post_message(self.DeleteRequested(cid))


class Sidebar(Vertical):
    def compose(self) -> ComposeResult:
        yield Static("Conversations", classes="sidebar-title")
        yield ConversationList(id="conversations")
