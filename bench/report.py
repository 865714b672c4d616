"""The JSON results file and the PNG plot.

JSON (``schema_version`` 1; times in seconds, memory in bytes, rates in tokens per second; None = not measured)::

    {
      "schema_version": 1,
      "created": "2026-12-03T10:00:00+00:00", "quick": false, "elapsed_s": 812.4,
      "machine": {"platform", "machine", "cpu_count", "python", "mlx", "mlx_lm", "blas", "llama_cpp_python"},
      "model": {"name", "source", "weight_bytes", "quantized", "context_length", "gguf_bytes_per_token"},
      "config": {"prompt_lengths": [32, 512, 2048], "max_tokens": 128, "repeats": 3, "samplers": {"greedy": {...},
                 "full": {...}}, "sampler_chains": {"greedy": "...", "full": "..."}, "systems": [...],
                 "skipped": {"llama.cpp": "why"}, "eos": "how every system was made to generate max_tokens",
                 "prompt_source": "...", "prompt_digest": "..."},
      "cases": [{"system": "mlxchat" | "mlx-lm" | "llama.cpp", "prompt_tokens": 512, "sampler": "greedy" | "full",
                 "samples": [SAMPLE, ...],             # one per repeat, in run order
                 "median": {"repeats", "ttft_s", "ttft_s_min", "ttft_s_max", "tpot_s", "tpot_s_min", "tpot_s_max",
                            "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
                            "completion_tokens"}}],
      "ratios": [{"prompt_tokens", "sampler", "peer", "decode", "ttft", "prefill",     # mlxchat / peer, medians
                  "decode_best", "ttft_best"}],                                     # best repeat / best repeat
      "chain_overhead": [{"system", "prompt_tokens", "greedy_tpot_s", "full_tpot_s", "overhead_pct"}],
      "trace": {"k", "max_tokens", "repeats", "untraced_tpot_s", "traced_tpot_s", "per_token_s", "overhead_pct",
                "step_s", "traced_step_s", "step_rounds", "steps_per_round"},  # full chain, trace=k vs off (issue 14)
      "chat": {"turns_run", "reply_tokens", "turns": [SAMPLE + {"turn", "cached_tokens", "prefilled_tokens",
               "context_tokens"}], "last_over_first_ttft", "median_ttft_s"},
      "rotating": {"max_kv_size", "keep", "prompt_tokens", "decode_tokens", "context_tokens", "completion_tokens",
                   "samples": [{"context_tokens", "phase": "prefill" | "decode" | "end", "peak_memory_bytes",
                                "active_memory_bytes", "kv_tokens", "elapsed_s"}],
                   "result": SAMPLE, "flatness": FLAT, "active_flatness": FLAT, "weight_bytes"},
      "tui": {"path", "max_tokens", "headless_samples": [SAMPLE], "tui_samples": [SAMPLE + {"wall_s",
              "ui_batches", "ui_cpu_ms_per_token", "streaming_ui_cpu_ms_per_token"}], "headless": MEDIANS,
              "tui": MEDIANS, "slowdown_pct"},
      "roofline": {"bandwidth_bytes_per_s", "weight_bytes_per_token", "ceiling_tokens_per_s",
                   "gguf_bytes_per_token", "gguf_ceiling_tokens_per_s",
                   "systems": {NAME: {"decode_tokens_per_s", "ceiling_tokens_per_s", "fraction"}},
                   "bandwidth": {"bytes_read", "repeats", "methods_bytes_per_s": {...}, "method"}},
      "formats": [{"format": "fp32" | "bf16" | "fp16" | "q8" | "q4", "bytes_per_token", "gemv_s", "gemv_s_min",
                   "ceiling_tokens_per_s", "effective_bytes_per_s", "bandwidth_ceiling_tokens_per_s"}],
      "native": {"available", "reason" | "weights_path", "active_bytes_after_load", "gguf_bytes", "memory_vs_gguf",
                 "int8": {"weights_path", "active_bytes_after_load", "drift": {"prompts", "reply_tokens", "positions",
                          "top1_agreement", "kl_mean", "kl_p99", "kl_max", "same_greedy_tokens_median",
                          "same_greedy_tokens"}},
                 "llama_cpp": "ran" | WHY NOT,
                 "decode": [{"system", "prompt_tokens", "decode_tokens_per_s", "ttft_s", "repeats"}] (systems: mlxchat
                            native, ..., MLX-op layers, mlxchat fp32, mlx-lm fp32, mlxchat native-int8, llama.cpp),
                 "gemv": {"native_1_thread", "native_2_threads", "fp32_blas", "native_ms", "matmuls", "threads"},
                 "per_token_ms": {"step", "matmuls", "everything_else"}, "per_token_ms_mlx_op_layers": (the same),
                 "decode_path": "decode: 30/30 layers fused" | "",
                 "prefill": [{"rows", "kernel_ms", "dequant_blas_ms"}],
                 "synthetic": {"parameters", "layers", "gguf_bytes", "tokens", "native": RUN, "fp32": RUN},
                 "targets": [TARGET]} or null (not run: bench/native.py; RUN = {"active_bytes", "load_s",
                 "weights_path", "decode_tokens_per_s"}),
      "split": {"max_tokens", "repeats", "greedy_tokens_equal", "overhead_ms_per_token", "largest_rank_weights_vs_one",
                "one_process": {"decode_tokens_per_s", "tpot_ms", "ttft_s", "peak_bytes", "weight_bytes"},
                "split": {"decode_tokens_per_s", "tpot_ms", "ttft_s", "peak_bytes", "split": [LAYERS PER RANK],
                          "ranks": {RANK: {"weight_bytes", "active_bytes", "peak_bytes"}}}} or null
               (bench/split.py: 2 processes over the ring on loopback),
      "realsize": {"available", "reason" | ("quick", "lengths", "repeats", "max_tokens", "threads", "making_s",
                   "making": {"folder", "shape", "params", "files": {LABEL: PATH}, "made": {STEP: SECONDS},
                              "reused": [LABEL], "record": {"made_s", "made_at", "llama_cpp_python", ...}},
                   "llama_cpp": {"version", "system_info", "features", "missing_for_this_cpu", "native"} | null,
                   "files": [FILE], "long": FILE, "targets": [TARGET])} or null (bench/realsize.py; FILE =
                   {"label", "file", "file_bytes", "weights_path", "mlxchat_error" | "llama_cpp_error" (optional),
                    "rows": [{"system", "prompt_tokens", "decode_tokens_per_s", "ttft_s", "repeats",
                              "generated_tokens", "ttft_runs_s", "decode_runs_tokens_per_s"}],
                    "load": {SYSTEM: {"load_s", "load_runs_s", "peak_load_bytes", "peak_rss_bytes",
                                      "ru_maxrss_bytes", "rss_growth_bytes", "rss_anon_after_bytes",
                                      "rss_file_after_bytes", "mlx_active_bytes", "weights_path", "repeats"}}}),
      "targets": [{"name", "value", "threshold", "unit", "passed": true | false | null, "detail"}],
      "errors": {"<section>": "what failed"}
    }

    SAMPLE = {"ttft_s", "tpot_s", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
              "prompt_tokens", "completion_tokens"}
    FLAT = {"from_tokens", "to_tokens", "from_bytes", "to_bytes", "growth_pct", "spread_pct"} or null

A section that failed or was not run is null, and ``errors`` says why.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

TOP_LEVEL = ("schema_version", "created", "quick", "elapsed_s", "machine", "model", "config", "cases", "ratios",
             "chain_overhead", "chat", "rotating", "tui", "roofline", "formats", "targets", "errors")
SAMPLE_KEYS = ("ttft_s", "tpot_s", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
               "prompt_tokens", "completion_tokens")
MEDIAN_KEYS = ("repeats", "ttft_s", "tpot_s", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
               "completion_tokens")


class SchemaError(ValueError):
    pass


def _need(obj: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise SchemaError(f"{where} must be an object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise SchemaError(f"{where} lacks {', '.join(missing)}")


def _number_or_none(v: Any, where: str) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                          (isinstance(v, float) and not math.isfinite(v))):
        raise SchemaError(f"{where} must be a finite number or null, got {v!r}")


def validate(results: dict[str, Any]) -> None:
    """Raise SchemaError unless ``results`` has the documented shape (version 1)."""
    _need(results, TOP_LEVEL, "results")
    if results["schema_version"] != SCHEMA_VERSION:
        raise SchemaError(f"schema_version must be {SCHEMA_VERSION}, got {results['schema_version']!r}")
    if not isinstance(results["cases"], list):
        raise SchemaError("cases must be a list")
    for i, c in enumerate(results["cases"]):
        _need(c, ("system", "prompt_tokens", "sampler", "samples", "median"), f"cases[{i}]")
        if c["sampler"] not in ("greedy", "full"):
            raise SchemaError(f"cases[{i}].sampler must be greedy or full, got {c['sampler']!r}")
        _need(c["median"], MEDIAN_KEYS, f"cases[{i}].median")
        for k in MEDIAN_KEYS:
            _number_or_none(c["median"][k], f"cases[{i}].median.{k}")
        for j, s in enumerate(c["samples"]):
            _need(s, SAMPLE_KEYS, f"cases[{i}].samples[{j}]")
            for k in SAMPLE_KEYS:
                _number_or_none(s[k], f"cases[{i}].samples[{j}].{k}")
    for i, r in enumerate(results["ratios"]):
        _need(r, ("prompt_tokens", "sampler", "peer", "decode", "ttft", "prefill"), f"ratios[{i}]")
    for i, t in enumerate(results["targets"]):
        _need(t, ("name", "value", "threshold", "passed", "detail"), f"targets[{i}]")
        if t["passed"] not in (True, False, None):
            raise SchemaError(f"targets[{i}].passed must be true, false or null")
    if results["rotating"] is not None:
        _need(results["rotating"], ("max_kv_size", "samples", "flatness"), "rotating")
    if results["chat"] is not None:
        _need(results["chat"], ("turns", "last_over_first_ttft"), "chat")
    if results["tui"] is not None:
        _need(results["tui"], ("path", "headless", "tui", "slowdown_pct"), "tui")
    if results["roofline"] is not None:
        _need(results["roofline"], ("bandwidth_bytes_per_s", "weight_bytes_per_token", "ceiling_tokens_per_s",
                                    "systems"), "roofline")
    if not isinstance(results["errors"], dict):
        raise SchemaError("errors must be an object")


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf become null, tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(results: dict[str, Any], out_dir: Path, stamp: str) -> tuple[Path, Path]:
    """Write ``bench-<stamp>.json`` and ``latest.json`` in ``out_dir``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = _clean(results)
    validate(results)
    data = (json.dumps(results, indent=1, ensure_ascii=False) + "\n").encode()
    path, latest = out_dir / f"bench-{stamp}.json", out_dir / "latest.json"
    _write_atomic(path, data)
    _write_atomic(latest, data)
    return path, latest


# --- the plot ----------------------------------------------------------------------------------------------------

COLORS = {"mlxchat": "#1f77b4", "mlx-lm": "#ff7f0e", "llama.cpp": "#2ca02c"}


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", framealpha=0.85)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    """A 2x2 PNG: decode tok/s by prompt length per system (with the roofline), TTFT by prompt length, memory over
    tokens of the rotating run, TTFT per chat turn. None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter
    except ImportError:
        return None
    from .stats import systems_in

    cases = results.get("cases") or []
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=110)
    model = results.get("model") or {}
    fig.suptitle(f"mlxchat bench · {model.get('name', '?')} · {results.get('created', '')[:16]}"
                 f"{' · quick' if results.get('quick') else ''}", fontsize=12)

    ax = axes[0][0]
    lengths = sorted({c["prompt_tokens"] for c in cases})

    def length_axis(ax: Any) -> None:
        ax.set_xscale("log", base=2)
        if lengths:
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.minorticks_off()

    for system in systems_in(cases):
        for sampler, style, marker in (("greedy", "-", "o"), ("full", "--", "s")):
            pts = sorted((c["prompt_tokens"], c["median"]["decode_tokens_per_s"]) for c in cases
                         if c["system"] == system and c["sampler"] == sampler
                         and c["median"]["decode_tokens_per_s"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker, color=COLORS.get(system),
                        label=f"{system} {sampler}")
                for x, y in pts:
                    ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(6, 3 if sampler == "greedy"
                                                                                          else -10), fontsize=7,
                                color=COLORS.get(system))
    roof = results.get("roofline") or {}
    if roof.get("ceiling_tokens_per_s"):
        ax.axhline(roof["ceiling_tokens_per_s"], color="grey", ls=":",
                   label=f"roofline, weights as loaded ({roof['ceiling_tokens_per_s']:.0f} tok/s)")
    if roof.get("gguf_ceiling_tokens_per_s"):
        ax.axhline(roof["gguf_ceiling_tokens_per_s"], color="grey", ls="-.", lw=0.8,
                   label=f"roofline, GGUF bytes ({roof['gguf_ceiling_tokens_per_s']:.0f} tok/s)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    lo, hi = ax.get_ylim()
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    if ys:
        lo = min(ys) / 1.6
        ax.set_ylim(lo, hi)
    ax.set_yticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if lo <= t <= hi])
    ax.margins(x=0.1)
    length_axis(ax)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode tok/s (median, log scale)")
    ax.set_title("Decode speed by prompt length")
    ax.grid(alpha=0.3, which="both")
    _legend(ax)

    ax = axes[0][1]
    for system in systems_in(cases):
        pts = sorted((c["prompt_tokens"], c["median"]["ttft_s"]) for c in cases
                     if c["system"] == system and c["sampler"] == "greedy" and c["median"]["ttft_s"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] * 1000 for p in pts], marker="o", color=COLORS.get(system),
                    label=system)
        for x, y in pts:
            ax.annotate(f"{y * 1000:.0f}", (x, y * 1000), textcoords="offset points", xytext=(6, -3), fontsize=7,
                        color=COLORS.get(system))
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    length_axis(ax)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT ms (median, greedy, log scale)")
    ax.margins(x=0.1)
    ax.set_title("Time to first token")
    ax.grid(alpha=0.3, which="both")
    _legend(ax)

    ax = axes[1][0]
    rot = results.get("rotating")
    if rot and rot.get("samples"):
        xs = [s["context_tokens"] for s in rot["samples"]]
        ax.plot(xs, [s["peak_memory_bytes"] / 2**20 for s in rot["samples"]], marker=".", label="peak since start")
        ax.plot(xs, [s["active_memory_bytes"] / 2**20 for s in rot["samples"]], marker=".", label="in use")
        ax.axvline(rot["max_kv_size"], color="grey", ls=":", label=f"window {rot['max_kv_size']}")
        if rot.get("decode_tokens"):
            ax.axvline(rot["prompt_tokens"], color="k", ls="--", lw=0.8, label="prefill | decode")
        flat = rot.get("flatness")
        if flat:
            ax.axhspan(flat["from_bytes"] / 2**20, flat["from_bytes"] * 1.1 / 2**20, color="green", alpha=0.1,
                       label="+10% band from 2k")
        ax.set_ylim(bottom=0)
        _legend(ax)
    else:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("tokens of context")
    ax.set_ylabel("MiB")
    ax.set_title("Memory over tokens, rotating KV cache")
    ax.grid(alpha=0.3)

    ax = axes[1][1]
    chat = results.get("chat")
    if chat and chat.get("turns"):
        turns = chat["turns"]
        ax.bar([t["turn"] for t in turns], [t["ttft_s"] * 1000 for t in turns], color=COLORS["mlxchat"])
        limit = turns[0]["ttft_s"] * 1000 * 1.2
        ax.axhline(limit, color="red", ls=":", label="1.2x turn 1")
        ax.set_ylim(0, max(limit, max(t["ttft_s"] * 1000 for t in turns)) * 1.15)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(ax)
    else:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("chat turn")
    ax.set_ylabel("TTFT ms")
    ax.set_title("TTFT per chat turn (KV cache reused)")
    ax.grid(alpha=0.3, axis="y")

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
