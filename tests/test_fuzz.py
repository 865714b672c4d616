"""Fuzzing (issue 7): the GGUF header reader, what it lets through to `mx.load`, profile parsing, the sampler.

The GGUF part drives scripts/fuzz_gguf.py's structure-aware mutators (the same ones its standalone, longer run
uses) with hypothesis, for a bounded number of cases. Whatever the bytes, `read_header` returns a header or
raises `ModelLoadError` with one line naming the file: never another exception, a hang or a large allocation.
Files that pass it must not crash the process in `mx.load` or in the real loader: those run in child processes,
so that a crash (a signal) is seen as one.
"""

from __future__ import annotations

import importlib.util
import random
import struct
import sys
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlxchat.core import ModelLoadError
from mlxchat.core.model import gguf
from mlxchat.core.sampling.profile import ProfileError, ProfileStore, SamplingProfile
from mlxchat.core.sampling.chain import Sampler

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_gguf", ROOT / "scripts" / "fuzz_gguf.py")
fz = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fuzz_gguf", fz)
_spec.loader.exec_module(fz)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SEED, FIELDS = fz.seed_file()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "case.gguf"


def test_the_seed_file_parses_completely(scratch: Path) -> None:
    scratch.write_bytes(SEED)
    h = gguf.read_header(scratch)
    assert h.architecture == "llama" and len(h.tensors) == 6 and h.metadata["nested"] == 2
    assert h.metadata["tokenizer.ggml.tokens"][-1] == "ab"
    assert h.float64_keys == ["llama.rope.freq_base"]  # the empty float64 array "empty" holds none
    kinds = {f.kind for f in FIELDS}
    assert {"version", "n_tensors", "n_kv", "key_len", "vtype", "len", "etype", "count", "name_len", "n_dims", "dim",
            "ttype", "toffset", "alignment"} <= kinds


@given(st.binary(max_size=2048))
@settings(FUZZ, max_examples=150)
def test_random_bytes_give_a_header_or_one_clear_line(scratch: Path, data: bytes) -> None:
    fz.check_bytes(data, scratch)
    fz.check_bytes(b"GGUF" + struct.pack("<I", 3) + data, scratch)


@given(st.randoms(use_true_random=False))
@FUZZ
def test_mutated_gguf_gives_a_header_or_one_clear_line(scratch: Path, rng: random.Random) -> None:
    fz.check_bytes(fz.mutate(rng, SEED, FIELDS), scratch)


@pytest.mark.parametrize("value", [2**60, 2**63, 2**64 - 1])
def test_huge_length_fields_allocate_nothing(scratch: Path, value: int) -> None:
    """Every length, count, dimension and offset of the seed file, in turn, claims `value`."""
    structural = [f for f in FIELDS if f.width == 8 and f.kind != "scalar"]
    assert len(structural) > 40
    for f in structural:
        data = bytearray(SEED)
        struct.pack_into("<Q", data, f.offset, value)
        scratch.write_bytes(bytes(data))
        tracemalloc.start()
        try:
            with pytest.raises(ModelLoadError) as info:
                gguf.read_header(scratch)
                pytest.fail(f"{f.kind} at byte {f.offset} = {value} was accepted")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # read_header's file buffer is 1 MiB; anything sized by the claim would be gigabytes.
        assert peak < 2 * 2**20, f"{f.kind} at byte {f.offset} = {value}: {peak} bytes allocated"
        assert str(scratch) in str(info.value) and "\n" not in str(info.value)


def test_every_truncation_is_a_clear_error(scratch: Path) -> None:
    data_start = next(f.offset for f in FIELDS if f.kind == "data_start")
    last_end = data_start + max(t.offset + t.nbytes for t in gguf.read_header(_write(scratch, SEED)).tensors)
    for cut in range(last_end):
        scratch.write_bytes(SEED[:cut])
        with pytest.raises(ModelLoadError) as info:
            gguf.read_header(scratch)
        assert "\n" not in str(info.value), cut


def test_wrong_value_types_are_clear_errors(scratch: Path) -> None:
    """Each metadata type tag and array element type, in turn, set to every id from 0 to 15 and a huge one."""
    seen = set()
    for f in (f for f in FIELDS if f.kind in ("vtype", "etype", "ttype")):
        for tag in [*range(16), 2**31, 2**32 - 1]:
            data = bytearray(SEED)
            struct.pack_into("<I", data, f.offset, tag)
            seen.add(fz.summarize(fz.check_bytes(bytes(data), scratch, trace_memory=False)))
    assert "ok" in seen and any("unknown metadata value type" in s for s in seen)


def test_deeply_nested_arrays_are_refused_not_a_recursion_error(scratch: Path) -> None:
    """Found by this fuzz target: 20 000 nested array headers raised RecursionError out of read_header."""
    key = struct.pack("<Q", 1) + b"k"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20_000
    scratch.write_bytes(data)
    with pytest.raises(ModelLoadError, match="nested more than 2 deep"):
        gguf.read_header(scratch)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --- what passes the reader must not crash mx.load or the loader (child processes) -----------------------------

def test_float64_metadata_is_refused_before_mx_load(tmp_path: Path) -> None:
    """Found by this fuzz target: `mx.load` (MLX 0.32) dies with SIGSEGV on any float64 metadata value, and a single
    bit flip turns a float32 type tag (6) into float64 (12). check_loadable now refuses such files."""
    data, _ = fz.build_gguf([("general.architecture", fz.STRING, "llama"), ("x", fz.F64, 1.5)],
                            [("a", (4,), 0, bytes(16))])
    header = gguf.read_header(_write(tmp_path / "f64.gguf", data))
    assert header.float64_keys == ["x"]
    with pytest.raises(ModelLoadError, match="x holds float64 values"):
        gguf.check_loadable(header)
    data, _ = fz.build_gguf([("y", fz.ARRAY, (fz.F64, [1.0, 2.0])), ("z", fz.ARRAY, (fz.F64, []))],
                            [("a", (4,), 0, bytes(16))])
    assert gguf.read_header(_write(tmp_path / "f64a.gguf", data)).float64_keys == ["y"]  # empty arrays are fine


def test_mx_load_survives_mutants_that_pass_the_header_checks(tmp_path: Path) -> None:
    paths = fz.loadable_mutants(random.Random(7), tmp_path, 150)
    assert len(paths) == 150
    outcomes = fz.mx_load_in_children(paths, timeout=120)
    crashed = {Path(p).name: o for p, o in outcomes.items() if o.startswith("CRASHED")}
    assert not crashed
    assert len(outcomes) == len(paths)


@pytest.fixture(scope="module")
def model_mutants(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("mutants")
    rng = random.Random(3)
    mutants = fz.tiny_model_mutants(rng, folder, 6)
    return [p for i, p in enumerate(mutants) if i % 2 == 0]  # noise in the tensor data (NaN, inf, garbage)


def test_real_loader_on_mutated_tensor_data_loads_or_fails_cleanly(model_mutants: list[Path], tmp_path: Path) -> None:
    f64, _ = fz.build_gguf([("general.architecture", fz.STRING, "llama"), ("x", fz.F64, 1.5)],
                           [("a", (4,), 0, bytes(16))])
    paths = [*model_mutants, _write(tmp_path / "f64.gguf", f64)]
    outcomes = fz.load_in_child(paths, timeout=240)
    assert len(outcomes) == len(paths), outcomes
    assert all(o.startswith(("LOADED", "MODELLOADERROR")) for o in outcomes.values()), outcomes
    assert outcomes[str(paths[-1])].startswith("MODELLOADERROR") and "float64" in outcomes[str(paths[-1])]
    assert sum(o.startswith("LOADED") for o in outcomes.values()) >= len(model_mutants)


# --- profile parsing: any input gives a profile or a ValidationError --------------------------------------------

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(-5, 5), inner,
                                                                max_size=4),
    max_leaves=8,
)
FIELD_NAMES = list(SamplingProfile.model_fields)


@given(ANY_JSON | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=12) | st.integers(), ANY_JSON,
                                  max_size=8))
@settings(max_examples=200, deadline=None)
def test_any_value_gives_a_profile_or_a_validation_error(data) -> None:
    """test_profile.py draws dicts over the field names; this adds non-dicts, arbitrary keys, bytes and infinities."""
    try:
        profile = SamplingProfile.model_validate(data)
    except ValidationError as e:
        assert e.errors()
        return
    assert SamplingProfile.model_validate(profile.model_dump()) == profile
    profile.describe_chain()


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
       | st.dictionaries(st.sampled_from(FIELD_NAMES + ["x"]), st.integers(-3, 300) | st.floats() | st.text(max_size=3),
                         max_size=4).map(lambda d: "".join(f"{k} = {v!r}\n" for k, v in d.items()).encode()))
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_profile_file_loads_or_is_one_line_naming_it(tmp_path_factory: pytest.TempPathFactory,
                                                         content: bytes) -> None:
    folder = tmp_path_factory.mktemp("profiles", numbered=True)
    path = folder / "fuzzed.toml"
    path.write_bytes(content)
    try:
        ProfileStore(folder).load("fuzzed")
    except ProfileError as e:
        assert str(path) in str(e) and "\n" not in str(e)
    assert path.read_bytes() == content


# --- the sampler chain on extreme finite logits ------------------------------------------------------------------
# test_sampling.py draws logits in [-30, 30] (with -inf masks); real models stay there, but a corrupt model or an
# overflowing fp16 activation does not. Near float32's limits, penalties and a small temperature overflow.

F32_MAX = float(np.finfo(np.float32).max)
EXTREME = st.sampled_from([F32_MAX, -F32_MAX, 1e38, -1e38, 1e30, -1e30, 1e-45, -1e-45, 0.0, 65504.0, -65504.0]) | \
    st.floats(-F32_MAX, F32_MAX, width=32)


@st.composite
def extreme_logits(draw) -> np.ndarray:
    vocab = draw(st.integers(2, 24))
    x = np.array(draw(st.lists(EXTREME, min_size=vocab, max_size=vocab)), np.float32)
    mask = np.array(draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))
    x[mask] = -np.inf
    x[draw(st.integers(1, vocab - 1))] = draw(EXTREME)  # one token (not EOS id 0) stays in play
    return x


@given(st.data())
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_extreme_logits_give_a_valid_unmasked_token(data) -> None:
    x = data.draw(extreme_logits())
    # Penalties only for tokens that are not alone in play: a penalty may legitimately push the last finite
    # logit to -inf (F32_MAX * 3 overflows), and then no token is valid.
    profile = SamplingProfile(
        temperature=data.draw(st.sampled_from([0.0, 1e-6, 0.01, 0.7, 1.0, 2.0])),
        top_k=data.draw(st.sampled_from([0, 1, 3])), top_p=data.draw(st.sampled_from([1.0, 0.9, 0.01])),
        min_p=data.draw(st.sampled_from([0.0, 0.05, 1.0])), typical_p=data.draw(st.sampled_from([1.0, 0.5])),
        xtc_probability=data.draw(st.sampled_from([0.0, 1.0])),
        logit_bias=data.draw(st.dictionaries(st.integers(0, x.size - 1), st.sampled_from([-100.0, 100.0]),
                                             max_size=2)),
        seed=data.draw(st.integers(0, 2**32)))
    s = Sampler(profile, vocab_size=x.size, eos_ids={0})
    for _ in range(2):
        token = s.step(mx.array(x))[0].item()
        assert 0 <= token < x.size and np.isfinite(x[token]), f"token {token} for {x} with {s.describe()}"


def _outcome(path: Path, strings: gguf.StringsReader | None) -> object:
    try:
        header = gguf.read_header(path, strings)
    except ModelLoadError as e:
        return str(e)
    return header.metadata, header.tensors, header.data_start


@pytest.fixture()
def native_strings(monkeypatch: pytest.MonkeyPatch) -> gguf.StringsReader:
    from mlxchat.core import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    monkeypatch.setattr(gguf, "_NATIVE_STRINGS", 1)  # every string array natively, the seed's short ones too
    return native.gguf_strings


def test_the_native_string_reader_parses_every_truncation_as_python_does(scratch: Path,
                                                                         native_strings: gguf.StringsReader) -> None:
    """The loader reads a vocabulary's strings natively (core/native's gguf_strings): the same header, or the same
    one-line error, as the Python reader, for every prefix of the seed file and a bad UTF-8 byte in a string."""
    for cut in range(len(SEED) + 1):
        scratch.write_bytes(SEED[:cut])
        assert _outcome(scratch, native_strings) == _outcome(scratch, None), cut
    at = SEED.index(b"ab") if b"ab" in SEED else None
    assert at is not None
    scratch.write_bytes(SEED[:at] + b"\xff" + SEED[at + 1:])
    message = _outcome(scratch, native_strings)
    assert message == _outcome(scratch, None) and "not valid UTF-8" in str(message)


@given(st.randoms(use_true_random=False))
@settings(FUZZ, max_examples=100)
def test_the_native_string_reader_parses_mutants_as_python_does(scratch: Path, native_strings: gguf.StringsReader,
                                                                rng: random.Random) -> None:
    scratch.write_bytes(fz.mutate(rng, SEED, FIELDS))
    assert _outcome(scratch, native_strings) == _outcome(scratch, None)
