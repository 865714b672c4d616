"""A GGUF writer next to the reader (core/model/gguf.py): the fuzzer, the tests' bad and synthetic models and the
bench's synthetic llama all write their files with it.

`build_gguf` takes every value with its GGUF type, so any file can be written, malformed ones included, and returns
where each field sits (the fuzzer mutates those). `write_gguf` is the short form for a plain file: types follow the
Python values, tensors come in MLX's shape order with a ggml type name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf import GGML_TYPES

# Metadata value type ids (gguf.h: enum gguf_type) and the struct formats of the scalar ones.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
           I64: "<q", F64: "<d"}
TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}  # ggml tensor type name -> id


@dataclass(frozen=True)
class Field:
    """A field of the file: where it starts, its width in bytes and what it is ("len", "count", "vtype", ...)."""

    offset: int
    width: int
    kind: str


class Writer:
    """The file's bytes so far, and the fields written into them."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.fields: list[Field] = []

    def put(self, fmt: str, value: Any, kind: str) -> None:  # noqa: ANN401 - any struct-packable value
        self.fields.append(Field(len(self.buf), struct.calcsize(fmt), kind))
        self.buf += struct.pack(fmt, value)

    def string(self, s: str | bytes, kind: str = "len") -> None:
        raw = s.encode() if isinstance(s, str) else s
        self.put("<Q", len(raw), kind)
        self.buf += raw

    def value(self, vtype: int, value: Any, kind: str = "scalar") -> None:  # noqa: ANN401 - per vtype
        if vtype in FORMATS:
            self.put(FORMATS[vtype], value, kind)
        elif vtype == STRING:
            self.string(value)
        else:
            etype, items = value
            self.put("<I", etype, "etype")
            self.put("<Q", len(items), "count")
            for item in items:
                self.value(etype, item)


def build_gguf(metadata: list[tuple[str, int, object]], tensors: list[tuple[str, tuple[int, ...], int, bytes]],
               *, alignment: int = 32, version: int = 3) -> tuple[bytes, list[Field]]:
    """A GGUF file: metadata as (key, vtype, value) (arrays: value = (etype, items)); tensors as
    (name, dims fastest-first, ggml type id, data). Returns the bytes and the fields' positions."""
    w = Writer()
    w.buf += b"GGUF"
    w.put("<I", version, "version")
    w.put("<Q", len(tensors), "n_tensors")
    w.put("<Q", len(metadata), "n_kv")
    for key, vtype, value in metadata:
        w.string(key, "key_len")
        w.put("<I", vtype, "vtype")
        w.value(vtype, value, "alignment" if key == "general.alignment" else "scalar")
    offset = 0
    blobs = []
    for name, dims, ttype, data in tensors:
        w.string(name, "name_len")
        w.put("<I", len(dims), "n_dims")
        for d in dims:
            w.put("<Q", d, "dim")
        w.put("<I", ttype, "ttype")
        w.put("<Q", offset, "toffset")
        pad = -len(data) % alignment
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    w.buf += b"\0" * (-len(w.buf) % alignment)
    w.fields.append(Field(len(w.buf), 0, "data_start"))
    for blob in blobs:
        w.buf += blob
    return bytes(w.buf), w.fields


def typed(value: Any) -> tuple[int, object]:  # noqa: ANN401 - a metadata value
    """(vtype, value) for a plain Python value: bool, int (U32, or I64 outside it), float (F32), str, or a list of
    str / float / int (I32)."""
    if isinstance(value, bool):
        return BOOL, value
    if isinstance(value, int):
        return (U32, value) if 0 <= value < 2**32 else (I64, value)
    if isinstance(value, float):
        return F32, value
    if isinstance(value, str):
        return STRING, value
    if isinstance(value, list):
        etype = STRING if value and isinstance(value[0], str) else F32 if value and isinstance(value[0], float) else I32
        return ARRAY, (etype, value)
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def write_gguf(path: Path, metadata: dict[str, Any], tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> Path:
    """Write a GGUF v3 file. Tensors as (name, ggml type name, MLX-order shape, raw bytes in that type's layout)."""
    meta = [(key, *typed(value)) for key, value in metadata.items()]
    table = [(name, tuple(reversed(shape)), TYPE_IDS[kind], data)  # GGUF lists the innermost dimension first
             for name, kind, shape, data in tensors]
    path.write_bytes(build_gguf(meta, table)[0])
    return path
