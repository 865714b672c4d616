"""A thinking model for the tests (issue 40): the embedded model's own weights and vocabulary in a GGUF whose chat
template is Qwen3's kind, with the reasoning opened in the generation prompt (``<think>\\n``, as DeepSeek-R1 distills
and Qwen3's thinking-only releases do) and an ``enable_thinking`` switch (false: an empty ``<think>\\n\\n</think>``).

The embedded model never writes ``</think>`` itself, so with the reasoning open it "thinks" until the budget closes
it (core/decode/reasoning.py): a real model, tokenizer and template on every path, with exact counts to test.
The file is the embedded GGUF with one metadata value replaced (tensor data copied byte for byte), written by
`core.model.gguf_writer`'s typed writer for the new value."""

from __future__ import annotations

import struct
from pathlib import Path

from mlxchat.core.model import gguf
from mlxchat.core.model.gguf_writer import STRING, Writer
from mlxchat.core.model.loader import embedded_model_path

THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning_content = message.reasoning_content if message.reasoning_content is defined else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_value(raw: bytes, pos: int, vtype: int) -> int:
    if vtype in _SCALAR_SIZES:
        return pos + _SCALAR_SIZES[vtype]
    if vtype == STRING:
        return pos + 8 + struct.unpack_from("<Q", raw, pos)[0]
    etype, count = struct.unpack_from("<IQ", raw, pos)
    pos += 12
    if etype in _SCALAR_SIZES:
        return pos + count * _SCALAR_SIZES[etype]
    for _ in range(count):
        pos = _skip_value(raw, pos, etype)
    return pos


def with_template(source: Path, path: Path, template: str) -> Path:
    """`source` (a GGUF) written to `path` with `tokenizer.chat_template` set to `template`."""
    header = gguf.read_header(source)
    raw = source.read_bytes()
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos, out = 24, bytearray(raw[:24])
    found = False
    for _ in range(n_kv):
        start = pos
        klen = struct.unpack_from("<Q", raw, pos)[0]
        key = raw[pos + 8:pos + 8 + klen].decode()
        vtype = struct.unpack_from("<I", raw, pos + 8 + klen)[0]
        end = _skip_value(raw, pos + 12 + klen, vtype)
        if key == "tokenizer.chat_template":
            w = Writer()
            w.string(key)
            w.put("<I", STRING, "vtype")
            w.value(STRING, template)
            out += w.buf
            found = True
        else:
            out += raw[start:end]
        pos = end
    if not found:
        raise ValueError(f"{source} has no chat template to replace")
    for _ in range(n_tensors):  # the tensor table, as it is (offsets count from the data's start)
        start = pos
        nlen = struct.unpack_from("<Q", raw, pos)[0]
        n_dims = struct.unpack_from("<I", raw, pos + 8 + nlen)[0]
        pos += 8 + nlen + 4 + 8 * n_dims + 4 + 8
        out += raw[start:pos]
    alignment = header.metadata.get("general.alignment", 32)
    out += b"\0" * (-len(out) % alignment)
    out += raw[header.data_start:]
    path.write_bytes(bytes(out))
    return path


def thinking_gguf(path: Path) -> Path:
    """The embedded model with THINKING_TEMPLATE (see the module docstring)."""
    return with_template(embedded_model_path(), path, THINKING_TEMPLATE)
