"""Blind A/B: pairs of outputs of two settings (same prompt, same seed) shown left/right in a random order, the
user's votes, and A's win rate with a Wilson interval."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from . import metrics as M
from .store import Run

CHOICES = ("left", "right", "tie", "skip")


@dataclass(frozen=True)
class Pair:
    prompt_id: str
    prompt: str
    seed: int
    left: str
    right: str
    a_on_left: bool


class BlindAB:
    def __init__(self, run: Run, cell_a: int, cell_b: int, rng: random.Random | None = None) -> None:
        rng = rng or random.Random()
        self.cell_a, self.cell_b = cell_a, cell_b
        a = {(o.prompt_id, o.seed): o.text for o in run.outputs_of(cell_a)}
        b = {(o.prompt_id, o.seed): o.text for o in run.outputs_of(cell_b)}
        self.pairs: list[Pair] = []
        for key in [k for k in a if k in b]:
            left_is_a = rng.random() < 0.5
            left, right = (a[key], b[key]) if left_is_a else (b[key], a[key])
            self.pairs.append(Pair(key[0], run.prompts.get(key[0], ""), key[1], left, right, left_is_a))
        rng.shuffle(self.pairs)
        self.votes: list[tuple[Pair, str]] = []

    @property
    def current(self) -> Pair | None:
        return self.pairs[len(self.votes)] if len(self.votes) < len(self.pairs) else None

    def vote(self, choice: str) -> tuple[Pair, str]:
        """Record a vote on the current pair; returns it with the winner in setting terms ("a", "b", "tie", "skip")."""
        if choice not in CHOICES:
            raise ValueError(f"vote must be one of {', '.join(CHOICES)}, got {choice!r}")
        pair = self.current
        if pair is None:
            raise ValueError("every pair has a vote already")
        self.votes.append((pair, choice))
        return pair, winner(choice, pair.a_on_left)

    def result(self) -> dict[str, Any]:
        return tally([winner(c, p.a_on_left) for p, c in self.votes])


def winner(choice: str, a_on_left: bool) -> str:
    if choice in ("tie", "skip"):
        return choice
    return "a" if (choice == "left") == a_on_left else "b"


def tally(winners: list[str]) -> dict[str, Any]:
    """A's win rate counting a tie as half a win, over the votes that were not skipped, with a Wilson interval."""
    wins_a, wins_b, ties = winners.count("a"), winners.count("b"), winners.count("tie")
    n = wins_a + wins_b + ties
    est = M.wilson(wins_a + 0.5 * ties, n)
    return {"a": wins_a, "b": wins_b, "tie": ties, "skip": winners.count("skip"),
            "win_rate_a": est.as_dict() if est else None}
