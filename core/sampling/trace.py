"""What the sampler inspector records for one generated token: its candidates through every stage of the chain.

This is the contract scripts, the server's extension field and the TUI's inspector read (issue 14):

* ``trace.candidates`` — best first (by raw logit after the processors), at most K of them, always holding the
  chosen token and every candidate any stage kept (up to K);
* each candidate's ``probs`` — an ordered mapping: ``"processed"`` (softmax after penalties and bias), then one key
  per transform exactly as ``Sampler.describe()`` prints it (e.g. ``"TopK(5)"``), each the renormalised probability
  the next stage sees, or ``None`` once a stage removed it. The last key's column is the distribution sampled from;
* ``removed_by`` — the key of the stage that removed the candidate, or ``None``;
* ``shifts`` — per processor (as ``describe()`` prints it), how far it moved this candidate's logit (``-inf`` when it
  banned the token, e.g. ``MinTokens``; ``as_dict`` writes that as ``null``, since JSON has no infinity);
* ``notes`` — per stage, why it acted on this candidate where the numbers do not say it: for DRY, the repeated
  sequence the candidate would extend (``"DRY(0.8, 1.75, 2, -1)": "repeats ' the cat sat' (3 tokens)"``).

Greedy chains have no transforms: ``probs`` holds just ``"processed"`` and the chosen token is its argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Candidate:
    token_id: int
    text: str
    logit: float  # the model's raw logit, before any processor
    probs: dict[str, float | None]  # ordered: "processed", then one key per transform
    removed_by: str | None
    chosen: bool
    shifts: dict[str, float] = field(default_factory=dict)  # processor -> logit change it made
    notes: dict[str, str] = field(default_factory=dict)  # stage -> why it acted on this candidate


@dataclass(frozen=True)
class TokenTrace:
    candidates: list[Candidate]
    entropy_before: float  # nats, of the processed distribution (before the transforms)
    entropy_after: float  # nats, of the distribution sampled from
    chosen_rank: int  # 0-based rank of the chosen token by processed probability
    stages: tuple[str, ...]  # the keys of every candidate's probs, in order

    @property
    def chosen(self) -> Candidate:
        """The candidate that was sampled (always present)."""
        return next(c for c in self.candidates if c.chosen)

    @property
    def chosen_prob(self) -> float:
        """The chosen token's probability in the distribution it was drawn from (what a heat view shades by)."""
        p = self.chosen.probs[self.stages[-1]]
        return 0.0 if p is None else p

    def choose(self, token_id: int) -> "TokenTrace | None":
        """The same step with `token_id` chosen instead (a branch forces another candidate: the distribution is the
        same, only the choice differs); None when `token_id` is not one of the candidates."""
        ids = [c.token_id for c in self.candidates]
        if token_id not in ids:
            return None
        return replace(self, candidates=[replace(c, chosen=c.token_id == token_id) for c in self.candidates],
                       chosen_rank=ids.index(token_id))

    def as_dict(self) -> dict:
        """JSON-ready form (the server's streaming extension field and the store use it)."""
        return {
            "candidates": [{"token_id": c.token_id, "text": c.text, "logit": c.logit, "probs": dict(c.probs),
                            "removed_by": c.removed_by, "chosen": c.chosen,
                            "shifts": {k: v if math.isfinite(v) else None for k, v in c.shifts.items()},
                            "notes": dict(c.notes)}
                           for c in self.candidates],
            "entropy_before": self.entropy_before, "entropy_after": self.entropy_after,
            "chosen_rank": self.chosen_rank, "stages": list(self.stages),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TokenTrace":
        return cls(candidates=[Candidate(c["token_id"], c["text"], c["logit"], dict(c["probs"]), c["removed_by"],
                                         c["chosen"], {k: -math.inf if v is None else v
                                                       for k, v in c.get("shifts", {}).items()},
                                         dict(c.get("notes", {})))
                               for c in d["candidates"]],
                   entropy_before=d["entropy_before"], entropy_after=d["entropy_after"],
                   chosen_rank=d["chosen_rank"], stages=tuple(d["stages"]))
