"""Settings from ``config.toml`` in the config folder, validated by pydantic.

Example ``~/.config/mlxchat/config.toml``::

    theme = "textual-light"
    profile = "precise"              # a preset or a saved user profile
    system_prompt = "You are terse."
    max_tokens = 512
    context_policy = "truncate"      # a chat longer than the context: "truncate" (drop the oldest turns, keep the
                                     # system prompt), "rotate" (a rotating KV window) or "error" (refuse the turn)
    kv_window = 2048                 # the rotating window's size (with context_policy = "rotate"; default: the context)
    models = ["~/models/qwen2.5-0.5b-instruct-q4.gguf"]
    trace = 8                        # trace every reply as it is written (costs decode speed; see the README)
    speculative = "auto"             # guess tokens and verify them in one pass, same text: "ngram", "auto" or "off"
    reopen_last = true               # start where you left off: the last chat, not a new one (`mlxchat chat --new`)
    kv_cache_dir = "~/.cache/mlxchat/kv"  # where chats' KV caches are saved, so a reopened chat starts warm
    kv_cache_mb = 4096               # the most that folder may hold (least recently used files go first); 0: off
    reasoning_budget = 1024          # a thinking model reasons for at most this many tokens, then answers
    enable_thinking = false          # switch a thinking model's reasoning off (templates with enable_thinking)

    [keys]                           # binding id = keys (comma-separated); see the help screen (F1) for the ids
    regenerate = "ctrl+r,f12"
    newline = "ctrl+j,shift+enter"

    [mcp.servers.time]               # MCP servers whose tools the model may call (F9 in the chat, generate --mcp)
    command = "uvx"                  # a program spoken to over stdio ...
    args = ["mcp-server-time"]
    env = { TZ = "Europe/Paris" }    # added to a safe part of mlxchat's environment
    timeout = 30                     # seconds one call may take

    [mcp.servers.search]
    url = "http://127.0.0.1:8931/mcp"  # ... or a server over streamable HTTP

A missing file means the defaults. An invalid one is reported in the app (one line naming the field) and the
defaults are used, so a typo never keeps the chat from opening.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlxchat.core.cache.kv_store import DEFAULT_BUDGET_MB
from mlxchat.core.chat.messages import ContextPolicy

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


class ConfigError(Exception):
    """The config file could not be read; the message is one line and names the file."""


class MCPServerSettings(BaseModel):
    """One ``[mcp.servers.NAME]`` table: ``command`` (with ``args``, ``env``) over stdio, or ``url`` over streamable
    HTTP; ``timeout`` is the most one call may take."""

    model_config = ConfigDict(extra="forbid")

    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    url: str | None = None
    timeout: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _one_transport(self) -> "MCPServerSettings":
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a program run over stdio) or url (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// address, got {self.url!r}")
        if self.url is not None and (self.args or self.env):
            raise ValueError("args and env go with command, not url")
        return self


class MCPSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    servers: dict[str, MCPServerSettings] = Field(default_factory=dict)

    @field_validator("servers")
    @classmethod
    def _names(cls, v: dict[str, MCPServerSettings]) -> dict[str, MCPServerSettings]:
        for name in v:
            if not name or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"mcp.servers.{name}: a server's name is letters, digits, '-' or '_'")
        return v

    def server(self, name: str):  # noqa: ANN201 - core.chat.mcp.MCPServer, imported late (it imports the engine's core)
        """The server `name` as a (not yet started) `MCPServer`; a ValueError naming the configured ones if none."""
        from mlxchat.core.chat.mcp import MCPServer, MCPServerSpec

        s = self.servers.get(name)
        if s is None:
            known = ", ".join(sorted(self.servers)) or "none (add [mcp.servers.NAME] to config.toml)"
            raise ValueError(f"no MCP server named {name!r} in config.toml; configured: {known}")
        return MCPServer(MCPServerSpec(name, s.command, tuple(s.args), dict(s.env), s.url, s.timeout))


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    theme: str = "textual-dark"
    dark_theme: str = "textual-dark"
    light_theme: str = "textual-light"
    profile: str = "chat"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    model: str | None = None
    max_tokens: int | None = Field(default=1024, ge=1)
    context_policy: ContextPolicy = "truncate"
    kv_window: int | None = Field(default=None, ge=16)
    sidebar: bool = True
    # Candidates recorded per token of every reply as it is written. 0 (the default): replies cost what they cost,
    # and F7 traces a reply only when asked (by writing it again with its seed).
    trace: int = Field(default=0, ge=0, le=100)
    # Speculative decoding for the chat's replies (core/decode/speculative.py); "draft" needs a draft model, which the
    # chat does not load. A rotating window (context_policy "rotate") cannot speculate: its replies decode plainly.
    speculative: Literal["ngram", "auto", "off"] = "off"
    models: list[str] = Field(default_factory=list)
    reopen_last: bool = False
    # KV caches saved to disk (core/cache/kv_store.py): None is the cache folder's kv/ (core/locations.py); 0 MB: off.
    kv_cache_dir: str | None = None
    kv_cache_mb: float = Field(default=DEFAULT_BUDGET_MB, ge=0)
    keys: dict[str, str] = Field(default_factory=dict)
    # Thinking models (core/decode/reasoning.py): the reasoning's budget in tokens (None: none), and the template's
    # switch (None: the template's default).
    reasoning_budget: int | None = Field(default=None, ge=0)
    enable_thinking: bool | None = None
    mcp: MCPSettings = Field(default_factory=MCPSettings)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        for binding_id, keys in v.items():
            if not isinstance(keys, str) or not keys.strip():
                raise ValueError(f"keys.{binding_id} must be a non-empty string such as \"ctrl+r\"")
        return v

    @model_validator(mode="after")
    def _window_rotates(self) -> "Settings":
        # A kv_window alone has always meant a rotating window; with another policy it would be ignored silently.
        if self.kv_window is not None:
            if "context_policy" not in self.model_fields_set:
                self.context_policy = "rotate"
            elif self.context_policy != "rotate":
                raise ValueError(f'kv_window goes with context_policy = "rotate", not "{self.context_policy}"')
        return self

    def engine_options(self) -> dict[str, Any]:
        """What `Engine.load` takes for the KV caches saved to disk (none when kv_cache_mb is 0)."""
        from mlxchat.core.locations import kv_cache_dir

        if self.kv_cache_mb == 0:
            return {"kv_cache_dir": None}
        folder = Path(self.kv_cache_dir).expanduser() if self.kv_cache_dir else kv_cache_dir()
        return {"kv_cache_dir": folder, "kv_cache_mb": self.kv_cache_mb}

    @classmethod
    def load(cls, path: Path) -> "Settings":
        """Read ``path``; a missing file gives the defaults, a bad one raises ConfigError."""
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            return cls()
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e}); using the defaults") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror}); using the defaults") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "config"
            more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
            msg = first["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{path}: {where}: {msg}{more}; using the defaults") from None
