"""One chat message, as the engine, the app and the store all see it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .events import FinishReason

Role = Literal["system", "user", "assistant"]
# What a conversation does once it no longer fits the model's context (see core.engine.ChatSession).
ContextPolicy = Literal["truncate", "rotate", "error"]


@dataclass
class ChatMessage:
    """A turn of a conversation. Replies also carry how they ended, their metrics and the profile that made them."""

    role: Role
    content: str
    finish_reason: FinishReason | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)

    def as_prompt(self) -> dict[str, str]:
        """The message as a chat template reads it."""
        return {"role": self.role, "content": self.content}

    @classmethod
    def coerce(cls, message: "ChatMessage | Mapping[str, Any]") -> "ChatMessage":
        """A ChatMessage from itself or from an OpenAI-style ``{"role", "content"}`` mapping."""
        if isinstance(message, ChatMessage):
            return message
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ValueError("each message needs a role (system, user or assistant) and a string 'content'")
        return cls(role, content, message.get("finish_reason"), dict(message.get("metrics") or {}),
                   dict(message.get("profile") or {}))
