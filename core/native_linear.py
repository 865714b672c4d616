"""Quantized layers that run on mlxchat's native kernel (core/native) on MLX's CPU backend.

`use_native(model)` swaps each affine 4/8-bit QuantizedLinear, and the tied-head use of a QuantizedEmbedding, for
these; the weights stay the same arrays (the GGUF's bytes, as mx.load maps them), so memory stays near the file size.
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


def _matmul(x: mx.array, layer: nn.Module) -> mx.array:
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    if x.size // x.shape[-1] > DEQUANTIZE_ROWS:
        return x @ native.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits).T
    return native.quantized_matmul(x, w, scales, biases, group_size=layer.group_size, bits=layer.bits)


# Subclasses of MLX's quantized layers, so code that looks for quantized layers (mlx-lm's utilities, the bench's
# weight-format case) still finds them. MLX's __init__ is skipped: it would quantize fresh random weights.
class NativeQuantizedLinear(nn.QuantizedLinear):
    """QuantizedLinear's parameters and call, computed by the native kernel."""

    def __init__(self, layer: nn.QuantizedLinear):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.weight, self.scales, self.biases = layer["weight"], layer["scales"], layer["biases"]
        if "bias" in layer:
            self.bias = layer["bias"]
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(x, self)
        return y + self["bias"] if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """QuantizedEmbedding: the lookup is MLX's own (a few rows), `as_linear` (a tied output head) is native."""

    def __init__(self, layer: nn.QuantizedEmbedding):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.weight, self.scales, self.biases = layer["weight"], layer["scales"], layer["biases"]
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return mx.dequantize(self["weight"][x], scales=self["scales"][x], biases=self["biases"][x],
                             group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return _matmul(x, self)


def use_native(model: nn.Module) -> int:
    """Replace the model's supported quantized layers in place; returns how many were replaced."""
    swaps = []
    for path, module in model.named_modules():
        if supports(module):
            cls = NativeQuantizedEmbedding if isinstance(module, nn.QuantizedEmbedding) else NativeQuantizedLinear
            swaps.append((path, cls(module)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)
