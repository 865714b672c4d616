"""The native kernel on every format a GGUF converts to (issue 35): 4, 5, 6 and 8 bits, groups of 16 (Q6_K's
sub-blocks, which MLX's own ops refuse), 32, 64 and 128, with float32 (K-quants: d * sc is not exact in fp16),
float16 and bfloat16 parameters. Codes and parameters are random; the references are NumPy's (and MLX's where it has
the format): dequantize bit for bit, the matmuls within the fp32 rounding bound of tests/test_native.py, and a tiny
llama whose projections mix the formats, fused against the MLX-op layers and against fp32 weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from mlxchat.core import native
from mlxchat.core.model import native_linear
from mlxchat.core.model.native_decoder import FusedTransformerBlock, use_fused_layers
from mlxchat.core.model.native_linear import NativeQuantizedLinear
from tests.avx2_process import run_on_avx2
from tests.markers import needs_native
from tests.test_native_decoder import _greedy, _tiny_quantized
from tests.test_native_packed import _rounded, needs_fixed24

EPS = float(np.finfo(np.float32).eps)
BITS, GROUPS, DTYPES = (4, 5, 6, 8), (16, 32, 64, 128), (mx.float32, mx.float16, mx.bfloat16)
# (bits, group size, parameter dtype) as the loader converts them: Q4_0/Q4_1/Q8_0, Q5_0/Q5_1, Q4_K, Q5_K, Q6_K, and
# mlx-community's MLX folders (4 and 8 bits in groups of 64, fp16 or bf16 parameters).
FORMATS = [(4, 32, mx.float16), (8, 32, mx.float16), (5, 32, mx.float16), (4, 32, mx.float32),
           (5, 32, mx.float32), (6, 16, mx.float32), (4, 64, mx.float16), (8, 64, mx.bfloat16)]


def pack_codes(codes: np.ndarray, bits: int) -> mx.array:
    """Codes [N, K] in MLX's layout: each row a little-endian bit stream in uint32 words, code k in bits
    [k * bits, (k + 1) * bits)."""
    n, k = codes.shape
    stream = ((codes[..., None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(n, k * bits)
    return mx.array(np.packbits(stream, axis=1, bitorder="little").view("<u4"))


def random_format(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, seed: int = 0):
    """(w, scales, biases) of random codes and parameters, and the weight as NumPy computes it in float32:
    scale * q, then + bias (two roundings, as gguf-py's reference and mx.dequantize)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, (n, k))
    scales = mx.array((rng.standard_normal((n, k // group_size)) * 0.02).astype(np.float32)).astype(dtype)
    biases = mx.array((rng.standard_normal((n, k // group_size)) * 0.1).astype(np.float32)).astype(dtype)
    s32 = np.repeat(np.array(scales.astype(mx.float32)), group_size, axis=1)
    b32 = np.repeat(np.array(biases.astype(mx.float32)), group_size, axis=1)
    return (pack_codes(codes, bits), scales, biases), s32 * codes.astype(np.float32) + b32


def kquant_format(n: int, k: int, bits: int, group_size: int, seed: int = 0):
    """Like `random_format`, with parameters as the loader makes them from a K-quant (float32, per super-block of
    256 an fp16 d and dmin): groups of 32 (Q4_K, Q5_K) scale d * sc and bias -(dmin * m), sc and m 6-bit; groups of
    16 (Q6_K) scale d * sc and bias -32 * d * sc, sc int8."""
    rng = np.random.default_rng(seed)
    shape = (n, k // 256, 256 // group_size)
    d = (rng.random(shape[:2] + (1,)) * 0.01).astype(np.float16).astype(np.float32)
    if group_size == 16:
        scales = d * rng.integers(-128, 128, shape).astype(np.float32)
        biases = np.float32(-32) * scales
    else:
        dmin = (rng.random(shape[:2] + (1,)) * 0.01).astype(np.float16).astype(np.float32)
        scales = d * rng.integers(0, 64, shape).astype(np.float32)
        biases = -(dmin * rng.integers(0, 64, shape).astype(np.float32))
    codes = rng.integers(0, 2 ** bits, (n, k))
    s32, b32 = scales.reshape(n, -1), biases.reshape(n, -1)
    deq = np.repeat(s32, group_size, axis=1) * codes.astype(np.float32) + np.repeat(b32, group_size, axis=1)
    return (pack_codes(codes, bits), mx.array(s32), mx.array(b32)), deq


def _assert_within_fp32_bound(y: mx.array, x: np.ndarray, deq: np.ndarray) -> None:
    """test_native.py's bound: |y - x @ W.T| <= K * eps * (|x| @ |W|.T), against float64."""
    xd, wd = x.astype(np.float64), deq.astype(np.float64)
    err = np.abs(np.array(y, dtype=np.float64) - xd @ wd.T)
    bound = x.shape[-1] * EPS * (np.abs(xd) @ np.abs(wd).T) + 1e-30
    assert (err <= bound).all(), f"max error {err.max():.3g} where the bound is {bound[err > bound].min():.3g}"


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_the_reference_bit_for_bit(bits: int, group_size: int, dtype: mx.Dtype):
    (w, s, b), deq = random_format(48, 256, bits, group_size, dtype)
    ours = native.dequantize(w, s, b, group_size=group_size, bits=bits)
    assert ours.dtype == mx.float32 and np.array_equal(np.array(ours), deq)
    if group_size != 16:  # where MLX has the format, its own dequantize gives the same bits
        theirs = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits)
        assert mx.array_equal(ours, theirs).item()
    packed = native.pack_weights(w, s, b, group_size=group_size, bits=bits)
    assert all(mx.array_equal(u, v).item()
               for u, v in zip(native.unpack_weights(*packed, group_size=group_size, bits=bits), (w, s, b)))
    if native.packs_exact():
        assert mx.array_equal(native.dequantize(*packed, group_size=group_size, bits=bits, packed=True), ours).item()
    # The embedding lookup on packed weights computes in float32, whatever the parameters' dtype: the reference rows.
    ids = mx.array([[0, 47, 17], [16, 5, 5]])
    rows = native.packed_lookup(ids, *packed, group_size=group_size, bits=bits)
    assert rows.shape == (2, 3, 256) and rows.dtype == mx.float32
    assert np.array_equal(np.array(rows), deq[np.array(ids)])


@needs_native
@pytest.mark.parametrize("bits, group_size, dtype", FORMATS)
def test_quantized_matmul_within_the_fp32_bound(bits: int, group_size: int, dtype: mx.Dtype):
    (w, s, b), deq = random_format(80, 384, bits, group_size, dtype, seed=bits)
    for m in (1, 5, 17, 64):
        x = mx.random.normal((m, 384), key=mx.random.key(m))
        y = native.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits)
        assert y.shape == (m, 80) and y.dtype == mx.float32
        _assert_within_fp32_bound(y, np.array(x), deq)


@needs_native
@pytest.mark.parametrize("bits, group_size, dtype", FORMATS)
def test_dequantized_matmul_within_the_fp32_bound(bits: int, group_size: int, dtype: mx.Dtype):
    # The long-prompt path: BLAS on the weight dequantized a piece of rows at a time (304 rows of 1024: two pieces).
    (w, s, b), deq = random_format(304, 1024, bits, group_size, dtype, seed=bits)
    weights = [((w, s, b), {})]
    if native.packs_exact():
        weights.append((native.pack_weights(w, s, b, group_size=group_size, bits=bits), {"packed": True}))
    for m in (1, 50, 300):
        x = mx.random.normal((m, 1024), key=mx.random.key(m))
        for arrays, how in weights:
            y = native.dequantized_matmul(x, *arrays, group_size=group_size, bits=bits, **how)
            assert y.shape == (m, 304) and y.dtype == mx.float32
            _assert_within_fp32_bound(y, np.array(x), deq)
    x16 = mx.random.normal((2, 3, 1024)).astype(mx.float16)  # any leading shape; x's dtype back
    y16 = native.dequantized_matmul(x16, w, s, b, group_size=group_size, bits=bits)
    assert y16.shape == (2, 3, 304) and y16.dtype == mx.float16


@needs_native
def test_rows_are_independent_on_the_new_formats():
    # A verify pass's rows equal single steps (the fp32 kernel, and the packed one where it runs).
    for bits, group_size in ((6, 16), (5, 32)):
        (w, s, b), _ = random_format(64, 256, bits, group_size, mx.float32)
        weights = [((w, s, b), {})]
        if native.packs_exact():
            weights.append((native.pack_weights(w, s, b, group_size=group_size, bits=bits), {"packed": True}))
        x = mx.random.normal((7, 256), key=mx.random.key(2))
        for arrays, how in weights:
            together = np.array(native.quantized_matmul(x, *arrays, group_size=group_size, bits=bits, **how))
            for i in range(7):
                alone = native.quantized_matmul(x[i:i + 1], *arrays, group_size=group_size, bits=bits, **how)
                np.testing.assert_array_equal(together[i:i + 1], np.array(alone))


@needs_fixed24
@pytest.mark.parametrize("bits, group_size, dtype", FORMATS)
def test_packed_matmul_with_fixed24_x_within_the_fp32_bound(bits: int, group_size: int, dtype: mx.Dtype):
    (w, s, b), deq = random_format(48, 384, bits, group_size, dtype, seed=bits)
    packed = native.pack_weights(w, s, b, group_size=group_size, bits=bits)
    for m in (1, 5, 17, 64):
        key = mx.random.key(m)  # x over ~5 binades within a block, as test_native_packed.py draws it
        x = mx.random.normal((m, 384), key=key) * mx.exp(2 * mx.random.normal((m, 384), key=mx.random.split(key)[0]))
        y = native.quantized_matmul(x, *packed, group_size=group_size, bits=bits, packed=True)
        _assert_within_fp32_bound(y, np.array(x), deq)


@needs_native
@pytest.mark.parametrize("bits, group_size, dtype", FORMATS)
def test_packed_matmul_with_int8_x_is_the_weights_times_x_rounded(bits: int, group_size: int, dtype: mx.Dtype):
    (w, s, b), deq = random_format(48, 384, bits, group_size, dtype, seed=bits)
    packed = native.pack_weights(w, s, b, group_size=group_size, bits=bits)
    for m in (1, 5, 17, 64):
        x = mx.random.normal((m, 384), key=mx.random.key(m)) * 3
        y = native.quantized_matmul(x, *packed, group_size=group_size, bits=bits, packed=True, int8=True)
        _assert_within_fp32_bound(y, _rounded(np.array(x)), deq)


@needs_native
def test_the_avx2_kernels_too_where_wider_ones_run():
    """CPUs without AVX-512 or VNNI run the AVX2 fp32 and int8 kernels (chosen once per process): in a child."""
    if native.kernel_name() == "avx2" and native.int8_kernel_name() == "avx2":
        pytest.skip("this CPU runs the AVX2 kernels: the tests above check them")
    run_on_avx2("assert native.kernel_name() == native.int8_kernel_name() == 'avx2'",
                ["import tests.test_native_formats as t"]
                + [f"t.test_quantized_matmul_within_the_fp32_bound({b}, {g}, mx.{d})" for b, g, d in
                   (("6", "16", "float32"), ("5", "32", "float32"), ("4", "32", "float32"), ("8", "64", "bfloat16"))]
                + [f"t.test_packed_matmul_with_int8_x_is_the_weights_times_x_rounded({b}, {g}, mx.{d})" for b, g, d in
                   (("6", "16", "float32"), ("5", "32", "float16"), ("8", "32", "float16"))]
                + ["t.test_dequantized_matmul_within_the_fp32_bound(6, 16, mx.float32)",
                   "t.test_dequantize_equals_the_reference_bit_for_bit(6, 16, mx.float32)",
                   "t.test_dequantize_equals_the_reference_bit_for_bit(5, 64, mx.float16)",
                   "t.test_rows_are_independent_on_the_new_formats()"])


@needs_native
def test_bad_formats_say_what_is_wrong():
    (w, s, b), _ = random_format(16, 64, 6, 16, mx.float32)
    with pytest.raises(ValueError, match="group_size must be 16, 32, 64 or 128, got 8"):
        native.quantized_matmul(mx.zeros((1, 64)), w, s, b, group_size=8, bits=6)
    # 16 values of 6 bits are 3 words: MLX's layout allows it, the kernels' blocks of 32 do not.
    with pytest.raises(ValueError, match="multiple of 32 values"):
        native.dequantize(w[:, :3], s[:, :1], b[:, :1], group_size=16, bits=6)


def _quantized_linear(codes_format: tuple[int, int, mx.Dtype], linear: nn.Module, seed: int) -> nn.QuantizedLinear:
    """A QuantizedLinear of `linear`'s shape holding random codes and parameters in the format (bits, group size,
    dtype), as the loader builds one from a GGUF tensor (MLX's own quantize refuses groups of 16)."""
    bits, group_size, dtype = codes_format
    n, k = linear.weight.shape[0], linear.weight.shape[1] * 32 // linear.bits
    layer = nn.QuantizedLinear(k, n, bias=False, group_size=32, bits=bits)
    (layer.weight, layer.scales, layer.biases), _ = random_format(n, k, bits, group_size, dtype, seed)
    layer.group_size = group_size
    return layer


def test_the_native_path_takes_every_format():
    layer = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=6)
    assert native_linear.supports(layer)
    layer.group_size = 16
    assert native_linear.supports(layer)
    assert not native_linear.supports(nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=3))


@needs_native
def test_a_llama_mixing_formats_fused_equals_the_mlx_op_layers_and_fp32(monkeypatch: pytest.MonkeyPatch):
    # nn.quantize's 5/6/8-bit projections at groups of 32 and 64 (fp16 parameters), then a K-quant mix as a GGUF
    # gives it: Q6_K (6 bits, groups of 16, float32 parameters) on o_proj and down_proj, Q4_K and Q5_K (float32) on
    # others; the q/k/v and gate/up jobs mix formats.
    model = _tiny_quantized(llama, {"q_proj": {"group_size": 32, "bits": 5}, "k_proj": {"group_size": 64, "bits": 6},
                                    "v_proj": {"group_size": 32, "bits": 8}, "gate_proj": {"group_size": 64, "bits": 5},
                                    "up_proj": {"group_size": 32, "bits": 6}})
    for block in model.model.layers:  # nn.quantize gives float32 parameters to a float32 model; GGUFs have fp16
        for layer, dtype in ((block.self_attn.q_proj, mx.float16), (block.self_attn.v_proj, mx.float16),
                             (block.mlp.gate_proj, mx.bfloat16)):
            layer.scales, layer.biases = layer.scales.astype(dtype), layer.biases.astype(dtype)
    k_quants = {"o_proj": (6, 16, mx.float32), "down_proj": (6, 16, mx.float32), "up_proj": (4, 32, mx.float32),
                "k_proj": (5, 32, mx.float32)}
    pack = native.packs_exact()
    for i, block in enumerate(model.model.layers):
        for name, fmt in k_quants.items():
            parent = block.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else block.mlp
            if i == 1 and name == "k_proj":
                continue  # layer 1 keeps nn.quantize's 6-bit k_proj
            setattr(parent, name, NativeQuantizedLinear(_quantized_linear(fmt, getattr(parent, name), 10 * i), pack))
    for block in model.model.layers:  # Q6_K's down_proj (K = 256) in the compact form, as the loader keeps it
        down = block.mlp.down_proj
        (down.weight, scales, biases), _ = kquant_format(down.weight.shape[0], 256, 6, 16, seed=7)
        down.scales, down.biases = native.compact_params(scales, biases, group_size=16)
        if down.packed:
            down.weight, down.scales, down.biases = native.pack_weights(down.weight, down.scales, down.biases,
                                                                        group_size=16, bits=6)
    mx.eval(model.parameters())
    assert use_fused_layers(model) == 2 and isinstance(model.model.layers[0], FusedTransformerBlock)
    formats = {(p.bits, p.group_size, p["scales"].dtype) for _, p in model.named_modules()
               if isinstance(p, NativeQuantizedLinear)}
    assert formats == {(6, 16, mx.float32), (4, 32, mx.float32), (5, 32, mx.float32), (5, 32, mx.float16),
                       (8, 32, mx.float16), (5, 64, mx.bfloat16), (6, 64, mx.float32), (6, 16, mx.uint8)}

    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 64, 40)]
    caches = lambda: [KVCache() for _ in range(2)]  # noqa: E731
    want = _greedy(model, prompt, 12, caches, monkeypatch, fused=False, verify=5)
    got = _greedy(model, prompt, 12, caches, monkeypatch, fused=True, verify=5)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)

    # And the same model with every projection dequantized to an fp32 nn.Linear (MLX's own matmul, the blocks' own
    # calls): the quantized model's weights are those.
    for block in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(block.self_attn, name, _dequantized_linear(getattr(block.self_attn, name)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.mlp, name, _dequantized_linear(getattr(block.mlp, name)))
    reference = _greedy(model, prompt, 12, caches, monkeypatch, fused=False)
    assert reference[0] == got[0]
    for a, b in zip(got[1], reference[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def _dequantized_linear(layer: NativeQuantizedLinear) -> nn.Linear:
    w, s, b = native_linear.mlx_weights(layer)
    linear = nn.Linear(1, 1, bias=False)
    linear.weight = native.dequantize(w, s, b, group_size=layer.group_size, bits=layer.bits)
    return linear


# --- the K-quants' compact parameters (native.compact_params) -------------------------------------------------------

K_QUANTS = [(4, 32), (5, 32), (6, 16)]  # Q4_K, Q5_K, Q6_K


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.array(a).view(np.uint8),
                                                                       np.array(b).view(np.uint8))


@needs_native
@pytest.mark.parametrize("bits, group_size", K_QUANTS)
def test_compact_params_give_every_op_the_same_bits_at_the_files_size(bits: int, group_size: int):
    (w, s, b), deq = kquant_format(64, 512, bits, group_size, seed=bits)
    compact = native.compact_params(s, b, group_size=group_size)
    assert compact is not None and native.is_compact(compact[0]) and not native.is_compact(s)
    cs, cb = compact
    # Weights and parameters against the GGUF's bits a weight (Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625): <= 1.1x.
    file_bits = {4: 4.5, 5: 5.5, 6: 6.5625}[bits]
    assert (w.nbytes + cs.nbytes + cb.nbytes) * 8 / (64 * 512) <= 1.1 * file_bits
    assert all(_same_bits(x, y) for x, y in zip(native.expand_params(cs, cb, group_size=group_size), (s, b)))
    ours = native.dequantize(w, cs, cb, group_size=group_size, bits=bits)
    assert np.array_equal(np.array(ours), deq)
    x = mx.random.normal((17, 512), key=mx.random.key(bits))
    fmt = {"group_size": group_size, "bits": bits}
    assert _same_bits(native.quantized_matmul(x, w, cs, cb, **fmt), native.quantized_matmul(x, w, s, b, **fmt))
    packed_f32 = native.pack_weights(w, s, b, **fmt)
    packed = native.pack_weights(w, cs, cb, **fmt)
    assert all(_same_bits(x, y) for x, y in zip(native.unpack_weights(*packed, **fmt), (w, cs, cb)))
    assert all(_same_bits(x, y)
               for x, y in zip(native.expand_params(packed[1], packed[2], group_size=group_size, packed=True), (s, b)))
    ids = mx.array([[3, 63], [16, 0]])
    assert _same_bits(native.packed_lookup(ids, *packed, **fmt), native.packed_lookup(ids, *packed_f32, **fmt))
    kinds = [{"int8": True}] + ([{}] if native.packs_exact() else [])
    for how in kinds:
        assert _same_bits(native.quantized_matmul(x, *packed, packed=True, **fmt, **how),
                          native.quantized_matmul(x, *packed_f32, packed=True, **fmt, **how))
    if native.packs_exact():
        assert np.array_equal(np.array(native.dequantize(*packed, packed=True, **fmt)), deq)
        assert _same_bits(native.dequantized_matmul(x, *packed, packed=True, **fmt),
                          native.dequantized_matmul(x, *packed_f32, packed=True, **fmt))
    assert _same_bits(native.dequantized_matmul(x, w, cs, cb, **fmt), native.dequantized_matmul(x, w, s, b, **fmt))


@needs_native
def test_compact_params_are_refused_where_they_would_not_be_exact():
    (_, s, b), _ = kquant_format(16, 256, 4, 32)
    assert native.compact_params(s + 1e-3, b, group_size=32) is None  # not fp16 times an integer
    assert native.compact_params(s[:, :4], b[:, :4], group_size=32) is None  # K = 128: no super-block of 256
    assert native.compact_params(mx.repeat(s, 2, axis=1), mx.repeat(b, 2, axis=1), group_size=64) is None
    with pytest.raises(ValueError, match="float32"):
        native.compact_params(s.astype(mx.float16), b.astype(mx.float16), group_size=32)


@needs_native
def test_compact_params_on_the_avx2_kernels_too():
    if native.kernel_name() == "avx2" and native.int8_kernel_name() == "avx2":
        pytest.skip("this CPU runs the AVX2 kernels: the test above checks them")
    run_on_avx2("assert native.kernel_name() == 'avx2'",
                ["import tests.test_native_formats as t"]
                + [f"t.test_compact_params_give_every_op_the_same_bits_at_the_files_size({b}, {g})"
                   for b, g in K_QUANTS])


def symmetric_format(n: int, k: int, bits: int, seed: int = 0):
    """Like `random_format` for ggml's Q4_0, Q5_0 and Q8_0: groups of 32, fp16 scales d and biases -2^(bits - 1) d."""
    (w, s, _), _ = random_format(n, k, bits, 32, mx.float16, seed)
    b = s * mx.array(-(2.0 ** (bits - 1)), dtype=mx.float16)
    return (w, s, b), np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits))


@needs_native
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_symmetric_biases_give_every_op_the_same_bits_at_the_files_size(bits: int):
    (w, s, b), deq = symmetric_format(64, 512, bits, seed=bits)
    stand_in = native.symmetric_biases(s, b, bits=bits)
    assert stand_in is not None and native.is_symmetric(stand_in) and stand_in.nbytes == 0
    assert (w.nbytes + s.nbytes) * 8 / (64 * 512) == bits + 0.5  # the GGUF's bits a weight
    assert _same_bits(native.expand_symmetric(s, bits=bits), b)
    fmt = {"group_size": 32, "bits": bits}
    assert np.array_equal(np.array(native.dequantize(w, s, stand_in, **fmt)), deq)
    x = mx.random.normal((17, 512), key=mx.random.key(bits))
    for op in (native.quantized_matmul, native.dequantized_matmul):
        assert _same_bits(op(x, w, s, stand_in, **fmt), op(x, w, s, b, **fmt))
    packed_b = native.pack_weights(w, s, b, **fmt)
    packed = native.pack_weights(w, s, stand_in, **fmt)
    assert all(_same_bits(u, v) for u, v in zip(native.unpack_weights(*packed, **fmt), (w, s, stand_in)))
    ids = mx.array([[3, 63], [16, 0]])
    assert _same_bits(native.packed_lookup(ids, *packed, **fmt), native.packed_lookup(ids, *packed_b, **fmt))
    for how in [{"int8": True}] + ([{}] if native.packs_exact() else []):
        for rows in (x[:1], x):  # one row, and 17 (AMX's tiles where they run)
            assert _same_bits(native.quantized_matmul(rows, *packed, packed=True, **fmt, **how),
                              native.quantized_matmul(rows, *packed_b, packed=True, **fmt, **how))
    if native.packs_exact():
        assert np.array_equal(np.array(native.dequantize(*packed, packed=True, **fmt)), deq)
        assert _same_bits(native.dequantized_matmul(x, *packed, packed=True, **fmt),
                          native.dequantized_matmul(x, *packed_b, packed=True, **fmt))


@needs_native
def test_symmetric_biases_are_refused_where_they_would_not_be_exact():
    (w, s, b), _ = symmetric_format(16, 256, 4)
    assert native.symmetric_biases(s, b, bits=5) is None  # -16 d is not Q4_0's bias
    assert native.symmetric_biases(s, b + 1e-3, bits=4) is None
    assert native.symmetric_biases(s.astype(mx.float32), b.astype(mx.float32), bits=4) is None


@needs_native
@pytest.mark.parametrize("pack", [False, True])
def test_a_q4_0_layer_holds_no_biases_and_gives_them_back(pack: bool):
    if pack and not native.packs_exact():
        pytest.skip("the native path packs where fixed24 x runs (AVX512-VNNI)")
    (w, s, b), deq = symmetric_format(64, 256, 4)
    layer = nn.QuantizedEmbedding(64, 256, group_size=32, bits=4)
    layer.weight, layer.scales, layer.biases = w, s, b
    embedding = native_linear.NativeQuantizedEmbedding(layer, pack)
    assert native.is_symmetric(embedding["biases"]) and embedding.packed == pack
    ids = mx.array([[0, 63, 17], [5, 5, 40]])
    assert np.array_equal(np.array(embedding(ids)), deq[np.array(ids)])
    x = mx.random.normal((3, 256))
    _assert_within_fp32_bound(embedding.as_linear(x), np.array(x), deq)
    assert all(_same_bits(u, v) for u, v in zip(native_linear.mlx_weights(embedding), (w, s, b)))


@needs_native
def test_symmetric_biases_on_the_avx2_kernels_too():
    if native.kernel_name() == "avx2" and native.int8_kernel_name() == "avx2":
        pytest.skip("this CPU runs the AVX2 kernels: the tests above check them")
    run_on_avx2("assert native.kernel_name() == 'avx2'",
                ["import tests.test_native_formats as t"]
                + [f"t.test_symmetric_biases_give_every_op_the_same_bits_at_the_files_size({b})" for b in (4, 5, 8)]
                + ["t.test_a_q4_0_layer_holds_no_biases_and_gives_them_back(False)"])


@needs_native
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("compact", [False, True])
def test_a_q6_k_embedding_looks_up_the_files_rows(pack: bool, compact: bool):
    if pack and not native.packs_exact():
        pytest.skip("the native path packs where fixed24 x runs (AVX512-VNNI)")
    (w, s, b), deq = kquant_format(64, 256, 6, 16)
    layer = nn.QuantizedEmbedding(64, 256, group_size=32, bits=6)
    layer.weight, layer.group_size = w, 16
    layer.scales, layer.biases = native.compact_params(s, b, group_size=16) if compact else (s, b)
    embedding = native_linear.NativeQuantizedEmbedding(layer, pack)
    assert embedding.packed == pack
    ids = mx.array([[0, 63, 17], [5, 5, 40]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, 256) and np.array_equal(np.array(rows), deq[np.array(ids)])
    x = mx.random.normal((3, 256))
    _assert_within_fp32_bound(embedding.as_linear(x), np.array(x), deq)
    mlx = native_linear.mlx_weights(embedding)  # what code that reads MLX's layout gets: float32 parameters
    assert all(_same_bits(u, v) for u, v in zip(mlx, (w, s, b)))
