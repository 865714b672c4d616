"""GGUF header and metadata reader, and the checks that run before MLX touches a file.

`mx.load` reads GGUF tensors fast, but a truncated or malformed file can take the process down or fail
with a message that does not name the problem. This reader walks the header, the metadata and the
tensor table in Python (its long string arrays natively where the loader asks), bounds-checks every
length against the file size, and raises a `ModelLoadError` with one line naming the file and the
cause. Only then are tensors loaded.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types (gguf.h: enum gguf_type).
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY, _F64 = 8, 9, 12
# GGUF allows arrays of arrays; MLX's loader refuses them with a clear error. This reader accepts one level of
# nesting and refuses deeper, which bounds its recursion (a file of nested array headers would otherwise raise
# RecursionError).
_MAX_NESTING = 1

# ggml tensor types: name, elements per block, bytes per block.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
}
# The tensor types mlxchat reads (core/model/gguf_tensors.py converts each exactly); the others are refused up front.
READABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's names for a whole file's quantization (general.file_type: enum llama_ftype in llama.h).
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
    20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}

# Arrays this long are not kept as Python lists unless asked for: only their length matters to callers, and an array
# not kept is its length.
_KEEP_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")
_MAX_ELEMENTS = 1 << 40


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    float64_keys: list[str] = field(default_factory=list)  # metadata holding float64 values
    data_start: int = 0  # where tensor data begins; each TensorInfo.offset counts from here

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def drop_tokenizer_arrays(self) -> None:
        """Replace the tokenizer's arrays (vocabulary, merges, scores, token types) by their lengths, as arrays not
        kept are, once the tokenizer is built: ~100k Python objects (~7 MB for a 49k vocabulary) that a load would
        otherwise hold while the weights are read, at its peak."""
        for key in _KEEP_ARRAYS:
            if isinstance(self.metadata.get(key), list):
                self.metadata[key] = len(self.metadata[key])

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each ggml type the file holds, most first."""
        counts = Counter(t.type_name for t in self.tensors)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def quantization(self) -> str:
        """The file's quantization as users know it, and its mix: "Q4_K_M: Q4_K 25, Q6_K 5, F32 9". Without
        general.file_type, the kind is the type most tensors have, norms (F32) aside."""
        counts = self.type_counts()
        mix = ", ".join(f"{name} {n}" for name, n in counts.items())
        kind = FILE_TYPES.get(self.metadata.get("general.file_type", -1)) or next(
            (name for name in counts if name != "F32"), "F32")
        return f"{kind}: {mix}"


# A native reader of string arrays (core/native's `gguf_strings`): (path, offset, count) -> (strings, the byte after
# the last one read, "" or why it stopped early). The loader passes it; everything else reads in Python.
StringsReader = Callable[[str, int, int], tuple[list[str], int, str]]
# Arrays shorter than this are read in Python: a native call maps the file, which only pays off on a vocabulary.
_NATIVE_STRINGS = 256


class _Reader:
    def __init__(self, f: BinaryIO, size: int, path: Path, native: StringsReader | None = None) -> None:
        self.f, self.size, self.pos, self.path, self.native = f, size, 0, path, native
        self.float64 = False  # whether any metadata value is a float64 (see check_loadable)

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(self.path,
                              f"{what} (at byte {self.pos} of {self.size}); the file is truncated or not a GGUF model")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"file ends inside the header: needed {n} more bytes")
        data = self.f.read(n)
        self.pos += n
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings (each a uint64 length and its UTF-8 bytes) in one loop: a vocabulary and its merges are
        ~100k of them, where a call chain per string was most of a header's parsing time."""
        out: list[str] = []
        if self.native is not None and count >= _NATIVE_STRINGS:
            out, end, problem = self.native(str(self.path), self.pos, count)
            self.pos = end
            self.f.seek(end)
            if not problem:
                return out
            count -= len(out)  # the loop below reads the bad string again, and says what is wrong with it
        read, pos = self.f.read, self.pos
        try:
            for _ in range(count):
                if pos + 8 > self.size:
                    raise self.fail("file ends inside the header: needed 8 more bytes")
                n = int.from_bytes(read(8), "little")
                pos = self.pos = pos + 8
                if pos + n > self.size:
                    raise self.fail(f"file ends inside the header: needed {n} more bytes")
                out.append(str(read(n), "utf-8"))
                pos = self.pos = pos + n
        except UnicodeDecodeError:
            raise self.fail("a metadata string is not valid UTF-8") from None
        return out

    def value(self, vtype: int, keep: bool, depth: int = 0) -> Any:
        if vtype == _F64:
            self.float64 = True
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth > _MAX_NESTING:
                raise self.fail(f"metadata arrays are nested more than {_MAX_NESTING + 1} deep")
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if count > _MAX_ELEMENTS:
                raise self.fail(f"metadata array claims {count} elements")
            if etype == _F64 and count:
                self.float64 = True
            if etype in _SCALARS and not keep:
                self.take(count * struct.calcsize(_SCALARS[etype]))
                return count
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                raw = self.take(count * struct.calcsize(fmt))
                return list(struct.unpack(f"<{count}{fmt[1:]}", raw))
            if etype == _STRING:
                items = self.strings(count)
                return items if keep else count
            items = [self.value(etype, keep, depth + 1) for _ in range(count)]
            return items if keep else count
        raise self.fail(f"unknown metadata value type {vtype}")


def read_header(path: str | Path, strings: StringsReader | None = None) -> GGUFHeader:
    """Parse and bounds-check a GGUF file's header, metadata and tensor table; `strings` reads the long string arrays
    (the vocabulary and merges) where given."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=1 << 20) as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(GGUF_MAGIC):
                raise ModelLoadError(path, f"file is {size} bytes, too short to be a GGUF model")
            return _parse(_Reader(f, size, path, strings))
    except OSError as e:
        raise ModelLoadError(path, e.strerror or str(e)) from None


def _parse(r: _Reader) -> GGUFHeader:
    path = r.path
    try:
        if bytes(r.take(4)) != GGUF_MAGIC:
            raise ModelLoadError(path, "not a GGUF file (no GGUF magic at its start)")
        version = r.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(path, f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        if n_tensors > r.size or n_kv > r.size:
            raise r.fail(f"header claims {n_tensors} tensors and {n_kv} metadata entries")
        header = GGUFHeader(path=path, version=version)
        for _ in range(n_kv):
            key = r.string()
            r.float64 = False
            # The architecture's arrays are per-layer values (a few, and they matter: gemma's sliding pattern);
            # writers put general.architecture first.
            arch = header.metadata.get("general.architecture")
            keep = key in _KEEP_ARRAYS or (isinstance(arch, str) and key.startswith(f"{arch}."))
            header.metadata[key] = r.value(r.scalar("<I"), keep=keep)
            if r.float64:
                header.float64_keys.append(key)
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("<I")
            if n_dims > 8:
                raise r.fail(f"tensor {name!r} claims {n_dims} dimensions")
            dims = tuple(r.scalar("<Q") for _ in range(n_dims))
            ttype, offset = r.scalar("<I"), r.scalar("<Q")
            infos.append((name, dims, ttype, offset))
        alignment = header.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ModelLoadError(path, f"general.alignment is {alignment!r}, not a positive integer")
        data_start = header.data_start = -(-r.pos // alignment) * alignment
        for name, dims, ttype, offset in infos:
            header.tensors.append(_tensor(path, r.size, data_start, name, dims, ttype, offset))
        return header
    except struct.error:
        raise r.fail("malformed header") from None


def _tensor(path: Path, size: int, data_start: int, name: str, dims: tuple[int, ...], ttype: int,
            offset: int) -> TensorInfo:
    if ttype not in GGML_TYPES:
        raise ModelLoadError(path, f"tensor {name!r} has unknown ggml type {ttype}")
    type_name, block, block_bytes = GGML_TYPES[ttype]
    count = 1
    for d in dims:
        count *= d
    if dims and dims[0] % block:
        raise ModelLoadError(path, f"tensor {name!r} ({type_name}) has a row of {dims[0]}, not a multiple of {block}")
    nbytes = count // block * block_bytes
    end = data_start + offset + nbytes
    if end > size:
        raise ModelLoadError(path, f"tensor {name!r} ends at byte {end} but the file has {size} bytes; "
                                   "the file is truncated")
    # GGUF lists dimensions fastest-first; MLX and mlx-lm use row-major (slowest-first).
    return TensorInfo(name, tuple(reversed(dims)), type_name, offset, nbytes)


def array_length(value: Any) -> int | None:  # noqa: ANN401 - any metadata value
    """The length of a metadata array, kept (a list) or not (its length); None for anything else."""
    if isinstance(value, list):
        return len(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_loadable(header: GGUFHeader) -> None:
    """Refuse what cannot be loaded, naming it, before any tensor is read: tensor types mlxchat has no reader for,
    and float64 metadata values, on which MLX's GGUF reader (`mx.load`, MLX 0.32) dies with a segmentation fault."""
    if header.float64_keys:
        keys = ", ".join(header.float64_keys[:3]) + (" ..." if len(header.float64_keys) > 3 else "")
        raise ModelLoadError(header.path, f"metadata {keys} holds float64 values, which MLX's GGUF reader cannot "
                                          "read; rewrite them as float32 (e.g. with gguf-py)")
    counts = header.type_counts()
    bad = [name for name in counts if name not in READABLE]
    if bad:
        holds = ", ".join(f"{name} x{n}" for name, n in counts.items())
        raise ModelLoadError(
            header.path,
            f"tensor type {', '.join(bad)} is not supported (the file holds {holds}; supported: "
            f"{', '.join(READABLE)}); use a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file of this model, or re-quantize it "
            "with llama.cpp's llama-quantize",
        )
