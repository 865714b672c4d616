"""Attention's softmax and the MLP's SwiGLU on the native kernels (core/native, core/model/native_blocks.py): against
MLX's own ops and mx.fast.scaled_dot_product_attention, and on the embedded model against the unmodified one."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlxchat.core import Engine, native
from mlxchat.core.model import loader
from mlxchat.core.model.native_blocks import NativeAttention, NativeMLP, attention, use_native_blocks
from tests.markers import needs_native

pytestmark = needs_native


def _reference_softmax(x: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    s = x.astype(np.float64) * scale
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None] <= np.arange(S - L, S)[:, None], s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 9), (2, 3, 5, 13), (1, 9, 17, 300), (2, 1, 64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_matches_a_float64_reference(shape: tuple[int, ...], causal: bool):
    if causal and len(shape) < 2:
        shape = (1, *shape)
    x = np.random.default_rng(sum(shape)).normal(0, 4, shape).astype(np.float32)
    got = np.array(native.softmax(mx.array(x), scale=0.37, causal=causal))
    ref = _reference_softmax(x, 0.37, causal)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7)
    if causal:
        assert (got[..., np.arange(shape[-1])[None] > np.arange(shape[-1] - shape[-2], shape[-1])[:, None]] == 0).all()


def test_softmax_reads_strided_input_and_underflows_to_zero():
    x = mx.random.normal((6, 40), key=mx.random.key(1))
    np.testing.assert_allclose(np.array(native.softmax(x.T)), _reference_softmax(np.array(x.T), 1.0, False),
                               rtol=2e-6, atol=1e-7)
    out = native.softmax(mx.array([[0.0, -200.0, -1e30, 88.0]]))
    assert out.tolist() == [[0.0, 0.0, 0.0, 1.0]]  # exp(-88) and below are 0, not a denormal


def test_swiglu_matches_silu_times_up():
    gate = mx.random.normal((3, 1541), key=mx.random.key(2)) * 8
    up = mx.random.normal((3, 1541), key=mx.random.key(3))
    np.testing.assert_allclose(np.array(native.swiglu(gate, up)), np.array(nn.silu(gate) * up), rtol=3e-6, atol=1e-7)
    big = mx.array([-1000.0, -90.0, 0.0, 90.0, 1000.0])
    assert native.swiglu(big, mx.ones_like(big)).tolist() == pytest.approx([0.0, 0.0, 0.0, 90.0, 1000.0], abs=1e-30)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="float32"):
        native.softmax(mx.zeros((2, 2), dtype=mx.float16))
    with pytest.raises(ValueError, match="at least as many keys"):
        native.softmax(mx.zeros((4, 3)), causal=True)
    with pytest.raises(ValueError, match="same shape"):
        native.swiglu(mx.zeros((2, 3)), mx.zeros((3, 2)))


@pytest.mark.parametrize(("heads", "kv_heads", "L", "S"), [(9, 3, 1, 1), (9, 3, 1, 70), (9, 3, 37, 37),
                                                          (9, 3, 16, 300), (4, 4, 5, 12), (8, 2, 64, 64),
                                                          # causal prompts in pieces of queries (the last one short)
                                                          (4, 2, 300, 300), (4, 2, 140, 400)])
def test_attention_matches_mlx_fast_sdpa(heads: int, kv_heads: int, L: int, S: int):
    keys = mx.random.split(mx.random.key(heads * L + S), 3)
    q = mx.random.normal((2, heads, L, 64), key=keys[0])
    k = mx.random.normal((2, kv_heads, S, 64), key=keys[1])
    v = mx.random.normal((2, kv_heads, S, 64), key=keys[2])
    for causal in (False, True):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal" if causal else None)
        got = attention(q, k, v, 0.125, causal)
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("L", [1, 2, 8])
def test_whole_attention_reads_a_kv_cache_slice_in_place(L: int):
    """The decode-step op on keys/values that are the first S positions of a larger cache buffer (rows contiguous
    along D, strided along S and heads), grouped heads, batch 2, a head size that is not a multiple of 16."""
    keys = mx.random.split(mx.random.key(L), 3)
    buffer_k = mx.random.normal((2, 3, 256, 72), key=keys[0])
    buffer_v = mx.random.normal((2, 3, 256, 72), key=keys[1])
    q = mx.random.normal((2, 9, L, 72), key=keys[2])
    k, v = buffer_k[..., :100, :], buffer_v[..., :100, :]
    for causal in (False, True):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.11, mask="causal" if causal else None)
        got = native.attention(q, k, v, scale=0.11, causal=causal)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="multiple of k's heads"):
        native.attention(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 3, 5, 8)), mx.zeros((1, 3, 5, 8)), scale=1.0)


def _tiny_llama() -> llama.Model:
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_re_classed_model_keeps_its_parameters_and_outputs():
    plain, fast = _tiny_llama(), _tiny_llama()
    assert use_native_blocks(fast) == 4  # 2 attention + 2 MLP modules
    attn = fast.model.layers[0].self_attn
    assert isinstance(attn, NativeAttention) and isinstance(attn, llama.Attention)
    assert isinstance(fast.model.layers[0].mlp, NativeMLP)
    assert use_native_blocks(fast) == 0  # already native: nothing to do
    assert sorted(k for k, _ in nn.utils.tree_flatten(fast.parameters())) == \
        sorted(k for k, _ in nn.utils.tree_flatten(plain.parameters()))
    ids = mx.array([[1, 5, 9, 2, 7, 3, 11, 4]])
    np.testing.assert_allclose(np.array(fast(ids)), np.array(plain(ids)), rtol=1e-4, atol=1e-5)
    # With caches: a prompt then one step (mask "causal", then none), and a rotating window's array mask, which
    # takes mlx-lm's own attention.
    for make in (lambda: KVCache(), lambda: RotatingKVCache(max_size=4, keep=1)):
        caches = [[make() for _ in range(2)] for _ in range(2)]
        for model, cache in zip((plain, fast), caches):
            model(ids, cache=cache)
        step = mx.array([[6]])
        np.testing.assert_allclose(np.array(fast(step, cache=caches[1])), np.array(plain(step, cache=caches[0])),
                                   rtol=1e-4, atol=1e-5)


def test_the_loader_runs_the_embedded_model_on_native_blocks(engine: Engine):
    model = engine.model.model
    fused = sum(isinstance(m, (NativeAttention, NativeMLP)) for _, m in model.named_modules())
    assert fused == 2 * engine.model.num_layers


def test_embedded_model_logits_match_mlx_lm_attention(engine: Engine):
    """The loaded model against the same weights with mlx-lm's own attention and MLP calls (the classes the native
    ones derive from: (mixin, mlx-lm class))."""
    plain = loader.load().model
    for _, m in plain.named_modules():
        if isinstance(m, (NativeAttention, NativeMLP)):
            m.__class__ = type(m).__bases__[1]
    ids = mx.array([list(range(100, 180))])
    a, b = engine.run(lambda: (np.array(engine.model.model(ids)), np.array(plain(ids))))
    assert (a.argmax(-1) == b.argmax(-1)).all()
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
