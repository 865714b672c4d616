"""`mlxchat bench`'s real-size section (issue 35 part 4): mlxchat against llama.cpp on the same files, at the size
people run, not only on the embedded 135M model.

The files are made here, never downloaded, into the bench's cache folder (``$MLXCHAT_CACHE_DIR/bench``, usually
``~/.cache/mlxchat/bench``) and reused by later runs:

- a TinyLlama-1.1B-shaped llama (hidden 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, untied output head, the
  embedded model's tokenizer and vocabulary) with random F16 weights, written with gguf-py's ``GGUFWriter`` in
  llama.cpp's tensor layout, then quantized by llama.cpp's own quantizer (``llama_model_quantize``) to Q4_K_M
  (ftype 15) and to pure Q4_0 (ftype 2, ``pure``); the F16 file (2.3 GB) is deleted once both exist;
- the embedded SmolLM2-135M Q4_1 file re-quantized to Q4_K_M (``allow_requantize``).

For each file, in this process, interleaved, medians: greedy decode tok/s at 32 and 512 prompt tokens and TTFT at 32,
50, 512 and 2,048 (2,048 in the full run only: a 1.1B prefill of 2k tokens takes ~30 s a run on 2 cores). In fresh
child processes, one per load, alternating the systems: load seconds, peak RSS while loading and memory after load.
Last, the embedded Q4_1 file at 2,048 prompt tokens (decode and TTFT), where a native llama.cpp build led.

    python -m mlxchat.bench.realsize [--quick] [--cache DIR]     # this section alone
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .native import interleaved_rows
from .stats import median
from .systems import DEFAULT_LLAMA_THREADS, EngineRunner, llama_cpp_available, llama_cpp_version, make_llama_cpp

DECODE_VS_LLAMA_CPP = 1.0
TTFT_VS_LLAMA_CPP = 1.0  # at TTFT_LENGTH prompt tokens
TTFT_LENGTH = 512
CLIFF = 2.0  # TTFT per prompt token may at most double from one measured prompt length to the next longer one
MEMORY_VS_FILE = 1.1
LOAD_VS_LLAMA_CPP = 2.0
PEAK_LOAD_VS_FILE = 1.3
LONG_PROMPT = 2048  # the embedded Q4_1 file's long-prompt row
DECODE_LENGTHS = (32, 512)  # prompt lengths whose decode rate is a target
TTFT_ONLY_TOKENS = 4  # tokens generated at the TTFT-only lengths (50, 2,048): the first one is what is timed


@dataclass(frozen=True)
class Shape:
    """A llama's shape: what the cached files are keyed by."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int = 4096  # 2,048-token prompts plus the generated tokens must fit (TinyLlama itself says 2048)
    seed: int = 0

    def label(self) -> str:
        """What the targets call it: "1.1B" for TinyLlama's shape."""
        return "1.1B" if self == TINYLLAMA else f"llama h{self.hidden} l{self.layers}"

    def key(self) -> str:
        return (f"llama-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}-f{self.ffn}-c{self.context}"
                f"-s{self.seed}")


TINYLLAMA = Shape(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632)


@dataclass(frozen=True)
class Quant:
    """One llama.cpp quantization: its name, `llama_ftype` and whether every tensor takes that type (`pure`)."""

    name: str
    ftype: int
    pure: bool = False


Q4_K_M = Quant("Q4_K_M", 15)
Q4_0 = Quant("Q4_0", 2, pure=True)  # pure: no Q6_K output head or other mix, the file mlxchat has loaded since issue 6


def cache_folder() -> Path:
    from mlxchat.core.locations import cache_dir

    return cache_dir() / "bench"


def gguf_available() -> bool:
    return importlib.util.find_spec("gguf") is not None


# --- making the files ---------------------------------------------------------------------------------------------

def _tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """llama.cpp's llama tensors (names and NumPy shapes, rows first), in its converter's order."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (shape.hidden,)), (b + "attn_q.weight", (shape.hidden, shape.hidden)),
                (b + "attn_k.weight", (kv, shape.hidden)), (b + "attn_v.weight", (kv, shape.hidden)),
                (b + "attn_output.weight", (shape.hidden, shape.hidden)), (b + "ffn_norm.weight", (shape.hidden,)),
                (b + "ffn_gate.weight", (shape.ffn, shape.hidden)), (b + "ffn_up.weight", (shape.ffn, shape.hidden)),
                (b + "ffn_down.weight", (shape.hidden, shape.ffn))]
    return out + [("output_norm.weight", (shape.hidden,)), ("output.weight", (vocab, shape.hidden))]


def write_llama_f16(path: Path, shape: Shape) -> int:
    """A llama GGUF with random F16 weights (norms F32 ones) and the embedded model's tokenizer, written tensor by
    tensor (the 1.1B model's 2.3 GB are never all in memory). Returns the parameter count."""
    import gguf

    from mlxchat.core.model.loader import embedded_model_path

    source = gguf.GGUFReader(embedded_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random llama {shape.key()} (mlxchat bench)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub)
    tensors = _tensors(shape, vocab)
    for name, dims in tensors:
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        w.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(shape.seed)
    for name, dims in tensors:
        if len(dims) == 1:
            w.write_tensor_data(np.ones(dims, np.float32))
        else:
            # Small random weights (an initializer's 0.02): activations stay finite through 22 layers.
            data = rng.standard_normal(dims, dtype=np.float32)
            data *= 0.02
            w.write_tensor_data(data.astype(np.float16))
            del data
    w.close()
    return sum(int(np.prod(d)) for _, d in tensors)


def quantize(src: Path, dst: Path, quant: Quant, *, requantize: bool = False) -> float:
    """llama.cpp's quantizer, in a child process (its log goes to stderr by the page, and a failure must not take
    the bench with it); written to a temporary name, then renamed. Returns the seconds it took."""
    tmp = dst.with_name(dst.name + ".part")
    t = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "mlxchat.bench.realsize", "quantize", str(src), str(tmp),
                            str(quant.ftype), *(["--pure"] if quant.pure else []),
                            *(["--requantize"] if requantize else [])], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if child.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (child.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"llama.cpp could not quantize {src.name} to {quant.name}: {last}")
    os.replace(tmp, dst)
    return seconds


def _quantize_here(src: str, dst: str, ftype: int, pure: bool, requantize: bool) -> int:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.allow_requantize = requantize
    params.nthread = os.cpu_count() or 1
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


def _record(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def make_files(folder: Path, shape: Shape = TINYLLAMA, quants: tuple[Quant, ...] = (Q4_K_M, Q4_0),
               embedded: bool = True) -> dict[str, Any]:
    """The real-size files, made once per cache folder and shape (and, with ``embedded``, the embedded model's
    Q4_K_M): ``{"files": {label: path}, "made": {...}, "reused": [...], "params": N}``, or ``{"reason": why not}``
    when gguf-py or llama-cpp-python is missing. A file that exists is reused; ``made`` holds the seconds each step
    took in this run, ``record`` the first run's."""
    from mlxchat.core.model.loader import embedded_model_path

    if not llama_cpp_available():
        return {"reason": "llama-cpp-python is not installed (its quantizer makes the files; see bench/README.md)"}
    if not gguf_available():
        return {"reason": "gguf-py is not installed (pip install gguf: it writes the random-weight model)"}
    folder.mkdir(parents=True, exist_ok=True)
    key = shape.key()
    record_path = folder / f"{key}.json"
    record = _record(record_path)
    made: dict[str, float] = {}
    files: dict[str, str] = {}
    f16 = folder / f"{key}-f16.gguf"
    todo = [q for q in quants if not (folder / f"{key}-{q.name.lower()}.gguf").exists()]
    if todo and not f16.exists():
        t = time.perf_counter()
        part = f16.with_name(f16.name + ".part")
        record["params"] = write_llama_f16(part, shape)
        os.replace(part, f16)
        made["F16 (gguf-py)"] = time.perf_counter() - t
    reused = []
    for q in quants:
        dst, label = folder / f"{key}-{q.name.lower()}.gguf", f"{shape.label()} {q.name}"
        if q in todo:
            made[q.name] = quantize(f16, dst, q)
        else:
            reused.append(label)
        files[label] = str(dst)
    f16.unlink(missing_ok=True)  # 2 bytes a parameter, and remade in ~25 s when a new quantization needs it
    if embedded:
        source = embedded_model_path()
        small = folder / f"{source.stem}-{source.stat().st_size}-q4_k_m.gguf"
        if small.exists():
            reused.append("embedded Q4_K_M")
        else:
            made["embedded Q4_K_M"] = quantize(source, small, Q4_K_M, requantize=True)
        files["embedded Q4_K_M"] = str(small)
    if made:
        record |= {"shape": asdict(shape), "made_s": record.get("made_s", {}) | made,
                   "llama_cpp_python": llama_cpp_version(), "made_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        record_path.write_text(json.dumps(record, indent=1))
    return {"folder": str(folder), "shape": asdict(shape), "params": record.get("params"), "files": files,
            "made": made, "reused": reused, "record": record}


def server_model(folder: Path | None = None) -> str | None:
    """The 1.1B-shaped Q4_K_M file the server section runs at real size (made here if missing, as for this
    section), or None where it cannot be made."""
    files = make_files(folder or cache_folder(), TINYLLAMA, (Q4_K_M,), embedded=False)
    return None if "reason" in files else files["files"][f"{TINYLLAMA.label()} {Q4_K_M.name}"]


# --- how llama.cpp was built --------------------------------------------------------------------------------------

# llama.cpp's system-info names for x86 features -> /proc/cpuinfo flags.
X86_FEATURES = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX_VNNI": "avx_vnni", "AVX2": "avx2", "F16C": "f16c",
                "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
                "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


def parse_system_info(info: str, cpu_flags: set[str] | None) -> dict[str, Any]:
    """The CPU features llama.cpp was compiled with (``llama_print_system_info``: "AVX2 = 1 | ..."), and those this
    CPU has that the build lacks: none means a build for this CPU (GGML_NATIVE=ON, or flags to the same effect)."""
    built = [k.strip() for part in info.split("|") if "=" in part
             for k, v in [part.rsplit("=", 1)] if v.strip() == "1"]
    built = [b.split(":")[-1].strip() for b in built]
    missing = None if cpu_flags is None else [name for name, flag in X86_FEATURES.items()
                                              if flag in cpu_flags and name not in built]
    return {"system_info": info.strip(), "features": built, "missing_for_this_cpu": missing,
            "native": None if missing is None else not missing}


def _cpu_flags() -> set[str] | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), None)


def llama_cpp_build() -> dict[str, Any] | None:
    if not llama_cpp_available():
        return None
    import llama_cpp

    return {"version": llama_cpp_version(),
            **parse_system_info(llama_cpp.llama_print_system_info().decode(errors="replace"), _cpu_flags())}


# --- load time and memory, each in a fresh process ----------------------------------------------------------------

def _status_bytes(field: str) -> int | None:
    """A VmRSS/VmHWM figure of this process (Linux), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Make VmHWM start again from the current RSS (Linux >= 4.0), so the peak is the load's, not the imports'."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def load_here(system: str, path: str, n_ctx: int, threads: int) -> dict[str, Any]:
    """In a fresh child process: load ``path`` once with ``system`` (mlxchat or llama.cpp), its library already
    imported, and report seconds, RSS before and after, the peak RSS while loading, and (mlxchat) MLX's active
    memory after load."""
    import resource

    if system == "mlxchat":
        import mlx.core as mx
        import mlx_lm.models.llama  # noqa: F401 - the model class: an import, not part of loading a model

        from mlxchat.core import Engine

        def load() -> Any:
            return Engine.load(path)
    else:
        from llama_cpp import Llama

        def load() -> Any:
            return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
    before = _status_bytes("VmRSS")
    reset = _reset_peak()
    t = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - t
    # RssFile: pages of mapped files (a mapped GGUF); RssAnon: the process's own memory (copies, repacked weights).
    out = {"system": system, "load_s": seconds, "rss_before": before, "rss_after": _status_bytes("VmRSS"),
           "rss_anon_after": _status_bytes("RssAnon"), "rss_file_after": _status_bytes("RssFile"),
           "peak_rss": _status_bytes("VmHWM") if reset else None,
           "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_since_load": reset}
    if system == "mlxchat":
        out["mlx_active"] = mx.get_active_memory()
        out["weights_path"] = model.model.weights_path
        model.close()
    else:
        model.close()
    return out


def measure_loads(path: str, n_ctx: int, threads: int, repeats: int,
                  systems: tuple[str, ...] = ("mlxchat", "llama.cpp")) -> dict[str, Any]:
    """Each system loads the file in a fresh child process ``repeats`` times, alternating which goes first; the
    medians per system. Peak RSS while loading is the child's VmHWM, reset just before the load, less its RSS then
    (the interpreter and the library): what loading added at its highest."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(repeats):
        for system in systems if r % 2 == 0 else systems[::-1]:
            child = subprocess.run([sys.executable, "-m", "mlxchat.bench.realsize", "load", system, path,
                                    "--n-ctx", str(n_ctx), "--threads", str(threads)],
                                   capture_output=True, text=True, timeout=900)
            if child.returncode != 0:
                last = (child.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"{system} could not load {Path(path).name} in a child process: {last}")
            runs[system].append(json.loads(child.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {}
    for system, rs in runs.items():
        def med(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
            return median(r.get(key) for r in rs)

        peak = median(r["peak_rss"] - r["rss_before"] for r in rs if r.get("peak_rss") and r.get("rss_before"))
        out[system] = {"load_s": med("load_s"), "load_runs_s": [r["load_s"] for r in rs],
                       "peak_load_bytes": peak, "peak_rss_bytes": med("peak_rss"), "ru_maxrss_bytes": med("ru_maxrss"),
                       "rss_growth_bytes": median(r["rss_after"] - r["rss_before"] for r in rs
                                                  if r.get("rss_after") and r.get("rss_before")),
                       "mlx_active_bytes": med("mlx_active"), "rss_anon_after_bytes": med("rss_anon_after"),
                       "rss_file_after_bytes": med("rss_file_after"), "weights_path": rs[-1].get("weights_path"),
                       "repeats": len(rs)}
    return out


# --- the rows -----------------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] real size: {msg}", file=sys.stderr, flush=True)


def _one_line(e: BaseException, path: str) -> str:
    """The error's first line, the file named by its name (the cache folder's path is in the section's header)."""
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0].replace(path, Path(path).name)


def file_case(path: str, label: str, plan: list[tuple[int, int]], repeats: int, load_repeats: int,
              threads: int = DEFAULT_LLAMA_THREADS) -> dict[str, Any]:
    """mlxchat and llama.cpp on one file: the interleaved rows of ``plan`` ((prompt tokens, generated tokens)), then
    load time and memory in child processes. When mlxchat cannot load the file, ``mlxchat_error`` says why and
    nothing else is run; without a llama.cpp that runs, ``llama_cpp_error`` says why and mlxchat runs alone (its
    cliff, memory and peak RSS need no peer)."""
    from mlxchat.core import Engine

    out: dict[str, Any] = {"label": label, "file": path, "file_bytes": Path(path).stat().st_size}
    _log(f"{label}: {', '.join(str(n) for n, _ in plan)} prompt tokens, {repeats} repeats")
    try:
        engine = Engine.load(path)
    except Exception as e:  # noqa: BLE001 - a format the loader refuses is a measurement (n/a), not a crash
        out["mlxchat_error"] = _one_line(e, path)
        return out
    n_ctx = max(n for n, _ in plan) + max(t for _, t in plan) + 64
    llama = None
    try:
        out["weights_path"] = engine.describe()
        llama, why = make_llama_cpp(path, sorted(engine.model.tokenizer.eos_ids), n_ctx, threads)
        if llama is None:
            out["llama_cpp_error"] = why
        runners = {"mlxchat": EngineRunner(engine)} | ({"llama.cpp": llama} if llama else {})
        # Warm-up (not counted): the first calls fault the weights in and compile kernels. A short prompt: before the
        # 2,048-token row a warm-up of its own length would cost a whole extra prefill per system.
        interleaved_rows(runners, engine.model.tokenizer, [(32, 2)], 1)
        out["rows"] = interleaved_rows(runners, engine.model.tokenizer, plan, repeats,
                                       log=lambda line: _log(f"{label}: {line}"))
    finally:
        engine.close()
        if llama is not None:
            llama.close()
    if load_repeats:
        _log(f"{label}: loads in fresh processes, {load_repeats} each")
        try:
            out["load"] = measure_loads(path, n_ctx, threads, load_repeats,
                                        ("mlxchat", "llama.cpp") if llama else ("mlxchat",))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the rows stand; the load targets read n/a
            out["load_error"] = str(e)
    return out


def plan_for(lengths: tuple[int, ...], max_tokens: int) -> list[tuple[int, int]]:
    """Generated tokens per prompt length: ``max_tokens`` where decode is a target, a few where only TTFT is."""
    return [(n, max_tokens if n in DECODE_LENGTHS else TTFT_ONLY_TOKENS) for n in lengths]


def realsize_case(*, quick: bool, max_tokens: int, repeats: int, llama_threads: int = DEFAULT_LLAMA_THREADS,
                  folder: Path | None = None, shape: Shape = TINYLLAMA) -> dict[str, Any]:
    """The whole section (see the module docstring); ``{"available": False, "reason"}`` when its files cannot be
    made here."""
    from mlxchat.core.model.loader import embedded_model_path

    t = time.perf_counter()
    _log("making or reusing the files")
    files = make_files(folder or cache_folder(), shape)
    if "reason" in files:
        return {"available": False, "reason": files["reason"]}
    lengths = (32, 50, 512) if quick else (32, 50, 512, 2048)
    load_repeats = 2 if quick else 3
    out: dict[str, Any] = {"available": True, "quick": quick, "making": files, "making_s": time.perf_counter() - t,
                           "llama_cpp": llama_cpp_build(), "lengths": list(lengths), "repeats": repeats,
                           "max_tokens": max_tokens, "threads": llama_threads, "files": []}
    for label, path in files["files"].items():
        out["files"].append(file_case(path, label, plan_for(lengths, max_tokens), repeats, load_repeats,
                                      llama_threads))
    # Its loads are not timed: the real-size files' are the load targets.
    out["long"] = file_case(str(embedded_model_path()), "embedded Q4_1", [(LONG_PROMPT, max_tokens)], repeats, 0,
                            llama_threads)
    return out


# --- targets and the summary --------------------------------------------------------------------------------------

def _target(name: str, value: float | None, threshold: float, passed: bool | None, detail: str,
            unit: str = "x") -> dict[str, Any]:
    return {"name": name, "value": value, "threshold": threshold, "unit": unit, "passed": passed, "detail": detail}


def _row(f: dict[str, Any], system: str, n: int) -> dict[str, Any] | None:
    return next((r for r in f.get("rows") or [] if r["system"] == system and r["prompt_tokens"] == n), None)


def _ratio(f: dict[str, Any], n: int, key: str) -> float | None:
    a, b = _row(f, "mlxchat", n), _row(f, "llama.cpp", n)
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def _why_not(f: dict[str, Any], peer: bool = True) -> str | None:
    """Why a figure of this file is missing: mlxchat could not load it, or (``peer``: a comparison) no llama.cpp."""
    if f.get("mlxchat_error"):
        return f"mlxchat cannot load it: {f['mlxchat_error']}"
    if peer and f.get("llama_cpp_error"):
        return f"no llama.cpp to compare: {f['llama_cpp_error']}"
    return None


def cliff(f: dict[str, Any]) -> tuple[float | None, str]:
    """The worst growth of TTFT per prompt token from one measured length to the next longer: a prefill that stays
    on its path costs the same or less per token as the prompt grows (weights are read once a batch) and attention's
    share at <= 2k tokens adds far less than 2x; a path switch (the 48-row crossover of issue 35: 50 tokens 10x
    slower than 31) shows as a jump."""
    per = sorted((r["prompt_tokens"], r["ttft_s"] / r["prompt_tokens"]) for r in f.get("rows") or []
                 if r["system"] == "mlxchat" and r.get("ttft_s"))
    steps = [(a, b, pb / pa) for (a, pa), (b, pb) in zip(per, per[1:])]
    if not steps:
        return None, "not measured"
    return max(s[2] for s in steps), ", ".join(f"{a}->{b}: {g:.2f}x" for a, b, g in steps)


def _check(v: float | None, threshold: float, at_least: bool = False) -> bool | None:
    return None if v is None else (v >= threshold if at_least else v <= threshold)


def file_targets(f: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets on one file, ``n/a`` (passed None) with the reason where they cannot be measured."""
    label, size = f["label"], f["file_bytes"]
    vs, alone = _why_not(f), _why_not(f, peer=False)
    loads = alone or f.get("load_error")
    decode = [(n, v) for n in DECODE_LENGTHS if (v := _ratio(f, n, "decode_tokens_per_s")) is not None]
    worst = min(v for _, v in decode) if decode else None
    ttft = _ratio(f, TTFT_LENGTH, "ttft_s")
    jump, steps = cliff(f)
    load = f.get("load") or {}
    ours, theirs = load.get("mlxchat") or {}, load.get("llama.cpp") or {}
    mem = ours["mlx_active_bytes"] / size if ours.get("mlx_active_bytes") else None
    load_ratio = ours["load_s"] / theirs["load_s"] if ours.get("load_s") and theirs.get("load_s") else None
    peak = ours["peak_load_bytes"] / size if ours.get("peak_load_bytes") else None
    a, b = _row(f, "mlxchat", TTFT_LENGTH), _row(f, "llama.cpp", TTFT_LENGTH)
    theirs_peak = f" (llama.cpp +{theirs['peak_load_bytes'] / 1e6:.0f} MB)" if theirs.get("peak_load_bytes") else ""
    return [
        _target(f"{label}: decode >= {DECODE_VS_LLAMA_CPP:g}x llama.cpp (every prompt length)", worst,
                DECODE_VS_LLAMA_CPP, _check(worst, DECODE_VS_LLAMA_CPP, at_least=True),
                vs or ", ".join(f"{n}: {v:.2f}x" for n, v in decode) or "not measured"),
        _target(f"{label}: TTFT at {TTFT_LENGTH} <= {TTFT_VS_LLAMA_CPP:g}x llama.cpp's", ttft, TTFT_VS_LLAMA_CPP,
                _check(ttft, TTFT_VS_LLAMA_CPP),
                vs or (f"{a['ttft_s']:.2f} vs {b['ttft_s']:.2f} s" if ttft is not None else "not measured")),
        _target(f"{label}: no TTFT cliff (TTFT per prompt token <= {CLIFF:g}x the next shorter prompt's)", jump,
                CLIFF, _check(jump, CLIFF), alone or steps),
        _target(f"{label}: memory after load <= {MEMORY_VS_FILE:g}x the file", mem, MEMORY_VS_FILE,
                _check(mem, MEMORY_VS_FILE),
                loads or (f"MLX active {ours['mlx_active_bytes'] / 1e6:.0f} MB for a {size / 1e6:.0f} MB file, "
                          "in a fresh process" if mem else "not measured")),
        _target(f"{label}: load time <= {LOAD_VS_LLAMA_CPP:g}x llama.cpp's", load_ratio, LOAD_VS_LLAMA_CPP,
                _check(load_ratio, LOAD_VS_LLAMA_CPP),
                vs or f.get("load_error")
                or (f"{ours['load_s']:.2f} vs {theirs['load_s']:.2f} s" if load_ratio else "not measured")),
        _target(f"{label}: peak RSS while loading <= {PEAK_LOAD_VS_FILE:g}x the file", peak, PEAK_LOAD_VS_FILE,
                _check(peak, PEAK_LOAD_VS_FILE),
                loads or (f"+{ours['peak_load_bytes'] / 1e6:.0f} MB over the process before loading{theirs_peak}"
                          if peak else "not measured")),
    ]


def long_targets(f: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Decode and TTFT on the embedded Q4_1 file at the long prompt."""
    why = "not measured" if f is None else _why_not(f)
    decode = None if f is None else _ratio(f, LONG_PROMPT, "decode_tokens_per_s")
    ttft = None if f is None else _ratio(f, LONG_PROMPT, "ttft_s")
    a, b = (_row(f, "mlxchat", LONG_PROMPT), _row(f, "llama.cpp", LONG_PROMPT)) if f else (None, None)
    return [
        _target(f"embedded Q4_1 at {LONG_PROMPT}: decode >= {DECODE_VS_LLAMA_CPP:g}x llama.cpp", decode,
                DECODE_VS_LLAMA_CPP, _check(decode, DECODE_VS_LLAMA_CPP, at_least=True),
                why or (f"{a['decode_tokens_per_s']:.1f} vs {b['decode_tokens_per_s']:.1f} tok/s" if decode
                        else "not measured")),
        _target(f"embedded Q4_1 at {LONG_PROMPT}: TTFT <= {TTFT_VS_LLAMA_CPP:g}x llama.cpp's", ttft,
                TTFT_VS_LLAMA_CPP, _check(ttft, TTFT_VS_LLAMA_CPP),
                why or (f"{a['ttft_s']:.2f} vs {b['ttft_s']:.2f} s" if ttft else "not measured")),
    ]


def targets(section: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not section or not section.get("available"):
        why = (section or {}).get("reason", "not measured")
        return [_target("real size: decode >= 1x llama.cpp and the other real-size targets", None,
                        DECODE_VS_LLAMA_CPP, None, why)]
    return [t for f in section["files"] for t in file_targets(f)] + long_targets(section.get("long"))


def _build_line(build: dict[str, Any] | None) -> str:
    if not build:
        return "llama.cpp: not installed"
    missing = build.get("missing_for_this_cpu")
    how = ("this CPU's features unknown" if missing is None
           else "every feature of this CPU (a GGML_NATIVE=ON build)" if not missing
           else f"without this CPU's {', '.join(missing)}"
           + ("" if all(m.startswith("AMX") for m in missing) else " (GGML_NATIVE=OFF?)"))
    return f"llama.cpp: llama-cpp-python {build['version']}, compiled with {' '.join(build['features'])}: {how}"


def _mb(b: float | None, sign: str = "") -> str:
    return "—" if b is None else f"{sign}{b / 1e6:.0f} MB"


def _file_lines(f: dict[str, Any]) -> list[str]:
    head = f"  {f['label']} ({f['file_bytes'] / 1e6:.0f} MB)"
    if why := _why_not(f, peer=False):
        return [f"{head}: {why}"]
    out = [f"{head}: {f.get('weights_path', '')}"]
    if f.get("llama_cpp_error"):
        out.append(f"    mlxchat alone: {f['llama_cpp_error']}")
    for n in sorted({r["prompt_tokens"] for r in f["rows"]}):
        a, b = _row(f, "mlxchat", n), _row(f, "llama.cpp", n) or {}
        line = f"    {n:5d} prompt tokens: TTFT {a['ttft_s'] * 1e3:7.0f} ms"
        if b:
            line += f" vs {b['ttft_s'] * 1e3:7.0f} ms ({a['ttft_s'] / b['ttft_s']:.2f}x)"
        if a["generated_tokens"] > TTFT_ONLY_TOKENS:
            line += f"; decode {a['decode_tokens_per_s']:6.1f} tok/s"
            if b:
                line += (f" vs {b['decode_tokens_per_s']:6.1f} "
                         f"({a['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x)")
        out.append(line + ("  (mlxchat vs llama.cpp)" if b else ""))
    if f.get("load_error"):
        out.append(f"    loads: {f['load_error']}")
    if load := f.get("load"):
        a, b = load["mlxchat"], load.get("llama.cpp") or {}
        size = f["file_bytes"]
        peak = a["peak_load_bytes"]
        out.append(f"    load {a['load_s']:.2f} s" + (f" vs {b['load_s']:.2f} s" if b else "")
                   + f"; peak RSS while loading {_mb(peak, '+')}" + (f" vs {_mb(b['peak_load_bytes'], '+')}" if b
                                                                      else "")
                   + (f" ({peak / size:.2f}x the file)" if peak else "")
                   + f"; after load: MLX active {_mb(a['mlx_active_bytes'])}, RSS {_mb(a['rss_growth_bytes'], '+')}"
                   + (f" vs {_mb(b['rss_growth_bytes'], '+')}" if b else "")
                   + f" (median of {a['repeats']} fresh processes)")
    return out


def summary_lines(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    if not section.get("available"):
        return [f"Real size: not run ({section['reason']})"]
    m = section["making"]
    made = ", ".join(f"{k} {v:.0f} s" for k, v in m["made"].items())
    before = (m.get("record") or {}).get("made_s") or {}
    reused = (f"reused {', '.join(m['reused'])} (made {m['record'].get('made_at', '?')}: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in before.items() if k not in m["made"]) + ")"
              if m["reused"] else "")
    params = f"{m['params'] / 1e9:.2f}B-parameter " if m.get("params") else ""
    out = [f"Real size: a {params}TinyLlama-1.1B-shaped llama (random weights) and the embedded model, "
           f"in {m['folder']}: " + "; ".join(x for x in (f"made {made}" if made else "", reused) if x),
           "  " + _build_line(section.get("llama_cpp")),
           f"  greedy, median of {section['repeats']} interleaved repeats, {section['max_tokens']} tokens at "
           f"{' and '.join(map(str, DECODE_LENGTHS))} prompt tokens, {TTFT_ONLY_TOKENS} elsewhere; "
           f"{section['threads']} llama.cpp threads"]
    for f in section["files"]:
        out += _file_lines(f)
    if section.get("long"):
        out += _file_lines(section["long"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxchat.bench.realsize", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    q = sub.add_parser("quantize", help="(internal) llama.cpp's quantizer on one file")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("ftype", type=int)
    q.add_argument("--pure", action="store_true")
    q.add_argument("--requantize", action="store_true")
    ld = sub.add_parser("load", help="(internal) load one file once and print the figures as JSON")
    ld.add_argument("system", choices=("mlxchat", "llama.cpp"))
    ld.add_argument("path")
    ld.add_argument("--n-ctx", type=int, default=4096)
    ld.add_argument("--threads", type=int, default=DEFAULT_LLAMA_THREADS)
    p.add_argument("--quick", action="store_true", help="fewer prompt lengths, tokens and repeats")
    p.add_argument("--cache", help="folder for the files (default: the bench's cache folder)")
    p.add_argument("--llama-threads", type=int, default=DEFAULT_LLAMA_THREADS)
    args = p.parse_args(argv)
    if args.command == "quantize":
        rc = _quantize_here(args.src, args.dst, args.ftype, args.pure, args.requantize)
        if rc != 0:
            print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return 1 if rc else 0
    if args.command == "load":
        print(json.dumps(load_here(args.system, args.path, args.n_ctx, args.threads)))
        return 0
    section = realsize_case(quick=args.quick, max_tokens=32 if args.quick else 128, repeats=2 if args.quick else 3,
                            llama_threads=args.llama_threads, folder=Path(args.cache) if args.cache else None)
    section["targets"] = targets(section)
    from .stats import format_targets

    print("\n".join(summary_lines(section)))
    print("Targets:")
    print(format_targets(section["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
