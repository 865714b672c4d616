"""GGUF architectures (core/model/gguf_archs.py): each test model (tests/arch_models.py) loads and generates, and its
logits equal llama.cpp's on the same F32 file at every position, teacher-forced, both in a whole-prompt pass and
one token at a time through the caches (rope, norms, soft-caps, sliding windows, rope_freqs)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxchat.core import Engine, ModelLoadError, SamplingProfile
from mlxchat.core.model import loader, native_decoder
from mlxchat.core.model.split import Stage
from tests.arch_models import ARCHS, GEMMA_TOKENS, WINDOW, write_model

pytest.importorskip("gguf", reason="gguf-py (PyPI gguf) writes the test models")

# 40 ids: longer than gemma's window (8), so local layers see only part of the prompt.
TOKENS = [1] + [300 + 7 * i for i in range(39)]
# Relative to the position's largest logit. float32 on both sides agrees to ~1e-6 (measured); the margin is for
# llama.cpp's GELU, below.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def f32_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("archs")
    return {arch: write_model(folder / f"{arch}.gguf", arch) for arch in ARCHS}


def _llama_cpp_logits(path: Path) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: no reference to compare")
    # F32 keys and values: llama.cpp's default F16 cache alone moves the logits by ~1e-3.
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=128, n_threads=2, type_k=0, type_v=0, verbose=False)
    llm.eval(TOKENS)
    logits = np.array(llm.scores[:len(TOKENS)], dtype=np.float32)
    llm.close()
    return logits


def _table_gelu(x: mx.array) -> mx.array:
    """ggml's CPU GELU (GGML_GELU_FP16): the fp16 result looked up by the fp16 input, exact past +-10. Gemma's MLP
    with MLX's exact GELU is off llama.cpp's by ~1e-3 for that reason alone (measured: 1.0e-3 gemma2, 2.0e-4
    gemma3), which would hide a real mapping error; with this, ~1e-6."""
    y = _GELU(x.astype(mx.float16).astype(mx.float32)).astype(mx.float16).astype(mx.float32)
    return mx.where(x <= -10, 0.0, mx.where(x >= 10, x, y))


_GELU = nn.gelu_approx


def _relative(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)


def _prefill(model: nn.Module) -> np.ndarray:
    return np.array(model(mx.array(TOKENS)[None], cache=make_prompt_cache(model))[0].astype(mx.float32))


def _stepwise(model: nn.Module) -> np.ndarray:
    """One token at a time through the model's own caches (sliding layers: a window-sized rotating cache)."""
    cache = make_prompt_cache(model)
    rows = [model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32) for t in TOKENS]
    return np.array(mx.stack(rows))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_llama_cpp(arch: str, f32_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    ref = _llama_cpp_logits(f32_files[arch])
    monkeypatch.setattr(nn, "gelu_approx", _table_gelu)  # mlx-lm's gemma MLPs look it up at each call
    model = loader.load(f32_files[arch], weights="dequantize").model
    for name, ours in (("prompt pass", _prefill(model)), ("token by token", _stepwise(model))):
        err = _relative(ours, ref)
        assert err.max() < TOLERANCE, f"{arch} {name}: worst position {err.argmax()} off by {err.max():.1e}"
        assert (ours.argmax(axis=1) == ref.argmax(axis=1)).all()


def test_gemma3_scales_embeddings_as_llama_cpp_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """At gemma-3-1b's width (1152) √hidden is 33.94, which mlx-lm rounds to bfloat16's 34.0 (4e-5 off llama.cpp
    here); at the other tests' width (64) the two agree, so this one is wide."""
    path = write_model(tmp_path / "wide.gguf", "gemma3", hidden=1152)
    ref = _llama_cpp_logits(path)
    monkeypatch.setattr(nn, "gelu_approx", _table_gelu)
    err = _relative(_prefill(loader.load(path, weights="dequantize").model), ref)
    assert err.max() < 1e-5, f"off by {err.max():.1e}"


def test_the_compared_features_matter(f32_files: dict[str, Path]):
    """The comparison above would catch a lost window or rope_freqs: without them the logits move far past it."""
    ref = _llama_cpp_logits(f32_files["gemma2"])
    model = loader.load(f32_files["gemma2"], weights="dequantize").model
    model.args.sliding_window = 10**6
    assert _relative(_prefill(model), ref)[WINDOW:].min() > 100 * TOLERANCE

    ref = _llama_cpp_logits(f32_files["llama3"])
    model = loader.load(f32_files["llama3"], weights="dequantize").model
    for layer in model.layers:
        layer.self_attn.rope = nn.RoPE(layer.self_attn.rope.dims, traditional=True, base=10000.0)
    assert _relative(_prefill(model), ref)[2:].min() > 100 * TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_loads_and_generates(arch: str, tmp_path: Path):
    with Engine.load(write_model(tmp_path / f"{arch}-f16.gguf", arch, f16=True)) as e:
        r = e.generate("Tell me a story", profile=SamplingProfile(temperature=0), max_tokens=12)
        assert r.metrics.completion_tokens >= 1 and r.finish_reason in ("stop", "length")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3"])
def test_default_policy_matches_fp32_and_fuses_only_llama_family_blocks(arch: str, tmp_path: Path):
    """Q8_0 layers on the default policy: on the native kernel (where built) the same logits as the F32 file of the
    Q8_0 values (token by token: through the fused layers where they run), and the fused decoder layer only on blocks
    it computes (llama's and qwen3's, q/k norms and all; Gemma's take their own call)."""
    default = loader.load(write_model(tmp_path / f"{arch}-q8.gguf", arch, q8=True))
    fused, layers = native_decoder.fused_layers(default.model)
    assert layers == len(default.model.layers)
    if arch in ("llama", "qwen3") and native_decoder.enabled() and default.quantized:
        assert fused == layers
    else:
        assert fused == 0
    if not default.quantized:
        pytest.skip(f"no native kernel here ({default.weights_path}): the default policy is the fp32 fallback")
    reference = loader.load(write_model(tmp_path / f"{arch}-ref.gguf", arch, q8_as_f32=True), weights="dequantize")
    err = _relative(_stepwise(default.model), _stepwise(reference.model))
    assert err.max() < TOLERANCE, f"{arch}: worst position {err.argmax()} off by {err.max():.1e}"


def test_gemma_turns_use_the_files_template_and_end_of_turn(f32_files: dict[str, Path]):
    tokenizer = loader.load(f32_files["gemma2"], weights="dequantize").tokenizer
    end_of_turn = next(i for i, t in GEMMA_TOKENS.items() if t == "<end_of_turn>")
    assert end_of_turn in tokenizer.eos_ids  # not the file's eos id (<eos>), yet it ends a reply
    prompt = tokenizer.render([{"role": "user", "content": "hi"}])
    assert prompt == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}])[0] == 3  # <start_of_turn>, one special id


def _one_line_error(path: Path, *parts: str) -> None:
    with pytest.raises(ModelLoadError) as e:
        loader.load(path, weights="dequantize")
    text = str(e.value)
    assert "\n" not in text and str(path) in text and all(p in text for p in parts), text


def test_bad_metadata_is_one_line(tmp_path: Path):
    _one_line_error(write_model(tmp_path / "q.gguf", "qwen3", drop=("qwen3.attention.key_length",)),
                    "qwen3.attention.key_length is missing")
    _one_line_error(write_model(tmp_path / "phi.gguf", "llama", file_arch="phi3"),
                    "architecture 'phi3' is not supported", "gemma2, gemma3, llama, mistral, qwen2, qwen3")
    _one_line_error(write_model(tmp_path / "g.gguf", "gemma2", drop=("gemma2.attention.head_count",)),
                    "gemma2.attention.head_count is missing")


def test_a_pipeline_stage_refuses_what_it_cannot_split(f32_files: dict[str, Path]):
    with pytest.raises(ModelLoadError) as e:
        loader.load(f32_files["gemma3"], weights="dequantize", stage=Stage(0, (1, 2)))
    assert "'gemma3' cannot be split across machines (supported: llama, mistral, qwen2)" in str(e.value)


def test_a_pipeline_stage_keeps_llama_3s_rope_freqs(f32_files: dict[str, Path]):
    from mlxchat.core.model.gguf_archs import FrequencyRoPE

    for rank in (0, 1):
        model = loader.load(f32_files["llama3"], weights="dequantize", stage=Stage(rank, (1, 1))).model
        assert [type(layer.self_attn.rope) for layer in model.layers] == [FrequencyRoPE]


def test_a_sliding_pattern_mlx_lm_cannot_run_is_one_line(tmp_path: Path):
    # llama.cpp's per-layer form: layers 0 and 1 local, 2 global is pattern 3; local, global, global repeats nothing.
    good = write_model(tmp_path / "good.gguf", "gemma3", sliding_pattern=[True, True, False])
    assert loader.load(good, weights="dequantize").model.args.sliding_window_pattern == 3
    _one_line_error(write_model(tmp_path / "bad.gguf", "gemma3", sliding_pattern=[True, False, False]),
                    "sliding_window_pattern", "not a repeating local/global pattern")
