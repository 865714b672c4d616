"""Prompt sets: TOML files of prompts with optional checks, shipped in templates/prompts or the user's config folder.

A file holds ``description`` and ``[[prompts]]`` tables with ``id``, ``text`` and optionally ``system``, ``answer``
(the exact answer must appear as a whole word, case-insensitive), ``expect`` (a regex searched in the output,
case-insensitive), ``max_words`` (the reply is at most that many words) and ``stop`` (a stop string passed to the
engine, for completion items). An output passes when every check the prompt has passes.

``schema`` (a table: a JSON Schema) asks for JSON: the reply is generated under it (a ``json_schema`` response format,
core/sampling/response_format.py) unless ``constrain = false``, and the ``schema_valid`` metric counts the outputs that
parse as JSON and validate under it (with the ``jsonschema`` package), constrained or not.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import re
import tomllib
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any


BUILTIN_DIR = importlib.resources.files("mlxchat.templates") / "prompts"
_KEYS = {"id", "text", "system", "answer", "expect", "max_words", "stop", "schema", "constrain"}


class PromptSetError(ValueError):
    """A prompt set is missing or malformed; the message is one line naming the file and the fix."""


def user_dir() -> Path:
    """Where the user's own prompt sets live: ``prompts/`` in mlxchat's config folder."""
    # Imported here: importing mlxchat.core loads MLX, which `mlxchat --help` need not.
    from mlxchat.core.locations import config_dir

    return config_dir() / "prompts"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    system: str | None = None
    answer: str | None = None
    expect: str | None = None
    max_words: int | None = None
    stop: str | None = None
    schema: dict[str, Any] | None = None
    constrain: bool = True  # generate under `schema` (else only check the output against it)

    @property
    def response_format(self) -> dict[str, Any] | None:
        """The response format the prompt is generated under, if any."""
        if self.schema is None or not self.constrain:
            return None
        return {"type": "json_schema", "json_schema": {"name": self.id[:64], "schema": self.schema, "strict": True}}

    def schema_valid(self, output: str) -> bool | None:
        """Whether `output` is JSON valid under the prompt's schema; None when the prompt has none."""
        if self.schema is None:
            return None
        import jsonschema  # here: only sets with a schema need it

        try:
            jsonschema.validate(json.loads(output), self.schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    @property
    def has_check(self) -> bool:
        return any(x is not None for x in (self.answer, self.expect, self.max_words))

    def check(self, output: str) -> bool | None:
        """Whether `output` passes every check of this prompt; None when the prompt has none."""
        if not self.has_check:
            return None
        ok = True
        if self.answer is not None:
            ok &= re.search(rf"(?<!\w){re.escape(self.answer)}(?!\w)", output, re.IGNORECASE) is not None
        if self.expect is not None:
            ok &= re.search(self.expect, output, re.IGNORECASE) is not None
        if self.max_words is not None:
            ok &= len(output.split()) <= self.max_words
        return bool(ok)


@dataclass(frozen=True)
class PromptSet:
    name: str
    description: str
    prompts: tuple[Prompt, ...]
    digest: str  # sha256 of the file's bytes: a run records it, so a changed set is visible in comparisons
    source: str

    def limited(self, n: int | None) -> PromptSet:
        if n is None:
            return self
        return PromptSet(self.name, self.description, self.prompts[:n], self.digest, self.source)


def _parse(name: str, raw: bytes, source: str) -> PromptSet:
    def bad(why: str) -> PromptSetError:
        return PromptSetError(f"{source}: {why}")

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise bad(f"not valid TOML ({e}); fix the file or remove it") from None
    items = data.get("prompts")
    if not isinstance(items, list) or not items:
        raise bad("needs at least one [[prompts]] table with id and text")
    prompts, seen = [], set()
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise bad(f"prompt {i} is not a table")
        unknown = set(item) - _KEYS
        if unknown:
            raise bad(f"prompt {i}: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(_KEYS))}")
        pid, text = item.get("id"), item.get("text")
        if not isinstance(pid, str) or not pid or not isinstance(text, str) or not text.strip():
            raise bad(f"prompt {i}: needs a non-empty string id and text")
        if pid in seen:
            raise bad(f"prompt {i}: id {pid!r} is used twice")
        seen.add(pid)
        for key in ("system", "answer", "expect", "stop"):
            if key in item and not isinstance(item[key], str):
                raise bad(f"prompt {pid!r}: {key} must be a string")
        if "max_words" in item and (not isinstance(item["max_words"], int) or item["max_words"] < 1):
            raise bad(f"prompt {pid!r}: max_words must be a whole number of at least 1")
        if "schema" in item:
            _check_schema(item["schema"], pid, bad)
        if "constrain" in item and not isinstance(item["constrain"], bool):
            raise bad(f"prompt {pid!r}: constrain must be true or false")
        if "expect" in item:
            try:
                re.compile(item["expect"])
            except re.error as e:
                raise bad(f"prompt {pid!r}: expect is not a valid regex ({e})") from None
        prompts.append(Prompt(**item))
    return PromptSet(name, str(data.get("description", "")), tuple(prompts), hashlib.sha256(raw).hexdigest(),
                     source)


def _check_schema(schema: Any, pid: str, bad: Any) -> None:
    if not isinstance(schema, dict):
        raise bad(f"prompt {pid!r}: schema must be a table (a JSON Schema)")
    from pydantic import ValidationError

    from mlxchat.core.sampling.response_format import ResponseFormat

    try:
        ResponseFormat(type="json_schema", json_schema={"name": "schema", "schema": schema, "strict": True})
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("response_format.json_schema.")
        raise bad(f"prompt {pid!r}: {msg}") from None


def _files() -> dict[str, Traversable | Path]:
    """Set name -> file; a user set of the same name as a built-in one replaces it."""
    found: dict[str, Traversable | Path] = {
        p.name.removesuffix(".toml"): p for p in BUILTIN_DIR.iterdir() if p.name.endswith(".toml")}
    if user_dir().is_dir():
        found.update({p.stem: p for p in user_dir().glob("*.toml")})
    return found


def available() -> list[str]:
    return sorted(_files())


def load(name_or_path: str) -> PromptSet:
    """A set by name (built-in or the user's) or by the path of a TOML file."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") and path.exists():
        return _parse(path.stem, path.read_bytes(), str(path))
    files = _files()
    if name_or_path not in files:
        raise PromptSetError(f"unknown prompt set {name_or_path!r}; sets: {', '.join(sorted(files))} "
                             f"(add your own as {user_dir()}/NAME.toml)")
    f = files[name_or_path]
    return _parse(name_or_path, f.read_bytes(), str(f))
