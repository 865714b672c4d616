"""One chat message, as the engine, the app and the store all see it; and a conversation as a tree of replies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..decode.events import FinishReason
from ..decode.tools import call_entry, result_message
from ..sampling.trace import TokenTrace

Role = Literal["system", "user", "assistant"]
# What a conversation does once it no longer fits the model's context (see core.chat.chat_session.ChatSession).
ContextPolicy = Literal["truncate", "rotate", "error"]


@dataclass
class ChatMessage:
    """A turn of a conversation. Replies also carry how they ended, their metrics and the profile that made them,
    and (from the engine) their token ids, the seed they were sampled with and, when traced, one trace per token
    id: what `ChatSession.branch` needs to continue a reply from any of its tokens; and the sampler chain and the
    model that wrote them (what a reply's stats line and the store show)."""

    role: Role
    content: str
    finish_reason: FinishReason | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    token_ids: tuple[int, ...] = ()
    seed: int | None = None
    traces: tuple[TokenTrace, ...] = ()
    sampler: str | None = None
    model: str | None = None
    reasoning: str = ""  # a thinking model's reasoning, apart from `content` (the answer; core/decode/reasoning.py)
    # A reply that called tools (core/chat/tool_loop.py): each call made on the way to its text, in order, as
    # {"id", "name", "arguments" (JSON text), "round" (which generation of the reply made it), "source" (the MCP
    # server or "python"), "result" (what the model was given back; None while not run), "ok", "note"}.
    tool_calls: tuple[dict[str, Any], ...] = ()

    def as_prompt(self) -> dict[str, str]:
        """The message as a chat template reads it: a reply's reasoning as ``reasoning_content``, which the template
        keeps or (most do, for old turns) leaves out."""
        if self.reasoning:
            return {"role": self.role, "content": self.content, "reasoning_content": self.reasoning}
        return {"role": self.role, "content": self.content}

    def as_prompts(self) -> list[dict[str, Any]]:
        """The message as the chat template reads it, a reply that called tools as what the model saw: per round,
        an assistant message with its calls then one tool message per result; then its text (when it has any, or
        when its last round's calls all have results: the text is what follows them)."""
        if not self.tool_calls:
            return [self.as_prompt()]
        out: list[dict[str, Any]] = []
        rounds = sorted({c.get("round", 0) for c in self.tool_calls})
        for r in rounds:
            calls = [c for c in self.tool_calls if c.get("round", 0) == r]
            out.append({"role": "assistant", "content": "",
                        "tool_calls": [call_entry(c["id"], c["name"], _arguments(c)) for c in calls]})
            out += [result_message(c["id"], c["result"], c["name"]) for c in calls if c.get("result") is not None]
        if self.content:
            out.append(self.as_prompt())
        return out

    @classmethod
    def coerce(cls, message: "ChatMessage | Mapping[str, Any]") -> "ChatMessage":
        """A ChatMessage from itself or from an OpenAI-style ``{"role", "content"}`` mapping (which may also carry
        the other fields, e.g. ``token_ids`` and ``seed`` of a stored reply)."""
        if isinstance(message, ChatMessage):
            return message
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ValueError("each message needs a role (system, user or assistant) and a string 'content'")
        traces = tuple(t if isinstance(t, TokenTrace) else TokenTrace.from_dict(t) for t in message.get("traces") or ())
        return cls(role, content, message.get("finish_reason"), dict(message.get("metrics") or {}),
                   dict(message.get("profile") or {}), tuple(message.get("token_ids") or ()), message.get("seed"),
                   traces, message.get("sampler"), message.get("model"),
                   message.get("reasoning") or message.get("reasoning_content") or "",
                   tuple(dict(c) for c in message.get("tool_calls") or ()))


def _arguments(call: Mapping[str, Any]) -> Any:
    """A stored call's arguments as an object (they are kept as JSON text, as the model wrote them)."""
    import json

    try:
        return json.loads(call.get("arguments") or "{}")
    except json.JSONDecodeError:
        return {}


# --- branches -------------------------------------------------------------------------------------------------------

@dataclass
class Tail:
    """What follows one position of the conversation in one alternative: its messages (the first one at that
    position) and the forks further down that alternative."""

    messages: list[ChatMessage]
    forks: dict[int, Fork] = field(default_factory=dict)


@dataclass
class Fork:
    """The alternatives at one position: ``tails[active]`` is None because that alternative is the live path."""

    active: int
    tails: list[Tail | None]

    def shifted(self, by: int) -> "Fork":
        """The same fork with the positions of the forks further down its tails moved by `by` (a system prompt put
        in front of, or taken from, the path they are positions of)."""
        return Fork(self.active, [None if t is None else Tail(t.messages, {p + by: f.shifted(by) for p, f in
                                                                          t.forks.items()}) for t in self.tails])


class ReplyTree:
    """A conversation as a tree of replies, held as its active path (the messages a prompt is rendered from) plus,
    at each position that has alternatives, a `Fork` keeping the inactive alternatives with everything that
    followed them. Switching a branch swaps a tail in and out, so the path is always a plain list."""

    def __init__(self, path: list[ChatMessage] | None = None, forks: dict[int, Fork] | None = None) -> None:
        self.path = path if path is not None else []
        self.forks = forks if forks is not None else {}

    def truncate(self, position: int) -> None:
        """Drop the path from `position` on, with the alternatives at those positions."""
        del self.path[position:]
        self.forks = {p: f for p, f in self.forks.items() if p < position}

    def add_alternative(self, position: int, message: ChatMessage) -> int:
        """Make `message` a new alternative at `position` and the active one (what followed the old one stays in its
        branch); return its index among the alternatives."""
        self._check(position)
        fork = self.forks.get(position) or Fork(0, [None])
        fork.tails[fork.active] = self._take_tail(position)
        fork.tails.append(None)
        fork.active = len(fork.tails) - 1
        self.forks[position] = fork
        self.path.append(message)
        return fork.active

    def select(self, position: int, index: int) -> None:
        """Make alternative `index` at `position` the active one (the path then continues with its messages)."""
        count = len(self.alternatives(position))
        if not 0 <= index < count:
            raise ValueError(f"branch index must be between 0 and {count - 1} at position {position}, got {index}")
        fork = self.forks.get(position)
        if fork is None or index == fork.active:
            return
        fork.tails[fork.active] = self._take_tail(position)
        tail = fork.tails[index]
        assert tail is not None
        fork.tails[index], fork.active = None, index
        self.path.extend(tail.messages)
        self.forks.update(tail.forks)

    def alternatives(self, position: int) -> list[ChatMessage]:
        """The first message of each alternative at `position`, oldest first (one when there is no fork)."""
        self._check(position)
        fork = self.forks.get(position)
        if fork is None:
            return [self.path[position]]
        return [self.path[position] if t is None else t.messages[0] for t in fork.tails]

    def active(self, position: int) -> int:
        """Which alternative at `position` the path follows."""
        self._check(position)
        fork = self.forks.get(position)
        return 0 if fork is None else fork.active

    def _check(self, position: int) -> None:
        if not 0 <= position < len(self.path):
            raise ValueError(f"position must be between 0 and {len(self.path) - 1}, got {position}")

    def _take_tail(self, position: int) -> Tail:
        """Cut the path at `position`, returning what was cut with the forks below `position`."""
        tail = Tail(self.path[position:], {p: f for p, f in self.forks.items() if p > position})
        del self.path[position:]
        self.forks = {p: f for p, f in self.forks.items() if p <= position}
        return tail


Prompt = str | Sequence[dict[str, str] | ChatMessage]


def prompt_messages(prompt: Prompt, system: str | None) -> list[dict[str, str]]:
    """A one-off prompt (a string, or messages) as the chat template's messages, checked, with `system` first."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        m.as_prompt() if isinstance(m, ChatMessage) else dict(m) for m in prompt]
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string 'role' and a string 'content'")
    if not messages or not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise ValueError("the prompt is empty: type a message first")
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


@dataclass(frozen=True)
class Forced:
    """The start of a reply already decided (`ChatSession.branch`): its token ids, and their traces (aligned with
    the ids, or empty)."""

    ids: tuple[int, ...]
    traces: tuple[TokenTrace, ...] = ()
