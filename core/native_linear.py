"""Quantized layers that run on mlxchat's native kernel (core/native) on MLX's CPU backend.

`use_native(model)` swaps each affine 4/8-bit QuantizedLinear, and the tied-head use of a QuantizedEmbedding, for
these; the weights stay the same arrays (the GGUF's bytes, as mx.load maps them), so memory stays near the file size.

`use_native(model, int8=True)` (weights="native-int8", opt-in) repacks each layer's weights for the int8-activation
matmul instead (the same bytes, reordered; a tied embedding keeps its own copy for the lookup, so the head's bytes
are held twice): x is rounded to int8 per block of 32 as llama.cpp rounds it, and the results move by that rounding
(the bench's native section measures how far).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import native

# Rows of x above which dequantizing the layer to fp32 and running one BLAS GEMM beats the kernel (prompt prefill).
# Measured by `mlxchat bench` (the native section's prefill crossover): equal at 16 rows here, BLAS 1.6x faster at 32.
DEQUANTIZE_ROWS = 16


def supports(module: nn.Module) -> bool:
    """Whether the native kernel handles this layer's quantization."""
    return (isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and not isinstance(module, (NativeQuantizedLinear, NativeQuantizedEmbedding)) and module.mode == "affine"
            and module.bits in (4, 8) and module.group_size in (32, 64, 128) and module.get("biases") is not None)


def _packable(module: nn.Module) -> bool:
    return module["weight"].shape[0] % 16 == 0


def _matmul(x: mx.array, layer: nn.Module, prefix: str = "") -> mx.array:
    w, scales, biases = layer[prefix + "weight"], layer[prefix + "scales"], layer[prefix + "biases"]
    if prefix or layer.packed:  # packed weights have no fp32 form; their kernel is the faster one at any length
        return native.quantized_matmul(x, w, scales, biases, group_size=layer.group_size, bits=layer.bits,
                                       packed=True)
    if x.size // x.shape[-1] > DEQUANTIZE_ROWS:
        return x @ native.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits).T
    return native.quantized_matmul(x, w, scales, biases, group_size=layer.group_size, bits=layer.bits)


# Subclasses of MLX's quantized layers, so code that looks for quantized layers (mlx-lm's utilities, the bench's
# weight-format case) still finds them. MLX's __init__ is skipped: it would quantize fresh random weights.
class NativeQuantizedLinear(nn.QuantizedLinear):
    """QuantizedLinear's parameters and call, computed by the native kernel. `packed`: the weights are in the
    int8-activation matmul's layout (`native.pack_int8_weights`)."""

    def __init__(self, layer: nn.QuantizedLinear, int8: bool = False):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.packed = int8 and _packable(layer)
        weights = (layer["weight"], layer["scales"], layer["biases"])
        if self.packed:
            weights = native.pack_int8_weights(*weights, group_size=self.group_size, bits=self.bits)
        self.weight, self.scales, self.biases = weights
        if "bias" in layer:
            self.bias = layer["bias"]
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(x, self)
        return y + self["bias"] if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """QuantizedEmbedding: the lookup is MLX's own (a few rows), `as_linear` (a tied output head) is native. With
    int8 the head reads a packed copy (head_weight, head_scales, head_biases); the lookup keeps MLX's layout."""

    def __init__(self, layer: nn.QuantizedEmbedding, int8: bool = False):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.weight, self.scales, self.biases = layer["weight"], layer["scales"], layer["biases"]
        self.packed = False  # the lookup's own weights never are
        if int8 and _packable(layer):
            self.head_weight, self.head_scales, self.head_biases = native.pack_int8_weights(
                self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return mx.dequantize(self["weight"][x], scales=self["scales"][x], biases=self["biases"][x],
                             group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return _matmul(x, self, "head_" if "head_weight" in self else "")


def use_native(model: nn.Module, int8: bool = False) -> int:
    """Replace the model's supported quantized layers in place; returns how many were replaced. `int8`: with packed
    weights and int8 activations where the layer's rows are a multiple of 16 (the rest keep the fp32 kernel)."""
    swaps = []
    for path, module in model.named_modules():
        if supports(module):
            cls = NativeQuantizedEmbedding if isinstance(module, nn.QuantizedEmbedding) else NativeQuantizedLinear
            swaps.append((path, cls(module, int8)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)
