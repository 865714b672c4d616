"""MLX folders as mlx-community publishes them (issue 35): 4-bit at group 64, 8-bit, and per-layer bits in
config.json's `quantization`, converted here by mlx-lm's own `convert`. On the CPU they run on the native kernel
where it takes the format, and give the same tokens as MLX's own quantized ops."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core import native
from mlxchat.core.model import loader, native_linear
from tests.model_files import hf_cache_with_tiny_model

PROMPT = [1, 504, 3058, 282, 253, 1345, 28, 198, 17, 30, 17]


def _convert(tmp_path: Path, **quantization: object) -> Path:
    from mlx_lm.convert import convert

    source = hf_cache_with_tiny_model(tmp_path / "hf")
    out = tmp_path / "mlx"
    convert(str(source), str(out), quantize=True, dtype="float32", **quantization)
    return out


def _greedy(model: loader.LoadedModel, steps: int = 16) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.model)
    logits = model.model(mx.array([PROMPT]), cache=cache)[0, -1]
    out = []
    for _ in range(steps):
        out.append(int(mx.argmax(logits).item()))
        logits = model.model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("quantization", [{"q_group_size": 64, "q_bits": 4}, {"q_group_size": 64, "q_bits": 8},
                                          {"q_group_size": 64, "quant_predicate": "mixed_4_6"}],
                         ids=["4bit-g64", "8bit-g64", "mixed_4_6"])
def test_an_mlx_folder_runs_native_with_mlx_s_tokens(tmp_path: Path, quantization: dict) -> None:
    if not native.available():
        pytest.skip(native.unavailable_reason())
    folder = _convert(tmp_path, **quantization)
    mine, theirs = loader.load(folder, weights="native"), loader.load(folder, weights="quantized")
    assert mine.weights_path.startswith("native") and theirs.weights_path == "MLX quantized"
    layers = [m for _, m in mine.model.named_modules() if isinstance(m, native_linear.NativeQuantizedLinear)]
    assert layers, "no layer runs on the native kernel"
    assert mine.quantization == theirs.quantization and mine.quantization.startswith("MLX ")
    assert _greedy(mine) == _greedy(theirs)
    a = np.array(mine.model(mx.array([PROMPT]))[0], np.float64)
    b = np.array(theirs.model(mx.array([PROMPT]))[0], np.float64)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_per_layer_bits_are_shown() -> None:
    config = {"quantization": {"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": {"group_size": 64,
                                                                                             "bits": 6},
                               "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 6}}}
    assert loader.folder_quantization(config) == "MLX 4-bit (group 64), 2 layers 6-bit"
    assert loader.folder_quantization({"torch_dtype": "bfloat16"}) == "bfloat16"
