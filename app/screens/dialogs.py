"""Small modal dialogs: a one-line text prompt and a yes/no confirmation."""

from __future__ import annotations

from collections.abc import Callable

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static


class TextPrompt(ModalScreen[str | None]):
    """Ask for one line of text (a title, a path, a name). Enter accepts, Esc cancels. With `check(text)`, the text
    is accepted only when it returns None; otherwise its message shows under the field, which keeps the text."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog_cancel")]

    def __init__(self, title: str, value: str = "", *, placeholder: str = "", accept: str = "OK",
                 check: Callable[[str], str | None] | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text, self.value, self.placeholder, self.accept = title, value, placeholder, accept
        self.check = check

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.title_text, classes="dialog-title", markup=False)
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")
            yield Static("", id="prompt-error", classes="field-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.accept, variant="primary", id="prompt-ok")
                yield Button("Cancel", id="prompt-cancel")

    def show_error(self, text: str) -> None:
        self.query_one("#prompt-error", Static).update(text)

    @on(Input.Submitted)
    @on(Button.Pressed, "#prompt-ok")
    def _accept(self) -> None:
        value = self.query_one("#prompt-input", Input).value.strip()
        if not value:
            self.show_error("type something first, or press Esc")
        elif self.check is not None and (problem := self.check(value)) is not None:
            self.show_error(problem)
        else:
            self.dismiss(value)

    @on(Button.Pressed, "#prompt-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    """A yes/no question. Cancel has the focus, so an Enter typed on the way in never confirms; y or a click does."""

    AUTO_FOCUS = "#confirm-no"
    BINDINGS = [Binding("escape", "no", "Cancel", id="confirm_cancel"), Binding("y", "yes", "Yes", id="confirm_yes")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__(classes="dialog-screen")
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="dialog-title", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, variant="error", id="confirm-yes")
                yield Button("Cancel", id="confirm-no")

    @on(Button.Pressed, "#confirm-yes")
    def action_yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#confirm-no")
    def action_no(self) -> None:
        self.dismiss(False)
