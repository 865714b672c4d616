"""Each sampler parameter's one declaration (core/sampling/sampler_params.py) reaches every surface: the profile's
field and range check, the CLI's flag, the TUI's picker, OpenAI's, Ollama's and Anthropic's request fields, the lab's
requests."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from mlxchat.app.cli import _sampler_flags, build_parser
from mlxchat.app.screens.profile_picker import FIELDS, field_text, parse_field
from mlxchat.core.sampling.profile import STEPS, SamplingProfile
from mlxchat.core.sampling.sampler_params import PARAMS, SamplerParam
from mlxchat.lab.endpoint import request_body
from mlxchat.lab.tune import RANGES
from mlxchat.server import anthropic, ollama, protocol
from mlxchat.server.protocol import ApiError

MESSAGES = [{"role": "user", "content": "hi"}]


def _other(p: SamplerParam) -> Any:
    """A valid value other than the default."""
    if p.type is list:
        return ["###"]
    if p.type is bool:
        return not p.default
    steps = (1, -1, 0.5, -0.5, 0.25)
    candidates = [p.default + s for s in steps if p.type is float or isinstance(s, int)]
    return next(v for v in candidates if p.range is None or p.range.contains(v))


def _outside(p: SamplerParam) -> float:
    """A value just outside the range."""
    assert p.range is not None
    if p.range.lo is not None:
        return p.range.lo if p.range.lo_open else p.range.lo - 1
    return p.range.hi + 1


def _cli_text(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


@pytest.mark.parametrize("p", PARAMS.values(), ids=PARAMS.keys())
def test_each_declaration_is_a_profile_field_with_its_default_and_a_chain_step(p: SamplerParam) -> None:
    profile = SamplingProfile()
    assert getattr(profile, p.name) == p.defaults()
    assert p.step is None or p.step in STEPS
    assert p.goes_with is None or PARAMS[p.goes_with].goes_with is None  # a switch, not another companion
    assert getattr(SamplingProfile(**{p.name: _other(p)}), p.name) == _other(p)


@pytest.mark.parametrize("p", [p for p in PARAMS.values() if p.range is not None],
                         ids=[n for n, p in PARAMS.items() if p.range is not None])
def test_a_value_outside_the_range_is_refused_naming_the_field_and_range_on_every_surface(p: SamplerParam) -> None:
    bad, text = _outside(p), p.range.text()
    with pytest.raises(ValueError, match=re.escape(f"{p.name} must be {text}")):
        SamplingProfile(**{p.name: bad})
    with pytest.raises(ApiError) as e:
        protocol.parse({"messages": MESSAGES, p.name: bad}, chat=True, served="m", base=SamplingProfile(),
                       profiles={})
    assert e.value.param == p.name and f"{p.name} must be {text}" in e.value.message
    if p.ollama:
        with pytest.raises(ApiError, match=f"options.{p.ollama} must be"):
            ollama.parse_options({p.ollama: bad}, SamplingProfile())
    if p.anthropic:
        with pytest.raises(ApiError, match=f"{p.name} must be"):
            anthropic.parse({"messages": MESSAGES, "model": "m", "max_tokens": 5, p.name: bad}, served="m",
                            base=SamplingProfile())


@pytest.mark.parametrize("p", PARAMS.values(), ids=PARAMS.keys())
def test_each_declaration_reaches_every_surface(p: SamplerParam) -> None:
    value = _other(p)
    flag = [p.flag] if p.type is bool else [arg for v in _cli_text(value) for arg in (p.flag, v)]
    args = build_parser().parse_args(["generate", "hi", *flag])
    assert _sampler_flags(args)[p.name] == value

    assert p.name in dict(FIELDS) and dict(FIELDS)[p.name] == p.hint
    shown = field_text(SamplingProfile(**{p.name: value}), p.name)  # the picker's text, read back
    assert getattr(SamplingProfile(**{p.name: parse_field(p.name, shown)}), p.name) == value
    if p.type is list:
        assert parse_field(p.name, "") == p.defaults()

    for chat in (True, False):
        body = {"messages": MESSAGES} if chat else {"prompt": "hi"}
        req = protocol.parse({**body, p.name: value}, chat=chat, served="m", base=SamplingProfile(), profiles={})
        assert getattr(req.profile, p.name) == value
    with pytest.raises(ApiError) as e:  # JSON types are strict: "0.5" is not a number
        protocol.parse({"messages": MESSAGES, p.name: str(value)}, chat=True, served="m", base=SamplingProfile(),
                       profiles={})
    assert e.value.param == p.name

    if p.ollama is not None:
        assert getattr(ollama.parse_options({p.ollama: value}, SamplingProfile()).profile, p.name) == value
    else:
        with pytest.raises(ApiError, match="not a known option"):
            ollama.parse_options({p.name: value}, SamplingProfile())

    messages = {"messages": MESSAGES, "model": "m", "max_tokens": 5, p.name: value}
    if p.anthropic:
        assert getattr(anthropic.parse(messages, served="m", base=SamplingProfile()).profile, p.name) == value
    else:
        with pytest.raises(ApiError):
            anthropic.parse(messages, served="m", base=SamplingProfile())

    # The lab sends OpenAI's own always, another only when set (with what goes with it), nothing a server refuses.
    sent = request_body(SamplingProfile(**{(p.goes_with or p.name): _other(PARAMS[p.goes_with or p.name])}), 8, None)
    assert p.name in sent
    assert (p.name in request_body(SamplingProfile(), 8, None)) == p.openai
    assert protocol.parse({**sent, "messages": MESSAGES}, chat=True, served="m", base=SamplingProfile(),
                          profiles={}).profile.model_dump(include=set(PARAMS)) == \
        SamplingProfile(**{k: v for k, v in sent.items() if k in PARAMS}).model_dump(include=set(PARAMS))


def test_the_lab_tunes_declared_parameters_within_their_ranges() -> None:
    for field, lo, hi, _ in RANGES.values():
        allowed = PARAMS[field].range
        assert allowed is not None and allowed.contains(lo) and allowed.contains(hi), field


def test_the_cli_parser_is_built_without_loading_mlx() -> None:
    """The flags come from core/sampling/sampler_params.py; core's package loads its engine (and MLX) when asked."""
    code = ("import sys; from mlxchat.app.cli import build_parser; build_parser(); "
            "assert 'mlx' not in sys.modules and 'mlxchat.core.engine' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_chain_step_has_its_object_and_is_built_from_its_declared_parameters() -> None:
    from mlxchat.core.sampling.chain import BUILDERS

    assert set(BUILDERS) == set(STEPS)
    for p in PARAMS.values():
        if p.step is not None and p.type is not list and STEPS[p.step].from_profile is None:
            changed = SamplingProfile(**{p.name: _other(p)})
            assert STEPS[p.step].args(changed) != STEPS[p.step].args(SamplingProfile()), p.name
