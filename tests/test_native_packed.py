"""The packed matmul (weights repacked into tiles of 16 rows, x as integers per block of 32): with fixed24 x (the
native path where AVX512-VNNI runs) it is the affine weights times x to fp32's precision; with int8 x (the opt-in
weights="native-int8") the weights times x rounded to int8. Rows independent of each other; the tied embedding's
lookup on packed weights; the loader's policy; and int8's drift from the exact path on the embedded model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.bench.native import int8_drift
from mlxchat.core import Engine, native
from mlxchat.core.model import loader
from mlxchat.core.model.native_linear import NativeQuantizedEmbedding, NativeQuantizedLinear
from tests.avx2_process import run_on_avx2
from tests.markers import needs_native

EPS = float(np.finfo(np.float32).eps)


def _packed(n: int, k: int, group_size: int, bits: int, scale_dtype: mx.Dtype, seed: int = 0):
    w, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(seed)), group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    return (w, s, b), native.pack_weights(w, s, b, group_size=group_size, bits=bits)


def _dequantized(w: mx.array, s: mx.array, b: mx.array, group_size: int, bits: int) -> np.ndarray:
    return np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits),
                    dtype=np.float64)


needs_fixed24 = pytest.mark.skipif(not (native.available() and native.packs_exact()),
                                   reason="fixed24 x runs on AVX512-VNNI; this CPU keeps MLX's layout")


@needs_fixed24
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32, mx.bfloat16])
def test_packed_matmul_with_fixed24_x_is_exact_to_fp32_rounding(bits: int, group_size: int, scale_dtype: mx.Dtype):
    # The fp32 kernel's bound (test_native.py): K * eps * (|x| @ |W|.T). x spans ~5 binades inside each block, so the
    # blocks' smaller values lose low bits to the shared power of two, as the bound allows; a wrong digit would be
    # off by 2^-16 of the block's largest value or more.
    (w, s, b), packed = _packed(48, 384, group_size, bits, scale_dtype)
    deq = _dequantized(w, s, b, group_size, bits)
    for m in (1, 2, 3, 4, 7, 17):
        key = mx.random.key(m)
        x = mx.random.normal((m, 384), key=key) * mx.exp(2 * mx.random.normal((m, 384), key=mx.random.split(key)[0]))
        y = native.quantized_matmul(x, *packed, group_size=group_size, bits=bits, packed=True)
        assert y.shape == (m, 48) and y.dtype == mx.float32
        xd = np.array(x, dtype=np.float64)
        ref, bound = xd @ deq.T, 384 * EPS * (np.abs(xd) @ np.abs(deq).T) + 1e-30
        assert (np.abs(np.array(y) - ref) <= bound).all()
        # no further from the exact product than the fp32 kernel on MLX's layout, within a few roundings
        fp32 = np.array(native.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits))
        assert np.abs(np.array(y) - ref).max() <= 4 * np.abs(fp32 - ref).max() + 1e-30


@needs_fixed24
def test_fixed24_holds_block_maxima_at_the_top_of_their_binade():
    # A block's largest |x| just under a power of two scales to just under 2^23, past the most that three signed
    # bytes hold (127 * 65536 + 127 * 256 + 127), and then takes the next power of two. Found by a chat whose second
    # turn read other text than the same messages sent fresh: the top digit had wrapped to -128 for 0.49805444.
    (w, s, b), packed = _packed(32, 128, 32, 4, mx.float16)
    deq = _dequantized(w, s, b, 32, 4)
    rng = np.random.default_rng(0)
    top = 127 * 65536 + 127 * 256 + 127
    mantissas = [top + j for j in (-1, 0, 1, 2, 64, 128, 255, 256, 257, 2**23 - 1 - top)]  # around it, to 2^23 - 1
    maxima = np.array([m * 2.0 ** (e - 23) for m in mantissas for e in (-1, 0, 3)] + [0.49805444], np.float32)
    x = (rng.standard_normal((len(maxima), 128)) * 0.1).astype(np.float32)
    for i, v in enumerate(maxima):
        x[i, 7] = v if i % 2 else -v  # the largest of its block, either sign
        x[i, 40 + i % 32] = v * 0.5 ** (i % 5)
    y = np.array(native.quantized_matmul(mx.array(x), *packed, group_size=32, bits=4, packed=True))
    xd = x.astype(np.float64)
    assert (np.abs(y - xd @ deq.T) <= 128 * EPS * (np.abs(xd) @ np.abs(deq).T)).all()


@needs_native
@pytest.mark.parametrize("int8", [True, False])
def test_packed_x_keeps_nan_and_zero_blocks(int8: bool):
    # A NaN or inf in x gives NaN rows (a NaN is never taken for the block's largest value and lost), as in fp32.
    if not int8 and not native.packs_exact():
        pytest.skip("fixed24 x runs on AVX512-VNNI only")
    _, packed = _packed(32, 64, 32, 4, mx.float16)
    x = mx.zeros((3, 64)).at[1, 5].add(float("nan")).at[2, 40].add(float("inf"))
    y = np.array(native.quantized_matmul(x, *packed, group_size=32, bits=4, packed=True, int8=int8))
    np.testing.assert_array_equal(y[0], 0.0)  # zero x: the bias term over a zero sum
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32, mx.bfloat16])
def test_packed_lookup_gives_mlx_dequantize_rows_bit_for_bit(bits: int, scale_dtype: mx.Dtype):
    """Rows in float32 whatever the parameters' type (an f16 scale times a code does not fit f16): MLX's
    dequantize of the same rows with their parameters widened to float32."""
    for group_size in (32, 64, 128):
        (w, s, b), packed = _packed(64, 256, group_size, bits, scale_dtype)
        ids = mx.array([[0, 63, 17], [16, 5, 5]])
        ours = native.packed_lookup(ids, *packed, group_size=group_size, bits=bits)
        theirs = mx.dequantize(w[ids], scales=s[ids].astype(mx.float32), biases=b[ids].astype(mx.float32),
                               group_size=group_size, bits=bits)
        assert ours.shape == (2, 3, 256) and ours.dtype == theirs.dtype == mx.float32
        assert mx.array_equal(ours, theirs).item()
        assert mx.isnan(native.packed_lookup(mx.array([64]), *packed, group_size=group_size, bits=bits)).all().item()


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
    deq = _dequantized(w, s, b, group_size, bits)
    for m in (1, 5, 6, 7, 17):
        x = mx.random.normal((m, 384), key=mx.random.key(m)) * 3
        y = native.quantized_matmul(x, *packed, group_size=group_size, bits=bits, packed=True, int8=True)
        assert y.shape == (m, 48) and y.dtype == mx.float32
        xr = _rounded(np.array(x))
        ref, bound = xr @ deq.T, 384 * EPS * (np.abs(xr) @ np.abs(deq).T) + 1e-30
        assert (np.abs(np.array(y) - ref) <= bound).all()
        # and near the exact product: the rounding of x is the only difference (a loose check of its size)
        exact = np.array(x, dtype=np.float64) @ deq.T
        assert np.abs(np.array(y) - exact).max() < 0.02 * np.abs(exact).max()


@needs_native
@pytest.mark.parametrize("int8", [True, False])
def test_each_packed_row_equals_that_row_alone_bit_for_bit(int8: bool):
    # A verify pass and the server's batch on packed weights still equal single steps.
    if not int8 and not native.packs_exact():
        pytest.skip("fixed24 x runs on AVX512-VNNI only")
    _, packed = _packed(320, 576, 32, 4, mx.float16)
    x = mx.random.normal((9, 576), key=mx.random.key(3))
    together = np.array(native.quantized_matmul(x, *packed, group_size=32, bits=4, packed=True, int8=int8))
    for i in range(9):
        alone = np.array(native.quantized_matmul(x[i:i + 1], *packed, group_size=32, bits=4, packed=True, int8=int8))
        np.testing.assert_array_equal(together[i:i + 1], alone)


@needs_fixed24
@pytest.mark.parametrize("bits, group_size, params",
                         [(4, 32, mx.float16), (8, 64, mx.bfloat16), (5, 128, mx.float32),
                          (4, 32, "compact"), (5, 32, "compact"), (6, 16, "compact")])
@pytest.mark.parametrize("int8", [False, True])
def test_prompt_rows_equal_single_rows_bit_for_bit(bits: int, group_size: int, params, int8: bool):
    # 33 rows: where the packed kernel runs prompts on AMX's tiles (native.packs_on_amx), two chunks of 16 rows there
    # and one left over, each equal to that row alone (on the VNNI kernel) bit for bit: a prompt, a verify pass and a
    # single step agree whichever kernel ran them.
    from tests.test_native_formats import kquant_format

    if params == "compact":
        (w, s, b), _ = kquant_format(48, 512, bits, group_size, seed=bits)
        s, b = native.compact_params(s, b, group_size=group_size)
        packed = native.pack_weights(w, s, b, group_size=group_size, bits=bits)
    else:
        _, packed = _packed(48, 512, group_size, bits, params)
    key = mx.random.key(bits)
    x = mx.random.normal((33, 512), key=key) * mx.exp(2 * mx.random.normal((33, 512), key=mx.random.split(key)[0]))
    fmt = {"group_size": group_size, "bits": bits, "packed": True, "int8": int8}
    together = np.array(native.quantized_matmul(x, *packed, **fmt))
    for i in (0, 15, 16, 31, 32):
        np.testing.assert_array_equal(together[i:i + 1], np.array(native.quantized_matmul(x[i:i + 1], *packed, **fmt)))


@needs_fixed24
@pytest.mark.parametrize("group_size, params", [(32, mx.float16), (64, mx.float32), (32, "compact")])
def test_prompt_rows_on_4_bit_codes_equal_single_rows_at_every_digit_extreme(group_size: int, params):
    # Where AMX runs prompts, 4-bit codes take x as fixed24_nibbles (m = e0 + 16 e1 + 4096 (e2 + 16 e3), two tile
    # products a block) while a single row takes the three base-256 digits on VNNI: the same integer sums, rounded
    # once each. Blocks whose largest |x| sits at the top of its binade (the top digits at their limits, either
    # sign), tiny and subnormal blocks, and zero blocks, all equal bit for bit.
    from tests.test_native_formats import kquant_format

    if params == "compact":
        (w, s, b), _ = kquant_format(32, 256, 4, group_size, seed=5)
        s, b = native.compact_params(s, b, group_size=group_size)
        packed = native.pack_weights(w, s, b, group_size=group_size, bits=4)
    else:
        _, packed = _packed(32, 256, group_size, 4, params, seed=5)
    rng = np.random.default_rng(5)
    top = 127 * 65536 + 127 * 256 + 127
    x = (rng.standard_normal((40, 256)) * np.exp(2 * rng.standard_normal((40, 256)))).astype(np.float32)
    for i in range(40):
        m = [top, top + 1, 2**23 - 1, top - 1, 2**22, 65535, 4095][i % 7]
        for blk in range(8):
            v = np.float32(m * 2.0 ** (blk - 30 - 20 * (i % 3)))
            x[i, 32 * blk + (i + blk) % 32] = v if (i + blk) % 2 else -v
    x[3, :64] = 0.0
    x[4, 32:64] = np.float32(1e-41)  # subnormal
    fmt = {"group_size": group_size, "bits": 4, "packed": True}
    together = np.array(native.quantized_matmul(mx.array(x), *packed, **fmt))
    for i in range(40):
        np.testing.assert_array_equal(together[i:i + 1],
                                      np.array(native.quantized_matmul(mx.array(x[i:i + 1]), *packed, **fmt)))


@needs_native
def test_the_avx2_int8_kernel_too_where_vnni_runs():
    """CPUs without AVX512-VNNI run the AVX2 kernel (chosen once per process): checked in a process of its own."""
    if native.int8_kernel_name() != "avx512-vnni":
        pytest.skip("this CPU runs the AVX2 int8 kernel: the tests above check it")
    run_on_avx2("assert native.int8_kernel_name() == 'avx2'",
                ["import tests.test_native_packed as t",
                 "t.test_packed_matmul_is_the_weights_times_x_rounded_to_int8(4, 32, mx.float16)",
                 "t.test_packed_matmul_is_the_weights_times_x_rounded_to_int8(8, 64, mx.bfloat16)",
                 "t.test_packed_matmul_is_the_weights_times_x_rounded_to_int8(8, 128, mx.float32)",
                 "t.test_each_packed_row_equals_that_row_alone_bit_for_bit(True)",
                 "t.test_packed_lookup_gives_mlx_dequantize_rows_bit_for_bit(8, mx.float16)"])


@needs_native
def test_fixed24_needs_vnni_and_the_native_path_then_keeps_mlx_layout():
    """Without AVX512-VNNI (here: MLXCHAT_NATIVE_ISA=avx2) the native path keeps MLX's layout and the fp32 kernel,
    and asking for fixed24 x on packed weights says what it needs."""
    if not native.packs_exact():
        pytest.skip("this CPU has no AVX512-VNNI: the other tests run the unpacked native path")
    run_on_avx2("assert not native.packs_exact()",
                ["import pytest",
                 "w, s, b = native.pack_weights(*mx.quantize(mx.zeros((16, 64)), group_size=32, bits=4), "
                 "group_size=32, bits=4)",
                 "pytest.raises(RuntimeError, native.quantized_matmul, mx.zeros((1, 64)), w, s, b, group_size=32, "
                 "bits=4, packed=True).match('packed weights with exact x need AVX512-VNNI')",
                 "from mlxchat.core.model import loader",
                 "m = loader.load(None, weights='native')",
                 "assert m.weights_path.startswith('native q4/q8 (avx2, '), m.weights_path",
                 "assert not m.model.model.layers[0].mlp.up_proj.packed"])


@needs_native
def test_packing_needs_rows_in_sixteens_and_says_so():
    w, s, b = mx.quantize(mx.random.normal((24, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match="multiple of 16 output rows, got 24"):
        native.pack_weights(w, s, b, group_size=32, bits=4)


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
    # one copy of the tied embedding, packed, for the head and the lookup: memory stays at the GGUF's size
    assert isinstance(embedding, NativeQuantizedEmbedding) and embedding.packed and embedding.int8
    assert m.weight_bytes <= 1.01 * loader.embedded_model_path().stat().st_size
    ids = mx.array([0, 17, 49151])
    reference = loader.load(None, weights="quantized").model.model.embed_tokens  # MLX's layout and lookup
    assert mx.array_equal(embedding(ids), reference(ids)).item()


@needs_native
def test_native_int8_keeps_its_own_kv_caches_on_disk(engine: Engine, int8_engine: Engine):
    # Its keys and values are not the exact path's: a cache saved by one must not be loaded by the other.
    from mlxchat.core.model.backend import KVOptions
    from mlxchat.core.cache.kv_store import fingerprint

    assert fingerprint(engine.model, KVOptions()) != fingerprint(int8_engine.model, KVOptions())


@needs_native
def test_native_int8_stays_near_the_exact_path(engine: Engine, int8_engine: Engine):
    # Measured here: top-1 agreement ~95%, KL ~0.003 nats (llama.cpp, rounding x the same way: ~96%, ~0.003).
    # A kernel or packing fault puts KL in whole nats and agreement near 0. The replies are decoded on the fused
    # layers and the teacher-forced passes run the layers' own calls, so both packed paths are in it.
    drift = int8_drift(engine, int8_engine, n_prompts=2, tokens=24)
    assert drift["positions"] == 48
    assert drift["top1_agreement"] >= 0.85 and drift["kl_mean"] < 0.02, drift



@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_gives_mlx_layout_back(bits: int):
    # mlx-lm's shard() (tensor parallel) slices MLX's layout: the loaded model is unpacked first.
    for group_size in (32, 64, 128):
        (w, s, b), packed = _packed(48, 256, group_size, bits, mx.bfloat16)
        assert not mx.array_equal(packed[0], w).item()
        back = native.unpack_weights(*packed, group_size=group_size, bits=bits)
        assert all(mx.array_equal(x, y).item() for x, y in zip((w, s, b), back))


@needs_fixed24
@pytest.mark.parametrize("bits", [4, 8])
def test_packed_weights_dequantize_to_the_same_fp32_weight(bits: int):
    # Long prompts on packed weights run dequantize + one BLAS GEMM, on the same fp32 weight as MLX's layout gives.
    for group_size in (32, 64, 128):
        (w, s, b), packed = _packed(48, 256, group_size, bits, mx.float16)
        ours = native.dequantize(*packed, group_size=group_size, bits=bits, packed=True)
        assert mx.array_equal(ours, native.dequantize(w, s, b, group_size=group_size, bits=bits)).item()
