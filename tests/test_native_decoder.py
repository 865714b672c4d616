"""Whole llama decoder layers as one native op (core/model/native_decoder.py): the fused path against the same model
with MLXCHAT_NATIVE_LAYERS=0 (today's path: the layer in MLX ops over the native matmul/attention/SwiGLU), on tiny
quantized llamas, a qwen2 and a qwen3, and on the embedded model."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxchat.core import Engine, native
from mlxchat.core.model import native_linear
from mlxchat.core.model.native_decoder import FusedTransformerBlock, use_fused_layers
from tests.markers import needs_native

pytestmark = needs_native


def _step_ops(model: nn.Module, ids: mx.array, cache: list, path: str) -> tuple[int, int]:
    """(graph nodes, fused-layer nodes) of one lazy forward pass (the cache is left untouched by building it)."""
    mx.eval([c.state for c in cache])
    offsets = [(c.offset, c.keys, c.values) for c in cache]
    mx.export_to_dot(path, model(ids, cache=cache))
    for c, (offset, keys, values) in zip(cache, offsets):
        c.offset, c.keys, c.values = offset, keys, values
    dot = open(path).read()
    return dot.count("label"), dot.count("MlxchatDecoderLayer")


def _greedy(model: nn.Module, prompt: list[int], steps: int, make_cache, monkeypatch, fused: bool,
            verify: int = 0) -> tuple[list[int], list[np.ndarray], list]:
    """Greedy tokens and logits: the prompt, `steps` one-token steps, then (optionally) one pass of `verify` rows
    as speculative verification feeds them."""
    monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1" if fused else "0")
    cache = make_cache()
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    tokens, rows = [], []
    for _ in range(steps):
        token = int(mx.argmax(logits, -1).item())
        tokens.append(token)
        rows.append(np.array(logits))
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    if verify:
        rows.append(np.array(model(mx.array([tokens[:verify]]), cache=cache)))
    return tokens, rows, cache


def _tiny_quantized(arch, formats: dict[str, dict[str, int]] | None = None, **rope) -> nn.Module:
    """A 2-layer model quantized to 4 bits in groups of 32, but `formats` for the projections it names."""
    args = arch.ModelArgs(model_type=arch.__name__.rsplit(".", 1)[-1], hidden_size=128, num_hidden_layers=2,
                          intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                          vocab_size=64, **rope)
    mx.random.seed(1)
    model = arch.Model(args)
    # qwen3's q/k norms: weights of their own (not RMSNorm's ones), so that one applied as the other would show.
    for name, norm in model.named_modules():
        if name.endswith(("q_norm", "k_norm")):
            norm.weight = 1.0 + 0.5 * mx.random.normal(norm.weight.shape)
    formats = formats or {}
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: hasattr(m, "to_quantized") and (
        formats.get(path.rsplit(".", 1)[-1], True)))
    native_linear.use_native(model)
    mx.eval(model.parameters())
    return model


# qwen2: q/k/v biases; qwen3: per-head q/k RMSNorms and a head size (64) other than hidden/heads. The formats: a GGUF
# may give v_proj more bits than q and k, or a projection other groups; the layer's q/k/v and gate/up jobs then mix
# formats, each with x prepared its own way.
@pytest.mark.parametrize("arch, rope, formats", [
    (llama, {}, None), (llama, {"rope_traditional": True, "rope_theta": 500.0}, None),
    (qwen2, {"rope_theta": 1e6}, None),
    (qwen3, {"rope_theta": 1e6, "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": False}, None),
    (llama, {}, {"v_proj": {"group_size": 32, "bits": 8}, "up_proj": {"group_size": 64, "bits": 4}})])
def test_tiny_models_fused_equal_todays_path(arch, rope: dict, formats: dict | None, monkeypatch, tmp_path):
    model = _tiny_quantized(arch, formats, **rope)
    assert use_fused_layers(model) == 2 and isinstance(model.model.layers[0], FusedTransformerBlock)
    # 300 positions: the caches grow past their first 256-step buffer inside the fused path.
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, 64, 250)]
    caches = lambda: [KVCache() for _ in range(2)]  # noqa: E731
    want = _greedy(model, prompt, 50, caches, monkeypatch, fused=False, verify=5)
    got = _greedy(model, prompt, 50, caches, monkeypatch, fused=True, verify=5)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    for a, b in zip(got[2], want[2]):
        assert a.offset == b.offset == 305
        np.testing.assert_allclose(np.array(a.state[0]), np.array(b.state[0]), rtol=0, atol=1e-4)
        np.testing.assert_allclose(np.array(a.state[1]), np.array(b.state[1]), rtol=0, atol=1e-4)
    # A rotating window's cache is not the plain one: the block's own call runs, with the same result.
    rotating = lambda: [RotatingKVCache(max_size=64, keep=4) for _ in range(2)]  # noqa: E731
    assert _greedy(model, prompt[:80], 4, rotating, monkeypatch, fused=True)[0] == \
        _greedy(model, prompt[:80], 4, rotating, monkeypatch, fused=False)[0]
    # Nor are a quantized cache (keys are tuples) and no cache at all (a whole pass, as the tracer makes).
    quantized = lambda: [QuantizedKVCache(group_size=32, bits=8) for _ in range(2)]  # noqa: E731
    assert _greedy(model, prompt[:40], 4, quantized, monkeypatch, fused=True)[0] == \
        _greedy(model, prompt[:40], 4, quantized, monkeypatch, fused=False)[0]
    monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1")
    np.testing.assert_array_equal(np.array(model(mx.array([[5]]))), np.array(model(mx.array([[5]]))))
    # The fused op writes a cache buffer in place only when nothing else holds it: a kept reference sees no change
    # (MLX's own SliceUpdate, today's path, wrote into it here), and the step's result is the same.
    step = {}
    for fused in (False, True):
        monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1" if fused else "0")
        cache = caches()
        mx.eval(model(mx.array([prompt[:20]]), cache=cache))
        held, before = cache[0].keys, np.array(cache[0].keys)
        step[fused] = np.array(model(mx.array([[5]]), cache=cache))
    np.testing.assert_array_equal(np.array(held), before)
    np.testing.assert_allclose(step[True], step[False], rtol=0, atol=1e-4)
    # One op per layer on a decode step, not the ~110 MLX nodes of today's path (the rest: embedding, norm, head).
    monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1")
    cache = caches()
    model(mx.array([prompt[:8]]), cache=cache)
    nodes, fused = _step_ops(model, mx.array([[3]]), cache, str(tmp_path / "step.dot"))
    assert fused == 2 and nodes < 100


def test_tiny_qwen3_batch_rows_fused_equal_todays_path(monkeypatch):
    # The server's batched step on qwen3's blocks: one row of each of three left-padded sequences in a BatchKVCache.
    model = _tiny_quantized(qwen3, rope_theta=1e6, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)
    assert use_fused_layers(model) == 2
    rng = np.random.default_rng(1)
    prompts = [[int(i) for i in rng.integers(0, 64, n)] for n in (30, 7, 19)]
    padding = [30 - len(p) for p in prompts]

    def batch(fused: bool) -> tuple[list[list[int]], list[np.ndarray]]:
        monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1" if fused else "0")
        cache = [BatchKVCache(padding) for _ in model.layers]
        logits = model(mx.array([[0] * pad + p for pad, p in zip(padding, prompts)]), cache=cache)[:, -1]
        tokens, rows = [], []
        for _ in range(16):
            token = logits.argmax(-1)
            tokens.append(token.tolist())
            rows.append(np.array(logits))
            logits = model(token[:, None], cache=cache)[:, -1]
        return tokens, rows

    calls = []
    op = native.decoder_layer
    monkeypatch.setattr(native, "decoder_layer", lambda *a, **k: calls.append(a[0].shape) or op(*a, **k))
    (want, want_rows), (got, got_rows) = batch(fused=False), batch(fused=True)
    assert calls == [(3, 1, 128)] * 2 * 16  # every decode step's layers fused (the prompt pass: MLX ops)
    assert got == want
    for a, b in zip(got_rows, want_rows):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_a_prompts_chunk_is_one_op_a_layer_where_the_projections_are_packed(monkeypatch, tmp_path):
    """Up to 256 rows of a prompt where the projections are packed (they stay on the kernel that long), else 16: on
    the MLX-op path a layer is ~110 graph nodes, ~30 ms of a short prompt's TTFT on the embedded model."""
    monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1")
    model = _tiny_quantized(llama)
    use_fused_layers(model)
    packed = all(m.packed for _, m in model.named_modules() if isinstance(m, native_linear.NativeQuantizedLinear))
    prompt = mx.array([[int(i) for i in np.random.default_rng(1).integers(0, 64, 300)]])
    for rows, fused in ((40, 2 if packed else 0), (256, 2 if packed else 0), (257, 0), (16, 2)):
        cache = [KVCache() for _ in range(2)]
        assert _step_ops(model, prompt[:, :rows], cache, str(tmp_path / f"{rows}.dot"))[1] == fused, rows


def test_fp32_layers_are_not_fused():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    assert use_fused_layers(llama.Model(args)) == 0


def test_embedded_model_greedy_tokens_equal_todays_path(engine: Engine, monkeypatch, tmp_path):
    model = engine.model.model
    assert engine.describe().endswith(f"decode: {len(model.layers)}/{len(model.layers)} layers fused")
    prompt = engine.model.tokenizer.encode_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    caches = lambda: [KVCache() for _ in model.layers]  # noqa: E731

    def both():
        want = _greedy(model, prompt, 24, caches, monkeypatch, fused=False, verify=6)
        got = _greedy(model, prompt, 24, caches, monkeypatch, fused=True, verify=6)
        cache = caches()
        model(mx.array([prompt]), cache=cache)
        return want, got, _step_ops(model, mx.array([[got[0][0]]]), cache, str(tmp_path / "step.dot"))

    def threads(n: int) -> np.ndarray:
        """One verify pass's output with `n` kernel threads: the rows a thread takes must not change a value."""
        native.set_threads(n)
        cache = caches()
        mx.eval(model(mx.array([prompt]), cache=cache))
        return np.array(model(mx.array([prompt[:6]]), cache=cache))

    want, got, (nodes, fused) = engine.run(both)
    before = engine.run(native.threads)
    try:
        one, two = engine.run(lambda: threads(1)), engine.run(lambda: threads(2))
    finally:
        engine.run(lambda: native.set_threads(before))
    np.testing.assert_array_equal(one, two)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
    assert fused == len(model.layers) and nodes < 150  # today's path: ~3300


def test_embedded_model_batch_rows_fused_equal_each_alone(engine: Engine, monkeypatch, tmp_path):
    # The server's batched step: one row of each sequence in a left-padded BatchKVCache. Each row's greedy tokens equal
    # its sequence decoded alone, fused or not, and the step is one op per layer.
    model, tok = engine.model.model, engine.model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": text}])
               for text in ("Name three colours of the rainbow.", "Hi", "Write a haiku about the sea, please.")]
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]

    def batch(fused: bool) -> tuple[list[list[int]], tuple[int, int]]:
        monkeypatch.setenv("MLXCHAT_NATIVE_LAYERS", "1" if fused else "0")
        cache = [BatchKVCache(padding) for _ in model.layers]
        ids = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
        tokens = model(ids, cache=cache)[:, -1].argmax(-1)
        out = [tokens.tolist()]
        for _ in range(9):
            tokens = model(tokens[:, None], cache=cache)[:, -1].argmax(-1)
            out.append(tokens.tolist())
        mx.eval([c.state for c in cache])
        saved = [c.state for c in cache]
        mx.export_to_dot(str(tmp_path / "batch.dot"), model(tokens[:, None], cache=cache))
        for c, state in zip(cache, saved):
            c.state = state
        dot = open(tmp_path / "batch.dot").read()
        return [list(row) for row in zip(*out)], (dot.count("label"), dot.count("MlxchatDecoderLayer"))

    def run() -> tuple:
        alone = [_greedy(model, p, 10, lambda: [KVCache() for _ in model.layers], monkeypatch, fused=True)[0]
                 for p in prompts]
        return alone, batch(fused=True), batch(fused=False)

    alone, (fused, (nodes, ops)), (unfused, _) = engine.run(run)
    assert fused == alone == unfused
    assert ops == len(model.layers) and nodes < 200


def test_kernel_threads_default_to_every_core_up_to_four():
    # One thread was the default while Python built ~3,300 graph nodes a step on the other core; with the fused
    # layer the second core decodes (bench/README.md).
    env = {k: v for k, v in os.environ.items() if k != "MLXCHAT_NATIVE_THREADS"}
    out = subprocess.run([sys.executable, "-c", "from mlxchat.core import native; print(native.threads())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert int(out) == min(os.cpu_count() or 1, 4)
