"""Where mlxchat keeps the user's things: XDG-style data and config folders (platformdirs). One module for the CLI,
the TUI and the profile store, so they all read the same folders.

``XDG_DATA_HOME`` / ``XDG_CONFIG_HOME`` / ``XDG_CACHE_HOME`` are honoured on every platform (platformdirs honours
them on Linux only), and ``MLXCHAT_DATA_DIR`` / ``MLXCHAT_CONFIG_DIR`` / ``MLXCHAT_CACHE_DIR`` override them, for
tests and portable installs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "mlxchat"


def _from_env(override: str, xdg: str) -> Path | None:
    if value := os.environ.get(override):
        return Path(value).expanduser()
    if value := os.environ.get(xdg):
        return Path(value).expanduser() / APP_NAME
    return None


def data_dir() -> Path:
    """Conversations database and exports (``$XDG_DATA_HOME/mlxchat``, usually ``~/.local/share/mlxchat``)."""
    return _from_env("MLXCHAT_DATA_DIR", "XDG_DATA_HOME") or platformdirs.user_data_path(APP_NAME)


def config_dir() -> Path:
    """``config.toml`` and user sampling profiles (``$XDG_CONFIG_HOME/mlxchat``, usually ``~/.config/mlxchat``)."""
    return _from_env("MLXCHAT_CONFIG_DIR", "XDG_CONFIG_HOME") or platformdirs.user_config_path(APP_NAME)


def cache_dir() -> Path:
    """What can be made again, e.g. saved KV caches (``$XDG_CACHE_HOME/mlxchat``, usually ``~/.cache/mlxchat``)."""
    return _from_env("MLXCHAT_CACHE_DIR", "XDG_CACHE_HOME") or platformdirs.user_cache_path(APP_NAME)


def kv_cache_dir() -> Path:
    """Where the TUI and `mlxchat serve` save conversations' KV caches by default (core/cache/kv_store.py)."""
    return cache_dir() / "kv"


@dataclass(frozen=True)
class Locations:
    """The folders one app instance uses; tests pass temporary ones."""

    data: Path
    config: Path

    @classmethod
    def resolve(cls, data: str | Path | None = None, config: str | Path | None = None) -> "Locations":
        return cls(Path(data) if data is not None else data_dir(), Path(config) if config is not None else config_dir())

    @property
    def database(self) -> Path:
        return self.data / "conversations.db"

    @property
    def exports(self) -> Path:
        return self.data / "exports"

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"

    @property
    def profiles(self) -> Path:
        return self.config / "profiles"
