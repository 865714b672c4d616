"""GGUF architectures, each mapped onto mlx-lm's own model class: tensor names, hyper-parameters, weight fix-ups.

llama.cpp's converter (convert_hf_to_gguf.py) writes every architecture in its own conventions; this module undoes
them so mlx-lm's class computes what llama.cpp's graph (src/models/<arch>.cpp) computes on the same file:
- llama/mistral: Q/K rows permuted for interleaved RoPE (`rope_traditional=True` undoes it); Llama 3.x's RoPE
  scaling arrives as a `rope_freqs` tensor of per-frequency factors, applied as they are (`FrequencyRoPE`).
- qwen2, qwen3: NeoX RoPE, no permutation; qwen3 adds per-head q/k RMSNorm and a head size of its own.
- gemma2, gemma3: RMSNorm weights stored with Gemma's +1 already added (mlx-lm's Gemma RMSNorm adds it itself, so
  it is subtracted here); local layers with a sliding window alternate with global ones by llama.cpp's pattern rule
  (layer i is local when i % pattern < pattern - 1); the attention scale is 1/sqrt(head size), except for the
  27B models, where llama.cpp (after gemma_pytorch) uses 1/sqrt(hidden / heads).

The loader (core/model/loader.py) reads the tensors; this module says what they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import ModelLoadError
from . import gguf

ARCHITECTURES = ("gemma2", "gemma3", "llama", "mistral", "qwen2", "qwen3")

# GGUF tensor names (llama.cpp's) as mlx-lm's parameter names: the top-level tensors by their first part, the layers'
# (``blk.N.<part>.``) by theirs; what follows the part (``weight``, ``bias``) is kept.
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama's one norm before the MLP is mlx-lm's post_attention_layernorm; Gemma has a norm on each side of both blocks.
_PRE_MLP_NORM = {"ffn_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Not a parameter of mlx-lm's llama: fix_weights turns it into the layers' RoPE.
ROPE_FREQS = "rope_freqs"
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA_LAYER | _PRE_MLP_NORM,
    "mistral": _LLAMA_LAYER | _PRE_MLP_NORM,
    "qwen2": _LLAMA_LAYER | _PRE_MLP_NORM,
    "qwen3": _LLAMA_LAYER | _PRE_MLP_NORM | _QK_NORMS,
    "gemma2": _LLAMA_LAYER | _GEMMA_NORMS,
    "gemma3": _LLAMA_LAYER | _GEMMA_NORMS | _QK_NORMS,
}
_IN_LAYER = re.compile(r"blk\.(\d+)\.([^.]+)\.")


def mlx_name(arch: str, name: str) -> str | None:
    """The mlx-lm parameter name of GGUF tensor `name` in a model of `arch`, or None for a tensor the model does
    not use. (Two dict lookups: the loader asks ~4 times per tensor, and a list of regular expressions tried in
    turn was ~20 ms of the embedded model's load.)"""
    if arch == "llama" and name == f"{ROPE_FREQS}.weight":
        return ROPE_FREQS
    if layer := _IN_LAYER.match(name):
        part = _LAYER_NAMES[arch].get(layer[2])
        return None if part is None else f"model.layers.{layer[1]}.{part}.{name[layer.end():]}"
    first, dot, rest = name.partition(".")
    top = _TOP.get(first)
    return None if top is None or not dot else f"{top}.{rest}"


# --- hyper-parameters -------------------------------------------------------------------------------------------

_POSITIVE = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length", "context_length",
             "vocab_size", "attention.sliding_window")
# The layer counts llama.cpp recognises as the 27B models, whose attention scale differs (see the module's doc).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def check_hparams(h: gguf.GGUFHeader) -> None:
    """The hyper-parameters must be sane and agree with the tensor table, before a model is built from them: a
    corrupt count otherwise divides by zero, overflows int32 in MLX, or builds 2**31 layers (all memory)."""
    m, arch = h.metadata, h.architecture
    for key in _POSITIVE:
        value = m.get(f"{arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(h.path, f"metadata {arch}.{key} has a value per layer, which mlx-lm's classes "
                                         "cannot run (one value for all layers)")
        if value is not None and (type(value) is not int or not 0 < value < 2**31):
            raise ModelLoadError(h.path, f"metadata {arch}.{key} is {value!r}, not a positive integer")
    layers = {int(x.group(1)) for t in h.tensors if (x := re.match(r"blk\.(\d+)\.", t.name))}
    count = m.get(f"{arch}.block_count")
    if count is not None and layers != set(range(count)):
        raise ModelLoadError(h.path, f"metadata {arch}.block_count is {count} but the file has tensors for "
                                     f"{len(layers)} layers")
    hidden, heads = m.get(f"{arch}.embedding_length"), m.get(f"{arch}.attention.head_count")
    embed = next((t for t in h.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError(h.path, "the file has no token_embd.weight tensor")
    if hidden is not None and embed.shape[-1] != hidden:
        raise ModelLoadError(h.path, f"metadata {arch}.embedding_length is {hidden} but token_embd.weight has "
                                     f"rows of {embed.shape[-1]}")
    # A head size of its own (qwen3, gemma) need not divide the hidden size; without one, the heads split it.
    if hidden is not None and heads is not None and hidden % heads and f"{arch}.attention.key_length" not in m:
        raise ModelLoadError(h.path, f"metadata {arch}.embedding_length {hidden} is not a multiple of "
                                     f"{arch}.attention.head_count {heads}")


class _Metadata:
    """The file's `<arch>.*` keys, each missing one a ModelLoadError naming it."""

    def __init__(self, h: gguf.GGUFHeader) -> None:
        self.h, self.arch = h, h.architecture

    def __call__(self, key: str, default: Any = None) -> Any:
        value = self.h.metadata.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(self.h.path, f"metadata key {self.arch}.{key} is missing")
        return value

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.h.metadata

    def fail(self, cause: str) -> ModelLoadError:
        return ModelLoadError(self.h.path, cause)


def _sliding_pattern(get: _Metadata, default: int) -> int:
    """Every how many layers a global one comes (layer i is local when i % pattern < pattern - 1), from
    `attention.sliding_window_pattern`: a number, or llama.cpp's per-layer list of booleans (true: local), which
    mlx-lm's classes can only run when it repeats with one global layer per period."""
    pattern = get("attention.sliding_window_pattern", default)
    if not isinstance(pattern, list):
        return int(pattern)
    for period in range(1, len(pattern) + 1):
        if [bool(v) for v in pattern] == [i % period < period - 1 for i in range(len(pattern))]:
            return period
    raise get.fail(f"metadata {get.arch}.attention.sliding_window_pattern {pattern} is not a repeating "
                   f"local/global pattern, which mlx-lm's {get.arch} class cannot run")


def _head_dim(get: _Metadata, hidden: int, heads: int) -> int:
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise get.fail(f"metadata {get.arch}.attention.value_length {get('attention.value_length')} differs from "
                       f"key_length {head_dim}, which mlx-lm's {get.arch} class cannot run")
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise get.fail(f"metadata {get.arch}.rope.dimension_count {rope_dims} is not the head size {head_dim} "
                       f"(partial RoPE), which mlx-lm's {get.arch} class cannot run")
    return head_dim


def model_args(h: gguf.GGUFHeader, tied: bool) -> Any:  # noqa: ANN401 - the architecture's mlx-lm ModelArgs
    """mlx-lm's ModelArgs for the file's architecture, from its metadata; `tied`: the file has no output.weight
    (the output head is the embedding matrix)."""
    get, arch, m = _Metadata(h), h.architecture, h.metadata
    heads, hidden, layers = get("attention.head_count"), get("embedding_length"), get("block_count")
    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, intermediate_size=get("feed_forward_length"),
        num_attention_heads=heads, num_key_value_heads=get("attention.head_count_kv", heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=get("vocab_size", gguf.array_length(m.get("tokenizer.ggml.tokens"))),
        max_position_embeddings=get("context_length", 4096),
    )
    scaling = get("rope.scaling.type", "none")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise get.fail(f"metadata {arch}.rope.scaling.type {scaling!r} is not supported (supported: linear)")
    if arch == "qwen3":
        if not get.has("attention.key_length"):
            raise get.fail(f"metadata key {arch}.attention.key_length is missing (qwen3's head size)")
        return qwen3.ModelArgs(model_type="qwen3", head_dim=_head_dim(get, hidden, heads), tie_word_embeddings=tied,
                               rope_theta=float(get("rope.freq_base", 1000000.0)), rope_scaling=rope_scaling,
                               **common)
    if arch in ("gemma2", "gemma3"):
        head_dim = _head_dim(get, hidden, heads)
        # llama.cpp's attention scale, after gemma_pytorch (the HF configs' query_pre_attn_scalar agree).
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        if arch == "gemma2":
            if not tied:
                raise get.fail("a gemma2 file with its own output.weight: mlx-lm's gemma2 class ties the output head "
                               "to the embeddings")
            if rope_scaling is not None:
                raise get.fail(f"metadata {arch}.rope.scaling.type {scaling!r}: mlx-lm's gemma2 class has no RoPE "
                               "scaling")
            return Gemma2Args(model_type="gemma2", head_dim=head_dim, query_pre_attn_scalar=scalar,
                              rope_theta=float(get("rope.freq_base", 10000.0)),
                              attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
                              final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
                              sliding_window=get("attention.sliding_window", 4096),
                              sliding_window_pattern=_sliding_pattern(get, 2), **common)
        if get("final_logit_softcapping", 0.0):
            raise get.fail(f"metadata {arch}.final_logit_softcapping is set: mlx-lm's gemma3_text class has no final "
                           "soft-capping")
        window = get("attention.sliding_window", 0)
        return gemma3_text.ModelArgs(
            model_type="gemma3_text", head_dim=head_dim, query_pre_attn_scalar=scalar,
            rope_theta=float(get("rope.freq_base", 1000000.0)),
            rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)), rope_scaling=rope_scaling,
            # No window: every layer is global (llama.cpp's LLAMA_SWA_TYPE_NONE), i.e. a pattern of 1.
            sliding_window=window or 1, sliding_window_pattern=_sliding_pattern(get, 6) if window else 1, **common)
    common |= dict(rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
                   tie_word_embeddings=tied)
    if arch == "qwen2":
        return qwen2.ModelArgs(model_type="qwen2", **common)
    # llama.cpp's converter permutes llama Q/K rows for interleaved RoPE: traditional=True undoes that.
    return llama.ModelArgs(model_type="llama", head_dim=_head_dim(get, hidden, heads), rope_traditional=True,
                           **common)


# --- model classes ----------------------------------------------------------------------------------------------

@dataclass
class Gemma2Args(gemma2.ModelArgs):
    """mlx-lm's gemma2 arguments, the sliding window its class leaves out (it runs every layer globally), and the
    context length (the loader's, which mlx-lm's gemma2 does not keep)."""

    max_position_embeddings: int = 8192
    sliding_window: int = 4096
    sliding_window_pattern: int = 2


def is_sliding(layer: int, pattern: int) -> bool:
    """llama.cpp's rule (llama_hparams::set_swa_pattern), which mlx-lm's gemma3_text shares."""
    return layer % pattern < pattern - 1


class _Gemma2Body(gemma2.GemmaModel):
    """mlx-lm's gemma2 body, its layers unchanged, each local layer given the sliding-window mask."""

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        h = self.embed_tokens(inputs) * (self.args.hidden_size**0.5)
        cache = cache if cache is not None else [None] * len(self.layers)
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            window = self.args.sliding_window if is_sliding(i, self.args.sliding_window_pattern) else None
            h = layer(h, create_attention_mask(h, c, window_size=window, return_array=True), c)
        return self.norm(h)


class Gemma2Model(gemma2.Model):
    """mlx-lm's gemma2 `Model` with sliding-window local layers (and a window-sized cache for them, as mlx-lm's
    gemma3_text makes)."""

    def __init__(self, args: Gemma2Args) -> None:
        super().__init__(args)
        self.model = _Gemma2Body(args)

    def make_cache(self) -> list:
        pattern, window = self.args.sliding_window_pattern, self.args.sliding_window
        return [RotatingKVCache(max_size=window) if is_sliding(i, pattern) else KVCache()
                for i in range(len(self.layers))]


class _Gemma3Body(gemma3_text.Gemma3Model):
    """llama.cpp scales gemma3's embeddings by √hidden in float32; mlx-lm rounds √hidden to bfloat16 first (as HF
    does for bf16 weights): 33.94 against 34.0 for gemma-3-1b's hidden 1152. The embeddings go in multiplied by the
    ratio, so mlx-lm's factor leaves llama.cpp's scaling (to one float32 rounding)."""

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        if input_embeddings is None:
            exact = self.args.hidden_size ** 0.5
            rounded = mx.array(exact, mx.bfloat16).item()
            input_embeddings = self.embed_tokens(inputs) * (exact / rounded)
        return super().__call__(inputs, cache, input_embeddings)


class Gemma3Model(gemma3_text.Model):
    """mlx-lm's gemma3_text `Model` with llama.cpp's float32 embedding scale."""

    def __init__(self, args: gemma3_text.ModelArgs) -> None:
        super().__init__(args)
        self.model = _Gemma3Body(args)


_CLASSES: dict[str, type[nn.Module]] = {"llama": llama.Model, "mistral": llama.Model, "qwen2": qwen2.Model,
                                        "qwen3": qwen3.Model, "gemma2": Gemma2Model, "gemma3": Gemma3Model}


def model_class(arch: str) -> type[nn.Module]:
    """The mlx-lm class a model of `arch` runs on (built from `model_args`)."""
    return _CLASSES[arch]


# --- weights ----------------------------------------------------------------------------------------------------

class FrequencyRoPE(nn.Module):
    """RoPE whose pair i turns at base**(-2i/dims) / factors[i]: llama.cpp's `rope_freqs` (Llama 3.x's scaling,
    computed by the converter from the HF config) applied as the file gives it, not re-derived."""

    def __init__(self, dims: int, base: float, traditional: bool, scale: float, factors: mx.array) -> None:
        super().__init__()
        self.dims, self.traditional, self.scale = dims, traditional, scale
        # mx.fast.rope's `freqs` are periods (position / freqs is the angle), hence the product.
        self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=self.scale, offset=offset,
                            freqs=self._freqs)


def fix_weights(arch: str, model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The file's tensors (mlx-lm names, from `mlx_name`) as `model` (built from `model_args`, cut to a pipeline
    stage or not) loads them: Gemma's norms less llama.cpp's +1; a llama `rope_freqs` becomes its layers' RoPE."""
    if arch in ("gemma2", "gemma3"):
        weights = {k: v.astype(mx.float32) - 1.0 if k.endswith("norm.weight") else v for k, v in weights.items()}
        if arch == "gemma3" and "lm_head.weight" not in weights:
            weights = model.sanitize(weights)  # mlx-lm's own: a file without output.weight ties the head
    factors = weights.pop(ROPE_FREQS, None)
    if factors is not None:
        args = model.args
        dims = args.head_dim or args.hidden_size // args.num_attention_heads
        if factors.shape != (dims // 2,):
            raise ValueError(f"rope_freqs.weight has shape {factors.shape}, not ({dims // 2},)")
        linear = (args.rope_scaling or {}).get("factor", 1.0)  # llama.cpp applies both, as freq_scale
        rope = FrequencyRoPE(dims, args.rope_theta, args.rope_traditional, 1.0 / linear, factors)
        for layer in model.layers:
            if layer is not None:  # a pipeline stage holds only its own layers
                layer.self_attn.rope = rope
    return weights
