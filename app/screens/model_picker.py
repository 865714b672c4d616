"""The model picker: the embedded model, local GGUF files / MLX folders that loaded before, models in the HF cache,
and a field to pull a repo id from the hub into that cache.

A path added here is offered for this visit only: the screen remembers it (models.to_remember) once it has loaded,
so a file that is not a model never stays in the list."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, OptionList, Static
from textual.widgets.option_list import Option

from ..models import EMBEDDED, ModelChoice, ModelPick, check_local, hf_cache_choices, local_choices


class ModelPicker(ModalScreen[ModelPick | None]):
    """Dismissed with None (cancelled) or a ModelPick; `already_loaded` is set when the current model was chosen."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="model_cancel"),
        Binding("ctrl+d", "remove", "Remove local model", id="model_remove", show=False),
    ]

    def __init__(self, local: Callable[[], list[tuple[str, str]]], remove_local: Callable[[str], None],
                 current: str | None, *, scan_hf_cache: bool = True) -> None:
        super().__init__(classes="dialog-screen")
        self._local, self._remove_local = local, remove_local
        self.current = current
        self.scan_hf_cache = scan_hf_cache
        self.choices: list[ModelChoice] = []
        self.hf: list[ModelChoice] = []
        self.added: list[str] = []  # paths added on this visit, not yet loaded

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog models"):
            yield Static("Model", classes="dialog-title")
            yield OptionList(id="model-list")
            yield Static("Add a local model (a .gguf file or an MLX / Hugging Face folder):", classes="field-label")
            with Horizontal(id="model-add-row"):
                yield Input(placeholder="~/models/model.gguf", id="model-path")
                yield Button("Add", id="model-add")
            yield Static("Pull a model from the Hugging Face hub (ORG/NAME):", classes="field-label")
            with Horizontal(id="model-pull-row"):
                yield Input(placeholder="mlx-community/SmolLM2-135M-Instruct", id="model-repo")
                yield Button("Pull", id="model-pull")
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
        saved = self._local()
        new = [(p, Path(p).name) for p in self.added if p not in {s for s, _ in saved}]
        self.choices = [EMBEDDED, *local_choices(saved),
                        *(replace(c, detail=f"{c.detail} · new: kept once it loads") for c in local_choices(new)),
                        *self.hf]
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
        resolved = str(Path(path).expanduser().resolve())
        if resolved not in self.added:
            self.added.append(resolved)
        self.query_one("#model-path", Input).value = ""
        self.refresh_choices()
        self.query_one("#model-list", OptionList).highlighted = next(
            i for i, c in enumerate(self.choices) if c.spec == resolved)

    @on(Button.Pressed, "#model-pull")
    @on(Input.Submitted, "#model-repo")
    def action_pull(self) -> None:
        repo = self.query_one("#model-repo", Input).value.strip()
        self.query_one("#model-error", Static).update("" if repo else "type a repo id first, e.g. ORG/NAME")
        if repo:
            self.query_one("#model-pull", Button).disabled = True
            self.pull(repo)

    @work(thread=True, exclusive=True, group="pull")
    def pull(self, repo: str) -> None:
        from mlxchat.core.model.hub import HubError, pull

        def progress(done: int, total: int) -> None:
            self.app.call_from_thread(self._pull_status, f"pulling {repo}: {done}/{total} files")

        self.app.call_from_thread(self._pull_status, f"pulling {repo}…")
        try:
            pull(repo, progress=progress)
        except HubError as e:
            self.app.call_from_thread(self._pulled, repo, str(e))
            return
        self.app.call_from_thread(self._pulled, repo, None)

    def _pull_status(self, text: str) -> None:
        self.query_one("#model-error", Static).update(text)

    def _pulled(self, repo: str, problem: str | None) -> None:
        self.query_one("#model-pull", Button).disabled = False
        self.query_one("#model-error", Static).update(problem or f"{repo} is in the Hugging Face cache")
        if problem is None:
            self.query_one("#model-repo", Input).value = ""
            self.scan()

    def action_remove(self) -> None:
        choice = self.selected()
        if choice and choice.source == "local" and choice.spec:
            if choice.spec in self.added:
                self.added.remove(choice.spec)
            else:
                self._remove_local(choice.spec)
            self.refresh_choices()

    @on(OptionList.OptionSelected, "#model-list")
    @on(Button.Pressed, "#model-load")
    def action_load(self) -> None:
        choice = self.selected()
        if choice is not None:
            self.dismiss(ModelPick(choice, already_loaded=choice.spec == self.current))

    @on(Button.Pressed, "#model-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
