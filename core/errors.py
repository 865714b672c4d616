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
    """The prompt does not fit the model's context (and the session's context policy is "error", or even the last
    message alone does not fit). It states facts only: the CLI and the TUI add the advice that fits where they show
    it (their own flag or key)."""

    def __init__(self, prompt_tokens: int, limit: int, model: str = "the model") -> None:
        self.prompt_tokens, self.limit, self.model = prompt_tokens, limit, model
        super().__init__(f"the prompt is {prompt_tokens} tokens but {model} has a context of {limit}")


class GenerationError(MlxChatError):
    """An exception inside the inference thread, carried to the caller of stream()/generate()."""
