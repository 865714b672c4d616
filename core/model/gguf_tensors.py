"""Read a GGUF file's tensors into MLX arrays, one tensor at a time, every ggml type mlxchat runs converted exactly.

A quantized tensor becomes MLX's affine quantization: `NAME.weight` (codes packed as MLX packs them: a little-endian
bit stream in uint32 words), `NAME.scales` and `NAME.biases`, with `w = scale * q + bias` per group along the row.
Every ggml type below maps onto that form with no rounding, so the weights multiplied are llama.cpp's own
dequantization of the file (tests/test_gguf_types.py checks each against gguf-py's reference, bit for bit):

| type  | bits | group | scale, bias (dtype)                | why exact                                          |
|-------|------|-------|------------------------------------|----------------------------------------------------|
| Q4_0  | 4    | 32    | d, -8d (f16)                        | a power-of-two multiple of an f16                  |
| Q4_1  | 4    | 32    | d, m (f16)                          | the block's own numbers                            |
| Q5_0  | 5    | 32    | d, -16d (f16)                       | as Q4_0                                            |
| Q5_1  | 5    | 32    | d, m (f16)                          | as Q4_1                                            |
| Q8_0  | 8    | 32    | d, -128d (f16), codes q + 128       | as Q4_0                                            |
| Q4_K  | 4    | 32    | d*sc, -dmin*m (f32)                 | f16 x 6-bit integer: 17 bits, exact in f32         |
| Q5_K  | 5    | 32    | d*sc, -dmin*m (f32)                 | as Q4_K                                            |
| Q6_K  | 6    | 16    | d*sc, -32*d*sc (f32)                | f16 x int8: 18 bits; x a 6-bit code: 24, exact     |

Q6_K's scales belong to 16 values, a group size MLX's own ops refuse: only mlxchat's native kernel runs it quantized
(`keep` decides; elsewhere the loader asks for it dense). Reading goes through plain file reads, not a memory map, so
the file's pages are not counted twice while a model loads.

This module's NumPy conversion is the reference and the path of every backend. On the native path the loader hands
each kept tensor to core/native's `read_ggml` instead, which does the same mapping in C++ in one pass on the
kernel's threads, straight into the packed layout and the K-quants' compact parameters (a 1.1B Q4_K_M file: NumPy's
conversion then the repacking took ~10 s of one core here, the native reader 0.5 s: 1.4 GB/s).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError
from . import heap
from .gguf import GGML_TYPES, READABLE, GGUFHeader, TensorInfo


@dataclass(frozen=True)
class QuantFormat:
    """How a quantized tensor is held: its codes' bits, the values one scale and bias serve, and the ggml type."""

    bits: int
    group_size: int
    ggml_type: str


@dataclass
class Tensors:
    """`arrays` named as `mx.load` names a GGUF's (quantized ones as NAME.weight/.scales/.biases); `formats` by NAME
    (the name less `.weight`) for each tensor kept quantized."""

    arrays: dict[str, mx.array] = field(default_factory=dict)
    formats: dict[str, QuantFormat] = field(default_factory=dict)
    packed: set[str] = field(default_factory=set)  # NAMEs read in the native kernel's packed layout

    def add(self, other: "Tensors") -> None:
        """Take `other`'s tensors too (another part of the same file's)."""
        self.arrays |= other.arrays
        self.formats |= other.formats
        self.packed |= other.packed


@dataclass(frozen=True)
class Place:
    """Where a tensor's blocks are: the file, the byte they start at, and the tensor's rows and columns."""

    path: str
    offset: int
    rows: int
    cols: int


# (codes [blocks, values], scales [blocks, groups], biases [blocks, groups]) of an array of whole blocks.
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]
KeepQuantized = Callable[[QuantFormat], bool]
# The native path's reader of kept tensors, all of a file's at once: for each (format, place), (weight, scales,
# biases, packed) straight from the file in the native kernel's own form (core/native's `read_ggml_many`), or None
# to have it converted here. At once: the native reader holds no GIL for the whole file, while the loader builds the
# tokenizer on another thread (one call a tensor waited each time to take the GIL back from that thread).
NativeRead = Callable[[list[tuple[QuantFormat, Place]]], list[tuple[mx.array, mx.array, mx.array, bool] | None]]
_FLOATS = {"F32": np.float32, "F16": np.float16}


def read_tensors(header: GGUFHeader, names: Iterable[str], keep: KeepQuantized = lambda f: True,
                 native: NativeRead | None = None) -> Tensors:
    """The named tensors (GGUF names, e.g. ``blk.3.attn_q.weight``). A quantized tensor whose format `keep` refuses
    comes back dense in float32 (llama.cpp's dequantization, exactly); the kept ones are read by `native` where it is
    given and takes them, else converted here to MLX's layout."""
    infos = {t.name: t for t in header.tensors}
    size = os.path.getsize(header.path)
    todo = []
    for name in names:
        info = infos[name]
        if header.data_start + info.offset + info.nbytes > size:
            raise ModelLoadError(header.path, f"tensor {name!r} ends past the end of the file; it is truncated")
        todo.append(info)
    out = Tensors()
    if native is not None:
        todo = _read_native(header, todo, keep, native, out)
    # NumPy lets go of the GIL in its array work: a tensor converts on each core while the next one is read.
    workers = os.cpu_count() or 1
    with open(header.path, "rb") as f, ThreadPoolExecutor(workers) as pool:
        pending = []
        for info in todo:
            f.seek(header.data_start + info.offset)
            raw = np.fromfile(f, dtype=np.uint8, count=info.nbytes)
            if len(pending) >= workers:
                pending.pop(0).result()  # a bounded queue: at most one tensor a core in memory at once
                heap.give_back_freed_memory()
            pending.append(pool.submit(_convert, header, info, raw, keep, out))
        for job in pending:
            job.result()
    return out


def _read_native(header: GGUFHeader, infos: list[TensorInfo], keep: KeepQuantized, native: NativeRead,
                 out: Tensors) -> list[TensorInfo]:
    """Read the kept quantized tensors of `infos` with `native` into `out`; the tensors left to convert here."""
    asked: list[tuple[TensorInfo, QuantFormat, Place]] = []
    rest = []
    for info in infos:
        quant = _QUANTS.get(info.type_name)
        if quant is None or not keep(quant[1]):
            rest.append(info)
            continue
        rows, cols = info.shape[:-1], info.shape[-1]
        asked.append((info, quant[1], Place(str(header.path), header.data_start + info.offset, int(np.prod(rows)),
                                            cols)))
    for (info, fmt, _), read in zip(asked, native([(fmt, place) for _, fmt, place in asked])):
        if read is None:
            rest.append(info)
            continue
        weight, scales, biases, packed = read
        rows = info.shape[:-1]
        base = info.name.removesuffix(".weight")
        out.arrays[f"{base}.weight"] = weight.reshape(*rows, weight.shape[-1])
        out.arrays[f"{base}.scales"] = scales.reshape(*rows, scales.shape[-1])
        out.arrays[f"{base}.biases"] = biases.reshape(*rows, biases.shape[-1])
        out.formats[base] = fmt
        if packed:
            out.packed.add(base)
    return rest


def _convert(header: GGUFHeader, info: TensorInfo, raw: np.ndarray, keep: KeepQuantized, out: Tensors) -> None:
    if info.type_name in _FLOATS:
        out.arrays[info.name] = mx.array(raw.view(_FLOATS[info.type_name]).reshape(info.shape))
        return
    if info.type_name == "BF16":
        out.arrays[info.name] = mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)
        return
    quant = _QUANTS.get(info.type_name)
    if quant is None:
        raise ModelLoadError(header.path, f"tensor {info.name!r} has type {info.type_name}, which mlxchat cannot "
                                          f"read (supported: {', '.join(READABLE)})")
    unpack, fmt = quant
    block_values, block_bytes = _BLOCKS[info.type_name]
    blocks = raw.reshape(-1, block_bytes)
    values = blocks.shape[0] * block_values
    rows, cols = info.shape[:-1], info.shape[-1]
    dense = not keep(fmt)
    # Unpacked a chunk at a time into the outputs: a big tensor's temporaries (codes a byte each, shifted copies)
    # would otherwise be several times its size while the model loads.
    step = max(1, _CHUNK_VALUES // block_values)
    if dense:
        weight = np.empty(values, np.float32)
    else:
        weight = np.empty(values * fmt.bits // 8, np.uint8)
    scales = biases = None
    for start in range(0, blocks.shape[0], step):
        q, s, b = unpack(blocks[start:start + step])
        first, count = start * block_values, q.size
        if dense:
            weight[first:first + count] = _dense(q, s, b, fmt.group_size).reshape(-1)
            continue
        if scales is None:
            scales, biases = np.empty(values // fmt.group_size, s.dtype), np.empty(values // fmt.group_size, b.dtype)
        weight[first * fmt.bits // 8:(first + count) * fmt.bits // 8] = pack_codes(q, fmt.bits).view(np.uint8)
        scales[first // fmt.group_size:(first + count) // fmt.group_size] = s.reshape(-1)
        biases[first // fmt.group_size:(first + count) // fmt.group_size] = b.reshape(-1)
    if dense:
        out.arrays[info.name] = mx.array(weight.reshape(info.shape))
        return
    base = info.name.removesuffix(".weight")
    out.arrays[f"{base}.weight"] = mx.array(weight.view(np.uint32).reshape(*rows, cols * fmt.bits // 32))
    groups = (*rows, cols // fmt.group_size)
    out.arrays[f"{base}.scales"], out.arrays[f"{base}.biases"] = (mx.array(scales.reshape(groups)),
                                                                  mx.array(biases.reshape(groups)))
    out.formats[base] = fmt


def _dense(q: np.ndarray, scales: np.ndarray, biases: np.ndarray, group: int) -> np.ndarray:
    """scale * q + bias in float32, a multiply then an add as MLX's `dequantize` and llama.cpp compute it."""
    g = q.reshape(q.shape[0], -1, group).astype(np.float32)
    return (g * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]).reshape(q.shape[0], -1)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing of codes (< 2**bits each): a little-endian bit stream, read as uint32 words."""
    q = q.reshape(-1)
    if bits == 8:
        packed = q.astype(np.uint8)
    elif bits == 4:
        packed = q[0::2] | (q[1::2] << 4)
    else:
        # 8 codes of b bits are b whole bytes: assemble them in a uint64 and keep its low b bytes. Column by column,
        # so the temporaries are one uint64 per 8 codes, not per code (a 100M-value tensor: 100 MB, not 800).
        eights = q.reshape(-1, 8)
        words = np.zeros(len(eights), dtype="<u8")
        for i in range(8):
            words |= eights[:, i].astype("<u8") << np.uint64(i * bits)
        packed = words.view(np.uint8).reshape(-1, 8)[:, :bits]
    return np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1).view(np.uint32)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16)


def _f32(blocks: np.ndarray, at: int) -> np.ndarray:
    return _f16(blocks, at).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value 4-bit block: byte j holds value j (low nibble) and value j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: bit j of the block's little-endian uint32 belongs to value j, as 16 or 0."""
    word = qh.copy().view("<u4")
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, d * np.float16(-8)


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6]), d, d * np.float16(-16)


def _q5_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b, 0)
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # MLX's codes are unsigned
    return q, d, d * np.float16(-128)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _k_params(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mins = _k_scales(b[:, 4:16])
    return _f32(b, 0) * sc, -(_f32(b, 2) * mins)


def _k_low_high(ql: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 4 runs of 32 bytes: run c holds values 64c..64c+31 (low nibbles) and the next 32 (high)."""
    runs = ql.reshape(ql.shape[0], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(ql.shape[0], 256)


def _q4_k(b: np.ndarray) -> Unpacked:
    return (_k_low_high(b[:, 16:144]), *_k_params(b))


def _q5_k(b: np.ndarray) -> Unpacked:
    # The fifth bit of value 32i + l is bit i of qh[l].
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return (_k_low_high(b[:, 48:176]) | ((qh & 1) << 4).reshape(-1, 256), *_k_params(b))


def _q6_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    # Per half of 128 values: ql's 64 bytes give values 0-63 (low nibbles) and 64-127 (high); qh's 32 bytes give
    # the top two bits of values l, l + 32, l + 64, l + 96 at bits 0, 2, 4, 6 of byte l.
    ql = (b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ql.reshape(n, 256) | (qh.reshape(n, 256) << 4)
    scales = _f32(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q, scales, scales * np.float32(-32)


_CHUNK_VALUES = 1 << 20
_BLOCKS = {name: (values, nbytes) for name, values, nbytes in GGML_TYPES.values()}  # a block's values and bytes
_QUANTS: dict[str, tuple[Callable[[np.ndarray], Unpacked], QuantFormat]] = {
    "Q4_0": (_q4_0, QuantFormat(4, 32, "Q4_0")),
    "Q4_1": (_q4_1, QuantFormat(4, 32, "Q4_1")),
    "Q5_0": (_q5_0, QuantFormat(5, 32, "Q5_0")),
    "Q5_1": (_q5_1, QuantFormat(5, 32, "Q5_1")),
    "Q8_0": (_q8_0, QuantFormat(8, 32, "Q8_0")),
    "Q4_K": (_q4_k, QuantFormat(4, 32, "Q4_K")),
    "Q5_K": (_q5_k, QuantFormat(5, 32, "Q5_K")),
    "Q6_K": (_q6_k, QuantFormat(6, 16, "Q6_K")),
}
assert set(READABLE) == {"F32", "F16", "BF16", *_QUANTS}, "gguf.READABLE must list what this module converts"
