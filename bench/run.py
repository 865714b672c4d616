"""`mlxchat bench [--quick]`: run every case in one process, print the table, write the JSON and the PNG.

    python -m bench.run --quick          # the same, without the CLI

All systems share the prompts and (for the two MLX systems) the very same weights in memory. The side-by-side
matrix is interleaved: each repeat runs every system once, alternating the order, so drift from other load on the
machine hits all of them alike, and the ratios come from the same run. Each figure is the median over repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from statistics import median
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlxchat.core  # noqa: F401 - loads the optimized BLAS before anything imports MLX

from . import cases as C
from . import constrained as CD
from . import kv as KV
from . import kv_disk as KD
from . import native as N
from . import realsize as RS
from . import server as S
from . import speculative as SB
from . import split as SP
from . import prompts, report, stats
from .systems import FULL, GREEDY, EngineRunner, MlxLmRunner, SamplerSpec, llama_cpp_version, make_llama_cpp

SECTIONS = ("matrix", "chat", "trace", "tui", "rotating", "roofline", "formats", "native", "kv", "server", "split",
            "constrained", "kv_disk", "speculative", "realsize")


@dataclass(frozen=True)
class Config:
    quick: bool
    prompt_lengths: tuple[int, ...]
    max_tokens: int
    repeats: int
    full_chain_lengths: tuple[int, ...]  # prompt lengths that also run the full sampler chain
    chat_turns: int
    chat_reply_tokens: int
    rotating_context: int
    rotating_decode: int
    rotating_window: int
    tui_repeats: int
    tui_tokens: int
    format_repeats: int
    bandwidth_bytes: int = 1 << 30
    llama_threads: int = 2
    skip: frozenset[str] = field(default_factory=frozenset)
    native: bool = False  # the native-kernel section (bench/native.py): loads two more models, so opt-in here
    kv_context: int = 4096  # the quantized-KV section (bench/kv.py): context length and greedy tokens decoded
    kv_decode: int = 128
    server_clients: tuple[int, ...] = (1, 2, 4, 8)  # the server section (bench/server.py): clients per run
    server_turns: int = 5  # the issue's target: turn 5 of a resent conversation
    split_tokens: int = 64  # the split section (bench/split.py): greedy tokens per reply, and replies
    split_repeats: int = 2
    constrained_seeds: int = 4  # the constrained-decoding section (bench/constrained.py): seeds per schema at T=1
    constrained_tokens: int = 128  # its cap per reply, and the greedy tokens of its TPOT comparison
    kv_disk: bool = False  # the disk KV cache (bench/kv_disk.py): a 3,000-token chat prefilled 4 times, so opt-in here
    spec_tokens: int = 128  # the speculative section (bench/speculative.py): greedy tokens per reply, and repeats
    spec_repeats: int = 4
    realsize: bool = False  # mlxchat vs llama.cpp on a 1.1B model (bench/realsize.py): minutes, so opt-in here
    realsize_repeats: int = 3


FULL_RUN = Config(quick=False, prompt_lengths=(32, 512, 2048), max_tokens=128, repeats=3,
                  full_chain_lengths=(32, 512, 2048), chat_turns=20, chat_reply_tokens=32,
                  rotating_context=20000, rotating_decode=2000, rotating_window=2048, tui_repeats=9, tui_tokens=128,
                  format_repeats=5, native=True, kv_disk=True, realsize=True)
# --quick: prefill is compute-bound here (~170 tok/s on 2 cores), so the quick run keeps long prompts few: the full
# chain runs at 1,024 tokens only (its penalties and DRY look at the prompt too, so that DRY reads a 1k-token
# history), and the rotating run is 2.6k tokens through a 512-token window. The TUI case runs 9 x 128 tokens a row
# (~20 s): one 32-token pair, ~0.2 s of decode each, read anywhere from 22% faster to 40% slower on this machine;
# with 3 pairs four quiet runs of the same tree read the rows from -0.3% to +15.9%, with 5 pairs the prose row read
# 2.0-5.9% in four runs of one tree.
QUICK_RUN = Config(quick=True, prompt_lengths=(32, 1024), max_tokens=32, repeats=3, full_chain_lengths=(1024,),
                   chat_turns=5, chat_reply_tokens=16, rotating_context=2600, rotating_decode=64,
                   rotating_window=512, tui_repeats=9, tui_tokens=128, format_repeats=3, native=True,
                   kv_context=1024, kv_decode=32, server_clients=(1, 4), server_turns=5, split_tokens=32,
                   split_repeats=1, constrained_seeds=2, constrained_tokens=64, spec_tokens=64, spec_repeats=2,
                   realsize=True, realsize_repeats=2)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _machine(blas: str | None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "mlx": v("mlx"), "mlx_lm": v("mlx-lm"), "blas": blas,
            "llama_cpp_python": llama_cpp_version()}


def _guard(errors: dict[str, str], section: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """Run one section; a failure is recorded (and printed), never fatal to the other sections."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - one broken case must not lose the rest of the run
        errors[section] = f"{type(e).__name__}: {e}"
        log(f"{section} failed: {errors[section]}")
        return None


def run_matrix(runners: list[Any], prompt_sets: dict[int, tuple[list, list[int]]], cfg: Config) -> list[dict]:
    """Every system on every prompt length and sampler, interleaved by repeat; returns the cases."""
    samples: dict[tuple[str, int, str], list[dict]] = {}
    # Warm-up (not counted): first calls compile kernels, fault pages in and build caches.
    msgs, ids = prompt_sets[min(prompt_sets)]
    for r in runners:
        for spec in (GREEDY, FULL):
            r.run(msgs, ids, spec, 8)
    for n in cfg.prompt_lengths:
        msgs, ids = prompt_sets[n]
        specs: list[SamplerSpec] = [GREEDY] + ([FULL] if n in cfg.full_chain_lengths else [])
        # Samplers alternate within each repeat as the systems do: run one after the other, a drift in the
        # machine's load lands on one sampler and reads as the chain's cost (this VM swings ±15% over a minute).
        for rep in range(cfg.repeats):
            order = runners if rep % 2 == 0 else runners[::-1]
            for spec in specs if rep % 2 == 0 else specs[::-1]:
                for r in order:
                    s = r.run(msgs, ids, spec, cfg.max_tokens)
                    if s["completion_tokens"] != cfg.max_tokens:
                        raise RuntimeError(f"{r.name} generated {s['completion_tokens']} tokens, "
                                           f"not {cfg.max_tokens}")
                    samples.setdefault((r.name, n, spec.name), []).append(s)
                line = " · ".join(f"{name} {samples[(name, n, spec.name)][-1]['decode_tokens_per_s']:.1f} tok/s"
                                  for name in (r.name for r in runners))
                log(f"prompt {n}, {spec.name}, repeat {rep + 1}/{cfg.repeats}: {line}")
    return [stats.make_case(system, n, sampler, ss) for (system, n, sampler), ss in samples.items()]


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:.0f} MiB"


def summary_text(results: dict[str, Any]) -> str:
    """Everything printed after the table: chain overhead, chat, rotating, TUI, roofline, formats, targets."""
    out = []
    best = [r for r in results.get("ratios") or [] if r.get("decode_best") is not None]
    if best:
        out.append("Best repeat against best repeat (other load only adds time, so this is the less noisy gauge):")
        for peer in dict.fromkeys(r["peer"] for r in best):
            out.append(f"  /{peer}: " + ", ".join(
                f"{r['prompt_tokens']} {r['sampler']}: decode {r['decode_best']:.2f}x TTFT {r['ttft_best']:.2f}x"
                for r in best if r["peer"] == peer))
    over = results.get("chain_overhead") or []
    if over:
        out.append("Full sampler chain vs greedy (TPOT): " + ", ".join(
            f"{o['system']} @{o['prompt_tokens']}: {o['overhead_pct']:+.1f}%" for o in over
            if o["overhead_pct"] is not None))
    tr = results.get("trace")
    if tr:
        out.append(f"Sampler trace (trace={tr['k']}, full chain, {tr['max_tokens']} tokens): TPOT "
                   f"{tr['untraced_tpot_s'] * 1000:.1f} ms untraced, {tr['traced_tpot_s'] * 1000:.1f} ms traced "
                   f"({tr['per_token_s'] * 1000:+.2f} ms/token, {tr['overhead_pct']:+.1f}%); the sampler step alone "
                   f"{tr['step_s'] * 1000:.2f} -> {tr['traced_step_s'] * 1000:.2f} ms. Untraced requests run "
                   "Sampler.step unchanged: the full-chain row above is the trace-off cost")
    chat = results.get("chat")
    if chat:
        ttfts = " ".join(f"{t['ttft_s'] * 1000:.0f}" for t in chat["turns"])
        out.append(f"Chat, {chat['turns_run']} turns x {chat['reply_tokens']} tokens, TTFT ms per turn: {ttfts}"
                   f"  (turn {chat['turns_run']}/turn 1 = {chat['last_over_first_ttft']:.2f}x; context at the end "
                   f"{chat['turns'][-1]['context_tokens']} tokens)")
    rot = results.get("rotating")
    if rot:
        flat = rot.get("flatness") or {}
        res = rot["result"]
        pts = ", ".join(f"{s['context_tokens']}: {s['peak_memory_bytes'] / 2**20:.0f}" for s in rot["samples"])
        out.append(f"Rotating cache (window {rot['max_kv_size']}, keep {rot['keep']}): {rot['prompt_tokens']} prompt "
                   f"+ {rot['completion_tokens']} generated = {rot['context_tokens']} tokens; decode "
                   f"{res['decode_tokens_per_s'] or 0:.1f} tok/s; peak MiB by context: {pts}")
        if flat:
            out.append(f"  peak {_mib(flat['from_bytes'])} at {flat['from_tokens']} -> {_mib(flat['to_bytes'])} at "
                       f"{flat['to_tokens']} ({flat['growth_pct']:+.1f}%); weights {_mib(rot['weight_bytes'])}")
    tui = results.get("tui")
    for row in (tui, (tui or {}).get("markdown")):
        if row:
            h, t = row["headless"], row["tui"]
            ui = [s["ui_cpu_ms_per_token"] for s in row["tui_samples"] if "ui_cpu_ms_per_token" in s]
            live = [s["streaming_ui_cpu_ms_per_token"] for s in row["tui_samples"]
                    if "streaming_ui_cpu_ms_per_token" in s]
            out.append(f"TUI vs headless, {row.get('reply', 'prose')} reply ({row['path']}): headless "
                       f"{h['decode_tokens_per_s']:.1f} tok/s, TUI {t['decode_tokens_per_s']:.1f} tok/s "
                       f"({row['slowdown_pct']:+.1f}% slower); TTFT {h['ttft_s'] * 1000:.0f} vs "
                       f"{t['ttft_s'] * 1000:.0f} ms" + (f"; UI thread {median(ui):.2f} ms CPU/token" if ui else "")
                       + (f" ({median(live):.2f} while it streamed)" if live else ""))
    roof = results.get("roofline")
    if roof:
        bw = roof["bandwidth"]
        methods = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw["methods_bytes_per_s"].items())
        out.append(f"Roofline: memory read bandwidth {roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (best of: "
                   f"{methods} GB/s, {bw['bytes_read'] / 2**30:.0f} GiB read, median of {bw['repeats']})")
        out.append(f"  weights as loaded: {roof['weight_bytes_per_token'] / 1e6:.0f} MB/token -> ceiling "
                   f"{roof['ceiling_tokens_per_s']:.1f} tok/s" + (
                       f"; the GGUF's own bytes: {roof['gguf_bytes_per_token'] / 1e6:.0f} MB/token -> ceiling "
                       f"{roof['gguf_ceiling_tokens_per_s']:.0f} tok/s" if roof.get("gguf_bytes_per_token") else ""))
        for name, s in roof["systems"].items():
            if s["fraction"] is not None:
                out.append(f"  {name}: {s['decode_tokens_per_s']:.1f} tok/s = {s['fraction'] * 100:.0f}% of "
                           f"{s['ceiling_tokens_per_s']:.0f} tok/s")
    fmts = results.get("formats")
    if fmts:
        out.append("Weight formats on MLX's CPU backend (all GEMVs of one token, one graph, no attention):")
        for f in fmts:
            bwc = f["bandwidth_ceiling_tokens_per_s"]
            out.append(f"  {f['format']:>4}: {f['bytes_per_token'] / 1e6:5.0f} MB/token, {f['gemv_s'] * 1000:7.1f} ms"
                       f" (best {f.get('gemv_s_min', f['gemv_s']) * 1000:.1f})"
                       f" -> {f['ceiling_tokens_per_s']:6.1f} tok/s ({f['effective_bytes_per_s'] / 1e9:5.1f} GB/s)"
                       + (f"; bandwidth allows {bwc:.0f} tok/s" if bwc else ""))
    out.extend(N.summary_lines(results.get("native")))
    out.extend(KV.summary_lines(results.get("kv")))
    out.extend(CD.summary_lines(results.get("constrained")))
    out.extend(KD.summary_lines(results.get("kv_disk")))
    out.extend(S.summary_lines(results.get("server")))
    out.extend(SP.summary_lines(results.get("split")))
    out.extend(SB.summary_lines(results.get("speculative")))
    out.extend(RS.summary_lines(results.get("realsize")))
    if results.get("errors"):
        out.append("Errors: " + "; ".join(f"{k}: {v}" for k, v in results["errors"].items()))
    out.append("Targets:")
    out.append(stats.format_targets(results["targets"] + ((results.get("native") or {}).get("targets") or [])
                                    + ((results.get("server") or {}).get("targets") or [])
                                    + ((results.get("constrained") or {}).get("targets") or [])
                                    + ((results.get("kv_disk") or {}).get("targets") or [])
                                    + ((results.get("speculative") or {}).get("targets") or [])
                                    + ((results.get("realsize") or {}).get("targets") or [])))
    return "\n".join(out)


def run(cfg: Config, model: str | None = None, out_dir: Path | str = "bench/results", *,
        engine: Any = None) -> dict[str, Any]:
    """Run the benchmark; write the JSON and PNG under ``out_dir``; return the results.

    ``engine``: an already loaded Engine to measure (the tests share one); it is left open."""
    from mlxchat.core import Engine
    from mlxchat.core.model import blas

    started = time.perf_counter()
    created = datetime.now(timezone.utc)
    stamp = created.strftime("%Y%m%d-%H%M%S")
    errors: dict[str, str] = {}
    owned = engine is None
    if owned:
        log(f"loading {model or 'the embedded model'}")
        engine = Engine.load(model)
    m = engine.model
    tok = m.tokenizer
    log(f"loaded {m.name}: {m.weight_bytes / 1e6:.0f} MB of weights ({'quantized' if m.quantized else 'float'}), "
        f"BLAS {blas.loaded or 'reference'}; weights: {m.weights_path}")
    # mlx-lm's peer runs its best format on this backend (issue 6: "mlx-lm stream_generate on identical fp32
    # weights"): on the CPU that is fp32, since MLX's own quantized matmul dequantizes on every call (the formats
    # section measures it), so when the engine runs the native kernel mlx-lm gets the same GGUF dequantized to fp32.
    # Elsewhere (fp32 or float models, Metal) it runs on the engine's very model object.
    wanted = "matrix" not in cfg.skip or (cfg.native and "native" not in cfg.skip)
    peer = Engine.load(m.source, weights="dequantize") if wanted and m.weights_path.startswith("native") else engine
    peer_weights = "the same GGUF as fp32 (weights=dequantize)" if peer is not engine else "the engine's model object"
    log(f"mlx-lm: on {peer_weights}")
    runners: list[Any] = [EngineRunner(engine), MlxLmRunner(peer)]
    skipped: dict[str, str] = {}
    llama = None
    if "matrix" not in cfg.skip:
        llama, why = make_llama_cpp(m.source, sorted(tok.eos_ids),
                                    n_ctx=max(cfg.prompt_lengths) + cfg.max_tokens + 64, threads=cfg.llama_threads)
        if llama is None:
            skipped["llama.cpp"] = why
            log(f"llama.cpp: skipped ({why})")
        else:
            runners.append(llama)
            log(f"llama.cpp: llama-cpp-python {llama_cpp_version()}, {cfg.llama_threads} threads")
    try:
        prompt_sets = {n: prompts.exact_prompt(tok, n) for n in cfg.prompt_lengths}
        cases: list[dict] = []
        if "matrix" not in cfg.skip:
            cases = _guard(errors, "matrix", run_matrix, runners, prompt_sets, cfg) or []
    finally:
        if llama is not None:
            llama.close()
    ratios = stats.compute_ratios(cases)
    overhead = [o for s in stats.systems_in(cases) for o in stats.chain_overhead(cases, s)]

    chat = rotating = tui = roof = formats = trace = None
    if "trace" not in cfg.skip:
        log("sampler trace: full chain untraced vs trace=10")
        msgs = prompt_sets[min(prompt_sets)][0]
        trace = _guard(errors, "trace", C.trace_case, engine, msgs, cfg.max_tokens, cfg.repeats)
    if "chat" not in cfg.skip:
        log(f"chat: {cfg.chat_turns} turns")
        chat = _guard(errors, "chat", C.chat_case, engine, cfg.chat_turns, cfg.chat_reply_tokens)
    if "tui" not in cfg.skip:
        log("TUI vs headless: prose, then a Markdown-heavy reply")
        tui = _guard(errors, "tui", C.tui_case, engine, cfg.tui_tokens, cfg.tui_repeats)
        if tui is not None:
            tui["markdown"] = _guard(errors, "tui_markdown", C.tui_case, engine, cfg.tui_tokens, cfg.tui_repeats,
                                     markdown=True)
    if "rotating" not in cfg.skip:
        log(f"rotating cache: {cfg.rotating_context} tokens of context, window {cfg.rotating_window}")
        rotating = _guard(errors, "rotating", C.rotating_case, engine, cfg.rotating_context, cfg.rotating_decode,
                          cfg.rotating_window)
    bandwidth = None
    if "roofline" not in cfg.skip:
        log("memory bandwidth")
        bw = _guard(errors, "roofline", C.memory_bandwidth, engine, cfg.bandwidth_bytes, 5 if not cfg.quick else 3)
        if bw:
            bandwidth = bw["bandwidth_bytes_per_s"]
            shortest = min(cfg.prompt_lengths)
            decode = {s: (stats.find_case(cases, s, shortest, "greedy") or {"median": {}})["median"]
                      .get("decode_tokens_per_s") for s in stats.systems_in(cases)}
            roof = C.roofline(bandwidth, m.weight_bytes, C.gguf_bytes_per_token(m.source), decode)
            roof["bandwidth"] = bw
            roof["at_prompt_tokens"] = shortest
    if "formats" not in cfg.skip:
        log("weight formats")
        formats = _guard(errors, "formats", C.weight_formats, engine, cfg.format_repeats, bandwidth=bandwidth)
    native = None
    if cfg.native and "native" not in cfg.skip:
        log("native kernel: decode vs fp32 and mlx-lm, GEMVs, prefill crossover, memory, synthetic llama")
        native = _guard(errors, "native", N.native_case, engine, quick=cfg.quick, max_tokens=cfg.max_tokens,
                        repeats=cfg.repeats, fp32=peer if peer is not engine else None,
                        llama_threads=cfg.llama_threads)
        if native is not None:
            native["targets"] = N.native_targets(native)
    kv = None
    if "kv" not in cfg.skip:
        log("KV cache: plain vs 8-bit vs 4-bit")
        kv = _guard(errors, "kv", KV.kv_case, engine, cfg.kv_context, cfg.kv_decode)
    kv_disk = None
    if cfg.kv_disk and "kv_disk" not in cfg.skip:
        log("KV cache on disk: a 3,000-token chat reopened in a new process, cold vs from disk")
        kv_disk = _guard(errors, "kv_disk", KD.kv_disk_case, engine, model, repeats=cfg.repeats)
        if kv_disk is not None:
            kv_disk["targets"] = KD.targets(kv_disk)
    server = None
    if "server" not in cfg.skip:
        log("server: mlxchat serve vs mlx_lm.server, concurrent streaming clients")
        # At real size too where that section runs (its 1.1B file): the issue's 4- and 8-client targets.
        server = _guard(errors, "server", S.server_case, cfg.server_clients, cfg.max_tokens, model,
                        cfg.server_turns, realsize_model=RS.server_model() if cfg.realsize else None)
        if server is not None:
            server["targets"] = S.server_targets(server)
    constrained = None
    if "constrained" not in cfg.skip:
        log("constrained decoding: JSON Schema validity at T=1, TPOT vs unconstrained greedy, mask and compile time")
        constrained = _guard(errors, "constrained", CD.constrained_case, engine, cfg.constrained_seeds,
                             cfg.constrained_tokens, cfg.constrained_tokens, cfg.repeats)
        if constrained is not None:
            constrained["targets"] = CD.targets(constrained)
    split = None
    if "split" not in cfg.skip:
        log("split: the model over 2 processes (ring on loopback) vs one process")
        split = _guard(errors, "split", SP.split_case, engine, model, cfg.split_tokens, cfg.split_repeats)
    speculative = None
    if "speculative" not in cfg.skip:
        log("speculative decoding: ngram and auto vs plain, verify cost against rows, self-speculation")
        speculative = _guard(errors, "speculative", SB.speculative_case, engine, cfg.spec_tokens, cfg.spec_repeats)
        if speculative is not None:
            speculative["targets"] = SB.targets(speculative)
    realsize = None
    if cfg.realsize and "realsize" not in cfg.skip:
        log("real size: a 1.1B llama (Q4_K_M, Q4_0) and the embedded model's Q4_K_M vs llama.cpp on the same files")
        realsize = _guard(errors, "realsize", RS.realsize_case, quick=cfg.quick, max_tokens=cfg.max_tokens,
                          repeats=cfg.realsize_repeats, llama_threads=cfg.llama_threads)
        if realsize is not None:
            realsize["targets"] = RS.targets(realsize)
    backend = {**engine.backend.as_dict(), "line": engine.describe()}
    eng = EngineRunner(engine)
    chains = {"greedy": eng.describe(GREEDY, cfg.max_tokens), "full": eng.describe(FULL, cfg.max_tokens)}
    if peer is not engine:
        peer.close()
    if owned:
        engine.close()

    results: dict[str, Any] = {
        "schema_version": report.SCHEMA_VERSION,
        "created": created.isoformat(timespec="seconds"),
        "quick": cfg.quick,
        "elapsed_s": None,
        "machine": _machine(blas.loaded),
        "model": {"name": m.name, "source": m.source, "weight_bytes": m.weight_bytes, "quantized": m.quantized,
                  "weights_path": m.weights_path,
                  "context_length": m.context_length, "gguf_bytes_per_token": C.gguf_bytes_per_token(m.source)},
        "config": {
            "prompt_lengths": list(cfg.prompt_lengths), "max_tokens": cfg.max_tokens, "repeats": cfg.repeats,
            "full_chain_lengths": list(cfg.full_chain_lengths),
            "samplers": {"greedy": GREEDY.as_dict(), "full": FULL.as_dict()},
            "sampler_chains": chains,
            "systems": [r.name for r in runners], "skipped": skipped,
            "eos": "end-of-turn ids banned until max_tokens (mlxchat: min_tokens; mlx-lm and llama.cpp: a logits "
                   "processor setting them to -inf), so every system generates exactly max_tokens",
            "mlx_lm": f"stream_generate on {peer_weights}, on its inference thread, defaults otherwise "
                      "(prefill_step_size 2048, 20-token penalty windows)",
            "llama_cpp": f"{cfg.llama_threads} threads, n_batch 512, KV cache reset before each run",
            "prompt_source": "CPython's pydoc_data.topics, sorted by topic", "prompt_digest": prompts.corpus_digest(),
            "chat_turns": cfg.chat_turns, "chat_reply_tokens": cfg.chat_reply_tokens,
            "rotating": {"context": cfg.rotating_context, "decode": cfg.rotating_decode,
                         "window": cfg.rotating_window},
            "tui_repeats": cfg.tui_repeats, "tui_tokens": cfg.tui_tokens,
            "skip": sorted(cfg.skip),
        },
        "cases": cases, "ratios": ratios, "chain_overhead": overhead, "trace": trace, "chat": chat,
        "rotating": rotating,
        "tui": tui, "roofline": roof, "formats": formats, "native": native, "kv": kv, "server": server,
        "split": split, "backend": backend, "constrained": constrained, "kv_disk": kv_disk,
        "speculative": speculative, "realsize": realsize,
        "errors": errors,
    }
    results["targets"] = stats.evaluate_targets(results)
    results["elapsed_s"] = time.perf_counter() - started

    out_dir = Path(out_dir)
    path, latest = report.write_json(results, out_dir, stamp)
    png = _guard(errors, "plot", report.plot, results, out_dir / f"bench-{stamp}.png")
    if png is not None:
        import shutil

        shutil.copyfile(png, out_dir / "latest.png")
    elif "plot" not in errors:
        errors["plot"] = "matplotlib is not installed (pip install 'mlxchat[bench]')"
    if "plot" in errors:  # rewrite with the plot's error recorded
        report.write_json(results, out_dir, stamp)
    results["_paths"] = {"json": str(path), "latest": str(latest), "png": str(png) if png else None}
    return results


def print_results(results: dict[str, Any]) -> None:
    m, mc = results["model"], results["machine"]
    cfg = results["config"]
    print(f"mlxchat bench{' --quick' if results['quick'] else ''} · {m['name']} · weights "
          f"{m['weight_bytes'] / 1e6:.0f} MB ({'quantized' if m['quantized'] else 'float'}) · BLAS "
          f"{mc['blas'] or 'reference'} · {mc['cpu_count']} cores · mlx {mc['mlx']}, mlx-lm {mc['mlx_lm']}"
          f"{', llama-cpp-python ' + mc['llama_cpp_python'] if mc['llama_cpp_python'] else ''}")
    print(f"{cfg['max_tokens']} generated tokens per run, median of {cfg['repeats']} repeats; "
          f"full chain = {cfg['sampler_chains']['full']}")
    for name, why in cfg["skipped"].items():
        print(f"({name} not compared: {why})")
    print()
    if results["cases"]:
        print(stats.format_table(results["cases"], results["ratios"]))
        print("(decode /peer > 1: mlxchat decodes faster; TTFT /peer < 1: mlxchat answers sooner)")
        print()
    print(summary_text(results))
    paths = results.get("_paths", {})
    print(f"\nWrote {paths.get('json')} (and {paths.get('latest')})" +
          (f", plot {paths['png']}" if paths.get("png") else "") + f" in {results['elapsed_s']:.0f} s")


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = QUICK_RUN if getattr(args, "quick", False) else FULL_RUN
    over: dict[str, Any] = {}
    if getattr(args, "repeats", None):
        over["repeats"] = args.repeats
    if getattr(args, "max_tokens", None):
        over["max_tokens"] = args.max_tokens
    if getattr(args, "lengths", None):
        lengths = tuple(int(x) for x in str(args.lengths).split(",") if x.strip())
        over["prompt_lengths"] = lengths
        over["full_chain_lengths"] = tuple(n for n in lengths if n in cfg.full_chain_lengths) or lengths[-1:]
    if getattr(args, "rotating_decode", None):
        over["rotating_decode"] = args.rotating_decode
    if getattr(args, "rotating_context", None):
        over["rotating_context"] = args.rotating_context
    if getattr(args, "llama_threads", None):
        over["llama_threads"] = args.llama_threads
    skip = set(getattr(args, "skip", None) or ())
    unknown = skip - set(SECTIONS)
    if unknown:
        raise ValueError(f"--skip takes {', '.join(SECTIONS)}; got {', '.join(sorted(unknown))}")
    over["skip"] = frozenset(skip)
    cfg = replace(cfg, **over)
    if cfg.rotating_decode >= cfg.rotating_context:
        raise ValueError("--rotating-decode must be less than --rotating-context")
    return cfg


def run_from_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    results = run(cfg, getattr(args, "model", None), getattr(args, "out", None) or "bench/results")
    print_results(results)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench flags beyond --quick/--model/--out (app/cli.py's ``bench`` subparser adds the same)."""
    p.add_argument("--repeats", type=int, help="repeats per case (default: 3)")
    p.add_argument("--max-tokens", type=int, help="generated tokens per run (default: 128; --quick 32)")
    p.add_argument("--lengths", help="prompt lengths, comma-separated (default: 32,512,2048; --quick 32,1024)")
    p.add_argument("--rotating-context", type=int, help="tokens of context in the rotating run (default: 20000)")
    p.add_argument("--rotating-decode", type=int,
                   help="of which generated, the rest is a prompt prefilled through the window (default: 2000)")
    p.add_argument("--llama-threads", type=int, help="llama.cpp threads (default: 2)")
    p.add_argument("--skip", action="append", choices=SECTIONS, help="leave a section out (repeatable)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer prompt lengths, tokens and repeats: about 5 minutes on an idle 2-core machine")
    p.add_argument("--model", help="GGUF file (default: the embedded model)")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG (default: bench/results)")
    add_arguments(p)
    return run_from_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
