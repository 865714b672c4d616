"""The errors the engine raises to its callers: each one a single line saying what was wrong and what to do."""

from __future__ import annotations

from pathlib import Path


class MlxChatError(Exception):
    """Base of every error that the CLI and the TUI show as one line instead of a traceback."""


class ModelLoadError(MlxChatError):
    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = str(path), problem
        super().__init__(f"cannot load model {self.path}: {problem}")


class ContextLengthError(MlxChatError):
    """The prompt does not fit the model's context and the session has no rotating window."""


class GenerationError(MlxChatError):
    """An exception inside the inference thread, carried to the caller of stream()/generate()."""
