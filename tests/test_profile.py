"""SamplingProfile validation, presets, advice and the user-profile store."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlxchat.core.sampling.profile import ProfileError, ProfileStore, SamplingProfile


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 3.5, "temperature must be between 0 and 2 (0 means greedy), got 3.5"),
    ("temperature", -0.1, "temperature must be between 0 and 2 (0 means greedy), got -0.1"),
    ("temperature", float("nan"), "temperature must be between 0 and 2 (0 means greedy), got nan"),
    ("top_p", 0, "top_p must be greater than 0 and at most 1, got 0"),
    ("top_p", 1.5, "top_p must be greater than 0 and at most 1, got 1.5"),
    ("top_k", -1, "top_k must be at least 0 (0 disables), got -1"),
    ("min_p", 1.2, "min_p must be between 0 and 1, got 1.2"),
    ("typical_p", 0.0, "typical_p must be greater than 0 and at most 1, got 0"),
    ("xtc_threshold", -0.5, "xtc_threshold must be between 0 and 1, got -0.5"),
    ("xtc_probability", 2, "xtc_probability must be between 0 and 1, got 2"),
    ("frequency_penalty", 2.5, "frequency_penalty must be between -2 and 2, got 2.5"),
    ("presence_penalty", -3, "presence_penalty must be between -2 and 2, got -3"),
    ("repetition_penalty", 0, "repetition_penalty must be greater than 0 (1 disables), got 0"),
    ("logit_bias", {50256: 200}, "logit_bias[50256] must be between -100 and 100, got 200"),
    ("logit_bias", {-1: 5}, "logit_bias token ids must be at least 0, got -1"),
    ("min_tokens", -2, "min_tokens must be at least 0, got -2"),
    ("penalty_window", -1, "penalty_window must be at least 0 (0 means all generated tokens), got -1"),
    ("seed", -5, "seed must be between 0 and 18446744073709551615, got -5"),
    ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
    ("top_logprobs", 21, "top_logprobs must be between 0 and 20, got 21"),
    ("version", 0, "version must be at least 1, got 0"),
    ("stop", ["END", ""], "stop strings must not be empty"),
    ("sampler_order", ["top_k", "beam"], "sampler_order names must be among top_n_sigma, top_k, typical_p, top_p, "
                                         "min_p, xtc, temperature, adaptive_p, got 'beam'"),
    ("dry_multiplier", -0.5, "dry_multiplier must be at least 0 (0 disables), got -0.5"),
    ("dry_base", 1.0, "dry_base must be greater than 1, got 1.0"),
    ("dry_allowed_length", 0, "dry_allowed_length must be at least 1, got 0"),
    ("dry_penalty_last_n", -2, "dry_penalty_last_n must be at least -1 (-1 means the whole context, 0 disables)"),
    ("dry_sequence_breakers", ["\n", 5], "dry_sequence_breakers must be a list of non-empty strings, got 5"),
    ("dry_sequence_breakers", ":", "dry_sequence_breakers must be a list of non-empty strings, got ':'"),
    ("top_n_sigma", -2, "top_n_sigma must be at least -1 (0 or below disables), got -2"),
    ("dynatemp_range", -0.1, "dynatemp_range must be between 0 and 2 (0 disables), got -0.1"),
    ("mirostat", 3, "mirostat must be between 0 and 2 (0 disables, 1 or 2 picks the version), got 3"),
    ("mirostat_tau", 0, "mirostat_tau must be greater than 0, got 0"),
    ("mirostat_eta", 0, "mirostat_eta must be greater than 0 and at most 1, got 0"),
    ("adaptive_p_target", 1.5, "adaptive_p_target must be between -1 and 1 (negative disables), got 1.5"),
    ("adaptive_p_decay", 1.0, "adaptive_p_decay must be between 0 and 0.99, got 1.0"),
    ("sampler_order", ["top_k", "top_k"], "sampler_order must not repeat a name"),
    ("name", "../etc/passwd", "name must be 1-64 letters"),
])
def test_bad_values_name_field_value_and_range(field: str, value, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingProfile(**{field: value})
    assert info.value.errors()[0]["loc"][0] == field
    assert message in str(info.value)
    # Assignment is validated the same way.
    profile = SamplingProfile()
    with pytest.raises(ValidationError, match=field):
        setattr(profile, field, value)


def test_unknown_fields_and_wrong_types_are_rejected() -> None:
    with pytest.raises(ValidationError, match="temprature"):
        SamplingProfile(temprature=0.5)
    with pytest.raises(ValidationError, match="top_k"):
        SamplingProfile(top_k="many")


def test_defaults_and_conveniences() -> None:
    p = SamplingProfile()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.penalty_window, p.penalize_prompt, p.seed) == \
        (1.0, 1.0, 0, 0.0, 0, False, None)
    assert p.describe_chain() == "sample" and p.warnings() == []
    assert SamplingProfile(stop="###").stop == ["###"]
    assert SamplingProfile(logit_bias={"7": -100}).logit_bias == {7: -100.0}


# Every preset caps the reply (issue #12 item 6: a greedy loop and the creative preset ran for minutes): ~1024
# tokens for answers and stories, 512 for short factual answers, 128 for an IDE completion (a line or a block).
EXPECTED_PRESETS = {
    "precise": dict(temperature=0.0, max_tokens=1024),
    "factual": dict(temperature=0.3, top_p=0.9, presence_penalty=0.4, max_tokens=512),
    "chat": dict(temperature=0.8, top_p=0.9, max_tokens=1024),
    "longform": dict(temperature=1.0, min_p=0.05, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2,
                     dry_penalty_last_n=-1, max_tokens=2048),
    "creative": dict(temperature=1.0, top_p=0.95, frequency_penalty=0.6, max_tokens=1024),
    "completion": dict(temperature=0.2, min_p=0.05, max_tokens=128),
}


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_presets_load_with_the_seed_table_values(name: str) -> None:
    p = SamplingProfile.preset(name)
    assert p.name == name and p.description
    assert p.model_dump(include=set(EXPECTED_PRESETS[name])) == EXPECTED_PRESETS[name]
    assert p.warnings() == []


def test_preset_list_and_unknown_name() -> None:
    assert SamplingProfile.presets() == sorted(EXPECTED_PRESETS)
    with pytest.raises(ValueError, match="unknown preset 'wild'; known presets: chat, completion, creative"):
        SamplingProfile.preset("wild")


def test_chain_description() -> None:
    p = SamplingProfile(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1)
    assert p.describe_chain() == "RepetitionPenalty(1.1) → TopK(40) → TopP(0.9) → Temperature(0.8) → sample"
    assert SamplingProfile(temperature=0, top_p=0.5).describe_chain() == "greedy"
    assert SamplingProfile(temperature=0.5, top_p=0.5, sampler_order=["temperature", "top_p"]).describe_chain() == \
        "Temperature(0.5) → TopP(0.5) → sample"
    # By default temperature comes last, after every filter.
    every = SamplingProfile(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, typical_p=0.9, xtc_probability=0.5)
    assert every.chain()[-2:] == ["Temperature(0.7)", "sample"] and len(every.chain()) == 7


def test_stacked_truncations_warn_but_are_allowed() -> None:
    p = SamplingProfile(top_k=40, top_p=0.9, min_p=0.05, temperature=0.7)
    [warning] = p.warnings()
    assert "top_k + top_p + min_p are stacked" in warning
    assert SamplingProfile(top_p=0.9, temperature=0.7).warnings() == []
    assert "not in sampler_order" in SamplingProfile(top_p=0.9, sampler_order=["temperature"]).warnings()[0]
    assert "greedy" in SamplingProfile(temperature=0, top_p=0.9).warnings()[0]


# --- the store -----------------------------------------------------------------------------------------------------

def test_user_profile_round_trip(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profiles")
    assert store.list() == []
    p = SamplingProfile(name="my story", version=3, description="long walks", temperature=1.1, top_p=0.93,
                        logit_bias={13: -2.5}, stop=["THE END"], seed=42, sampler_order=["temperature", "top_p"])
    path = store.save(p)
    assert path == tmp_path / "profiles" / "my story.toml"
    assert tomllib.loads(path.read_text())["version"] == 3
    assert store.load("my story") == p
    assert store.list() == ["my story"]
    store.save(p.model_copy(update={"version": 4}))
    assert store.load("my story").version == 4
    store.delete("my story")
    assert store.list() == []
    with pytest.raises(ProfileError, match="no such profile"):
        store.load("my story")
    with pytest.raises(ProfileError, match="no such profile"):
        store.delete("my story")


def test_save_needs_a_name(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="needs a name"):
        ProfileStore(tmp_path).save(SamplingProfile())


def test_a_preset_name_is_refused_in_one_line_proposing_a_free_one(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.save(SamplingProfile(name="precise-2", temperature=0.1))
    with pytest.raises(ProfileError) as refused:
        store.save(SamplingProfile(name="precise", temperature=0.2))
    assert str(refused.value) == "'precise' is a preset's name; save it under another, e.g. 'precise-3'"
    assert store.list() == ["precise-2"]
    assert store.free_name("mine") == "mine" and store.free_name("chat") == "chat-2"


@pytest.mark.parametrize("content, reason", [
    (b"temperature = = 2\n", "not valid TOML"),
    (b"temperature = 7.0\n", "temperature must be between 0 and 2"),
    (b"colour = 'blue'\n", "colour: Extra inputs are not permitted"),
    (b"\xff\xfe\x00", "not valid TOML"),
])
def test_corrupt_profile_is_reported_and_left_alone(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "broken.toml"
    path.write_bytes(content)
    with pytest.raises(ProfileError) as info:
        ProfileStore(tmp_path).load("broken")
    message = str(info.value)
    assert str(path) in message and reason in message and "\n" not in message
    assert path.read_bytes() == content
    assert ProfileStore(tmp_path).list() == ["broken"]


def test_default_folder_honours_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    store = ProfileStore()
    assert store.folder == tmp_path / "mlxchat" / "profiles"
    store.save(SamplingProfile(name="x"))
    assert (tmp_path / "mlxchat" / "profiles" / "x.toml").exists()


def test_loading_a_stacked_profile_logs_the_advice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ProfileStore(tmp_path)
    store.save(SamplingProfile(name="stacked", top_k=20, min_p=0.1))
    with caplog.at_level(logging.WARNING, logger="mlxchat.core.sampling.profile"):
        store.load("stacked")
    assert "stacked" in caplog.text and "top_k + min_p" in caplog.text


# --- any input: a profile or a ValidationError, nothing else -------------------------------------------------------

FIELDS = list(SamplingProfile.model_fields) + ["bogus"]
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4) | st.integers(), inner,
                                                                max_size=3),
    max_leaves=6,
)


@given(st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=6))
@settings(max_examples=150, deadline=None)
def test_any_dict_gives_a_profile_or_a_validation_error(data: dict) -> None:
    try:
        profile = SamplingProfile.model_validate(data)
    except ValidationError:
        return
    assert SamplingProfile.model_validate(profile.model_dump()) == profile
    profile.warnings()
    profile.describe_chain()


def test_min_tokens_above_max_tokens_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError, match=r"min_tokens \(10\) must not exceed max_tokens \(5\)"):
        SamplingProfile(min_tokens=10, max_tokens=5)
    p = SamplingProfile(min_tokens=5, max_tokens=5)
    with pytest.raises(ValidationError, match="must not exceed max_tokens"):
        p.max_tokens = 4  # assignment is validated too
    assert SamplingProfile(min_tokens=10).max_tokens is None  # the call's max_tokens may still be larger


def test_the_printed_chain_is_the_built_chain_for_every_step() -> None:
    from mlxchat.core.sampling.profile import STEPS
    from mlxchat.core.sampling.chain import Sampler

    p = SamplingProfile(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, typical_p=0.95, xtc_probability=0.5,
                        repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={3: 1.0},
                        min_tokens=2, dry_multiplier=0.8, top_n_sigma=1.5, dynatemp_range=0.5, adaptive_p_target=0.4)
    # Mirostat replaces the transforms, so it is checked on its own.
    assert all(p.active(name) for name in STEPS if name != "mirostat")
    built = Sampler(p, vocab_size=16, eos_ids={0})
    assert len(built.processors) + len(built.transforms) == len(STEPS) - 1
    assert built.describe() == p.describe_chain()
    assert "DRY(0.8, 1.75, 2, -1) → LogitBias" in p.describe_chain()
    assert "TopNSigma(1.5) → TopK(40)" in p.describe_chain()
    assert "DynaTemp(0.2..1.2, 1) → AdaptiveP(0.4, 0.9) → sample" in p.describe_chain()
    m = p.model_copy(update={"mirostat": 2})
    assert Sampler(m, vocab_size=16, eos_ids={0}).describe() == m.describe_chain()
    assert m.describe_chain().endswith("MinTokens(2) → Temperature(0.7) → MirostatV2(5, 0.1) → sample")
    assert any("mirostat 2 replaces the other transforms" in w for w in m.warnings())
    assert p.describe_chain().startswith("RepetitionPenalty(1.1) → FrequencyPenalty(0.5) → PresencePenalty(0.3) → "
                                         "DRY(0.8, 1.75, 2, -1) → LogitBias(1 tokens) → MinTokens(2) → "
                                         "TopNSigma(1.5) → TopK(40) → TypicalP(0.95)")
