"""Attention and the gated MLP of llama-style models on mlxchat's native CPU ops (core/native).

MLX's CPU `exp` is scalar on x86 (about 16 ns an element here), so attention's softmax and the MLP's silu were most of
a long prompt's prefill: at 512 tokens 1.5 s and 0.5 s of 3 s. `use_native_blocks(model)` re-classes each mlx-lm
`Attention`/`MLP` module of a supported architecture in place to a subclass whose call runs those two on the native
kernels; parameters and module tree are unchanged, so saving, sharding and mlx-lm's utilities see the same model.

In a prefill chunk attention keeps MLX's BLAS matmuls for `q @ k^T` and `p @ v` and only the masked softmax in between
is native; a decode step's attention is one native op (in MLX ops it was a dozen graph nodes and 18 tiny BLAS calls a
layer: ~8 ms of a 38 ms token at 32 tokens of context, ~17 ms at 512). Masks other
than none or "causal" (a rotating window's, a padded batch's), a quantized KV cache and non-float32 activations take
mlx-lm's own path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import scaled_dot_product_attention

from .. import native


# Queries up to which attention is one native op (a decode step: L = 1). Above, a prefill chunk's attention is two
# BLAS matmuls around the native softmax, which use the cores better on hundreds of rows.
WHOLE_ATTENTION_QUERIES = 8


# Queries a causal prefill's attention takes at a time: each piece's matmuls stop at the last key its rows see, so a
# prompt's upper triangle (masked, half its scores) is mostly not computed, and a piece's scores stay in cache.
# 512 tokens, one thread, CPU ms a layer: the 1.1B shape (32 heads, 4 KV heads, 64 a head) 42.6 whole, 22.3 in
# pieces of 128 (21.9 of 64, 25.1 of 256); the embedded model's (9 heads, 3 KV heads) 6.7 whole, 6.1 in pieces.
CAUSAL_PIECE_QUERIES = 128


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool) -> mx.array:
    """Scaled dot-product attention of float32 `queries [B, H, L, D]` over `keys/values [B, H_kv, S, D]` (grouped
    heads when H > H_kv), as `mx.fast.scaled_dot_product_attention` with no mask or mask="causal"."""
    L = queries.shape[2]
    if L <= WHOLE_ATTENTION_QUERIES:
        return native.attention(queries, keys, values, scale=scale, causal=causal)
    if not causal or L <= CAUSAL_PIECE_QUERIES:
        return _scores_attention(queries, keys, values, scale, causal)
    # Query i sees keys 0 .. S - L + i (the mask aligned to the last keys): a piece of queries ending at i1 needs the
    # first S - L + i1, and with those alone the same mask holds for it.
    S = keys.shape[2]
    pieces = []
    for i0 in range(0, L, CAUSAL_PIECE_QUERIES):
        i1 = min(L, i0 + CAUSAL_PIECE_QUERIES)
        seen = S - L + i1
        pieces.append(_scores_attention(queries[:, :, i0:i1], keys[:, :, :seen], values[:, :, :seen], scale, True))
    return mx.concatenate(pieces, axis=2)


def _scores_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool) -> mx.array:
    """`attention` as two BLAS matmuls around the native softmax."""
    B, H, L, D = queries.shape
    kv_heads = keys.shape[1]
    if H != kv_heads:  # grouped-query attention: each key/value head serves H / kv_heads query heads
        queries = queries.reshape(B, kv_heads, H // kv_heads, L, D)
        keys, values = keys[:, :, None], values[:, :, None]
    scores = queries @ keys.swapaxes(-1, -2)
    out = native.softmax(scores, scale=scale, causal=causal) @ values
    return out.reshape(B, H, L, D)


def _attend(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any) -> mx.array:
    plain_mask = mask is None or (isinstance(mask, str) and mask == "causal")
    if plain_mask and not hasattr(cache, "bits") and queries.dtype == mx.float32 and keys.dtype == mx.float32:
        return attention(queries, keys, values, scale, causal=mask is not None)
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)


class NativeAttention:
    """The call of mlx-lm's llama/qwen2 `Attention` (the two are the same), with `_attend` for the softmax."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        out = _attend(queries, keys, values, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class NativeMLP:
    """The call of mlx-lm's llama/qwen2 `MLP`, with the native SwiGLU for float32 activations."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype == mx.float32 and up.dtype == mx.float32:
            return self.down_proj(native.swiglu(gate, up))
        return self.down_proj(nn.silu(gate) * up)


# Exactly these classes (not subclasses, whose calls may differ): their calls are the ones copied above.
_REPLACEMENTS: dict[type, type] = {
    cls: type(f"Native{module.__name__.rsplit('.', 1)[-1].title()}{cls.__name__}", (mixin, cls), {})
    for module in (llama, qwen2)
    for cls, mixin in ((module.Attention, NativeAttention), (module.MLP, NativeMLP))
}


def use_native_blocks(model: nn.Module) -> int:
    """Re-class the model's supported attention and MLP modules in place; returns how many were changed."""
    changed = 0
    for _, module in model.named_modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
            changed += 1
    return changed
