"""What the TUI lab screen shows, as a plain class: run an experiment into the store, then browse its outputs
prompt by prompt and vote blind between two settings. Tested without a terminal."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

from mlxchat.core import Engine

from . import prompts as P
from .ab import BlindAB
from .runner import Experiment, Output
from .settings import build_settings
from .store import LabStore, Run


class LabSession:
    def __init__(self, store: LabStore) -> None:
        self.store = store
        self.run: Run | None = None
        self.index = 0  # the prompt being browsed
        self.ab: BlindAB | None = None
        self.cancelled = threading.Event()

    def prepare(self, prompt_set: str, profiles: list[str], sweep: str | None, seeds: int, max_tokens: int,
                limit: int | None) -> Experiment:
        """Validate the form; raises ValueError (one line) before anything runs."""
        return Experiment(P.load(prompt_set).limited(limit), build_settings(profiles, sweep or None, None), seeds,
                          max_tokens)

    def execute(self, engine: Engine, experiment: Experiment, progress: Callable[[int, int], None]) -> Run:
        """Run to the end or until `cancel()`; what finished is stored either way. Called from a worker thread."""
        self.cancelled.clear()
        ps = experiment.prompt_set
        run_id = self.store.create(
            model=engine.name, prompt_set=ps.name, prompt_set_hash=ps.digest,
            settings=[s.record() for s in experiment.settings],
            prompts={p.id: p.text for p in ps.prompts}, seeds=len(experiment.seeds), max_tokens=experiment.max_tokens)
        total, done = len(experiment.jobs()), 0

        def on_output(output: Output) -> None:
            nonlocal done
            self.store.add_output(run_id, output)
            done += 1
            progress(done, total)

        finished = experiment.run(engine, on_output, self.cancelled)
        self.store.finish(run_id, "done" if finished else "cancelled")
        self.run, self.index, self.ab = self.store.load(run_id), 0, None
        return self.run

    def cancel(self) -> None:
        self.cancelled.set()

    # --- browsing ------------------------------------------------------------------------------------------------

    def step(self, delta: int) -> None:
        if self.run and self.run.prompts:
            self.index = (self.index + delta) % len(self.run.prompts)

    def current(self) -> tuple[str, str, list[tuple[str, Output | None]]]:
        """(prompt id, prompt text, [(setting label, its first-seed output)]) of the browsed prompt."""
        assert self.run is not None
        pid = list(self.run.prompts)[self.index]
        cols = [(s["label"], next((o for o in self.run.outputs_of(i) if o.prompt_id == pid), None))
                for i, s in enumerate(self.run.settings)]
        return pid, self.run.prompts[pid], cols

    # --- blind A/B -----------------------------------------------------------------------------------------------

    def start_ab(self, rng: random.Random | None = None) -> BlindAB:
        if self.run is None or len(self.run.settings) < 2:
            raise ValueError("blind A/B needs a finished run with at least two settings")
        self.ab = BlindAB(self.run, 0, 1, rng)
        return self.ab

    def vote(self, choice: str) -> dict[str, Any]:
        """Record a vote (stored with the run at once) and return the running tally."""
        assert self.ab is not None and self.run is not None
        pair, _ = self.ab.vote(choice)
        self.store.add_vote(self.run.id, pair.prompt_id, pair.seed, self.ab.cell_a, self.ab.cell_b, pair.a_on_left,
                            choice)
        return self.ab.result()
