"""Small GGUF models whose tensors are llama.cpp's quantized blocks, written here (never downloaded).

Any bytes make valid Q4_K/Q5_K/Q6_K/Q5_0/... blocks once their float16 fields hold finite numbers, so a model of
random blocks exercises every code and scale a real file can hold. `reference_f32` writes the same model with each
tensor dequantized by gguf-py (llama.cpp's reference dequantizer): what the quantized file must compute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mlxchat.core.model import gguf
from mlxchat.core.model.gguf_writer import write_gguf
from tests.model_files import embedded_metadata

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 256, 2, 4, 2, 512

# Each type's float16 fields (byte offsets in a block) and a size for them that gives weights of ~0.05.
_F16_FIELDS = {"Q4_0": ([0], 0.01), "Q4_1": ([0, 2], 0.004), "Q5_0": ([0], 0.004), "Q5_1": ([0, 2], 0.002),
               "Q8_0": ([0], 5e-4), "Q4_K": ([0, 2], 2e-4), "Q5_K": ([0, 2], 1e-4), "Q6_K": ([208], 3e-5)}
# A mix as llama.cpp's K-quant files have them: every supported type in one model, a Q6_K tied embedding.
MIXED = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
         "ffn_gate": "Q5_1", "ffn_up": "Q4_K", "ffn_down": "Q4_0"}


def random_blocks(type_name: str, values: int, rng: np.random.Generator) -> bytes:
    """`values` weights of ggml type `type_name` as random valid blocks."""
    _, block, block_bytes = next(v for v in gguf.GGML_TYPES.values() if v[0] == type_name)
    blocks = rng.integers(0, 256, size=(values // block, block_bytes), dtype=np.uint8)
    fields, size = _F16_FIELDS[type_name]
    for at in fields:
        # Never 0 in f16: a real quantizer writes d = 0 only for an all-zero block, whose scales are then all 0.
        d = ((0.5 + np.abs(rng.standard_normal(len(blocks)))) * size).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


def _shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    head = HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * head, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FFN), f"blk.{i}.attn_norm.weight": (HIDDEN,),
                   f"blk.{i}.ffn_norm.weight": (HIDDEN,)}
    return shapes


def _metadata(file_type: int) -> dict:
    src = embedded_metadata()
    meta = {k: v for k, v in src.items() if k.startswith(("tokenizer.", "general.name"))}
    meta.update({"general.architecture": "llama", "general.file_type": file_type, "llama.block_count": LAYERS,
                 "llama.embedding_length": HIDDEN, "llama.feed_forward_length": FFN,
                 "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
                 "llama.context_length": 512, "llama.attention.layer_norm_rms_epsilon": 1e-5,
                 "llama.rope.freq_base": 10000.0, "llama.vocab_size": len(src["tokenizer.ggml.tokens"])})
    return meta


def quantized_llama(path: Path, types: dict[str, str], seed: int = 0, file_type: int = 15) -> Path:
    """A 2-layer llama (hidden 256: rows K-quants can hold) with the embedded model's tokenizer, each weight of the
    type `types` gives for its kind ("attn_q", "token_embd", ...; F32 where absent), norms F32."""
    rng = np.random.default_rng(seed)
    tensors = []
    for name, shape in _shapes(len(embedded_metadata()["tokenizer.ggml.tokens"])).items():
        kind = name.split(".")[-2]
        if len(shape) == 1:
            tensors.append((name, "F32", shape, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32).tobytes()))
        elif kind in types:
            tensors.append((name, types[kind], shape, random_blocks(types[kind], int(np.prod(shape)), rng)))
        else:
            tensors.append((name, "F32", shape, (0.05 * rng.standard_normal(shape)).astype(np.float32).tobytes()))
    return write_gguf(path, _metadata(file_type), tensors)


def reference_f32(quantized: Path, path: Path) -> Path:
    """The same model with every tensor dequantized by gguf-py: llama.cpp's reference for `quantized`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    header = gguf.read_header(quantized)
    tensors = []
    with open(quantized, "rb") as f:
        for t in header.tensors:
            f.seek(header.data_start + t.offset)
            raw = np.frombuffer(f.read(t.nbytes), dtype=np.uint8)
            values = dequantize(raw, GGMLQuantizationType[t.type_name]).astype(np.float32)
            tensors.append((t.name, "F32", t.shape, values.tobytes()))
    return write_gguf(path, header.metadata | {"general.file_type": 0}, tensors)
