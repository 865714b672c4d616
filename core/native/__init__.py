"""mlxchat's native quantized matmul, attention/MLP and sampling ops for MLX's CPU backend (a C++ MLX extension,
built by setup.py).

MLX's own CPU ``quantized_matmul`` dequantizes to fp32 first (~1 GB/s here), so without this the loader has to keep
fp32 weights (5.5x the GGUF's size). These ops read MLX's affine 4/5/6/8-bit format directly (groups of 16, 32, 64
or 128; 16 is Q6_K's sub-block, which MLX's own ops refuse) (or its bytes repacked into
tiles of 16 rows, `pack_weights`), exact to fp32 rounding unless int8 is asked for, as lazy graph nodes
(``mx.eval``, ``mx.async_eval`` and ``mx.compile`` work as with any MLX op).

``available()`` says whether they can run here and ``unavailable_reason()`` why not: the extension was not built (no
compiler or CMake at install time), the CPU lacks AVX2/FMA/F16C, or ``MLXCHAT_NATIVE=0`` switched it off.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType

import mlx.core as mx  # first: loads libmlx and registers mx.array with nanobind, which _ext's signatures use

_FIX = "reinstall with a C++17 compiler and CMake >= 3.24 present (`bash scripts/setup.sh` or `pip install -e .`)"


def _load() -> tuple[ModuleType | None, str]:
    if importlib.util.find_spec(f"{__name__}._ext") is None:
        return None, f"the native extension is not built; {_FIX}"
    try:
        from . import _ext
    except ImportError as e:  # built against another mlx/nanobind, or a missing libmlx
        return None, f"the native extension does not load ({str(e).splitlines()[0]}); {_FIX}"
    if not _ext.cpu_supported():
        return None, _ext.cpu_unsupported_reason()
    return _ext, ""


_ext, _reason = _load()
_HAS_LAYER_OP = hasattr(_ext, "decoder_layer")


_OFF = ("0", "false", "no", "off")


def switched_off(variable: str) -> bool:
    """Whether an on/off environment variable (on by default) is set to 0/false/no/off. Asked by each layer of each
    decode step, so the common case (unset) costs one lookup."""
    value = os.environ.get(variable)
    return value is not None and value.strip().lower() in _OFF


def _disabled() -> bool:
    return switched_off("MLXCHAT_NATIVE")


def available() -> bool:
    """Whether the native ops can run in this process (read at each call, so MLXCHAT_NATIVE=0 takes effect)."""
    return _ext is not None and not _disabled()


def has_layer_op() -> bool:
    """Whether the fused decoder-layer op can run (an extension built before it was added lacks it until setup runs
    again; the layers then keep their MLX-op path)."""
    return _HAS_LAYER_OP and not _disabled()


def unavailable_reason() -> str:
    """Why `available()` is False ("" when it is True)."""
    if _disabled():
        return "switched off by MLXCHAT_NATIVE=0"
    return _reason


def _module() -> ModuleType:
    if not available():
        raise RuntimeError(f"the native quantized matmul is unavailable: {unavailable_reason()}")
    return _ext  # type: ignore[return-value]


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                     bits: int, packed: bool = False, int8: bool = False) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` for MLX's affine format, 4, 5, 6 or 8 bits, groups of 16/32/64/128
    (K a multiple of 32), with fp32/fp16/bf16 scales (or `compact_params`'s); x of any shape ``[..., K]`` and float
    dtype (the result has x's dtype), any strides.
    ``packed``: the weights come from `pack_weights`, and x is taken as integers per block of 32: with ``int8``
    rounded to 8 bits (opt-in, weights="native-int8"), else to fp32's precision (fixed24; needs `packs_exact`)."""
    return _module().quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits, packed=packed,
                                      int8=int8)


def pack_weights(w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                 bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """``(w, scales, biases)`` reordered for the packed matmul: the same shapes, dtypes and bytes, in tiles of 16
    output rows (the row count must be a multiple of 16), so one integer dot instruction serves 16 outputs."""
    return tuple(_module().pack_weights(w, scales, biases, group_size=group_size, bits=bits))  # type: ignore


def unpack_weights(w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                   bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """`pack_weights`'s inverse: the arrays back in MLX's layout."""
    return tuple(_module().unpack_weights(w, scales, biases, group_size=group_size, bits=bits))  # type: ignore


def packed_lookup(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                  bits: int) -> mx.array:
    """Rows ``ids`` of a `pack_weights` weight, ``[*ids.shape, K]``, in float32 (scale * q, then + bias: as
    ``mx.dequantize`` computes them from MLX's layout with float32 parameters, whatever the parameters' type): a tied
    embedding's lookup when its head is packed."""
    return _module().packed_lookup(ids, w, scales, biases, group_size=group_size, bits=bits)


def compact_params(scales: mx.array, biases: mx.array, *, group_size: int) -> tuple[mx.array, mx.array] | None:
    """A K-quant layer's float32 ``scales`` and ``biases`` ``[N, K / group_size]`` (MLX's layout) in a compact
    two-level form at about the GGUF's size, or None where they do not fit it exactly (then keep the float32 ones).

    The form: per super-block of 256 values along K an fp16 ``D``, and per group an int8 multiplier ``q``, the
    parameter being ``float(D) * q`` (exact in float32). Q4_K/Q5_K's scales ``d * sc`` and biases ``-(dmin * m)``
    and Q6_K's ``d * sc`` and ``-32 * d * sc`` fit it bit for bit; Q4_K's parameters go from 1.5 bits a weight to
    0.625 (the file: 0.5), Q6_K's from 4 to 1.125 (the file: 0.56), so Q4_K weights take 1.03x the file and Q6_K's
    1.09x. Needs ``group_size`` 16 or 32 and K a multiple of 256 (else None).

    Returns two uint8 arrays ``[N, K / 256 * (2 + 256 / group_size)]`` that take the float32 arrays' place in every
    op of this module (`quantized_matmul`, `dequantize`, `pack_weights`/`unpack_weights`, `packed_lookup`,
    `layer_weights`), with the same w, ``group_size`` and ``bits``: the results are bit for bit those of the float32
    parameters (each piece of rows gets its parameters expanded to float32 in cache just before the kernel runs).
    MLX's own ops cannot read them: `expand_params` gives the float32 ones back. Computed now (evaluates its inputs).
    """
    out = _module().compact_params(scales, biases, group_size=group_size)
    return None if out is None else (out[0], out[1])


def read_ggml(path: str, offset: int, ggml_type: str, rows: int, cols: int, *,
              packed: bool) -> tuple[mx.array, mx.array, mx.array] | None:
    """A GGUF tensor of ggml type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (``rows`` of ``cols`` values, its
    blocks at byte ``offset`` of the file) read straight into ``(w, scales, biases)`` for this module's ops, in one
    pass on the kernel's threads, a few rows of the file at a time: the values are llama.cpp's dequantization of the
    file exactly (core/model/gguf_tensors.py's table). ``scales``/``biases`` are float16 (``[rows, cols / 32]``), or for
    the K-quants `compact_params`'s form; Q4_0/Q5_0/Q8_0's biases are `symmetric_biases`'s stand-in wherever it
    stands for them (every block but one whose -2^(bits - 1) d overflows an f16). ``packed``: in `pack_weights`'s
    layout (``rows`` a multiple of 16), else MLX's. None where a K-quant's parameters do not fit the compact form
    (then convert it another way). Raises RuntimeError when the file cannot be read or ends inside the tensor."""
    return read_ggml_many(path, [(offset, ggml_type, rows, cols, packed)])[0]


def read_ggml_many(path: str, places: list[tuple[int, str, int, int, bool]]
                   ) -> list[tuple[mx.array, mx.array, mx.array] | None]:
    """`read_ggml` on each ``(offset, ggml_type, rows, cols, packed)`` of one file, in order, in one call that holds
    no GIL throughout (the loader builds the tokenizer on another thread meanwhile). Raises as `read_ggml` does, at
    the first tensor that fails."""
    ext = _module()
    out = ext.read_ggml_many(path, [ext.GgmlPlace(*p) for p in places])
    return [None if arrays is None else (arrays[0], arrays[1], arrays[2]) for arrays in out]


def gguf_strings(path: str, offset: int, count: int) -> tuple[list[str], int, str]:
    """``count`` GGUF metadata strings (each a uint64 byte length and its UTF-8 bytes) from byte ``offset`` of the
    file: ``(strings, the byte after the last, "")``, or where the file ends inside one or one is not UTF-8, the
    strings before it, the byte where it starts and ``"ends"`` or ``"utf-8"`` (core/model/gguf.py's `StringsReader`)."""
    items, end, problem = _module().gguf_strings(path, offset, count)
    return items, end, problem


def expand_params(scales: mx.array, biases: mx.array, *, group_size: int,
                  packed: bool = False) -> tuple[mx.array, mx.array]:
    """`compact_params`'s arrays (in MLX's layout, or `pack_weights`'s with ``packed``) back as the float32 scales
    and biases ``[N, K / group_size]`` in MLX's layout, bit for bit."""
    out = _module().expand_params(scales, biases, group_size=group_size, packed=packed)
    return out[0], out[1]


def symmetric_biases(scales: mx.array, biases: mx.array, *, bits: int) -> mx.array | None:
    """For float16 ``scales`` and ``biases`` where every bias is ``-2^(bits - 1)`` times its scale exactly in float32
    (ggml's Q4_0, Q5_0 and Q8_0: -8 d, -16 d, -128 d), the array that stands for those biases in this module's ops:
    an empty ``[N, 0]`` float16 array, since the ops compute each bias from its scale (exact in float32, so the
    results are bit for bit those of the stored biases). None where some bias is not (keep them). The biases were a
    ninth of a Q4_0 model: 5 bits a weight against the file's 4.5. Either layout (MLX's or `pack_weights`'s): the
    two arrays share it. MLX's own ops cannot read the empty array: `expand_symmetric` gives the biases back."""
    # Compared as float32 bits (the one value each op computes, -0.0 and all), in C++: with MLX's ops the check
    # added 0.17 s to a 1.1B Q4_0 file's load.
    if not _module().biases_symmetric(scales, biases, bits=bits):
        return None
    return mx.zeros((scales.shape[0], 0), dtype=mx.float16)


def symmetric_bias_factor(bits: int) -> float:
    return -float(2 ** (bits - 1))


def expand_symmetric(scales: mx.array, *, bits: int) -> mx.array:
    """The float16 biases `symmetric_biases` stood for (in the scales' layout), bit for bit."""
    return scales * mx.array(symmetric_bias_factor(bits), dtype=mx.float16)


def is_symmetric(biases: mx.array) -> bool:
    """Whether a layer's biases are `symmetric_biases`'s empty stand-in (which only this module's ops read)."""
    return biases.ndim == 2 and biases.shape[1] == 0


def is_compact(scales: mx.array) -> bool:
    """Whether a layer's scales are `compact_params`'s form (which only this module's ops read)."""
    return scales.dtype == mx.uint8


def packs_exact() -> bool:
    """Whether the packed matmul takes x at fp32's precision here (AVX512-VNNI, and MLXCHAT_NATIVE_ISA is not avx2):
    then weights="native" packs its weights too; elsewhere it keeps MLX's layout and the fp32 kernel."""
    return _module().packs_exact()


def packs_on_amx() -> bool:
    """Whether the packed matmul runs prompts (16 rows of x and more) on AMX's tiles, with the VNNI kernel's results
    bit for bit (AMX-INT8, where `packs_exact`; MLXCHAT_NATIVE_AMX=0 turns it off): then no prompt length is worth
    dequantizing for BLAS's GEMM."""
    return _module().packs_on_amx()


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int,
               packed: bool = False) -> mx.array:
    """The fp32 weight ``[N, K]``: scale * q, then + bias, in fp32 (two roundings, as ``mx.dequantize`` computes it:
    equal to it bit for bit), for long prompts where one BLAS GEMM is faster.
    ``packed``: the weights come from `pack_weights` (where `packs_exact`)."""
    return _module().dequantize(w, scales, biases, group_size=group_size, bits=bits, packed=packed)


def dequantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                       bits: int, packed: bool = False) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` by BLAS's GEMM (the one MLX's matmul calls), for prompts long enough
    that it beats the kernels: the fp32 weight is made a cache-sized piece of rows at a time and each piece
    multiplied as it comes, never held whole (a 1.1B model's MLP matrix is 46 MB of fp32). Takes what
    `quantized_matmul` takes; ``packed``: `pack_weights`'s layout (where `packs_exact`)."""
    return _module().dequantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits, packed=packed)


def softmax(x: mx.array, *, scale: float = 1.0, causal: bool = False) -> mx.array:
    """``softmax(scale * x)`` along the last axis of float32 ``x [..., L, S]``, with a vectorised exp (MLX's CPU exp
    is scalar on x86). ``causal``: query ``i`` of the ``L`` sees keys ``0 .. S - L + i`` (MLX's "causal" mask, aligned
    to the last keys); the masked entries are 0."""
    return _module().softmax(x, scale=scale, causal=causal)


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool = False) -> mx.array:
    """Scaled dot-product attention of float32 ``q [B, H, L, D]`` over ``k, v [B, H_kv, S, D]`` (grouped heads when
    H > H_kv) as one op: for the few queries of a decode step, where MLX's own is a dozen graph nodes and batched
    BLAS calls per layer. ``causal``: query ``i`` sees keys ``0 .. S - L + i``. k and v may be a KV cache's slices."""
    return _module().attention(q, k, v, scale=scale, causal=causal)


def top_k_index(logits: mx.array, k: int) -> mx.array:
    """The positions (uint32, ascending) of the ``k`` largest float32 ``logits`` along the last axis (its length must
    exceed ``k``), as one op; of values tied with the k-th largest, the lowest positions."""
    return _module().top_k_index(logits, k)


def dry_breakers(heads: list[int], offsets: list[int], tails: list[int]) -> object:
    """DRY's sequence breakers as the native op holds them (core/sampling/dry.py's `Breakers.flat()`), built once."""
    return _module().DryBreakers(heads, offsets, tails)


def dry_penalty(logits: mx.array, history: mx.array, breakers: object, *, multiplier: float, base: float,
                allowed_length: int) -> mx.array:
    """llama.cpp's DRY penalty (core/sampling/dry.py) on float32 logits [V] after int32 history ids [n]: one lazy op."""
    return _module().dry_penalty(logits, history, breakers, multiplier=multiplier, base=base,
                                 allowed_length=allowed_length)


def penalties(logits: mx.array, ids: mx.array, counts: mx.array, *, repetition: float = 1.0, frequency: float = 0.0,
              presence: float = 0.0) -> mx.array:
    """core/sampling/chain.py's repetition, frequency and presence penalties (in that order) at the history's int32 ids
    of float32 logits [V], from float32 counts [V], bit for bit, as one lazy op."""
    return _module().penalties(logits, ids, counts, repetition=repetition, frequency=frequency, presence=presence)


def uniform_at(ids: mx.array, words: mx.array) -> mx.array:
    """core/sampling/draw.py's `uniform_at` (a uniform float32 in (0, 1) per uint32 id, keyed by two uint32 words), bit
    for bit, as one op. With words [rows, 2] (a batch's rows, each its own key) and ids [n] or [rows, n]: [rows, n]."""
    return _module().uniform_at(ids, words)


def gumbel_argmax(logits: mx.array, ids: mx.array, words: mx.array) -> mx.array:
    """core/sampling/draw.py's Gumbel-max draw along the last axis of float32 ``logits [..., n]``: the positions (uint32
    [...]) of argmax(logit - log(-log(uniform_at(ids, words)))), bit for bit, as one op that makes no noise for -inf
    logits. ``ids`` [n] or one row per row; ``words`` [2] or one pair per row."""
    return _module().gumbel_argmax(logits, ids, words)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` for float32 arrays of one shape (the gated MLP of llama-style models)."""
    return _module().swiglu(gate, up)


def nucleus(logits: mx.array, p: float | Sequence[float], *, typical: bool = False) -> mx.array:
    """Top-p (or, with ``typical``, typical-p) along the last axis of float32 ``logits [..., V]``: the logits of the
    kept tokens, -inf elsewhere. Kept: the smallest set of the best-ranked finite tokens whose probability reaches
    ``p`` (at least one; tokens ranked equal to the last kept one too), ranked by logit or by |surprisal - entropy|.
    Lazy and exact, with sums in double: it selects (no full sort unless nearly the whole row is needed), so a
    sampler can run it every decode step without waiting on the device. ``p`` may be one per row (a batch's rows)."""
    return _module().nucleus(logits, [p] if isinstance(p, (int, float)) else list(p), typical=typical)


def layer_shape(*, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float, rope_dims: int,
                rope_traditional: bool, rope_scale: float, attention_scale: float, qk_norm: bool = False) -> object:
    """The sizes and constants of a llama decoder layer, for `decoder_layer`; ``qk_norm``: qwen3's per-head RMSNorm
    of q and k before RoPE (eps ``norm_eps``), whose weights `layer_weights` then takes last."""
    return _module().LayerShape(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, norm_eps=norm_eps,
                                rope_dims=rope_dims, rope_traditional=rope_traditional, rope_scale=rope_scale,
                                attention_scale=attention_scale, qk_norm=qk_norm)


def rope_inv_freqs(dims: int, base: float) -> mx.array:
    """``mx.fast.rope``'s frequencies for ``base``, computed by the same MLX ops its CPU path composes."""
    return _module().rope_inv_freqs(dims, base)


def layer_weights(weights: list[mx.array], group_sizes: list[int], bits: list[int], packed: list[int], int8: bool,
                  shape: object) -> object:
    """A llama decoder layer's parameters for `decoder_layer`, checked and made dense once: the two RMSNorm weights,
    ``rope_inv_freqs``, then (w, scales, biases) of q, k, v, o, gate, up and down (MLX's affine format, or
    `pack_weights`'s where ``packed`` says so, one flag a projection), then optionally the float32 biases of q, k
    and v, then the float32 q_norm and k_norm weights ``[head_dim]`` when ``shape`` has ``qk_norm``; ``int8``: the
    packed ones take x rounded to int8 (else fixed24); ``shape`` from `layer_shape`."""
    return _module().layer_weights(weights, group_sizes, bits, packed, int8, shape)


def decoder_layer(h: mx.array, keys: mx.array, values: mx.array, layer: object, *, offset: int, causal: bool,
                  left_padding: mx.array) -> list[mx.array]:
    """A llama decoder layer over ``h [B, L, D]`` (B * L small) as one op: ``[h_out, keys_out, values_out]``. ``keys``
    and ``values`` ``[B, H_kv, C, head_dim]`` are the layer's KV cache buffers with ``offset`` positions written and
    room for L more; the outputs are them with this step's keys and values written after ``offset`` (in place when
    nothing else holds them). ``layer``: `layer_weights`'s object (made where the extension runs, so it is not asked
    again: this runs 30 times a decode step). ``causal``: MLX's "causal" mask. ``left_padding`` (int32 ``[B]``):
    each row's first real position (mlx-lm's BatchKVCache; zeros for one sequence)."""
    return _ext.decoder_layer(h, keys, values, layer, offset=offset, causal=causal,  # type: ignore[union-attr]
                              left_padding=left_padding)


def set_threads(n: int) -> None:
    """Threads the native ops use, the calling one included (default: MLXCHAT_NATIVE_THREADS, else every core up
    to 4)."""
    _module().set_threads(n)


def threads() -> int:
    return _module().threads()


def kernel_name() -> str:
    """Which fp32 matmul kernel runs here for weights in MLX's layout ("avx512" where the CPU has AVX-512F, else
    "avx2"; MLXCHAT_NATIVE_ISA=avx2 keeps the AVX2 one)."""
    return _module().kernel_name()


def int8_kernel_name() -> str:
    """Which int8-activation kernel runs for weights="native-int8" ("avx512-vnni" where the CPU has AVX512-VNNI,
    else "avx2"; MLXCHAT_NATIVE_ISA=avx2 keeps the AVX2 one)."""
    return _module().int8_kernel_name()


def kernel_seconds() -> float:
    """Seconds spent inside the native ops so far in this process (the bench's matmul share of a decode step)."""
    return _module().kernel_seconds()
