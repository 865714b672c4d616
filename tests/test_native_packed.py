"""The opt-in int8-activation matmul (weights="native-int8"): the packed kernel computes the affine weights times x
rounded to int8 per block of 32, rows independent of each other; the loader's policy; and its drift from the exact
path on the embedded model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.bench.native import int8_drift
from mlxchat.core import Engine, loader, native
from mlxchat.core.native_linear import NativeQuantizedEmbedding, NativeQuantizedLinear
from tests.avx2_process import run_on_avx2
from tests.markers import needs_native

EPS = float(np.finfo(np.float32).eps)


def _packed(n: int, k: int, group_size: int, bits: int, scale_dtype: mx.Dtype, seed: int = 0):
    w, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(seed)), group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    return (w, s, b), native.pack_int8_weights(w, s, b, group_size=group_size, bits=bits)


def _rounded(x: np.ndarray) -> np.ndarray:
    """x as the kernel rounds it, in float32 steps: per block of 32, d = max|x| / 127, q = rint(x * (1 / d))."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return (np.rint(blocks * inv) * d.astype(np.float64)).reshape(x.shape)


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32, mx.bfloat16])
def test_packed_matmul_is_the_weights_times_x_rounded_to_int8(bits: int, group_size: int, scale_dtype: mx.Dtype):
    (w, s, b), packed = _packed(48, 384, group_size, bits, scale_dtype)
    deq = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits),
                   dtype=np.float64)
    for m in (1, 5, 6, 7, 17):
        x = mx.random.normal((m, 384), key=mx.random.key(m)) * 3
        y = native.quantized_matmul(x, *packed, group_size=group_size, bits=bits, packed=True)
        assert y.shape == (m, 48) and y.dtype == mx.float32
        xr = _rounded(np.array(x))
        ref, bound = xr @ deq.T, 384 * EPS * (np.abs(xr) @ np.abs(deq).T) + 1e-30
        assert (np.abs(np.array(y) - ref) <= bound).all()
        # and near the exact product: the rounding of x is the only difference (a loose check of its size)
        exact = np.array(x, dtype=np.float64) @ deq.T
        assert np.abs(np.array(y) - exact).max() < 0.02 * np.abs(exact).max()


@needs_native
def test_each_packed_row_equals_that_row_alone_bit_for_bit():
    # A verify pass and the server's batch on weights="native-int8" still equal single steps.
    _, packed = _packed(320, 576, 32, 4, mx.float16)
    x = mx.random.normal((9, 576), key=mx.random.key(3))
    together = np.array(native.quantized_matmul(x, *packed, group_size=32, bits=4, packed=True))
    for i in range(9):
        alone = np.array(native.quantized_matmul(x[i:i + 1], *packed, group_size=32, bits=4, packed=True))
        np.testing.assert_array_equal(together[i:i + 1], alone)


@needs_native
def test_the_avx2_int8_kernel_too_where_vnni_runs():
    """CPUs without AVX512-VNNI run the AVX2 kernel (chosen once per process): checked in a process of its own."""
    if native.int8_kernel_name() != "avx512-vnni":
        pytest.skip("this CPU runs the AVX2 int8 kernel: the tests above check it")
    run_on_avx2("assert native.int8_kernel_name() == 'avx2'",
                ["import tests.test_native_int8 as t",
                 "t.test_packed_matmul_is_the_weights_times_x_rounded_to_int8(4, 32, mx.float16)",
                 "t.test_packed_matmul_is_the_weights_times_x_rounded_to_int8(8, 64, mx.bfloat16)",
                 "t.test_packed_matmul_is_the_weights_times_x_rounded_to_int8(8, 128, mx.float32)",
                 "t.test_each_packed_row_equals_that_row_alone_bit_for_bit()"])


@needs_native
def test_packing_needs_rows_in_sixteens_and_says_so():
    w, s, b = mx.quantize(mx.random.normal((24, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="multiple of 16 output rows, got 24"):
        native.pack_int8_weights(w, s, b, group_size=32, bits=4)


def test_the_policy_names_itself_and_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="^weights must be auto, native, native-int8, quantized or dequantize, got"):
        loader.resolve_policy("int8")  # type: ignore[arg-type]
    monkeypatch.setenv("MLXCHAT_WEIGHTS", "int8")  # set by the user: the message names the variable
    with pytest.raises(ValueError, match="^MLXCHAT_WEIGHTS must be auto, native, native-int8"):
        loader.resolve_policy(None)
    monkeypatch.setenv("MLXCHAT_WEIGHTS", "native-int8")
    assert loader.requested_policy(None) == "native-int8"
    monkeypatch.setenv("MLXCHAT_NATIVE", "0")
    with pytest.raises(ValueError, match="weights=native-int8 is not possible here: switched off by MLXCHAT_NATIVE=0"):
        loader.resolve_policy("native-int8")
    with pytest.raises(ValueError, match="MLXCHAT_WEIGHTS=native-int8 is not possible here: switched off"):
        loader.resolve_policy(None)


@pytest.fixture(scope="module")
def int8_engine():
    with Engine.load(None, weights="native-int8") as e:
        yield e


@needs_native
def test_native_int8_packs_every_layer_and_names_its_path(int8_engine: Engine):
    m = int8_engine.model
    assert m.weights_path.startswith(f"native-int8 q4/q8 ({native.int8_kernel_name()}, ")
    assert "decode: 30/30 layers fused" in int8_engine.decode_path()
    layers = [mod for _, mod in m.model.named_modules() if isinstance(mod, NativeQuantizedLinear)]
    assert len(layers) == 30 * 7 and all(mod.packed for mod in layers)
    embedding = m.model.model.embed_tokens
    assert isinstance(embedding, NativeQuantizedEmbedding) and "head_weight" in embedding
    # the lookup still reads MLX's layout: the first token's embedding is the exact path's
    assert int8_embedding_matches(embedding)


def int8_embedding_matches(embedding: NativeQuantizedEmbedding) -> bool:
    ids = mx.array([0, 17, 49151])
    plain = mx.dequantize(embedding["weight"][ids], embedding["scales"][ids], embedding["biases"][ids],
                          group_size=embedding.group_size, bits=embedding.bits)
    return bool(mx.array_equal(embedding(ids), plain).item())


@needs_native
def test_native_int8_keeps_its_own_kv_caches_on_disk(engine: Engine, int8_engine: Engine):
    # Its keys and values are not the exact path's: a cache saved by one must not be loaded by the other.
    from mlxchat.core.backend import KVOptions
    from mlxchat.core.kv_store import fingerprint

    assert fingerprint(engine.model, KVOptions()) != fingerprint(int8_engine.model, KVOptions())


@needs_native
def test_native_int8_stays_near_the_exact_path(engine: Engine, int8_engine: Engine):
    # Measured here: top-1 agreement ~95%, KL ~0.003 nats (llama.cpp, rounding x the same way: ~96%, ~0.003).
    # A kernel or packing fault puts KL in whole nats and agreement near 0. The replies are decoded on the fused
    # layers and the teacher-forced passes run the layers' own calls, so both packed paths are in it.
    drift = int8_drift(engine, int8_engine, n_prompts=2, tokens=24)
    assert drift["positions"] == 48
    assert drift["top1_agreement"] >= 0.85 and drift["kl_mean"] < 0.02, drift

