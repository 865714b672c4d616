"""The live readouts line above the footer (like toolong's footer): model state, prefill progress, TTFT, TPOT,
decode tok/s, tokens in/out, context used vs. limit (and the rotating window), peak memory, and the profile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from ..formatting import live_readouts, prefill_progress
from ..layout import fit_fields


class StatsBar(Horizontal):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.metrics: Any = None  # the last Metrics shown (tests read it)
        self.state = "idle"
        self._fields: list[str] = []  # a state's detail given as fields: fitted to the width it has

    def compose(self) -> ComposeResult:
        yield Static("", id="stats-state", markup=False)
        yield Static("", id="stats-readouts", markup=False)
        yield Static("", id="stats-profile", markup=False)

    def _set(self, part: str, text: str) -> None:
        widget = self.query_one(f"#stats-{part}", Static)
        if str(widget.content) != text:
            # The parts have fixed widths (app.tcss), so a new text never needs a new layout.
            widget.update(text, layout=False)

    def show_state(self, state: str, text: str, detail: str | Sequence[str] | None = None) -> None:
        """A short label on the left; ``detail`` (if given) replaces the readouts, e.g. an error message. Given as
        fields (most important first), it is shortened to fit by dropping the least important (``fit_fields``),
        never cut mid-word."""
        self.state = state
        self.set_class(state == "error", "-error")
        self.set_class(state in ("prefill", "decode", "loading", "waiting", "stopping"), "-busy")
        self._set("state", text)
        if detail is not None:
            self.metrics = None
            self._fields = [] if isinstance(detail, str) else list(detail)
            if self.styles.height is not None and self.styles.height.value != 1:
                self.styles.height = 1  # live readouts may have taken two rows
            self._set("readouts", detail if isinstance(detail, str) else self._fitted())

    def _fitted(self) -> str:
        width = self.query_one("#stats-readouts", Static).content_region.width
        return fit_fields(self._fields, width) if width else " · ".join(self._fields)

    def show_profile(self, name: str) -> None:
        self._set("profile", f"profile {name}")

    def show_prefill(self, done: int, total: int, cached: int = 0) -> None:
        pct, text = prefill_progress(done, total, cached)
        self.show_state("prefill", f"▷ prefill {pct}%", text)

    def show_metrics(self, metrics: Any, *, state: str = "decode", label: str = "decoding") -> None:
        self.metrics = metrics
        self.show_state(state, label)
        self._show_readouts()

    def _show_readouts(self) -> None:
        width = self.query_one("#stats-readouts", Static).content_region.width
        text = live_readouts(self.metrics, width or None)
        # What does not fit even written compactly wraps onto a second row rather than being cut off.
        rows = 2 if width and len(text) > width else 1
        if self.styles.height is None or self.styles.height.value != rows:
            self.styles.height = rows
        self._set("readouts", text)

    def on_resize(self) -> None:
        if self.metrics is not None:
            self._show_readouts()
        elif self._fields:
            self._set("readouts", self._fitted())

    @property
    def readouts(self) -> str:
        return str(self.query_one("#stats-readouts", Static).content)
