"""Settings from ``config.toml`` in the config folder, validated by pydantic.

Example ``~/.config/mlxchat/config.toml``::

    theme = "textual-light"
    profile = "precise"              # a preset or a saved user profile
    system_prompt = "You are terse."
    max_tokens = 512
    kv_window = 2048                 # rotating KV window; leave out for a plain, growing cache
    models = ["~/models/qwen2.5-0.5b-instruct-q4.gguf"]
    trace = 8                        # trace every reply as it is written (costs decode speed; see the README)

    [keys]                           # binding id = keys (comma-separated); see the help screen (F1) for the ids
    regenerate = "ctrl+r,f9"
    newline = "ctrl+j,shift+enter"

A missing file means the defaults. An invalid one is reported in the app (one line naming the field) and the
defaults are used, so a typo never keeps the chat from opening.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


class ConfigError(Exception):
    """The config file could not be read; the message is one line and names the file."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    theme: str = "textual-dark"
    dark_theme: str = "textual-dark"
    light_theme: str = "textual-light"
    profile: str = "chat"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    model: str | None = None
    max_tokens: int | None = Field(default=1024, ge=1)
    kv_window: int | None = Field(default=None, ge=16)
    sidebar: bool = True
    # Candidates recorded per token of every reply as it is written. 0 (the default): replies cost what they cost,
    # and F7 traces a reply only when asked (by writing it again with its seed).
    trace: int = Field(default=0, ge=0, le=100)
    models: list[str] = Field(default_factory=list)
    keys: dict[str, str] = Field(default_factory=dict)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        for binding_id, keys in v.items():
            if not isinstance(keys, str) or not keys.strip():
                raise ValueError(f"keys.{binding_id} must be a non-empty string such as \"ctrl+r\"")
        return v

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
            raise ConfigError(f"{path}: {where}: {first['msg']}{more}; using the defaults") from None
