"""Read chosen tensors of a GGUF file, without touching the others: a rank of a split model reads its own layers.

`mx.load` reads every tensor of a GGUF file into memory. A rank that runs layers 15-29 of a model must not pay for
the other half, so this module reads the bytes of the named tensors only (one seek and read each) and converts them
as MLX's own GGUF loader does (mlx/io/gguf_quants.cpp): float tensors as they are, and Q4_0, Q4_1 and Q8_0 blocks
as MLX's affine quantization (`NAME.weight` packed uint32, `NAME.scales` and `NAME.biases` in float16), so the
arrays equal what `mx.load` gives (tests/test_distributed_load.py checks it).
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np

from .errors import ModelLoadError
from .gguf import GGUFHeader, TensorInfo

_FLOATS = {"F32": np.float32, "F16": np.float16}


def read_tensors(header: GGUFHeader, names: Iterable[str]) -> dict[str, mx.array]:
    """The named tensors (GGUF names, e.g. ``blk.3.attn_q.weight``) as MLX arrays, named as `mx.load` names them."""
    infos = {t.name: t for t in header.tensors}
    out: dict[str, mx.array] = {}
    with open(header.path, "rb") as f:
        for name in names:
            info = infos[name]
            f.seek(header.data_start + info.offset)
            raw = np.frombuffer(f.read(info.nbytes), dtype=np.uint8)
            out.update(_convert(header, info, raw))
    return out


def _convert(header: GGUFHeader, info: TensorInfo, raw: np.ndarray) -> dict[str, mx.array]:
    if info.type_name in _FLOATS:
        return {info.name: mx.array(raw.view(_FLOATS[info.type_name]).reshape(info.shape))}
    if info.type_name == "BF16":
        return {info.name: mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)}
    unpack = _QUANTS.get(info.type_name)
    if unpack is None:
        raise ModelLoadError(header.path, f"tensor {info.name!r} has type {info.type_name}, which a split model "
                                          f"cannot read (supported: F32, F16, BF16, {', '.join(_QUANTS)})")
    q, scales, biases, bits = unpack(raw)
    rows, cols = info.shape[:-1], info.shape[-1]
    base = info.name.removesuffix(".weight")
    return {f"{base}.weight": mx.array(_pack(q, bits).reshape(*rows, cols * bits // 32)),
            f"{base}.scales": mx.array(scales.reshape(*rows, cols // 32)),
            f"{base}.biases": mx.array(biases.reshape(*rows, cols // 32))}


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    blocks = raw.reshape(-1, 20)
    d, m = blocks[:, 0:2].copy().view(np.float16), blocks[:, 2:4].copy().view(np.float16)
    return _nibbles(blocks[:, 4:]), d, m, 4


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    blocks = raw.reshape(-1, 18)
    d = blocks[:, 0:2].copy().view(np.float16)
    return _nibbles(blocks[:, 2:]), d, d * np.float16(-8), 4


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    blocks = raw.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16)
    q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # MLX's 8-bit values are unsigned
    return q, d, d * np.float16(-128), 8


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit block: byte j holds value j (low nibble) and value j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: values in order, `32 / bits` to a little-endian uint32, the first in the low bits."""
    q = q.reshape(-1)
    if bits == 4:
        q = q[0::2] | (q[1::2] << 4)
    return np.ascontiguousarray(q).view(np.uint32)


_QUANTS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}
