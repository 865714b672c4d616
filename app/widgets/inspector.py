"""The sampler inspector's widgets: a reply's tokens shaded by probability (the heat view) and the panel that shows
one token's candidates through every stage of the chain. What they show is made by ``app/inspector.py``; these
only lay it out, move a cursor and post what the user picked."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import DataTable, Static

from mlxchat.core.sampling.trace import TokenTrace

from .. import inspector


class TokenStrip(Static, can_focus=True):
    """A reply's tokens, each shaded by the probability it was chosen with. ←/→ move the cursor (the inspector
    follows it), n jumps to the next doubtful token, Enter or a click opens the inspector on a token."""

    BINDINGS = [
        Binding("left", "move(-1)", "Previous token", id="token_previous", show=False),
        Binding("right", "move(1)", "Next token", id="token_next", show=False),
        Binding("home", "move_to(0)", "First token", id="token_first", show=False),
        Binding("end", "move_to(-1)", "Last token", id="token_last", show=False),
        Binding("n", "next_doubt", "Next doubtful token", id="token_next_doubt"),
        Binding("enter", "inspect", "Inspect token", id="token_inspect"),
    ]

    @dataclass
    class Moved(Message):
        """The cursor is on another token."""

        strip: "TokenStrip"
        index: int

    @dataclass
    class Inspect(Message):
        """Enter or a click on a token: open the inspector on it."""

        strip: "TokenStrip"
        index: int

    cursor: reactive[int] = reactive(0, init=False)

    def __init__(self, traces: list[TokenTrace], *, marked: int | None = None, id: str | None = None) -> None:
        super().__init__(id=id, classes="token-strip", markup=False)
        self.traces = traces
        self.tokens = inspector.pieces(traces)
        self.marked = marked  # the token a replay parts at
        if marked is not None and marked < len(traces):
            self.set_reactive(TokenStrip.cursor, marked)

    def on_mount(self) -> None:
        self._paint()

    def _paint(self) -> None:
        cursor = self.cursor if self.has_focus else None
        self.update(inspector.heat_text(self.tokens, cursor=cursor, marked=self.marked))

    def watch_cursor(self) -> None:
        self._paint()
        self.post_message(self.Moved(self, self.cursor))

    def on_focus(self) -> None:
        self._paint()

    def on_blur(self) -> None:
        self._paint()

    def action_move(self, step: int) -> None:
        if self.tokens:
            self.cursor = max(0, min(len(self.tokens) - 1, self.cursor + step))

    def action_move_to(self, index: int) -> None:
        if self.tokens:
            self.cursor = index % len(self.tokens)

    def action_next_doubt(self) -> None:
        """Jump to the next shaded token (wrapping round), so a long reply's doubtful spans are a key away."""
        n = len(self.tokens)
        for step in range(1, n + 1):
            i = (self.cursor + step) % n
            if inspector.heat_level(self.tokens[i].prob) > 0:
                self.cursor = i
                return
        self.notify("Every token of this reply was chosen with ≥ 90 % probability")

    def action_inspect(self) -> None:
        if self.tokens:
            self.post_message(self.Inspect(self, self.cursor))

    @on(events.Click)
    def _click(self, event: events.Click) -> None:
        index = event.style.meta.get("token")
        if index is not None:
            event.stop()
            self.focus()
            self.cursor = index
            self.post_message(self.Inspect(self, index))


class TokenInspector(Vertical):
    """One token's candidates x stages: raw logit, the processors' shift, the probability after the processors and
    after each transform (with bars; "cut" once removed), and the stage that cut it. With branching on, Enter on a
    candidate asks to continue the reply from it.

    The table is laid out for the width it has (``inspector.fit``): full stage names and bars when they fit, else
    short names, shorter bars, then none; it is laid out again when the panel is resized."""

    BINDINGS = [Binding("escape", "close", "Close inspector", id="inspector_close")]

    @dataclass
    class BranchRequested(Message):
        inspector: "TokenInspector"
        token_index: int
        token_id: int

    @dataclass
    class Closed(Message):
        inspector: "TokenInspector"

    def __init__(self, *, branching: bool = True, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.branching = branching
        self.trace: TokenTrace | None = None
        self.index = 0
        self.density: inspector.Density | None = None  # how the table is laid out now
        self.alike: tuple[TokenTrace, ...] = ()  # traces another panel shows beside this one, laid out alike

    def compose(self) -> ComposeResult:
        yield Static("", classes="inspector-summary", markup=False)
        yield DataTable(classes="inspector-table", cursor_type="row", zebra_stripes=True)
        hint = ("Enter: continue from this candidate · " if self.branching else "") + \
            "Esc: close · the last stage is what it was drawn from"  # wraps in a narrow panel (app.tcss)
        yield Static(hint, classes="inspector-hint", markup=False)

    @property
    def table(self) -> DataTable:
        return self.query_one(DataTable)

    def show(self, trace: TokenTrace, index: int, *, seed: int | None, profile: str | None,
             sampler: str | None, alike: tuple[TokenTrace, ...] = ()) -> None:
        """Show token ``index`` of a reply, drawn with ``seed`` under ``profile`` (its chain printed as ``sampler``);
        ``alike``: the traces other panels show beside it (the other side of a replay), whose tables must fit the
        same layout."""
        self.trace, self.index, self.alike = trace, index, alike
        self.query_one(".inspector-summary", Static).update(
            inspector.summary(trace, index=index, seed=seed, profile=profile, sampler=sampler))
        self._fill(trace, self._density(trace))

    def _density(self, trace: TokenTrace) -> inspector.Density:
        """The widest layout that fits the panel; the full one while the panel has no width (hidden)."""
        width = self.content_region.width
        if not width:
            return inspector.FULL
        table = self.table
        if len(trace.candidates) + 1 > table.size.height:  # the rows and header overflow: room for its scrollbar
            width -= table.styles.scrollbar_size_vertical
        return inspector.fit((trace, *self.alike), width, table.cell_padding)

    def _fill(self, trace: TokenTrace, density: inspector.Density, *, row: int = 0) -> None:
        table = self.table
        table.clear(columns=True)
        table.add_columns(*inspector.columns(trace, density))
        shifts, dry = inspector.has_shifts(trace), inspector.has_dry(trace)
        for candidate in inspector.rows(trace):
            table.add_row(*candidate.cells(shifts=shifts, dry=dry, density=density), key=str(candidate.token_id))
        if row:
            table.move_cursor(row=min(row, table.row_count - 1))
        self.density = density

    def on_resize(self) -> None:
        if self.trace is not None and (density := self._density(self.trace)) != self.density:
            self._fill(self.trace, density, row=self.table.cursor_row)  # the same candidate stays selected

    def action_close(self) -> None:
        self.post_message(self.Closed(self))

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if self.branching and self.trace is not None and event.row_key.value is not None:
            self.post_message(self.BranchRequested(self, self.index, int(event.row_key.value)))
