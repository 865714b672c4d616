"""The side-by-side replay's logic without Textual: what to change, how to run both sides, where they part.

A replay answers the same messages twice with the same seed: once with the reply's own profile (the original,
re-run so both sides are traced the same way) and once with one parameter changed. The first token where the two
parts is what the replay screen marks and inspects on both sides.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from mlxchat.core.profile import SamplingProfile

from .inspector import first_divergence

if TYPE_CHECKING:
    from mlxchat.core import Engine
    from mlxchat.core.events import GenerationResult
    from mlxchat.core.messages import ChatMessage


TRACE_K = 8  # candidates per token recorded on demand (F7 on an untraced reply, a replay, a branch)


class ReplayError(ValueError):
    """The change cannot be made; the message is one line naming the field."""


def parse_change(text: str) -> tuple[str, Any]:
    """``"temperature=1.2"`` -> ("temperature", 1.2). The value is read as JSON (numbers, true/false, null, lists),
    else kept as a string."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ReplayError("write the change as name=value, e.g. temperature=1.2 or top_k=5")
    try:
        return name, json.loads(value.strip())
    except json.JSONDecodeError:
        return name, value.strip()


@dataclass(frozen=True)
class ReplaySource:
    """What a reply answered and how it was drawn: the messages before it, its stored profile and its seed."""

    messages: tuple["ChatMessage", ...]
    profile: dict[str, Any]
    seed: int | None
    max_tokens: int | None

    def suggestion(self) -> str:
        """A change worth seeing: greedy gets some temperature, a sampled reply a hotter one."""
        temperature = self.profile.get("temperature", 0.0) or 0.0
        return "temperature=0.8" if temperature == 0 else f"temperature={min(2.0, temperature + 0.5):g}"

    def plan(self, change: str) -> "ReplayPlan":
        return ReplayPlan.make(self.messages, self.profile, self.seed, change, self.max_tokens)

    def retrace(self, engine: "Engine", trace: int, max_tokens: int) -> "GenerationResult":
        """The reply written again as it was (same messages, profile and seed), traced: tracing does not change
        the tokens, so this records the traces of a reply that was written untraced (blocking: call it off the
        UI thread)."""
        return engine.generate([m.as_prompt() for m in self.messages],
                               profile=SamplingProfile.model_validate(seeded(self.profile, self.seed)),
                               max_tokens=max_tokens, trace=trace)


def seeded(profile: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """A reply's stored profile with the seed it was drawn with (a random seed is reported: a re-run reuses it)."""
    base = {k: v for k, v in profile.items() if k in SamplingProfile.model_fields}
    if seed is not None:
        base["seed"] = seed
    try:
        SamplingProfile.model_validate(base)
    except ValidationError as e:
        raise ReplayError(f"the reply's profile is no longer valid: {e.errors()[0]['msg']}") from None
    return base


@dataclass(frozen=True)
class ReplayPlan:
    """Both runs of a replay: the messages the reply answered, the reply's profile with its seed, and the change."""

    messages: tuple["ChatMessage", ...]
    original: SamplingProfile
    changed: SamplingProfile
    change: str  # as the user wrote it, normalised ("top_k=5")
    max_tokens: int | None

    @classmethod
    def make(cls, messages: Sequence["ChatMessage"], profile: dict[str, Any], seed: int | None, change: str,
             max_tokens: int | None) -> "ReplayPlan":
        """The reply's stored ``profile`` with the ``seed`` it ran with, and the same with ``change`` applied."""
        base = seeded(profile, seed)
        original = SamplingProfile.model_validate(base)
        name, value = parse_change(change)
        if name not in SamplingProfile.model_fields:
            raise ReplayError(f"{name!r} is not a sampling parameter (e.g. temperature, top_p, top_k, min_p)")
        if name == "seed":
            raise ReplayError("a replay keeps the seed: change a sampling parameter instead")
        try:
            changed = SamplingProfile.model_validate({**base, name: value, "name": None})
        except ValidationError as e:
            raise ReplayError(str(e.errors()[0]["msg"])) from None
        if changed.model_dump(exclude={"name"}) == original.model_dump(exclude={"name"}):
            raise ReplayError(f"{name} is already {value!r}: pick another value")
        return cls(tuple(messages), original, changed, f"{name}={json.dumps(value)}", max_tokens)

    def run(self, engine: "Engine", trace: int) -> "tuple[GenerationResult, GenerationResult]":
        """Both sides, traced (blocking: call it off the UI thread)."""
        messages = [m.as_prompt() for m in self.messages]
        kw = {"max_tokens": self.max_tokens, "trace": trace}
        return (engine.generate(messages, profile=self.original, **kw),
                engine.generate(messages, profile=self.changed, **kw))


def parting(a: "GenerationResult", b: "GenerationResult") -> int | None:
    """The first token index where the two replies differ, or None when they are the same."""
    return first_divergence(a.token_ids, b.token_ids)
