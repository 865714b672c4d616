"""llama.cpp's quantized tensor types (issue 35): Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 next to Q4_0, Q4_1 and Q8_0.

The reference is gguf-py's `gguf.quants.dequantize`, maintained with llama.cpp: the weights mlxchat multiplies must
equal it, bit for bit, on every weight path (the native kernel, MLX's quantized ops, the fp32 fallback).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxchat.core.model import gguf, gguf_tensors, loader
from mlxchat.core.errors import ModelLoadError
from mlxchat.core.model.gguf_writer import write_gguf
from tests.quant_models import MIXED, quantized_llama, random_blocks, reference_f32

gguf_py = pytest.importorskip("gguf", reason="gguf-py (PyPI gguf) is the reference dequantizer")
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
PROMPT = [1, 504, 3058, 282, 253, 1345, 28, 198, 17, 30, 17, 279, 1055, 314, 2]


def _reference(raw: bytes, type_name: str, rows: int) -> np.ndarray:
    data = np.frombuffer(raw, dtype=np.uint8)
    return gguf_py.quants.dequantize(data, gguf_py.GGMLQuantizationType[type_name]).reshape(rows, -1)


def _one_tensor_file(path: Path, type_name: str, shape: tuple[int, int], raw: bytes) -> gguf.GGUFHeader:
    write_gguf(path, {"general.architecture": "llama"}, [("t.weight", type_name, shape, raw)])
    return gguf.read_header(path)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_reads_as_llama_cpp_dequantizes_it(tmp_path: Path, type_name: str) -> None:
    shape = (8, 512)
    raw = random_blocks(type_name, shape[0] * shape[1], np.random.default_rng(1))
    ref = _reference(raw, type_name, shape[0])
    header = _one_tensor_file(tmp_path / "t.gguf", type_name, shape, raw)

    dense = gguf_tensors.read_tensors(header, ["t.weight"], keep=lambda f: False)
    assert np.array_equal(np.array(dense.arrays["t.weight"]), ref)

    kept = gguf_tensors.read_tensors(header, ["t.weight"])
    fmt = kept.formats["t"]
    assert fmt.ggml_type == type_name
    w, scales, biases = (kept.arrays[f"t.{k}"] for k in ("weight", "scales", "biases"))
    assert w.dtype == mx.uint32 and w.shape == (8, 512 * fmt.bits // 32) and scales.shape == (8, 512 // fmt.group_size)
    if fmt.group_size >= 32:  # MLX's own dequantization of the kept form (Q6_K's groups of 16 are below its minimum)
        mine = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=fmt.group_size,
                             bits=fmt.bits)
        assert np.array_equal(np.array(mine), ref)


def test_a_type_mlxchat_cannot_read_is_named_with_what_the_file_holds(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    write_gguf(path, {"general.architecture": "llama"},
               [("a.weight", "IQ4_XS", (2, 256), bytes(2 * 136)), ("b.weight", "F32", (4,), bytes(16))])
    with pytest.raises(ModelLoadError, match=r"tensor type IQ4_XS is not supported \(the file holds F32 x1, IQ4_XS x1; "
                                             r"supported: .*Q4_K.*Q6_K\); use a Q4_K_M"):
        gguf.check_loadable(gguf.read_header(path))


def test_a_tensor_cut_short_is_one_line(tmp_path: Path) -> None:
    path = quantized_llama(tmp_path / "m.gguf", {"attn_q": "Q4_K"})
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        loader.load(path)


def _logits(model: loader.LoadedModel, ids: list[int]) -> np.ndarray:
    """Every position's logits, teacher-forced: the prompt at once, then the last token again as a decode step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.model)
    whole = model.model(mx.array([ids[:-1]]), cache=cache)
    step = model.model(mx.array([ids[-1:]]), cache=cache)  # one row: the fused decoder layer where it runs
    return np.concatenate([np.array(whole[0], np.float64), np.array(step[0], np.float64)])


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("mixed")
    quantized = quantized_llama(folder / "mixed.gguf", MIXED)
    return quantized, reference_f32(quantized, folder / "mixed-f32.gguf")


@pytest.mark.parametrize("weights", ["native", "quantized", "dequantize"])
def test_a_model_mixing_every_type_computes_llama_cpps_weights(mixed_files: tuple[Path, Path], weights: str) -> None:
    quantized, reference = mixed_files
    if weights == "native" and not loader.native.available():
        pytest.skip(loader.native.unavailable_reason())
    mine = loader.load(quantized, weights=weights)
    ref = _logits(loader.load(reference, weights="dequantize"), PROMPT)
    got = _logits(mine, PROMPT)
    # Same weights, fp32 sums in another order: agreement to float32's precision of the logits' scale.
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max(), mine.weights_path
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_the_quantization_mix_is_shown(mixed_files: tuple[Path, Path]) -> None:
    model = loader.load(mixed_files[0], weights="dequantize")
    assert model.architecture == "llama"
    assert model.quantization == "Q4_K_M: F32 5, Q4_K 4, Q6_K 3, Q4_0 2, Q5_0 2, Q5_1 2, Q5_K 2"


def test_llama_cpp_agrees_on_the_mixed_file(mixed_files: tuple[Path, Path]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    quantized, reference = mixed_files
    # F32 keys and values: llama.cpp's default F16 cache alone moves the logits by ~1e-3.
    peer = llama_cpp.Llama(str(reference), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    peer.eval(PROMPT)
    theirs = np.array(peer.scores[:len(PROMPT)], np.float64)
    mine = _logits(loader.load(quantized), PROMPT)
    assert np.abs(mine - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert (mine.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("embedding", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("weights", ["native", "quantized"])
def test_embedding_rows_are_the_files_values_in_float32(tmp_path: Path, embedding: str, weights: str) -> None:
    """A lookup is not rounded to its f16 scales' precision (Q8_0's d * q needs 15 bits): the rows are llama.cpp's."""
    if weights == "native" and not loader.native.available():
        pytest.skip(loader.native.unavailable_reason())
    path = quantized_llama(tmp_path / "m.gguf", {"token_embd": embedding})
    header = gguf.read_header(path)
    ref = np.array(gguf_tensors.read_tensors(header, ["token_embd.weight"], keep=lambda f: False)
                   .arrays["token_embd.weight"])
    ids = [1, 2, 17, 504, 49151]
    rows = loader.load(path, weights=weights).model.model.embed_tokens(mx.array([ids]))
    assert rows.dtype == mx.float32 and np.array_equal(np.array(rows[0]), ref[ids])


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_llama_cpps_q4_k_m_of_each_architecture_runs_exactly(tmp_path: Path, arch: str) -> None:
    """llama.cpp's own quantizer (Q4_K_M: K-quants where rows allow, Q5_0/Q8_0 elsewhere) on each architecture's
    test model: every weight path computes the F32 file of the same values."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from tests.arch_models import write_model

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = 15, 2  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    source, quantized = write_model(tmp_path / "f32.gguf", arch), tmp_path / "q4km.gguf"
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(quantized).encode(), ctypes.byref(params)) == 0
    ref = _logits(loader.load(reference_f32(quantized, tmp_path / "ref.gguf"), weights="dequantize"), PROMPT)
    for weights in ("native", "quantized", "dequantize") if loader.native.available() else ("quantized", "dequantize"):
        model = loader.load(quantized, weights=weights)
        assert model.quantization.startswith("Q4_K_M: ")
        got = _logits(model, PROMPT)
        assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max(), (weights, model.weights_path)


# --- the native reader (core/native's read_ggml): the same values, straight into the kernel's layouts -------------

def _signed_blocks(type_name: str, rows: int, cols: int, seed: int) -> bytes:
    """Random valid blocks whose f16 fields take both signs and zero: the compact parameters' signs of zero must
    still be the NumPy conversion's."""
    raw = np.frombuffer(random_blocks(type_name, rows * cols, np.random.default_rng(seed)), np.uint8).copy()
    _, block, block_bytes = next(v for v in gguf.GGML_TYPES.values() if v[0] == type_name)
    blocks = raw.reshape(-1, block_bytes)
    at = 208 if type_name == "Q6_K" else 0
    flip = np.random.default_rng(seed + 1).random(len(blocks)) < 0.5
    blocks[flip, at + 1] ^= 0x80  # the f16's sign bit
    blocks[::7, at:at + 2] = 0  # d = 0 (a block of zeros, as a quantizer writes it)
    return blocks.tobytes()


@pytest.mark.parametrize("type_name", TYPES)
def test_the_native_reader_gives_the_numpy_conversions_values_in_each_layout(tmp_path: Path, type_name: str) -> None:
    native = loader.native
    if not native.available():
        pytest.skip(native.unavailable_reason())
    rows, cols = 48, 768
    header = _one_tensor_file(tmp_path / "t.gguf", type_name, (rows, cols),
                              _signed_blocks(type_name, rows, cols, seed=3))
    numpy_read = gguf_tensors.read_tensors(header, ["t.weight"])
    fmt = numpy_read.formats["t"]
    w, scales, biases = (numpy_read.arrays[f"t.{k}"] for k in ("weight", "scales", "biases"))
    offset = header.data_start + header.tensors[0].offset

    def as_f32(s: mx.array, b: mx.array, packed: bool) -> tuple[np.ndarray, np.ndarray]:
        if native.is_symmetric(b):  # Q4_0/Q5_0/Q8_0: the stand-in, in the scales' layout
            b = native.expand_symmetric(s, bits=fmt.bits)
        if native.is_compact(s):
            s, b = native.expand_params(s, b, group_size=fmt.group_size, packed=packed)
        elif packed:  # f16 parameters in tiles: back to MLX's layout through the reference unpacking
            _, s, b = native.unpack_weights(got_w, s, b, group_size=fmt.group_size, bits=fmt.bits)
        return np.array(s.astype(mx.float32)).view(np.uint32), np.array(b.astype(mx.float32)).view(np.uint32)

    for packed in (False, True):
        got = native.read_ggml(str(header.path), offset, type_name, rows, cols, packed=packed)
        assert got is not None
        got_w, got_s, got_b = got
        assert got_w.dtype == mx.uint32 and got_w.shape == w.shape
        assert native.is_compact(got_s) == type_name.endswith("_K")
        assert native.is_symmetric(got_b) == (type_name in ("Q4_0", "Q5_0", "Q8_0"))
        want_w = native.pack_weights(w, scales, biases, group_size=fmt.group_size, bits=fmt.bits)[0] if packed else w
        assert np.array_equal(np.array(got_w), np.array(want_w)), packed
        # Every parameter bit for bit, signs of zero included (float32 bits compared).
        got_params = as_f32(got_s, got_b, packed)
        want_params = (np.array(scales.astype(mx.float32)).view(np.uint32),
                       np.array(biases.astype(mx.float32)).view(np.uint32))
        assert np.array_equal(got_params[0], want_params[0]) and np.array_equal(got_params[1], want_params[1])
        dense = native.dequantize(got_w, got_s, got_b, group_size=fmt.group_size, bits=fmt.bits, packed=packed)
        assert np.array_equal(np.array(dense), _reference(bytes(np.fromfile(header.path, np.uint8)[offset:]
                                                               [:header.tensors[0].nbytes]), type_name, rows))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q8_0"])
def test_the_native_reader_stores_symmetric_biases_only_where_the_product_overflows(tmp_path: Path,
                                                                                   type_name: str) -> None:
    """A block whose d * -2^(bits - 1) is no f16 (it overflows) keeps stored biases, the f16 product as the NumPy
    conversion computes it; the loader's layers then run on them (`symmetric_biases` finds them not symmetric)."""
    native = loader.native
    if not native.available():
        pytest.skip(native.unavailable_reason())
    rows, cols = 16, 64
    raw = np.frombuffer(random_blocks(type_name, rows * cols, np.random.default_rng(5)), np.uint8).copy()
    blocks = raw.reshape(rows * cols // 32, -1)
    blocks[3, 0:2] = np.array([30000], np.float16).view(np.uint8)  # d * -8 and beyond: -inf as an f16
    header = _one_tensor_file(tmp_path / "t.gguf", type_name, (rows, cols), blocks.tobytes())
    want = gguf_tensors.read_tensors(header, ["t.weight"]).arrays["t.biases"]
    for packed in (False, True):
        w, s, b = native.read_ggml(str(header.path), header.data_start + header.tensors[0].offset, type_name, rows,
                                   cols, packed=packed)
        assert not native.is_symmetric(b) and native.symmetric_biases(s, b, bits=int(type_name[1])) is None
        if packed:
            _, _, b = native.unpack_weights(w, s, b, group_size=32, bits=int(type_name[1]))
        assert np.array_equal(np.array(b).view(np.uint16), np.array(want).view(np.uint16)), packed


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q8_0"])
def test_the_native_reader_tells_symmetric_blocks_as_the_float32_check_does_for_every_f16_scale(
        tmp_path: Path, type_name: str) -> None:
    """read_ggml decides from d's exponent alone whether a block's bias is the stand-in's product; that must agree with
    `native.symmetric_biases` (float32 bits compared) on the NumPy conversion's biases, for each of the 65536 f16
    values of d, one block each: every symmetric finite d together gives the stand-in, and every other alone
    stores."""
    native = loader.native
    if not native.available():
        pytest.skip(native.unavailable_reason())
    bits = int(type_name[1])
    d = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    with np.errstate(all="ignore"):
        want = np.float32(d.view(np.float16)) * np.float32(-(2 ** (bits - 1)))
        got = np.float32(want.astype(np.float16))
    # Infinite and NaN d (exponent 31) are not worth the stand-in: they keep stored biases (exact either way).
    symmetric = (got.view(np.uint32) == want.view(np.uint32)) & ((d & 0x7C00) != 0x7C00)

    def read(scales: np.ndarray, name: str) -> tuple[mx.array, mx.array, mx.array]:
        blocks = np.frombuffer(random_blocks(type_name, 32 * len(scales), np.random.default_rng(2)),
                               np.uint8).copy().reshape(len(scales), -1)
        blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
        header = _one_tensor_file(tmp_path / name, type_name, (len(scales), 32), blocks.tobytes())
        return native.read_ggml(str(header.path), header.data_start + header.tensors[0].offset, type_name,
                                len(scales), 32, packed=False)

    _, s, b = read(d[symmetric], "all.gguf")
    assert native.is_symmetric(b)
    assert np.array_equal(np.array(native.expand_symmetric(s, bits=bits)).view(np.uint16).ravel(),
                          want[symmetric].astype(np.float16).view(np.uint16))
    others = d[~symmetric]
    assert len(others) > 1000  # overflowing products, infinities, NaNs
    for one in others[np.random.default_rng(3).choice(len(others), 24, replace=False)].tolist() + [others[0]]:
        _, s, b = read(np.array([one], np.uint16), "one.gguf")
        assert not native.is_symmetric(b), hex(one)


def test_the_native_reader_reads_a_files_tensors_in_one_call_as_one_by_one(tmp_path: Path) -> None:
    """`read_ggml_many` (the loader's: one call without the GIL for the file) gives what `read_ggml` gives for each
    tensor, None where that does, and fails as it does on a tensor that runs past the end."""
    native = loader.native
    if not native.available():
        pytest.skip(native.unavailable_reason())
    tensors = [(f"t{i}.weight", t, (32, 256), random_blocks(t, 32 * 256, np.random.default_rng(i)))
               for i, t in enumerate(["Q4_0", "Q6_K", "Q5_0", "Q4_K", "Q8_0"])]
    big = np.frombuffer(tensors[1][3], np.uint8).copy().reshape(-1, 210)
    big[:, 208:210] = np.full(len(big), 4096, np.float16).view(np.uint8).reshape(-1, 2)  # not the compact form
    tensors.append(("big.weight", "Q6_K", (32, 256), big.tobytes()))
    path = tmp_path / "many.gguf"
    write_gguf(path, {"general.architecture": "llama"}, tensors)
    header = gguf.read_header(path)
    places = [(header.data_start + t.offset, t.type_name, 32, 256, packed)
              for t, packed in zip(header.tensors, [True, False, True, True, False, True])]
    many = native.read_ggml_many(str(path), places)
    assert many[-1] is None and len(many) == len(places)
    for got, (offset, type_name, rows, cols, packed) in zip(many, places):
        want = native.read_ggml(str(path), offset, type_name, rows, cols, packed=packed)
        assert (got is None) == (want is None)
        for a, b in zip(got or (), want or ()):
            assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    with pytest.raises(RuntimeError, match="truncated"):
        native.read_ggml_many(str(path), [*places[:2], (places[-1][0], "Q4_K", 64, 256, False)])


def test_the_native_reader_refuses_what_does_not_fit(tmp_path: Path) -> None:
    native = loader.native
    if not native.available():
        pytest.skip(native.unavailable_reason())
    header = _one_tensor_file(tmp_path / "t.gguf", "Q4_K", (24, 256), random_blocks("Q4_K", 24 * 256,
                                                                                     np.random.default_rng(0)))
    offset = header.data_start + header.tensors[0].offset
    # MLX's layout: any rows
    assert native.read_ggml(str(header.path), offset, "Q4_K", 24, 256, packed=False) is not None
    with pytest.raises(ValueError, match="tiles of 16 rows"):
        native.read_ggml(str(header.path), offset, "Q4_K", 24, 256, packed=True)
    with pytest.raises(ValueError, match="cannot read tensor type IQ4_XS"):
        native.read_ggml(str(header.path), offset, "IQ4_XS", 24, 256, packed=False)
    with pytest.raises(RuntimeError, match="truncated"):
        native.read_ggml(str(header.path), offset, "Q4_K", 48, 256, packed=False)
    # A Q6_K block whose d is so large that -32 d is no f16: not the compact form; the loader converts it with NumPy.
    big = np.frombuffer(random_blocks("Q6_K", 16 * 256, np.random.default_rng(0)), np.uint8).copy().reshape(16, 210)
    big[:, 208:210] = np.full(16, 4096, np.float16).view(np.uint8).reshape(16, 2)
    header = _one_tensor_file(tmp_path / "big.gguf", "Q6_K", (16, 256), big.tobytes())
    assert native.read_ggml(str(header.path), header.data_start + header.tensors[0].offset, "Q6_K", 16, 256,
                            packed=True) is None
    model_like = gguf_tensors.read_tensors(header, ["t.weight"], native=loader._native_reader("native"))
    assert model_like.arrays["t.scales"].dtype == mx.float32 and not model_like.packed
