"""Quantized layers that run on mlxchat's native kernel (core/native) on MLX's CPU backend.

`use_native(model)` swaps each affine 4/5/6/8-bit QuantizedLinear (groups of 16 to 128; float32, float16, bfloat16
or `native.compact_params` parameters), and the tied-head use of a QuantizedEmbedding, for these. Where the CPU has
AVX512-VNNI (`native.packs_exact`) the weights are repacked in place into tiles of 16 rows (the same bytes,
reordered: memory stays at the file's size) for the packed matmul, which takes x at fp32's precision as 24-bit
integers per block; elsewhere they stay the arrays the GGUF gave (MLX's layout, the fp32 kernel).

`use_native(model, int8=True)` (weights="native-int8", opt-in) always packs, and rounds x to int8 per block of 32 as
llama.cpp rounds it: the results move by that rounding (the bench's native section measures how far).
"""

from __future__ import annotations

from collections.abc import Collection

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .. import native
from . import heap

# Rows of x above which BLAS's GEMM on the dequantized weight (`native.dequantized_matmul`, a cache-sized piece of
# rows at a time) beats the kernel (prompt prefill). On MLX's layout (the fp32 kernel): equal at 16 rows on the
# embedded model, and on a 1.1B-shaped one (hidden 2048, FFN 5632) TTFT grows smoothly past it (CPU seconds a layer,
# one thread each: 50 / 83 / 116 / 200 ms at 16 / 32 / 64 / 128 rows, against 49 / 96 / 208 / 412 on the kernel).
# On packed weights (fixed24 x) the kernel's rows are cheap: measured the same way, it is as fast as the GEMM up to
# ~256 rows on both model sizes (1.1B: 77 vs 96-126 ms at 50 rows, 187-200 vs 200 at 128, 406-417 vs 388-398 at
# 256, 914 vs 824-863 at 512; 135M-shaped: 34.5 vs 33.7 at 128, 72 vs 66 at 256, 173 vs 150 at 512). It was 48
# when the GEMM took the whole fp32 weight at once: on the 1.1B model that was a 3.3x step from 40 to 50 rows.
# int8 x stays on its kernel at any length: it is what that option asks for. Where the packed kernel runs prompts on
# AMX's tiles (`native.packs_on_amx`) it stays there at any length too: one 5632 x 2048 matrix, 512 rows, one thread,
# CPU time: Q4_K 54-59 ms against 89 dequantized for the GEMM, Q6_K (groups of 16) 89 against 82; at 64 and 256
# rows Q4_K 7.8 against 14, ~28 against 46.
DEQUANTIZE_ROWS = 16
PACKED_DEQUANTIZE_ROWS = 256


def supports_format(bits: int, group_size: int) -> bool:
    """Whether the native kernel runs affine weights of `bits` per code and `group_size` values per scale: 4, 5, 6
    or 8 bits in groups of 16 (Q6_K's sub-blocks, which MLX's own ops refuse), 32, 64 or 128."""
    return bits in (4, 5, 6, 8) and group_size in (16, 32, 64, 128)


def supports(module: nn.Module) -> bool:
    """Whether the native kernel handles this layer's quantization: MLX's affine format in a format
    `supports_format` accepts, with float32/float16/bfloat16 scales and biases."""
    return (isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and not isinstance(module, (NativeQuantizedLinear, NativeQuantizedEmbedding)) and module.mode == "affine"
            and supports_format(module.bits, module.group_size) and module.get("biases") is not None)


PACKED_ROWS = 16  # the packed layout's tiles: a matrix packs where its rows are a multiple of this


def _packable(module: nn.Module) -> bool:
    return module["weight"].shape[0] % PACKED_ROWS == 0


def _matmul(x: mx.array, layer: nn.Module) -> mx.array:
    """x @ the layer's weight.T: on the kernel for a few rows, by BLAS for a long prompt."""
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    rows = x.size // x.shape[-1]
    if (rows > (PACKED_DEQUANTIZE_ROWS if layer.packed else DEQUANTIZE_ROWS) and not layer.int8
            and not (layer.packed and native.packs_on_amx())):
        return native.dequantized_matmul(x, w, scales, biases, group_size=layer.group_size, bits=layer.bits,
                                         packed=layer.packed)
    return native.quantized_matmul(x, w, scales, biases, group_size=layer.group_size, bits=layer.bits,
                                   packed=layer.packed, int8=layer.int8)


def _set_weights(module: nn.Module, layer: nn.Module, pack: bool, int8: bool, packed: bool) -> None:
    """`module`'s weight, scales and biases from `layer`'s, packed where asked and the rows allow (a multiple of 16),
    or as they are where they are `packed` already; `module.packed` and `int8` say how the native matmul takes them."""
    module.group_size, module.bits, module.mode = layer.group_size, layer.bits, layer.mode
    module.packed = packed or (pack and _packable(layer))
    module.int8 = int8 and module.packed
    weights = (layer["weight"], layer["scales"], layer["biases"])
    if module.packed and not packed:
        weights = native.pack_weights(*weights, group_size=layer.group_size, bits=layer.bits)
    module.weight, module.scales, module.biases = weights
    # Q4_0/Q5_0/Q8_0's biases are their scales times -2^(bits - 1): the kernels compute them instead of reading them
    # (`native.read_ggml` gives the stand-in already).
    if not native.is_symmetric(module.biases):
        stand_in = native.symmetric_biases(module.scales, module.biases, bits=layer.bits)
        if stand_in is not None:
            module.biases = stand_in


# Subclasses of MLX's quantized layers, so code that looks for quantized layers (mlx-lm's utilities, the bench's
# weight-format case) still finds them. MLX's __init__ is skipped: it would quantize fresh random weights.
class NativeQuantizedLinear(nn.QuantizedLinear):
    """QuantizedLinear's parameters and call, computed by the native kernel. `packed`: the weights are in the
    packed matmul's layout (`native.pack_weights`); `int8`: it rounds x to int8."""

    def __init__(self, layer: nn.QuantizedLinear, pack: bool = False, int8: bool = False, packed: bool = False):
        nn.Module.__init__(self)
        _set_weights(self, layer, pack, int8, packed)
        if "bias" in layer:
            self.bias = layer["bias"]
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(x, self)
        return y + self["bias"] if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """QuantizedEmbedding: `as_linear` (a tied output head) is native. The lookup (a few rows) is MLX's own on MLX's
    layout; on packed weights it is `native.packed_lookup`, which gives the same values."""

    def __init__(self, layer: nn.QuantizedEmbedding, pack: bool = False, int8: bool = False, packed: bool = False):
        nn.Module.__init__(self)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        _set_weights(self, layer, pack, int8, packed)
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        if self.packed:
            return native.packed_lookup(x, self["weight"], self["scales"], self["biases"],
                                        group_size=self.group_size, bits=self.bits)
        # MLX's dequantize reads neither groups of 16 (Q6_K) nor compact or symmetric parameters: the native one does.
        if self.group_size < 32 or native.is_compact(self["scales"]) or native.is_symmetric(self["biases"]):
            rows = x.reshape(-1)
            return native.dequantize(self["weight"][rows], self["scales"][rows], self["biases"][rows],
                                     group_size=self.group_size, bits=self.bits).reshape(*x.shape, self.dims)
        # In float32: MLX dequantizes in its scales' dtype, and an f16 scale times a code does not fit f16 (Q8_0's
        # d * q needs 15 bits). The rows' parameters only are widened: the embedding stays at the file's size.
        return mx.dequantize(self["weight"][x], scales=self["scales"][x].astype(mx.float32),
                             biases=self["biases"][x].astype(mx.float32), group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return _matmul(x, self)


def use_native(model: nn.Module, int8: bool = False, packed: Collection[str] = ()) -> int:
    """Replace the model's supported quantized layers in place; returns how many were replaced. Packed where
    `native.packs_exact()` or `int8` (x rounded to int8), for layers whose rows are a multiple of 16 (the rest keep
    MLX's layout and the fp32 kernel). `packed`: the paths of layers whose arrays are in the packed layout already
    (`native.read_ggml` read them so), which are taken as they are."""
    pack = int8 or native.packs_exact()
    paths = [path for path, module in model.named_modules() if supports(module)]
    as_they_are = []  # layers that take the arrays they were given: swapped in together, at the end
    for path in paths:
        module = _submodule(model, path)
        cls = NativeQuantizedEmbedding if isinstance(module, nn.QuantizedEmbedding) else NativeQuantizedLinear
        new = cls(module, pack, int8, path in packed)
        if new["weight"] is module["weight"]:
            as_they_are.append((path, new))
            continue
        # Repacked: one at a time, each evaluated and swapped in before the next is packed, so the old arrays go as
        # the new ones come and a model is never held twice (a 1.1B model's load peaked at twice its weights).
        mx.eval(new.parameters())
        model.update_modules(tree_unflatten([(path, new)]))
        heap.give_back_freed_memory()
    if as_they_are:
        model.update_modules(tree_unflatten(as_they_are))
    return len(paths)


def _submodule(model: nn.Module, path: str) -> nn.Module:
    module = model
    for part in path.split("."):
        module = module[int(part)] if isinstance(module, list) else module[part]
    return module


def mlx_weights(module: nn.Module) -> tuple[mx.array, mx.array, mx.array]:
    """A quantized layer's (weight, scales, biases) in MLX's layout, unpacked if it is packed, with float32
    parameters if they are `native.compact_params`'s and the biases stored if they are `native.symmetric_biases`'s."""
    w, scales, biases = module["weight"], module["scales"], module["biases"]
    if getattr(module, "packed", False):
        w, scales, biases = native.unpack_weights(w, scales, biases, group_size=module.group_size, bits=module.bits)
    if native.is_compact(scales):
        scales, biases = native.expand_params(scales, biases, group_size=module.group_size)
    if native.is_symmetric(biases):
        biases = native.expand_symmetric(scales, bits=module.bits)
    return w, scales, biases


def use_mlx_layout(model: nn.Module) -> int:
    """Unpack every packed layer in place (they then run the fp32 kernel), for code that slices MLX's layout itself
    (mlx-lm's `shard()`); returns how many. Fused decoder layers hold the old arrays: plan them again after."""
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, (NativeQuantizedLinear, NativeQuantizedEmbedding)) and module.packed:
            module.weight, module.scales, module.biases = mlx_weights(module)
            module.packed = module.int8 = False
            count += 1
    return count
