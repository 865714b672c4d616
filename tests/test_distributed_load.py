"""A rank of a split model loads only its part (issue 16): a pipeline stage's layers from a GGUF (the project's
reader, tensor by tensor, equal to `mx.load`'s arrays) or an MLX/HF folder (lazily, as mlx-lm's `sharded_load`),
the embeddings only on the first stage, the norm and the head only on rank 0."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxchat.core.model import gguf, loader
from mlxchat.core.model.split import Stage
from mlxchat.core.model.gguf_tensors import read_tensors
from tests.model_files import hf_cache_with_tiny_model, tiny_llama_gguf

def test_every_embedded_gguf_tensor_equals_mx_load() -> None:
    path = loader.embedded_model_path()
    header = gguf.read_header(path)
    mine, theirs = read_tensors(header, [t.name for t in header.tensors]).arrays, mx.load(str(path))  # Q4_1, Q8_0, F32
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype and mine[name].shape == value.shape, name
        assert mx.array_equal(mine[name], value).item(), name


def test_f16_gguf_tensors_equal_mx_load(tmp_path: Path) -> None:
    path = tiny_llama_gguf(tmp_path / "tiny.gguf", dtype=mx.float16)
    header = gguf.read_header(path)
    mine, theirs = read_tensors(header, [t.name for t in header.tensors]).arrays, mx.load(str(path))
    assert all(mx.array_equal(mine[k], v).item() and mine[k].dtype == v.dtype for k, v in theirs.items())


def _names(loaded: loader.LoadedModel) -> set[str]:
    return {k for k, _ in tree_flatten(loaded.model.parameters())}


@pytest.mark.parametrize("kind", ["llama-gguf", "qwen2-gguf", "llama-folder"])
def test_each_stage_holds_only_its_part(tmp_path: Path, kind: str) -> None:
    arch, form = kind.split("-")
    spec = tiny_llama_gguf(tmp_path / "tiny.gguf", architecture=arch) if form == "gguf" else \
        hf_cache_with_tiny_model(tmp_path)
    first = loader.load(spec, stage=Stage(1, (1, 1)))  # layer 0 and the embeddings
    last = loader.load(spec, stage=Stage(0, (1, 1)))  # layer 1, the norm and the (tied) head
    whole = loader.load(spec)
    assert {n.split(".")[2] for n in _names(first) if ".layers." in n} == {"0"}
    assert {n.split(".")[2] for n in _names(last) if ".layers." in n} == {"1"}
    assert any(n.startswith("model.embed_tokens.") for n in _names(first))
    assert not any(n.startswith("model.norm.") for n in _names(first))
    assert any(n.startswith("model.norm.") for n in _names(last)) and len(first.model.layers) == 1
    assert first.weight_bytes < whole.weight_bytes and last.weight_bytes < whole.weight_bytes


def test_a_model_type_without_stages_is_refused(tmp_path: Path) -> None:
    import json

    snap = hf_cache_with_tiny_model(tmp_path)
    config = json.loads((snap / "config.json").read_text())
    (snap / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(loader.ModelLoadError, match="'gpt2' cannot be split across machines"):
        loader.load(snap, stage=Stage(1, (1, 1)))
