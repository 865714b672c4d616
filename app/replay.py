"""The side-by-side replay's logic without Textual: what to change, how to run both sides, where they part.

A replay answers the same messages twice with the same seed: once with the reply's own profile (the original,
re-run so both sides are traced the same way) and once with one parameter changed. The first token where the two
parts is what the replay screen marks and inspects on both sides. A branch (a reply continued from one of its
tokens with another candidate) is replayed as it is shown: its decided start (the kept tokens and the forced one)
is forced on both sides, as `ChatSession.branch` made it, and the rest is drawn.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from mlxchat.core.chat.messages import ChatMessage
from mlxchat.core.sampling.profile import SamplingProfile

from .inspector import first_divergence

if TYPE_CHECKING:
    from mlxchat.core import Engine
    from mlxchat.core.decode.events import GenerationResult
    from mlxchat.core.sampling.trace import TokenTrace


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
    start: tuple[int, ...] = ()  # a branch's decided start (kept and forced ids), forced again on both sides
    start_traces: tuple["TokenTrace", ...] = ()  # their traces (aligned with start, or empty)

    @classmethod
    def of(cls, messages: Sequence["ChatMessage"], reply: "ChatMessage", profile: dict[str, Any],
           max_tokens: int | None) -> "ReplaySource":
        """What replaying ``reply`` (the answer to ``messages``) re-runs. A branch's decided start is the ids it
        did not draw: its metrics count only the drawn ones."""
        drawn = reply.metrics.get("completion_tokens")
        decided = len(reply.token_ids) - drawn if isinstance(drawn, int) and drawn < len(reply.token_ids) else 0
        return cls(tuple(messages), profile, reply.seed, max_tokens, reply.token_ids[:decided],
                   reply.traces[:decided])

    def suggestion(self) -> str:
        """A change worth seeing: greedy gets some temperature, a sampled reply a hotter one."""
        temperature = self.profile.get("temperature", 0.0) or 0.0
        return "temperature=0.8" if temperature == 0 else f"temperature={min(2.0, temperature + 0.5):g}"

    def plan(self, change: str) -> "ReplayPlan":
        plan = ReplayPlan.make(self.messages, self.profile, self.seed, change, self.max_tokens)
        return dataclasses.replace(plan, start=self.start, start_traces=self.start_traces)

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
    start: tuple[int, ...] = ()  # see ReplaySource
    start_traces: tuple["TokenTrace", ...] = ()

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
        if self.start:
            return self._continued(engine, self.original, trace), self._continued(engine, self.changed, trace)
        messages = [m.as_prompt() for m in self.messages]
        kw = {"max_tokens": self.max_tokens, "trace": trace}
        return (engine.generate(messages, profile=self.original, **kw),
                engine.generate(messages, profile=self.changed, **kw))

    def _continued(self, engine: "Engine", profile: SamplingProfile, trace: int) -> "GenerationResult":
        """The messages answered with the decided start forced and the rest drawn with ``profile`` (and its seed),
        as `ChatSession.branch` continues a reply: the sampler's key and penalties go on as if the start had been
        drawn."""
        system = self.messages[0].content if self.messages and self.messages[0].role == "system" else None
        chat = engine.chat(system=system, profile=profile)
        start = ChatMessage("assistant", "", profile=profile.model_dump(mode="json"), token_ids=self.start,
                            seed=profile.seed, traces=self.start_traces)
        chat.replace_history([*self.messages[1 if system is not None else 0:], start])
        return chat.branch(-1, len(self.start) - 1, self.start[-1], max_tokens=self.max_tokens, trace=trace).wait()


def parting(a: "GenerationResult", b: "GenerationResult") -> int | None:
    """The first token index where the two replies differ, or None when they are the same."""
    return first_divergence(a.token_ids, b.token_ids)
