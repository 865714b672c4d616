"""The lab screen: pick a prompt set and two profiles (or a sweep), run with live progress, browse the outputs side
by side per prompt under the metrics table, and vote blind between two settings. The logic is
``mlxchat.lab.session.LabSession``; this screen only shows it.

The TUI opens it with F6 through the entry point ``lab`` of the group ``mlxchat.screens`` (``open_lab`` below; see
app/tool_screens.py), so the app never imports the lab."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Button, DataTable, Footer, Input, Label, ProgressBar, Select, Static

from mlxchat.core import SamplingProfile

from . import prompts as P
from .report import verdict
from .session import LabSession
from .store import LabStore

if TYPE_CHECKING:
    from mlxchat.core import Engine

COLUMNS = ("pass_rate", "distinct_2", "rep_4", "self_bleu", "mean_logprob", "length")


def open_lab(engine: "Engine", data_dir: Path) -> "LabScreen":
    """The entry point ``mlxchat.screens`` ``lab``: the lab on the app's engine, its runs in ``data_dir``/lab.db."""
    return LabScreen(engine, LabStore(data_dir / "lab.db"))


def metric_cell(stat: dict | None) -> str:
    """A metrics table cell: the mean, and its 95% interval below it."""
    if not stat:
        return "n/a"
    return f"{stat['mean']:.2f}\n[{stat['low']:.2f}, {stat['high']:.2f}]"


def field(label: str, widget: Widget, id: str | None = None) -> Vertical:  # noqa: A002 - Textual's name
    """A form field: its label above it."""
    return Vertical(Label(label), widget, classes="field", id=id)


class LabScreen(Screen):
    DEFAULT_CSS = """
    LabScreen .row { height: auto; padding: 0 1; }
    LabScreen .field { width: auto; height: auto; margin-right: 1; }
    LabScreen .field Label { color: $text-muted; }
    LabScreen .field Select { width: 19; }
    LabScreen .field Input { width: 13; }
    LabScreen #sweep_field { width: 1fr; }
    LabScreen #sweep_field Input { width: 1fr; }
    LabScreen #run { margin-top: 1; }
    LabScreen #hint { height: auto; padding: 0 1; color: $text-muted; }
    LabScreen #status { height: auto; padding: 0 1; }
    LabScreen #metrics { height: auto; max-height: 8; }
    LabScreen #prompt { height: auto; padding: 0 1; background: $boost; }
    LabScreen #sides { height: 1fr; }
    LabScreen #sides VerticalScroll { width: 1fr; border: round $primary; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "close", "Back / stop", id="lab_close"),
        Binding("ctrl+r", "run", "Run", id="lab_run"),
        Binding("right_square_bracket", "step(1)", "Next prompt", id="lab_next"),
        Binding("left_square_bracket", "step(-1)", "Prev prompt", id="lab_prev"),
        Binding("ctrl+b", "blind", "Blind A/B", id="lab_blind"),
        Binding("f1", "vote('left')", "Left", id="lab_left", show=False),
        Binding("f2", "vote('right')", "Right", id="lab_right", show=False),
        Binding("f3", "vote('tie')", "Tie", id="lab_tie", show=False),
        Binding("f4", "vote('skip')", "Skip", id="lab_skip", show=False),
    ]

    class Progress(Message):
        def __init__(self, done: int, total: int) -> None:
            super().__init__()
            self.done, self.total = done, total

    class Finished(Message):
        def __init__(self, error: str | None = None) -> None:
            super().__init__()
            self.error = error

    def __init__(self, engine: "Engine", store: LabStore | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.session = LabSession(store or LabStore())
        self.running = False

    def compose(self) -> ComposeResult:
        profiles = [(p, p) for p in SamplingProfile.presets()]
        # Two rows of labelled fields, so each label and hint reads whole in 80 columns.
        with Horizontal(classes="row"):
            yield field("prompt set", Select([(s, s) for s in P.available()], value="chat", allow_blank=False,
                                             id="set"))
            yield field("setting A", Select(profiles, value="precise", allow_blank=False, id="profile_a"))
            yield field("setting B", Select(profiles, value="chat", allow_blank=False, id="profile_b"))
            yield Button("Run", id="run", variant="primary")
        with Horizontal(classes="row"):
            yield field("or a sweep instead of A and B", Input(placeholder="temperature=0,0.7", id="sweep"),
                        id="sweep_field")
            yield field("seeds", Input("2", id="seeds", type="integer"))
            yield field("max tokens", Input("48", id="max_tokens", type="integer"))
            yield field("prompts used", Input("4", id="limit", type="integer"))
        yield Static("Ctrl+R run · Esc stop / back · [ ] browse prompts · Ctrl+B blind A/B (F1 left, F2 right, "
                     "F3 tie, F4 skip)", id="hint")
        yield ProgressBar(id="progress", show_eta=True)
        yield Static("Choose a prompt set and two profiles (or a sweep), then Run.", id="status")
        yield DataTable(id="metrics", cursor_type="row", zebra_stripes=True)
        yield Static("", id="prompt")
        with Horizontal(id="sides"):
            with VerticalScroll():
                yield Static("", id="left")
            with VerticalScroll():
                yield Static("", id="right")
        yield Footer()

    def status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    # --- running -------------------------------------------------------------------------------------------------

    @on(Button.Pressed, "#run")
    def action_run(self) -> None:
        if self.running:
            return
        try:
            ints = {k: int(self.query_one(f"#{k}", Input).value) for k in ("seeds", "max_tokens", "limit")}
        except ValueError:
            self.status("seeds, max tokens and prompts must be whole numbers")
            return
        sweep = self.query_one("#sweep", Input).value.strip()
        profiles = [] if sweep else [str(self.query_one(f"#{k}", Select).value) for k in ("profile_a", "profile_b")]
        try:
            experiment = self.session.prepare(str(self.query_one("#set", Select).value), profiles, sweep,
                                              ints["seeds"], ints["max_tokens"], ints["limit"])
        except ValueError as e:
            self.status(str(e))
            return
        self.running = True
        self.query_one(ProgressBar).update(total=len(experiment.jobs()), progress=0)
        self.status(f"running {len(experiment.jobs())} generations… (Esc stops and keeps what finished)")
        self.run_experiment(experiment)

    @work(thread=True, exclusive=True)
    def run_experiment(self, experiment) -> None:  # noqa: ANN001 - lab.runner.Experiment
        try:
            self.session.execute(self.engine, experiment, lambda d, t: self.post_message(self.Progress(d, t)))
        except Exception as e:  # noqa: BLE001 - an engine error is shown on the screen, never a traceback
            self.post_message(self.Finished(f"{type(e).__name__}: {e}"))
        else:
            self.post_message(self.Finished())

    def on_lab_screen_progress(self, message: Progress) -> None:
        self.query_one(ProgressBar).update(progress=message.done)

    def on_lab_screen_finished(self, message: Finished) -> None:
        self.running = False
        if message.error:
            self.status(f"the run failed: {message.error}")
            return
        run = self.session.run
        self.status(f"run {run.id} {run.status}: {len(run.outputs)} outputs stored · [ ] browse prompts · "
                    "Ctrl+B blind A/B of the first two settings")
        table = self.query_one("#metrics", DataTable)
        table.clear(columns=True)
        table.add_columns("setting", *COLUMNS, "finish")
        for cell in run.cells():
            m = cell["metrics"]
            finish = sorted(m["finish_reasons"].items())
            # Two lines a row, the mean over its 95% interval: on one line the table ran to ~145 columns and
            # clipped its interval and finish columns at 120.
            table.add_row(cell["label"], *(metric_cell(m.get(c)) for c in COLUMNS),
                          "\n".join(f"{k} {v}" for k, v in finish), height=max(2, len(finish)))
        self.show_prompt()

    # --- browsing and voting -------------------------------------------------------------------------------------

    def show_prompt(self) -> None:
        pid, text, cols = self.session.current()
        self.query_one("#prompt", Static).update(f"[{self.session.index + 1}/{len(self.session.run.prompts)}] "
                                                 f"{pid}: {text}")
        for side, (label, out) in zip(("#left", "#right"), cols):
            body = "(no output)" if out is None else f"{out.text}\n\n— {out.finish_reason}, {verdict(out.passed)}"
            self.query_one(side, Static).update(f"{label}\n\n{body}")

    def action_step(self, delta: int) -> None:
        if self.session.run and self.session.ab is None:
            self.session.step(delta)
            self.show_prompt()

    def action_blind(self) -> None:
        try:
            self.session.start_ab()
        except ValueError as e:
            self.status(str(e))
            return
        self.show_pair("Blind A/B: F1 left · F2 right · F3 tie · F4 skip")

    def show_pair(self, note: str) -> None:
        pair = self.session.ab.current
        if pair is None:
            labels = [s["label"] for s in self.session.run.settings[:2]]
            r = self.session.ab.result()
            w = r["win_rate_a"]
            rate = f"{w['mean']:.2f} [{w['low']:.2f}, {w['high']:.2f}]" if w else "–"
            self.status(f"A/B done: {labels[0]} won {r['a']}, {labels[1]} won {r['b']}, ties {r['tie']}, "
                        f"skipped {r['skip']}; {labels[0]} win rate {rate} (Wilson 95%), stored with the run")
            self.session.ab = None
            self.show_prompt()
            return
        self.status(note)
        self.query_one("#prompt", Static).update(f"{pair.prompt_id}: {pair.prompt}")
        self.query_one("#left", Static).update(f"left\n\n{pair.left}")
        self.query_one("#right", Static).update(f"right\n\n{pair.right}")

    def action_vote(self, choice: str) -> None:
        if self.session.ab is None:
            return
        r = self.session.vote(choice)
        self.show_pair(f"voted {choice} · so far {r['a'] + r['b'] + r['tie']} votes, {r['skip']} skipped")

    def action_close(self) -> None:
        if self.running:
            self.session.cancel()
            self.status("stopping after the current generation…")
        else:
            self.dismiss()
