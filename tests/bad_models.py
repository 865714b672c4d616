"""Bad model files for the reliability tests (engine and CLI): each is written by the test into its own folder,
named, with what the one-line error must say. A helper module, not a test module, so several test files share it.

core's GGUF writer (core/model/gguf_writer.py, also the fuzzer's) builds the malformed headers.
"""

from __future__ import annotations

import struct
from pathlib import Path

from mlxchat.core.model import gguf
from mlxchat.core.model.gguf_writer import build_gguf


def _gguf(meta: list, tensors: list | None = None) -> bytes:
    return build_gguf(meta, tensors if tensors is not None else [("output_norm.weight", (4,), 0, bytes(16))])[0]


def set_u32_after(data: bytearray, key: str, value: int, skip: int = 0) -> None:
    raw = struct.pack("<Q", len(key)) + key.encode()
    struct.pack_into("<I", data, data.index(raw) + len(raw) + skip, value)


def bad_model_files(folder: Path, tiny: Path) -> dict[str, tuple[Path, str]]:
    """Name → (path, what the one-line error must say). Shared with tests/test_cli.py."""
    data = tiny.read_bytes()
    header = gguf.read_header(tiny)
    first = header.tensors[0].name.encode()
    table = data.rindex(struct.pack("<Q", len(first)) + first)
    end = max(t.offset + t.nbytes for t in header.tensors)
    data_start = (len(data) - end) // 32 * 32
    cuts = {
        "cut in the fixed header": 10,
        "cut in the first metadata key": 30,
        "cut in the vocabulary": data.index(b"tokenizer.ggml.tokens") + 5000,
        "cut in the tensor table": table + 12,
        "cut at the start of the data": data_start,
        "cut in the middle of the data": data_start + end // 2,
        "cut one byte short": len(data) - 1,
    }
    out: dict[str, tuple[Path, str]] = {}
    for i, (name, cut) in enumerate(cuts.items()):
        p = folder / f"cut-{i}.gguf"
        p.write_bytes(data[:cut])
        out[name] = (p, "truncated")

    def variant(name: str, edit, expected: str) -> None:
        d = bytearray(data)
        edit(d)
        p = folder / f"{name.replace(' ', '-')}.gguf"
        p.write_bytes(bytes(d))
        out[name] = (p, expected)

    # the first tensor's type field: after its name, n_dims and dims
    n_dims = struct.unpack_from("<I", data, table + 8 + len(first))[0]
    type_at = table + 8 + len(first) + 4 + 8 * n_dims
    variant("unknown tensor type", lambda d: struct.pack_into("<I", d, type_at, 99), "unknown ggml type 99")
    variant("K-quant tensor type", lambda d: struct.pack_into("<I", d, type_at, 12), "Q4_K")
    arch = struct.pack("<Q", 20) + b"general.architecture" + struct.pack("<IQ", 8, 5)
    arch_at = data.index(arch) + len(arch)
    variant("unsupported architecture", lambda d: d.__setitem__(slice(arch_at, arch_at + 5), b"mamba"),
            "architecture 'mamba' is not supported")
    variant("missing hyper-parameter", lambda d: d.__setitem__(slice(d.index(b"llama.block_count"),
                                                                     d.index(b"llama.block_count") + 17),
                                                               b"llama.block_cXunt"),
            "metadata key llama.block_count is missing")

    def write(name: str, raw: bytes, expected: str) -> None:
        p = folder / f"{name.replace(' ', '-')}.gguf"
        p.write_bytes(raw)
        out[name] = (p, expected)

    write("no architecture", _gguf([("general.name", 8, "x")]), "architecture '(none)' is not supported")
    write("no tokenizer", _gguf([("general.architecture", 8, "llama")]), "has no tokenizer")
    write("float64 metadata", _gguf([("general.architecture", 8, "llama"), ("llama.rope.freq_base", 12, 1e4)]),
          "llama.rope.freq_base holds float64 values")
    write("not a GGUF file", b"PK\x03\x04 a zip file, not a model" * 10, "not a GGUF file")
    write("empty file", b"", "too short")
    write("future GGUF version", b"GGUF" + struct.pack("<IQQ", 4, 0, 0), "GGUF version 4 is not supported")
    empty_dir = folder / "empty-folder"
    empty_dir.mkdir()
    out["folder without config.json"] = (empty_dir, "no config.json")
    no_weights = folder / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    out["folder without weights"] = (no_weights, "no *.safetensors")
    out["missing file"] = (folder / "absent.gguf", "no such file")
    return out


BAD_NAMES = ["cut in the fixed header", "cut in the first metadata key", "cut in the vocabulary",
             "cut in the tensor table", "cut at the start of the data", "cut in the middle of the data",
             "cut one byte short", "unknown tensor type", "K-quant tensor type", "unsupported architecture",
             "missing hyper-parameter", "float64 metadata", "no architecture", "no tokenizer", "not a GGUF file",
             "empty file", "future GGUF version", "folder without config.json", "folder without weights",
             "missing file"]
