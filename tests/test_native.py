"""The native quantized matmul (core/native): exact fp32 results against MLX's own ops, the loader's weight policy,
and greedy decoding against mlx-lm on MLX's quantized matmul."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxchat.core import Engine, SamplingProfile, native
from mlxchat.core.model import loader
from mlxchat.core.model.native_linear import NativeQuantizedEmbedding, NativeQuantizedLinear
from tests.avx2_process import run_on_avx2
from tests.markers import needs_native

EPS = float(np.finfo(np.float32).eps)


def _quantized(n: int, k: int, group_size: int, bits: int, scale_dtype: mx.Dtype, seed: int = 0):
    w, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(seed)), group_size=group_size, bits=bits)
    return w, s.astype(scale_dtype), b.astype(scale_dtype)


def _reference(x: mx.array, w: mx.array, s: mx.array, b: mx.array, group_size: int, bits: int):
    """x @ W.T with W dequantized in fp32, and the rounding bound K * eps * (|x| @ (|s| q + |b|).T) that any fp32
    summation order stays within (the kernel sums scale * sum(x q) + bias * sum(x) per group)."""
    f32 = mx.float32
    x32 = x.astype(f32)
    deq = mx.dequantize(w, s.astype(f32), b.astype(f32), group_size=group_size, bits=bits)
    mag = mx.dequantize(w, mx.abs(s.astype(f32)), mx.abs(b.astype(f32)), group_size=group_size, bits=bits)
    k = x.shape[-1]
    return x32 @ deq.T, k * EPS * (mx.abs(x32) @ mag.T) + 1e-30


def _assert_close(y: mx.array, ref: mx.array, bound: mx.array) -> None:
    err = mx.abs(y.astype(mx.float32) - ref)
    assert mx.all(err <= bound).item(), f"max error {mx.max(err).item():.3g}, bound {mx.min(bound).item():.3g}"


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32, mx.bfloat16])
def test_matches_dequantized_matmul_and_mlx(bits: int, group_size: int, scale_dtype: mx.Dtype):
    w, s, b = _quantized(80, 384, group_size, bits, scale_dtype)
    for m in range(1, 17):
        x = mx.random.normal((m, 384), key=mx.random.key(m))
        y = native.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits)
        ref, bound = _reference(x, w, s, b, group_size, bits)
        assert y.shape == (m, 80) and y.dtype == mx.float32
        _assert_close(y, ref, bound)
        # MLX's own CPU kernel computes exactly x @ dequantized W, so the same bound holds against it.
        _assert_close(y, mx.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits), bound)


@needs_native
def test_each_row_equals_that_row_alone_bit_for_bit():
    # Speculative verification and the server's batch need it: a row's logits may not depend on the rows beside it.
    w, s, b = _quantized(300, 576, 32, 4, mx.float16)
    x = mx.random.normal((8, 576), key=mx.random.key(3))
    together = np.array(native.quantized_matmul(x, w, s, b, group_size=32, bits=4))
    for i in range(8):
        alone = np.array(native.quantized_matmul(x[i:i + 1], w, s, b, group_size=32, bits=4))
        np.testing.assert_array_equal(together[i:i + 1], alone)


@needs_native
def test_the_avx2_kernel_too_where_avx512_runs():
    """Both kernels are built; where AVX-512 runs, the AVX2 one (other CPUs' kernel) is checked in a process of its
    own, since the kernel is chosen once per process."""
    if native.kernel_name() != "avx512":
        pytest.skip("this CPU runs the AVX2 kernel: the tests above check it")
    run_on_avx2("assert native.kernel_name() == 'avx2'",
                ["import tests.test_native as t", "t.test_matches_dequantized_matmul_and_mlx(4, 32, mx.float16)",
                 "t.test_matches_dequantized_matmul_and_mlx(8, 64, mx.float32)",
                 "t.test_each_row_equals_that_row_alone_bit_for_bit()"])


@needs_native
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), groups=st.integers(1, 12), m=st.integers(1, 16), bits=st.sampled_from([4, 8]),
       group_size=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**16))
def test_any_shape(n: int, groups: int, m: int, bits: int, group_size: int, seed: int):
    k = groups * group_size
    w, s, b = _quantized(n, k, group_size, bits, mx.float16, seed)
    x = mx.random.normal((m, k), key=mx.random.key(seed + 1))
    ref, bound = _reference(x, w, s, b, group_size, bits)
    _assert_close(native.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits), ref, bound)


@needs_native
@pytest.mark.parametrize("x_dtype", [mx.float16, mx.bfloat16])
def test_half_precision_x_keeps_its_dtype(x_dtype: mx.Dtype):
    w, s, b = _quantized(64, 256, 32, 4, mx.float16)
    x = mx.random.normal((3, 256)).astype(x_dtype)
    y = native.quantized_matmul(x, w, s, b, group_size=32, bits=4)
    ref, bound = _reference(x, w, s, b, 32, 4)
    assert y.dtype == x_dtype
    # Computed in fp32, then rounded once to x's dtype.
    _assert_close(y, ref, bound + mx.abs(ref) * (2.0 ** -8 if x_dtype == mx.bfloat16 else 2.0 ** -11))


@needs_native
def test_non_contiguous_and_batched_x():
    w, s, b = _quantized(48, 128, 64, 8, mx.float16)
    wide = mx.random.normal((5, 256))
    x = wide[:, ::2]  # strided columns
    ref, bound = _reference(x, w, s, b, 64, 8)
    _assert_close(native.quantized_matmul(x, w, s, b, group_size=64, bits=8), ref, bound)
    xt = mx.random.normal((128, 4)).T  # column-major rows
    ref, bound = _reference(xt, w, s, b, 64, 8)
    _assert_close(native.quantized_matmul(xt, w, s, b, group_size=64, bits=8), ref, bound)
    x3 = mx.random.normal((2, 3, 128))
    y3 = native.quantized_matmul(x3, w, s, b, group_size=64, bits=8)
    ref, bound = _reference(x3.reshape(6, 128), w, s, b, 64, 8)
    assert y3.shape == (2, 3, 48)
    _assert_close(y3.reshape(6, 48), ref, bound)


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dequantize_is_exact(bits: int, scale_dtype: mx.Dtype):
    w, s, b = _quantized(40, 256, 64, bits, scale_dtype)
    ours = native.dequantize(w, s, b, group_size=64, bits=bits)
    theirs = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=bits)
    assert ours.dtype == mx.float32
    if scale_dtype == mx.float32:
        # One fused multiply-add (one rounding) against MLX's multiply then add (two): within one rounding.
        mag = mx.dequantize(w, mx.abs(s), mx.abs(b), group_size=64, bits=bits)
        assert mx.all(mx.abs(ours - theirs) <= EPS * mag).item()
    else:
        assert mx.array_equal(ours, theirs).item()  # half-precision scale * 4/8-bit integer is exact in fp32


@needs_native
def test_lazy_async_and_compiled():
    w, s, b = _quantized(64, 256, 32, 4, mx.float16)
    x = mx.random.normal((1, 256))
    eager = native.quantized_matmul(x, w, s, b, group_size=32, bits=4)
    mx.eval(eager)
    lazy = native.quantized_matmul(x, w, s, b, group_size=32, bits=4) * 2
    mx.async_eval(lazy)
    compiled = mx.compile(lambda v: native.quantized_matmul(v, w, s, b, group_size=32, bits=4) * 2)
    assert mx.array_equal(lazy, eager * 2).item() and mx.array_equal(compiled(x), eager * 2).item()


@needs_native
def test_bad_arguments_say_what_is_wrong():
    w, s, b = _quantized(8, 64, 32, 4, mx.float16)
    with pytest.raises(ValueError, match="bits must be 4, 5, 6 or 8"):
        native.quantized_matmul(mx.zeros((1, 64)), w, s, b, group_size=32, bits=3)
    with pytest.raises(ValueError, match="last dimension must be 64"):
        native.quantized_matmul(mx.zeros((1, 65)), w, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="do not match w"):
        native.quantized_matmul(mx.zeros((1, 64)), w, s, b, group_size=64, bits=4)


# --- the loader's weight policy -------------------------------------------------------------------------------------

@needs_native
def test_auto_policy_runs_the_native_kernel_at_the_gguf_size(engine: Engine):
    m = engine.model
    assert m.weights_path.startswith("native q4/q8 (avx")
    layer = m.model.model.layers[0]
    assert isinstance(layer.mlp.up_proj, NativeQuantizedLinear) and layer.mlp.up_proj.bits == 4
    assert isinstance(m.model.model.embed_tokens, NativeQuantizedEmbedding) and m.model.model.embed_tokens.bits == 8
    gguf_bytes = loader.embedded_model_path().stat().st_size
    assert m.weight_bytes <= 1.3 * gguf_bytes


def test_switched_off_falls_back_to_fp32_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("MLXCHAT_NATIVE", "0")
    assert not native.available() and "MLXCHAT_NATIVE=0" in native.unavailable_reason()
    with caplog.at_level(logging.WARNING, logger="mlxchat"):
        m = loader.load(None)
    assert not m.quantized and m.weights_path == "fp32 (dequantized): switched off by MLXCHAT_NATIVE=0"
    notices = [r.getMessage() for r in caplog.records if r.name.startswith("mlxchat")]
    assert len(notices) == 1 and "run as fp32" in notices[0] and "MLXCHAT_NATIVE=0" in notices[0]
    with pytest.raises(ValueError, match="weights=native is not possible here: switched off"):
        loader.load(None, weights="native")


# --- greedy decoding against mlx-lm on MLX's quantized matmul -------------------------------------------------------

PROMPTS = ["Write a long story about a lighthouse keeper and a storm.",
           "Explain in detail how a refrigerator works, step by step.",
           "List twenty animals and one fact about each."]
# MLX's own CPU quantized matmul (the reference) costs about 0.1 s a token on two cores, prompt tokens included: the
# chat template's system prompt, which every prompt starts with, is prefilled into the reference's cache once, and
# each reply is compared over its first GREEDY_TOKENS tokens (a loader or kernel fault shows in the first few).
GREEDY_TOKENS = 12


@needs_native
def test_greedy_tokens_equal_mlx_lm_on_mlx_quantized_matmul(engine: Engine):
    import copy

    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    reference = loader.load(None, weights="quantized")
    assert reference.weights_path == "MLX quantized"
    encoded = [engine.model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    shared = 0
    while all(len(e) > shared + 1 and e[shared] == encoded[0][shared] for e in encoded):
        shared += 1
    assert shared >= 16, shared  # the system prompt
    prefix_cache = make_prompt_cache(reference.model)
    reference.model(mx.array(encoded[0][:shared])[None], cache=prefix_cache)
    mx.eval([c.state for c in prefix_cache])
    for prompt, ids in zip(PROMPTS, encoded):
        ours = engine.generate(prompt, profile=SamplingProfile(temperature=0), max_tokens=GREEDY_TOKENS).token_ids
        theirs = [int(t) for t, _ in generate_step(mx.array(ids[shared:]), reference.model,
                                                     prompt_cache=copy.deepcopy(prefix_cache),
                                                     max_tokens=GREEDY_TOKENS,
                                                     sampler=lambda logits: mx.argmax(logits, axis=-1))]
        assert len(ours) == GREEDY_TOKENS, f"{prompt!r} stopped after {len(ours)} tokens"
        assert list(ours) == theirs, prompt


# --- GGUF's own quantizations map exactly onto MLX's affine format -----------------------------------------------

def _ggml_dequantize(kind: str, raw: bytes, rows: int, cols: int) -> np.ndarray:
    """ggml's definitions (ggml-quants.c): per block of 32, fp16 scale d (and min m for Q4_1); Q4_* hold element j in
    the low nibble of byte j and element j + 16 in its high nibble."""
    nbytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, nbytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (q * d).reshape(rows, cols)
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    if kind == "Q4_0":
        return ((q - 8) * d).reshape(rows, cols)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (q * d + m).reshape(rows, cols)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_quantizations_load_exactly(tmp_path, kind: str):
    from mlxchat.core.model.gguf_writer import write_gguf

    rng = np.random.default_rng(7)
    rows, cols = 24, 128
    blocks = rng.integers(0, 256, size=(rows * cols // 32, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]), dtype=np.uint8)
    scales = rng.uniform(-0.1, 0.1, size=len(blocks)).astype(np.float16)  # signed, as real files have
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    if kind == "Q4_1":
        blocks[:, 2:4] = rng.uniform(-1, 1, size=len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.tobytes()
    path = write_gguf(tmp_path / "q.gguf", {"general.architecture": "llama"}, [("t.weight", kind, (rows, cols), raw)])
    loaded = mx.load(str(path))
    w, s, b = loaded["t.weight"], loaded["t.scales"], loaded["t.biases"]
    bits = 8 if kind == "Q8_0" else 4
    ours = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits))
    np.testing.assert_array_equal(ours, _ggml_dequantize(kind, raw, rows, cols))
    if native.available():
        np.testing.assert_array_equal(np.array(native.dequantize(w, s, b, group_size=32, bits=bits)), ours)
