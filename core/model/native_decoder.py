"""Whole decoder layers of llama-family models as one native op each, for the few rows of a decode step.

On MLX's CPU backend every graph node costs ~20-40 us of dispatch, and a llama layer in MLX ops is ~110 nodes (RMSNorm
and RoPE are composed of small ops on the CPU, the KV cache update is four more): measured on the embedded model, a
decode step was 26 ms of which 11 ms in the native kernels, the rest mostly dispatch. `use_fused_layers(model)`
re-classes each mlx-lm llama, qwen2 or qwen3 `TransformerBlock` (mistral loads as llama; exactly those classes:
Gemma's blocks, with four norms or soft-capping, keep their own call) in place to a subclass whose call is one
`native.decoder_layer` node (RMSNorm, the q/k/v projections, qwen3's per-head q/k RMSNorms, RoPE, the append to the
layer's KV cache, attention, o_proj, residual, RMSNorm, gate/up, SwiGLU, down, residual) when it computes what the
block computes:
float32 activations, all seven projections on the native kernel (biases only on q, k and v, float32, as qwen2's),
`nn.RoPE`, and either at most `FUSED_ROWS` rows of one sequence in mlx-lm's plain `KVCache` (no mask or "causal";
a prompt's chunk of up to `FUSED_PROMPT_ROWS` where the projections are packed), or one row each of at most
`FUSED_ROWS` sequences in the server's `BatchKVCache` (the mask is the cache's own: its left
padding, which the op takes instead). Anything else (a longer prefill chunk, a rotating or quantized cache, other RoPE
variants, Metal) takes the block's own call, i.e. the MLX-op path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache, KVCache

from .. import native
from .native_linear import PACKED_DEQUANTIZE_ROWS, NativeQuantizedLinear

# Rows (query positions, or sequences of a batch's decode step) up to which a layer is one op: a decode step (1), a
# speculative verification (<= 8), small batches of rows. Above, projections on MLX's layout dequantize for BLAS
# (native_linear.DEQUANTIZE_ROWS), which the op does not.
FUSED_ROWS = 16
# A prompt's chunk where all seven projections are packed: those stay on the kernel up to
# native_linear.PACKED_DEQUANTIZE_ROWS rows, so the op takes the chunk too. On the MLX-op path a layer is ~110 graph
# nodes (~20-40 us of dispatch each on the CPU): measured on the embedded model (prefill and first step from an empty
# cache), 32 tokens 72-75 -> 44-47 ms, 64 tokens 107 -> 70-76, 128 tokens 165 -> 121-131, 256 tokens the same (~300).
FUSED_PROMPT_ROWS = PACKED_DEQUANTIZE_ROWS

_ACTIVATIONS = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class _Plan:
    """What a block's fused call needs: its shape, and its parameters in the op's order, gathered and checked once
    (reading the 24 of them through mlx.nn's attribute lookup at every call was ~0.6 ms of Python per decode step,
    and handing them to the op as a list another ~0.2 ms). The plan holds the arrays themselves, so
    `use_fused_layers` must run again when a layer's parameters are replaced (as after mlx-lm's `shard()`); nothing
    else replaces them after loading."""

    shape: Any  # native LayerShape (its n_kv_heads and head_dim are read here)
    layer: Any  # native LayerWeights: the norms, RoPE's frequencies, the 7 projections (packed or not), q/k/v biases
    rows: int  # the most query positions of one sequence the op takes (FUSED_ROWS, or FUSED_PROMPT_ROWS if packed)


def _projections(block: nn.Module) -> list[nn.Module]:
    attn, mlp = block.self_attn, block.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def _plan(block: nn.Module) -> _Plan | None:
    """The block's plan, or None when the fused op would not compute what the block computes."""
    attn, rope = block.self_attn, block.self_attn.rope
    projections = _projections(block)
    norms = (block.input_layernorm, block.post_attention_layernorm)
    head_dim = attn.q_proj["weight"].shape[0] // attn.n_heads  # qwen2's Attention keeps no head_dim
    qkv_bias = ["bias" in p for p in projections[:3]]
    # qwen3's per-head q/k RMSNorms (over head_dim, before RoPE); llama's and qwen2's Attention have none.
    qk_norms = [attn[name] for name in ("q_norm", "k_norm") if name in attn]
    if (type(rope) is not nn.RoPE or rope.dims > head_dim or qkv_bias not in ([False] * 3, [True] * 3)
            or not all(p["bias"].dtype == mx.float32 for p in projections[:3] if "bias" in p)
            or not all(type(p) is NativeQuantizedLinear for p in projections)
            or any("bias" in p for p in projections[3:])
            or not all(type(n) is nn.RMSNorm and n.weight.dtype == mx.float32 for n in norms + tuple(qk_norms))
            or any(n.eps != norms[0].eps for n in norms[1:] + tuple(qk_norms))
            or len(qk_norms) not in (0, 2) or any(n.weight.shape != (head_dim,) for n in qk_norms)):
        return None
    # RoPE's frequencies, computed by the ops mx.fast.rope composes on the CPU.
    inv_freqs = native.rope_inv_freqs(rope.dims, rope.base)
    mx.eval(inv_freqs)
    weights = [block.input_layernorm.weight, block.post_attention_layernorm.weight, inv_freqs]
    for p in projections:
        weights += [p["weight"], p["scales"], p["biases"]]
    weights += [p["bias"] for p in projections[:3] if "bias" in p]
    weights += [n.weight for n in qk_norms]
    shape = native.layer_shape(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=head_dim,
                               norm_eps=norms[0].eps, rope_dims=rope.dims, rope_traditional=rope.traditional,
                               rope_scale=rope.scale, attention_scale=attn.scale, qk_norm=bool(qk_norms))
    layer = native.layer_weights(weights, [p.group_size for p in projections], [p.bits for p in projections],
                                 [int(p.packed) for p in projections], any(p.int8 for p in projections), shape)
    return _Plan(shape, layer, FUSED_PROMPT_ROWS if all(p.packed for p in projections) else FUSED_ROWS)


def _grown(keys: mx.array | None, values: mx.array | None, used: int, rows: int, shape: tuple[int, int, int],
           step: int) -> tuple[mx.array, mx.array]:
    """Cache buffers with room for `rows` more positions after `used`, grown as mlx-lm's KVCache and BatchKVCache
    grow them in update_and_fetch; `shape` is (batch, kv heads, head_dim)."""
    if keys is not None and values is not None and used + rows <= keys.shape[2]:
        return keys, values
    batch, kv_heads, head_dim = shape
    size = (batch, kv_heads, (step + rows - 1) // step * step, head_dim)
    new_keys, new_values = mx.zeros(size, mx.float32), mx.zeros(size, mx.float32)
    if keys is None or values is None:
        return new_keys, new_values
    if used % step != 0:
        keys, values = keys[..., :used, :], values[..., :used, :]
    return mx.concatenate([keys, new_keys], axis=2), mx.concatenate([values, new_values], axis=2)


def _fits(x: mx.array, mask: Any, cache: Any, rows: int) -> bool:
    """Whether a call's arguments are ones the fused op computes as the block does: up to `rows` rows of one sequence
    in a plain float32 KVCache with no mask or "causal", or one row of each of a few sequences in a BatchKVCache."""
    if type(cache) not in (KVCache, BatchKVCache) or not enabled() or x.dtype not in _ACTIVATIONS or (
            cache.keys is not None and cache.keys.dtype != mx.float32):
        return False
    if type(cache) is BatchKVCache:  # its mask is made from its left padding, which the op takes instead
        return x.shape[0] <= FUSED_ROWS and x.shape[1] == 1
    plain_mask = mask is None or (isinstance(mask, str) and mask == "causal")
    return x.shape[0] == 1 and x.shape[1] <= rows and plain_mask


@functools.cache
def _no_padding() -> mx.array:
    """A single sequence's left padding, for the op."""
    padding = mx.zeros((1,), mx.int32)
    mx.eval(padding)
    return padding


class FusedTransformerBlock:
    """The call of mlx-lm's llama/qwen2/qwen3 `TransformerBlock` (the three are the same), as one native op where
    `_plan` and the call's arguments allow."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        plan = self.__dict__.get("_mlxchat_plan")
        if plan is None or not _fits(x, mask, cache, plan.rows):
            return super().__call__(x, mask, cache)
        batch, rows = x.shape[:2]
        # The first layer gets the embedding's rows in its scales' dtype (fp16 for a GGUF): the block computes on
        # them in float32 (RMSNorm casts, the residual promotes), so the exact cast here changes nothing.
        x = x.astype(mx.float32)
        shape = (batch, plan.shape.n_kv_heads, plan.shape.head_dim)

        def layer(keys: mx.array | None, values: mx.array | None, used: int,
                  padding: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            keys, values = _grown(keys, values, used, rows, shape, cache.step)
            out, keys, values = native.decoder_layer(x, keys, values, plan.layer, offset=used,
                                                     causal=mask is not None, left_padding=padding)
            return out, keys, values

        if type(cache) is BatchKVCache:  # through its public state: (keys, values, offsets, left padding, index)
            keys, values, _, padding, used = cache.state
            out, keys, values = layer(keys, values, used, padding.astype(mx.int32))
            # Each row's offset is the index less its padding (mlx-lm keeps it so); made afresh, not `offsets + rows`,
            # which nothing here evaluates: a chain of one add per step per layer would grow for the whole reply.
            cache.state = (keys, values, (used + rows) - padding, padding, used + rows)
            return out
        out, cache.keys, cache.values = layer(cache.keys, cache.values, cache.offset, _no_padding())
        cache.offset += rows
        return out


def enabled() -> bool:
    """Whether fused layers run (read at each call): MLXCHAT_NATIVE_LAYERS=0 switches them off, e.g. to compare."""
    return native.has_layer_op() and not native.switched_off("MLXCHAT_NATIVE_LAYERS")


# Exactly these classes (not subclasses, whose calls may differ): their calls are the one above.
_FUSED = {cls: type(f"Fused{name}TransformerBlock", (FusedTransformerBlock, cls), {})
          for name, cls in (("Llama", llama.TransformerBlock), ("Qwen2", qwen2.TransformerBlock),
                            ("Qwen3", qwen3.TransformerBlock))}


_BASES = {fused: cls for cls, fused in _FUSED.items()}


def use_fused_layers(model: nn.Module) -> int:
    """Re-class the model's llama/qwen2/qwen3 decoder layers that the fused op computes exactly; returns how many. Run
    again after the layers change (mlx-lm's `shard()` swaps their projections and heads): a layer the op no longer
    computes goes back to its own class."""
    if not native.has_layer_op():
        return 0
    changed = 0
    for _, module in model.named_modules():
        base = _BASES.get(type(module), type(module))
        fused = _FUSED.get(base)
        if fused is None:
            continue
        plan = _plan(module)
        module.__class__ = fused if plan is not None else base
        object.__setattr__(module, "_mlxchat_plan", plan)
        changed += plan is not None
    return changed


def fused_layers(model: nn.Module) -> tuple[int, int]:
    """(fused, all) decoder layers of `model`, for "fused layers: 0/28" in --stats: every architecture's layers
    count (those of the gemma families run on MLX ops); 0 fused while fused layers are switched off."""
    layers = [layer for layer in getattr(model, "layers", []) if layer is not None]
    fused = sum(isinstance(layer, FusedTransformerBlock) for layer in layers) if enabled() else 0
    return fused, len(layers)


def describe(model: nn.Module) -> str:
    """Which decode path runs, for --stats and the bench: "decode: 30/30 layers fused", and "decode: 0/28 layers
    fused" for the native path's architectures the op does not cover (gemma) ("" off the native path)."""
    if not any(isinstance(m, NativeQuantizedLinear) for _, m in model.named_modules()):
        return ""
    fused, layers = fused_layers(model)
    return f"decode: {fused}/{layers} layers fused"
