"""The message input: Enter sends, a newline key that works on any terminal, up/down history."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from .. import textual_compat


class ChatInput(TextArea):
    """A multi-line input. Enter sends; ctrl+j (any terminal: it is a plain LF byte) or shift+enter (terminals
    with the Kitty keyboard protocol) insert a newline. Not alt+enter: Textual reads ESC CR as a plain enter on
    xterm-like terminals. Up on the first line / down on the last line walk the history of sent messages."""

    # These keys are handled in on_key, in order with the typed characters: a priority binding would run before
    # the characters of the same terminal read reach the widget (text typed and Enter pressed at once would be
    # sent incomplete). The bindings still name them for the footer, the help screen and remapping.
    BINDINGS = [
        Binding("enter", "submit", "Send", id="send"),
        Binding("ctrl+j,shift+enter", "newline", "Newline", id="newline", show=False),
        Binding("up", "history_previous", "Previous message", id="history_previous", show=False),
        Binding("down", "history_next", "Next message", id="history_next", show=False),
        # The chat screen's Esc, seen here first so that it reaches the screen after a Submitted sent just before
        # it (Enter then Esc at once stops that reply instead of being lost). Same id: one remap moves both.
        Binding("escape", "stop", "Stop", id="stop"),
    ]
    _KEYED = {"send": "submit", "newline": "newline", "history_previous": "history_previous",
              "history_next": "history_next", "stop": "stop"}

    class Submitted(Message):
        """The user pressed Enter on a message."""

        def __init__(self, chat_input: "ChatInput", text: str) -> None:
            super().__init__()
            self.chat_input = chat_input
            self.text = text

        @property
        def control(self) -> "ChatInput":
            return self.chat_input

    class StopRequested(Message):
        """The user pressed the stop key (Esc) in the input."""

    def __init__(self, *, id: str | None = None, history: list[str] | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         compact=True, placeholder="Type a message · Enter sends · ctrl+j newline")
        self.sent: list[str] = list(history or [])
        self._history_index: int | None = None  # None: editing a new message
        self._draft = ""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # TextArea binds F6 to "select line"; here F6 belongs to the chat screen (the lab). Declining the action
        # lets the key go on to the screen's binding. (F7, TextArea's "select all", is a priority binding there.)
        if action == "select_line":
            return False
        return super().check_action(action, parameters)

    def _action_for(self, key: str) -> str | None:
        keymap = textual_compat.keymap(self.app)
        for binding in self.BINDINGS:
            assert isinstance(binding, Binding)
            if binding.id in self._KEYED:
                keys = keymap.get(binding.id, binding.key)
                if key in (k.strip() for k in keys.split(",")):
                    return self._KEYED[binding.id]
        return None

    def on_key(self, event: events.Key) -> None:
        action = self._action_for(event.key)
        if action is not None and self.check_action(action, ()):
            event.stop()
            event.prevent_default()  # TextArea's own key handler (a base class's) must not also insert a newline
            getattr(self, f"action_{action}")()
        # Otherwise Textual goes on to the base classes' key handlers: TextArea's inserts the character.

    # --- history -------------------------------------------------------------------------------------------------

    def remember(self, text: str) -> None:
        if text.strip() and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._history_index = None
        self._draft = ""

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    def action_history_previous(self) -> None:
        """Up: a row up in the message; on its first (visual) row, the previous sent message."""
        if not self.navigator.is_first_wrapped_line(self.cursor_location) or not self.sent:
            self.action_cursor_up()
            return
        if self._history_index is None:
            self._draft = self.text
            self._history_index = len(self.sent)
        if self._history_index > 0:
            self._history_index -= 1
            self._show(self.sent[self._history_index])

    def action_history_next(self) -> None:
        """Down: a row down in the message; on its last (visual) row, the next sent message (then the draft)."""
        if not self.navigator.is_last_wrapped_line(self.cursor_location) or self._history_index is None:
            self.action_cursor_down()
            return
        self._history_index += 1
        if self._history_index >= len(self.sent):
            self._history_index = None
            self._show(self._draft)
        else:
            self._show(self.sent[self._history_index])

    # --- sending -------------------------------------------------------------------------------------------------

    def action_submit(self) -> None:
        text = self.text
        if text.strip():
            self.post_message(self.Submitted(self, text))

    def action_stop(self) -> None:
        self.post_message(self.StopRequested())

    def action_newline(self) -> None:
        self.insert("\n")
