"""Small random-weight GGUFs, one per architecture, written as llama.cpp's converter writes them (gguf-py's
GGUFWriter, llama.cpp's tensor names and metadata keys), with the embedded model's vocabulary.

The shapes exercise what tells the architectures apart: qwen3's head size differs from hidden/heads; gemma2 and
gemma3 have a local layer whose window (8) is shorter than the tests' prompts, next to a global one, and soft-capping
small enough to bend the scores; gemma3's global layers have their own RoPE base and a linear scaling; llama 3.x has
a `rope_freqs` tensor of factors that are not all 1. Gemma's norm weights hold llama.cpp's +1, as the converter
stores them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.model_files import embedded_metadata

ARCHS = ("llama", "llama3", "qwen2", "qwen3", "gemma2", "gemma3")
HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 128
WINDOW = 8  # gemma's sliding window: shorter than the tests' prompts, so it matters

# Gemma's turn markers and end token, written over three of the embedded vocabulary's unused control tokens (not
# <|endoftext|>, which the GPT-2 tokenizer adds back when it is missing, past the model's vocabulary).
GEMMA_TOKENS = {3: "<start_of_turn>", 4: "<end_of_turn>", 5: "<eos>"}
GEMMA_EOS = 5
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_GEMMA = ("{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
          "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _tokenizer(writer, arch: str) -> int:  # noqa: ANN001 - gguf.GGUFWriter (gguf is a test-only dependency)
    """The embedded model's tokenizer metadata, typed as llama.cpp reads it; returns the vocabulary's size."""
    src = embedded_metadata()
    tokens = list(src["tokenizer.ggml.tokens"])
    gemma = arch.startswith("gemma")
    if gemma:
        for i, name in GEMMA_TOKENS.items():
            tokens[i] = name
    writer.add_tokenizer_model(src["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(src["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(list(src["tokenizer.ggml.token_type"]))
    writer.add_token_merges(list(src["tokenizer.ggml.merges"]))
    writer.add_add_bos_token(False)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(GEMMA_EOS if gemma else 2)
    writer.add_chat_template(_GEMMA if gemma else _CHATML)
    return len(tokens)


def write_model(path: Path, arch: str, *, f16: bool = False, q8: bool = False, q8_as_f32: bool = False,
                seed: int = 0, file_arch: str | None = None, drop: tuple[str, ...] = (),
                sliding_pattern: int | list[bool] = 3, hidden: int = HIDDEN) -> Path:
    """Write the test model of `arch` (one of ARCHS: "llama3" is a llama file with `rope_freqs`) to `path`, its
    matrices in F32 or F16, or the layers' in Q8_0 (`q8`), or in F32 holding exactly the Q8_0 file's values
    (`q8_as_f32`: its reference); norms and rope_freqs in F32, as llama.cpp writes them.
    gemma3's `sliding_pattern`: a number or llama.cpp's per-layer list (true: local). `hidden`: the width.
    Bad files: `file_arch` names another architecture (its keys follow), `drop` leaves out metadata keys."""
    import gguf

    gguf_arch = file_arch or ("llama" if arch == "llama3" else arch)
    gemma = arch.startswith("gemma")
    layers = 3 if arch == "gemma3" else 2
    # qwen3 and gemma: a head size of their own, not hidden/heads.
    head_dim = 32 if arch in ("qwen3", "gemma2", "gemma3") else hidden // HEADS
    rng = np.random.default_rng(seed)
    dtype = np.float16 if f16 else np.float32

    def matrix(rows: int, cols: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(dtype)

    def norm(n: int) -> np.ndarray:
        w = 1.0 + rng.standard_normal(n) * 0.1
        return (w + 1.0 if gemma else w).astype(np.float32)  # llama.cpp's converter adds Gemma's +1

    writer = gguf.GGUFWriter(str(path), gguf_arch)
    vocab = _tokenizer(writer, arch)
    writer.add_name(f"test-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // HEADS:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base({"qwen2": 1000000.0, "qwen3": 1000000.0, "gemma3": 1000000.0}.get(arch, 10000.0))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(1.0)
        writer.add_final_logit_softcapping(10.0)
        writer.add_sliding_window(WINDOW)
    if arch == "gemma3":
        writer.add_sliding_window(WINDOW)
        writer.add_sliding_window_pattern(sliding_pattern)  # 3: layers 0 and 1 local, 2 global
        writer.add_float32(f"{gguf_arch}.rope.freq_base_swa", 10000.0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden, 1.0 if gemma else 0.1))
    writer.add_tensor("output_norm.weight", norm(hidden))
    if arch in ("llama", "qwen3"):  # the others are tied: the head is the embedding matrix
        writer.add_tensor("output.weight", matrix(vocab, hidden))
    if arch == "llama3":
        # Llama 3.1's factors for this head size (convert_hf_to_gguf.py, factor 8, low 1, high 4, original
        # context 8192) would all be 1 at dims 16: spread them instead, so every kind of pair is covered.
        writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        q, kv = HEADS * head_dim, KV_HEADS * head_dim
        tensors = {"attn_norm.weight": norm(hidden), "attn_q.weight": matrix(q, hidden),
                   "attn_k.weight": matrix(kv, hidden), "attn_v.weight": matrix(kv, hidden),
                   "attn_output.weight": matrix(hidden, q), "ffn_norm.weight": norm(hidden),
                   "ffn_gate.weight": matrix(FFN, hidden), "ffn_up.weight": matrix(FFN, hidden),
                   "ffn_down.weight": matrix(hidden, FFN)}
        if arch == "qwen2":
            tensors |= {"attn_q.bias": matrix(1, q)[0].astype(np.float32),
                        "attn_k.bias": matrix(1, kv)[0].astype(np.float32),
                        "attn_v.bias": matrix(1, kv)[0].astype(np.float32)}
        if arch in ("qwen3", "gemma3"):
            tensors |= {"attn_q_norm.weight": norm(head_dim), "attn_k_norm.weight": norm(head_dim)}
        if gemma:
            tensors |= {"post_attention_norm.weight": norm(hidden), "post_ffw_norm.weight": norm(hidden)}
        for name, value in tensors.items():
            if (q8 or q8_as_f32) and value.ndim == 2:
                q = gguf.quants.quantize(value.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
                if q8:
                    writer.add_tensor(b + name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                else:
                    writer.add_tensor(b + name, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))
            else:
                writer.add_tensor(b + name, value)
    for key in drop:
        del writer.kv_data[0][key]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
