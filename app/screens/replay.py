"""The side-by-side replay (F9): a reply answered again with one parameter changed and the same seed; both texts as
heat strips, the first token where they part marked, and the inspector for that token on both sides.

The logic (parsing the change, running both sides, finding where they part) is ``app/replay.py``; this screen only
asks for the change, runs the plan on a thread (the engine's calls block) and lays out the outcome: side by side from
140 columns, one over the other below (the screen's ``-stacked`` class, app.tcss), where two tables side by side
would each be under 70 columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from ..replay import ReplayError, ReplayPlan, ReplaySource, parting
from ..widgets import TokenInspector, TokenStrip

if TYPE_CHECKING:
    from mlxchat.core import Engine
    from mlxchat.core.decode.events import GenerationResult


class ReplayScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "close", "Close", id="replay_close")]
    HORIZONTAL_BREAKPOINTS = [(0, "-stacked"), (140, "-side-by-side")]

    def __init__(self, engine: "Engine", source: ReplaySource, *, trace: int) -> None:
        super().__init__(classes="dialog-screen")
        self.engine, self.source, self.trace = engine, source, trace
        self.results: tuple["GenerationResult", "GenerationResult"] | None = None
        self.parts_at: int | None = None
        self.shown = False  # both sides laid out

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog replay"):
            yield Static("Replay with one change (same seed)", classes="dialog-title")
            yield Input(self.source.suggestion(), id="replay-change",
                        placeholder="name=value, e.g. temperature=1.2, top_k=5, min_p=0.1")
            yield Static("Enter runs both sides · Esc closes", id="replay-status", classes="replay-status",
                         markup=False)
            with Horizontal(id="replay-sides"):
                for side in ("a", "b"):
                    with Vertical(id=f"replay-{side}", classes="replay-side"):
                        yield Static("", classes="replay-title", markup=False)
                        yield Vertical(classes="replay-strip")
                        yield TokenInspector(branching=False, classes="replay-inspector")

    @on(Input.Submitted, "#replay-change")
    def _submitted(self, event: Input.Submitted) -> None:
        try:
            plan = self.source.plan(event.value)
        except ReplayError as e:
            self._status(str(e))
            return
        self._status(f"running both sides: as written, and with {plan.change}…")
        self._run(plan)

    def _status(self, text: str) -> None:
        self.query_one("#replay-status", Static).update(text)

    @work(thread=True, exclusive=True)
    def _run(self, plan: ReplayPlan) -> None:
        try:
            results = plan.run(self.engine, self.trace)
        except Exception as e:  # noqa: BLE001 - an engine error is shown here; the chat goes on
            self.app.call_from_thread(self._status, f"the replay failed: {e}")
            return
        self.app.call_from_thread(self._show, plan, results)

    async def _show(self, plan: ReplayPlan, results: tuple["GenerationResult", "GenerationResult"]) -> None:
        self.results, self.parts_at, self.shown = results, parting(*results), False
        at = self.parts_at
        self._status("the same text on both sides" if at is None else
                     f"they part at token {at + 1} (marked); ←/→ move on both sides, Tab switches side")
        for side, result, profile, title in (("a", results[0], plan.original, "as written"),
                                             ("b", results[1], plan.changed, plan.change)):
            box = self.query_one(f"#replay-{side}")
            box.query_one(".replay-title", Static).update(f"{title} · {profile.describe_chain()}")
            holder = box.query_one(".replay-strip")
            await holder.remove_children()
            traces = list(result.traces)
            await holder.mount(TokenStrip(traces, marked=at, id=f"replay-strip-{side}"))
            if traces:
                self._inspect(side, min(at if at is not None else 0, len(traces) - 1))
        self.query_one("#replay-strip-a", TokenStrip).focus()
        self.shown = True

    def _inspect(self, side: str, index: int) -> None:
        assert self.results is not None
        result = self.results[0 if side == "a" else 1]
        traces = result.traces
        if index >= len(traces):
            return
        other = self.results[1 if side == "a" else 0].traces
        panel = self.query_one(f"#replay-{side} TokenInspector", TokenInspector)
        panel.show(traces[index], index, seed=result.seed, profile=result.profile.get("name") or "changed",
                   sampler=result.sampler, alike=tuple(other[index:index + 1]))  # both tables laid out alike
        panel.add_class("-open")

    @on(TokenStrip.Moved)
    def _moved(self, event: TokenStrip.Moved) -> None:
        # Both sides follow one cursor: the same token index is compared.
        for side in ("a", "b"):
            for strip in self.query(f"#replay-strip-{side}").results(TokenStrip):  # none while a run is laid out
                self._inspect(side, event.index)
                if strip is not event.strip and event.index < len(strip.tokens):
                    strip.cursor = event.index

    @on(TokenStrip.Inspect)
    def _token(self, event: TokenStrip.Inspect) -> None:
        event.stop()  # the panels already follow the cursor

    @on(TokenInspector.Closed)
    def _panel_closed(self, event: TokenInspector.Closed) -> None:
        event.stop()
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
