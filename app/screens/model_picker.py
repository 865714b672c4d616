"""The model picker: the embedded model, local GGUF files / MLX folders the user added, models in the HF cache."""

from __future__ import annotations

from collections.abc import Callable

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, OptionList, Static
from textual.widgets.option_list import Option

from ..models import EMBEDDED, ModelChoice, check_local, hf_cache_choices, local_choices


class ModelPicker(ModalScreen[ModelChoice | None]):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="model_cancel"),
        Binding("ctrl+d", "remove", "Remove local model", id="model_remove", show=False),
    ]

    def __init__(self, local: Callable[[], list[tuple[str, str]]], add_local: Callable[[str], None],
                 remove_local: Callable[[str], None], current: str | None, *, scan_hf_cache: bool = True) -> None:
        super().__init__(classes="dialog-screen")
        self._local, self._add_local, self._remove_local = local, add_local, remove_local
        self.current = current
        self.scan_hf_cache = scan_hf_cache
        self.choices: list[ModelChoice] = []
        self.hf: list[ModelChoice] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog models"):
            yield Static("Model", classes="dialog-title")
            yield OptionList(id="model-list")
            yield Static("Add a local model (a .gguf file or an MLX / Hugging Face folder):", classes="field-label")
            with Horizontal(id="model-add-row"):
                yield Input(placeholder="~/models/model.gguf", id="model-path")
                yield Button("Add", id="model-add")
            yield Static("", id="model-error", classes="field-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Load", variant="primary", id="model-load")
                yield Button("Cancel", id="model-cancel")

    def on_mount(self) -> None:
        self.refresh_choices()
        if self.scan_hf_cache:
            self.scan()

    @work(thread=True, exclusive=True)
    def scan(self) -> None:
        found = hf_cache_choices()
        self.app.call_from_thread(self._scanned, found)

    def _scanned(self, found: list[ModelChoice]) -> None:
        self.hf = found
        self.refresh_choices()

    def refresh_choices(self) -> None:
        self.choices = [EMBEDDED, *local_choices(self._local()), *self.hf]
        options = self.query_one("#model-list", OptionList)
        highlighted = options.highlighted
        options.clear_options()
        for i, c in enumerate(self.choices):
            mark = "● " if c.spec == self.current else "  "
            prompt = Content.assemble(mark, (c.label, "bold"), "  ", (c.source, "dim"), "\n    ", (c.detail, "dim"))
            options.add_option(Option(prompt, id=str(i)))
        options.highlighted = highlighted if highlighted is not None and highlighted < len(self.choices) else 0

    def selected(self) -> ModelChoice | None:
        options = self.query_one("#model-list", OptionList)
        return None if options.highlighted is None else self.choices[options.highlighted]

    @on(Button.Pressed, "#model-add")
    @on(Input.Submitted, "#model-path")
    def action_add(self) -> None:
        path = self.query_one("#model-path", Input).value.strip()
        problem = check_local(path) if path else "type a path first"
        self.query_one("#model-error", Static).update(problem or "")
        if problem:
            return
        self._add_local(path)
        self.query_one("#model-path", Input).value = ""
        self.refresh_choices()
        self.query_one("#model-list", OptionList).highlighted = 1

    def action_remove(self) -> None:
        choice = self.selected()
        if choice and choice.source == "local" and choice.spec:
            self._remove_local(choice.spec)
            self.refresh_choices()

    @on(OptionList.OptionSelected, "#model-list")
    @on(Button.Pressed, "#model-load")
    def action_load(self) -> None:
        choice = self.selected()
        if choice is not None:
            self.dismiss(choice)

    @on(Button.Pressed, "#model-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
