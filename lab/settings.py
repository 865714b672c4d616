"""The settings of a run: full validated SamplingProfiles from preset/saved names or a one-field sweep; bad values
are one line naming the flag and the field's range."""

from __future__ import annotations

from pydantic import ValidationError

from mlxchat.core import SamplingProfile
from mlxchat.core.sampling.profile import ProfileStore
from mlxchat.core.sampling.sampler_params import PARAMS

from .runner import RUN_FIELDS, Setting

# Fields a sweep may not change: labels and provenance, per-run fields (max_tokens is --max-tokens), lists and
# dicts that have no "v1,v2" form, and beam search, which the lab (sampling only) does not run.
_NOT_SWEEPABLE = {"name", "description", "version", "stop", "logit_bias", "sampler_order", "max_tokens",
                  "beam_size", "length_penalty", *(n for n, p in PARAMS.items() if p.type is list)} | RUN_FIELDS


def named_profile(name: str) -> SamplingProfile:
    if name in SamplingProfile.presets():
        return SamplingProfile.preset(name)
    store = ProfileStore()
    if name in store.list():
        return store.load(name)
    raise ValueError(f"--profile {name!r}: unknown; presets: {', '.join(SamplingProfile.presets())}; saved "
                     f"profiles (in {store.folder}): {', '.join(store.list()) or 'none'}")


def sweep_settings(spec: str, base_name: str | None) -> list[Setting]:
    field, sep, raw = spec.partition("=")
    field = field.strip()
    sweepable = sorted(f for f in SamplingProfile.model_fields if f not in _NOT_SWEEPABLE)
    if not sep or not raw.strip():
        raise ValueError(f"--sweep {spec!r}: write PARAM=v1,v2,..., e.g. temperature=0,0.7,1.2")
    if field not in sweepable:
        raise ValueError(f"--sweep: {field!r} cannot be swept; fields: {', '.join(sweepable)}")
    base = named_profile(base_name) if base_name else SamplingProfile()
    settings = []
    for value in (v.strip() for v in raw.split(",")):
        try:
            profile = SamplingProfile.model_validate({**base.model_dump(), field: value})
        except ValidationError as e:
            msg = e.errors()[0]["msg"]
            raise ValueError(f"--sweep {field}={value}: {msg if msg.startswith(field) else f'{field}: {msg}'}") \
                from None
        settings.append(Setting(f"{field}={value}", profile, base_name or "default"))
    if len({s.label for s in settings}) != len(settings):
        raise ValueError(f"--sweep {spec!r}: a value is given twice")
    return settings


def build_settings(profiles: list[str], sweep: str | None, base: str | None) -> list[Setting]:
    """The settings of a run from --profile names, or from --sweep PARAM=v1,v2,... over --base."""
    if sweep and profiles:
        raise ValueError("give either --profile (one or more) or --sweep, not both")
    if sweep:
        return sweep_settings(sweep, base)
    if base:
        raise ValueError("--base goes with --sweep; to run a profile as it is, use --profile")
    if not profiles:
        raise ValueError("give at least one --profile NAME (e.g. --profile chat --profile creative) or a --sweep")
    if len(set(profiles)) != len(profiles):
        raise ValueError("--profile: a profile is given twice")
    return [Setting(name, named_profile(name)) for name in profiles]
