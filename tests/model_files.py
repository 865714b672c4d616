"""Small model files built by the tests: GGUFs with chosen tensor types and a Hugging Face cache folder.

They reuse the embedded model's real vocabulary, so the tokenizer path is the real one, with tiny
random weights so they load in a fraction of a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlxchat.core.model import gguf
from mlxchat.core.model.loader import embedded_model_path

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def embedded_metadata() -> dict:
    return gguf.read_header(embedded_model_path()).metadata


def _mx_metadata(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        if isinstance(v, bool):
            out[k] = mx.array(v)
        elif isinstance(v, int):
            out[k] = mx.array(v, dtype=mx.uint32)
        elif isinstance(v, float):
            out[k] = mx.array(v, dtype=mx.float32)
        elif isinstance(v, str) or (isinstance(v, list) and v and isinstance(v[0], str)):
            out[k] = v
        elif isinstance(v, list):
            out[k] = mx.array(v, dtype=mx.int32)
    return out


def tiny_llama_gguf(path: Path, *, dtype: mx.Dtype = mx.float16, architecture: str = "llama",
                    renamed: dict[int, str] | None = None) -> Path:
    """A 2-layer llama GGUF in F16 or F32 with the embedded model's tokenizer (with `renamed` tokens replaced: another
    vocabulary of the same size)."""
    src = embedded_metadata()
    vocab = len(src["tokenizer.ggml.tokens"])
    meta = {k: v for k, v in src.items() if k.startswith(("tokenizer.", "general.name"))}
    if renamed:
        meta["tokenizer.ggml.tokens"] = [renamed.get(i, t) for i, t in enumerate(src["tokenizer.ggml.tokens"])]
    a = architecture
    meta.update({"general.architecture": a, f"{a}.block_count": LAYERS, f"{a}.embedding_length": HIDDEN,
                 f"{a}.feed_forward_length": FFN, f"{a}.attention.head_count": HEADS,
                 f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.context_length": 256,
                 f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.freq_base": 10000.0,
                 f"{a}.vocab_size": vocab})
    key = mx.random.key(0)
    head_dim = HIDDEN // HEADS

    def rnd(*shape: int) -> mx.array:
        nonlocal key
        key, k = mx.random.split(key)
        return (mx.random.normal(shape, key=k) * 0.05).astype(dtype)

    w = {"token_embd.weight": rnd(vocab, HIDDEN), "output_norm.weight": mx.ones((HIDDEN,), dtype=mx.float32)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        w |= {b + "attn_q.weight": rnd(HIDDEN, HIDDEN), b + "attn_k.weight": rnd(KV_HEADS * head_dim, HIDDEN),
              b + "attn_v.weight": rnd(KV_HEADS * head_dim, HIDDEN), b + "attn_output.weight": rnd(HIDDEN, HIDDEN),
              b + "ffn_gate.weight": rnd(FFN, HIDDEN), b + "ffn_up.weight": rnd(FFN, HIDDEN),
              b + "ffn_down.weight": rnd(HIDDEN, FFN), b + "attn_norm.weight": mx.ones((HIDDEN,), dtype=mx.float32),
              b + "ffn_norm.weight": mx.ones((HIDDEN,), dtype=mx.float32)}
        if architecture == "qwen2":  # qwen2's q, k and v projections have biases
            w |= {b + "attn_q.bias": rnd(HIDDEN), b + "attn_k.bias": rnd(KV_HEADS * head_dim),
                  b + "attn_v.bias": rnd(KV_HEADS * head_dim)}
    mx.save_gguf(str(path), w, _mx_metadata(meta))
    return path


def hf_cache_with_tiny_model(cache_dir: Path, repo_id: str = "mlxchat-test/tiny-llama") -> Path:
    """A Hugging Face hub cache (models--org--name/snapshots/<rev>/, refs/main) holding a tiny MLX llama."""
    from mlxchat.core.model.tokenizer import from_gguf_metadata

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    tok = from_gguf_metadata(embedded_metadata())
    tok.hf.save_pretrained(snap)
    vocab = tok.vocab_size
    config = {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
              "vocab_size": vocab, "max_position_embeddings": 256, "tie_word_embeddings": True,
              "eos_token_id": 2}
    (snap / "config.json").write_text(json.dumps(config))
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(snap / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return snap
