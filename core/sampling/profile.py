"""Sampling profiles: one validated parameter object per request, named presets, saved user profiles.

Field names follow OpenAI / vLLM (docs/architecture.md §7). The sampler parameters' fields (type, default, range) and
the chain's steps come from their declarations in ``core.sampling.sampler_params``. Every range is checked here, once,
at the edge; an invalid value raises a pydantic ``ValidationError`` whose message names the field, the value and the
allowed range. Nothing here imports MLX.

Penalty semantics (peers differ, so they are explicit fields):

* ``penalty_window = 0`` (default): frequency, presence and repetition penalties look at every token generated so
  far in the request. ``penalty_window = N`` looks at the latest N tokens only (mlx-lm uses 20).
* ``penalize_prompt = False`` (default, OpenAI's behaviour): prompt tokens do not count. When True, the prompt's
  tokens count as if generated (and fill the window first).

The sampler chain is described in ``core.sampling.chain``; ``sampler_order`` names its transforms, ``None`` meaning
:data:`DEFAULT_ORDER`. A transform left out of a custom order does not run (as with llama.cpp's
``--sampling-seq``); :meth:`SamplingProfile.warnings` points that out when such a transform has a setting.
"""

from __future__ import annotations

import importlib.resources
import itertools
import logging
import os
import re
import tempfile
import tomllib
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any

import tomli_w
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from ..errors import MlxChatError
from ..locations import config_dir
from .response_format import ResponseFormat, parse_response_format
from .sampler_params import PARAMS, STEPS, ChainStep, Range, SamplerParam, format_number

log = logging.getLogger(__name__)

# Package data (templates/presets in the repository), so a wheel install has the presets too.
PRESET_DIR = importlib.resources.files("mlxchat.templates") / "presets"

def _check(allowed: Range) -> AfterValidator:
    """A range check whose error reads "<field> must be <range>, got <value>"."""
    text = allowed.text()

    def check(value: float, info: ValidationInfo) -> float:
        if not allowed.contains(value):
            raise PydanticCustomError("out_of_range", "{field} must be {range}, got {value}",
                                      {"field": info.field_name, "range": text, "value": value})
        return value

    return AfterValidator(check)


def _range(lo: float | None, hi: float | None, *, lo_open: bool = False, what: str = "") -> AfterValidator:
    return _check(Range(lo, hi, lo_open, what))


PROCESSORS: tuple[str, ...] = tuple(n for n, s in STEPS.items() if s.kind == "processor")
DEFAULT_ORDER: tuple[str, ...] = tuple(n for n, s in STEPS.items() if s.kind == "transform" and n != "mirostat")
TRANSFORMS = frozenset(DEFAULT_ORDER)
MIROSTAT_ORDER = ("temperature", "mirostat")
TRUNCATIONS = ("top_n_sigma", "top_k", "top_p", "min_p", "typical_p")


NAME_RE = re.compile(r"^\w[\w .-]{0,63}$")


class ProfileError(MlxChatError):
    """A profile could not be found, read or written. The message is one line and names the file."""


def _field(p: SamplerParam) -> tuple[Any, Any]:
    """A sampler parameter's pydantic field: its type, its range check, its default."""
    kind: Any = list[str] if p.type is list else p.type
    annotation = Annotated[kind, _check(p.range)] if p.range is not None else kind
    return annotation, Field(default_factory=p.defaults) if p.type is list else p.default


class _Identity(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str | None = None
    description: str = ""
    # The user's revision number of a saved profile (the seed: "version profiles and keep regression runs");
    # the store writes it as given and never bumps it.
    version: Annotated[int, _range(1, None)] = 1


# Every sampler parameter is a field, declared in core/sampling/sampler_params.py (type, default, range; after the
# identity fields, so a saved profile's TOML starts with its name).
_SamplerFields = create_model("_SamplerFields", __base__=_Identity, __module__=__name__,
                              **{name: _field(p) for name, p in PARAMS.items()})


class SamplingProfile(_SamplerFields):
    """The sampler parameters of core.sampling.sampler_params.PARAMS, and a request's other settings."""

    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: Annotated[int, _range(0, 2**64 - 1)] | None = None
    stop: list[str] = Field(default_factory=list)
    max_tokens: Annotated[int, _range(1, None)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, _range(0, 20)] = 0
    sampler_order: list[str] | None = None
    # Beam search (non-streaming): beam_size 1 means sampling with the chain above.
    beam_size: Annotated[int, _range(1, 16, what=" (1 means no beam search)")] = 1
    length_penalty: Annotated[float, _range(0, 4)] = 1.0
    # Constrained decoding (core/sampling/response_format.py, constraint.py): OpenAI's shapes, plus regex and grammar.
    response_format: ResponseFormat | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise PydanticCustomError(
                "bad_name", "name must be 1-64 letters, digits, spaces, '.', '-' or '_', "
                "starting with a letter or digit, got {value}", {"value": repr(v)})
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float]) -> dict[int, float]:
        for token, bias in v.items():
            if token < 0:
                raise PydanticCustomError("out_of_range", "logit_bias token ids must be at least 0, got {value}",
                                          {"value": token})
            if not -100 <= bias <= 100:
                raise PydanticCustomError("out_of_range", "logit_bias[{token}] must be between -100 and 100, "
                                          "got {value}", {"token": token, "value": bias})
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v: Any) -> Any:
        return parse_response_format(v)

    @field_validator("dry_sequence_breakers", mode="before")
    @classmethod
    def _breakers(cls, v: Any) -> Any:
        # Checked before pydantic's own list[str] check, so that the error names the field, the value and what is
        # allowed (pydantic's would read "Input should be a valid string").
        items = v if isinstance(v, (list, tuple)) else [v]
        bad = next((x for x in items if not isinstance(x, str) or not x), None) if items else None
        if not isinstance(v, (list, tuple)) or bad is not None:
            raise PydanticCustomError(
                "bad_breakers", "dry_sequence_breakers must be a list of non-empty strings, got {value}",
                {"value": repr(bad if isinstance(v, (list, tuple)) else v)})
        return list(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_str(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if "" in v:
            raise PydanticCustomError("empty_stop", "stop strings must not be empty, got {value}", {"value": repr(v)})
        return v

    @field_validator("sampler_order")
    @classmethod
    def _order(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        unknown = [n for n in v if n not in TRANSFORMS]
        if unknown:
            raise PydanticCustomError("bad_order", "sampler_order names must be among {known}, got {value}",
                                      {"known": ", ".join(DEFAULT_ORDER), "value": repr(unknown[0])})
        if len(set(v)) != len(v):
            raise PydanticCustomError("bad_order", "sampler_order must not repeat a name, got {value}",
                                      {"value": repr(v)})
        return v

    @model_validator(mode="after")
    def _cross_fields(self) -> "SamplingProfile":
        # Checks across fields, as vLLM's SamplingParams does; the rest (top_logprobs without logprobs, a stack of
        # truncations, an unreachable XTC threshold) is allowed and reported by warnings().
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise PydanticCustomError(
                "min_above_max", "min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
                {"min_tokens": self.min_tokens, "max_tokens": self.max_tokens})
        if self.response_format is not None and self.beam_size > 1:
            raise PydanticCustomError("beam_format", "response_format cannot be used with beam search (beam_size "
                                      "{beam_size}): use beam_size 1", {"beam_size": self.beam_size})
        return self

    # --- presets -------------------------------------------------------------------------------------------------

    @classmethod
    def presets(cls) -> list[str]:
        return sorted(p.name.removesuffix(".toml") for p in PRESET_DIR.iterdir() if p.name.endswith(".toml"))

    @classmethod
    def preset(cls, name: str) -> SamplingProfile:
        if name not in cls.presets():
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(cls.presets())}")
        path = PRESET_DIR / f"{name}.toml"
        data = _read_toml(path)
        data.setdefault("name", name)
        return _validated(data, path)

    # --- advice and description ----------------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def order(self) -> list[str]:
        """The transforms in the order they run; with Mirostat, temperature then Mirostat (llama.cpp's chain)."""
        if self.mirostat:
            return list(MIROSTAT_ORDER)
        return list(DEFAULT_ORDER if self.sampler_order is None else self.sampler_order)

    def active(self, step: str) -> bool:
        """Whether a chain step's setting would change anything (ignoring the order)."""
        return STEPS[step].active(self)

    def warnings(self) -> list[str]:
        """The seed's advice and likely mistakes, as sentences; none of them is an error."""
        out = []
        stacked = [t for t in TRUNCATIONS if self.active(t)]
        if len(stacked) >= 2 and not self.greedy:
            out.append(f"{' + '.join(stacked)} are stacked: use temperature with one truncation (top_p or min_p), "
                       "and tune one parameter at a time")
        if self.greedy:
            ignored = [t for t in STEPS if STEPS[t].kind == "transform" and t != "temperature" and self.active(t)]
            if ignored:
                out.append(f"temperature 0 is greedy, so these are ignored: {', '.join(ignored)}")
        else:
            missing = [t for t in DEFAULT_ORDER if self.active(t) and t not in self.order() and not self.mirostat]
            if missing:
                out.append(f"{', '.join(missing)} set but not in sampler_order, so not applied")
        if self.mirostat and not self.greedy:
            ignored = [t for t in DEFAULT_ORDER if t != "temperature" and self.active(t)]
            if ignored:
                out.append(f"mirostat {self.mirostat} replaces the other transforms, so these are ignored: "
                           f"{', '.join(ignored)}")
        if self.xtc_probability > 0 and self.xtc_threshold > 0.5:
            out.append(f"xtc_threshold {format_number(self.xtc_threshold)} is above 0.5: XTC can never act")
        if self.top_logprobs and not self.logprobs:
            out.append("top_logprobs has no effect while logprobs is false")
        return out

    def chain(self) -> list[str]:
        """The printed steps that run, in order: processors, then transforms, then the draw. Each is printed by its
        registry entry, as the objects ``core.sampling.chain.Sampler`` builds print themselves."""
        steps = [STEPS[n].describe(self) for n in PROCESSORS if self.active(n)]
        if self.response_format is not None:  # the constraint stage: after the processors, before the transforms
            steps.append(self.response_format.label())
        if self.greedy:
            return steps + ["greedy"]
        return steps + [STEPS[t].describe(self) for t in self.order() if self.active(t)] + ["sample"]

    def describe_chain(self) -> str:
        return " → ".join(self.chain())


# --- user profiles -----------------------------------------------------------------------------------------------

def _read_toml(path: Traversable) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: not valid TOML ({e})") from None
    except OSError as e:
        raise ProfileError(f"{path}: cannot read ({e.strerror})") from None


def _validated(data: dict[str, Any], path: Traversable, warn: bool = True) -> SamplingProfile:
    try:
        profile = SamplingProfile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        reason = first["msg"] if first["msg"].startswith(where) else f"{where}: {first['msg']}"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ProfileError(f"{path}: invalid profile: {reason}{more}") from None
    for w in profile.warnings() if warn else ():
        log.warning("%s: %s", path.name, w)
    return profile


class ProfileStore:
    """User profiles as ``<name>.toml`` files in one folder (default: ``profiles/`` in the config folder that
    core.locations resolves, so the CLI and the TUI read the same one)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else config_dir() / "profiles"

    def resolve(self, name: str) -> SamplingProfile:
        """The profile called ``name``: a preset, else a saved profile. The one place that decides which; a preset
        wins over a saved profile of the same name. Raises ProfileError naming both lists when neither exists, and
        for a saved profile that is corrupt (naming the file, which is left as it is)."""
        if name in SamplingProfile.presets():
            return SamplingProfile.preset(name)
        if name in self.list():
            return self.load(name)
        raise ProfileError(f"unknown profile {name!r}; presets: {', '.join(SamplingProfile.presets())}; "
                           f"saved profiles (in {self.folder}): {', '.join(self.list()) or 'none'}")

    def _path(self, name: str) -> Path:
        if not NAME_RE.match(name):
            raise ProfileError(f"{name!r} is not a valid profile name")
        return self.folder / f"{name}.toml"

    def save(self, profile: SamplingProfile) -> Path:
        if profile.name is None:
            raise ProfileError("a profile needs a name to be saved")
        if profile.name in SamplingProfile.presets():  # `resolve` would give the preset: the saved one is unreachable
            raise ProfileError(f"{profile.name!r} is a preset's name; save it under another, e.g. "
                               f"{self.free_name(profile.name)!r}")
        path = self._path(profile.name)
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            text = tomli_w.dumps(profile.model_dump(mode="json", exclude_none=True))
        except TypeError as e:  # TOML has no null: a response_format schema with one (e.g. "const": null)
            raise ProfileError(f"profile {profile.name!r} cannot be written as TOML ({e}): TOML has no null, so a "
                               "response_format schema must not use one") from None
        # Write then rename, so a crash never leaves a half-written profile behind.
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{profile.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return path

    def free_name(self, name: str) -> str:
        """`name` if a profile may be saved under it, else the first of `name-2`, `name-3`, ... that is neither a
        preset nor a saved profile."""
        if name not in SamplingProfile.presets():
            return name
        taken = {*SamplingProfile.presets(), *self.list()}
        return next(f"{name}-{i}" for i in itertools.count(2) if f"{name}-{i}" not in taken)

    def load(self, name: str, *, warn: bool = True) -> SamplingProfile:
        """The saved profile `name`; its `warnings()` are logged unless `warn` is false (a server that loads every
        saved profile in case a request names one warns only about the one it runs by default)."""
        path = self._path(name)
        if not path.exists():
            raise ProfileError(f"{path}: no such profile; saved profiles: {', '.join(self.list()) or 'none'}")
        data = _read_toml(path)
        data.setdefault("name", name)
        return _validated(data, path, warn)

    def list(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.toml")) if self.folder.is_dir() else []

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such profile") from None


__all__ = ["DEFAULT_ORDER", "PROCESSORS", "STEPS", "ChainStep", "ProfileError", "ProfileStore",
           "SamplingProfile"]
