"""The server case: aggregate decode tok/s and the time between tokens with 1, 2, 4, 8 concurrent streaming clients.

    python -m mlxchat.bench.server [--clients 1,2,4,8] [--max-tokens 64] [--mlx-lm] [--turns 10]

Each client streams one greedy chat completion of exactly `max_tokens` tokens (end-of-turn ids banned with OpenAI's
`logit_bias`, which both servers honour, so nobody stops early). Aggregate decode tok/s = tokens received after each
client's first token / (last token - first of the first tokens); gaps are per client, pooled. With `--mlx-lm`,
`mlx_lm.server` runs on the same weights (the engine's loaded model saved as an MLX folder) with the same BLAS
(preloaded as mlxchat does), after ours, in the same run. Then, on mlxchat's server: a new client's TTFT alone and
while 7 others decode (prefill interleaved with their steps, so it should stay under 2x), and a client that resends
a growing conversation for `--turns` turns while 4 others decode: with the prefix cache, turn N's TTFT stays near
turn 1's. Both servers listen on 127.0.0.1 only.

Speculation (`--spec-repeats`, on mlxchat's server): one client streaming an input-grounded reply (bench/
speculative.py's grounded prompts, the next one each repeat: edit code, copy, rewrite, extract) with
`speculative: "ngram"` against the same request plain, and 4 clients with
`"auto"` against 4 plain; modes alternate within each repeat (the order reversed every other repeat) and a ratio is
the median over repeats of the mode's aggregate tok/s over plain's in the same repeat, so the machine's drift cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPT = "Write a long story about a lighthouse keeper and a storm."
BUSY_UNDER_NEW = 7  # clients decoding while a new one arrives
BUSY_UNDER_RESENT = 4  # clients decoding while a conversation is resent


@dataclass
class ServerFigures:
    system: str
    clients: int
    tokens: int
    aggregate_tok_s: float
    p50_gap_ms: float
    p99_gap_ms: float
    mean_ttft_ms: float
    # Tokens a second while every client decodes (from the last first token to the first last one): the loop's
    # steady rate, which the CPU's bound (`row_bound`) compares with; `aggregate_tok_s` also counts the start, while
    # the clients' prompts are prefilled one after another.
    steady_tok_s: float = 0.0


def _content(line: str) -> str:
    """The text an SSE line of a streamed chat completion carries ("" for any other line)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def _stream(url: str, model: str, max_tokens: int, bias: dict[str, int], out: list, barrier: threading.Barrier,
            content: str = PROMPT, extra: dict | None = None) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "logit_bias": bias, **(extra or {})}
    barrier.wait()
    sent = time.perf_counter()
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if _content(line):
                stamps.append(time.perf_counter())
    out.append((sent, stamps))


def measure(url: str, model: str, clients: int, max_tokens: int, bias: dict[str, int], system: str,
            content: str = PROMPT, extra: dict | None = None) -> ServerFigures:
    out: list = []
    barrier = threading.Barrier(clients)
    threads = [threading.Thread(target=_stream, args=(url, model, max_tokens, bias, out, barrier, content, extra))
               for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = [s[0] for _, s in out if s]
    lasts = [s[-1] for _, s in out if s]
    after_first = sum(len(s) - 1 for _, s in out if s)
    gaps = sorted(b - a for _, s in out for a, b in zip(s, s[1:]))
    window = max(lasts) - min(firsts)
    start, end = max(firsts), min(lasts)
    steady = sum(start < t <= end for _, s in out for t in s) / (end - start) if end > start else 0.0
    return ServerFigures(system, clients, sum(len(s) for _, s in out), after_first / window if window > 0 else 0.0,
                         gaps[len(gaps) // 2] * 1000 if gaps else 0.0,
                         gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1000 if gaps else 0.0,
                         statistics.mean(s[0] - sent for sent, s in out if s) * 1000, steady)


def _decode_until(url: str, model: str, content: str, bias: dict[str, int], started: threading.Event,
                  stop: threading.Event) -> None:
    """Stream a long greedy reply until `stop` is set (then hang up: the server cancels it)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4096,
            "temperature": 0, "stream": True, "logit_bias": bias}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if _content(line):
                started.set()
                if stop.is_set():
                    return


@contextmanager
def busy_clients(url: str, model: str, n: int, bias: dict[str, int]) -> Iterator[None]:
    """`n` clients streaming long replies (each different, so none reuses another's prefill) for the duration,
    every one of them decoding before the block runs."""
    stop = threading.Event()
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_decode_until, args=(url, model, f"Busy client {i}: {PROMPT}", bias, started[i],
                                                            stop), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        for e in started:
            e.wait(600)
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(600)


def new_client_ttft(url: str, model: str, tag: str, repeats: int = 3) -> float:
    """Median TTFT (ms, as the client sees it) of a new conversation: a question no earlier request asked. Each reply
    is read to its end before the next question, so the next one meets only the busy clients: a client that hung up
    at its first token still held its slot for a step or two, and with every slot taken the next one waited for it
    (measured in-process: 140-150 ms against 82 with the slot free)."""
    ttfts = []
    for k in range(repeats):
        body = {"model": model, "messages": [{"role": "user", "content": f"Client {tag}{k}: describe a quiet harbour "
                                                                         "at dawn in a few words."}],
                "max_tokens": 2, "temperature": 0, "stream": True}
        sent = time.perf_counter()
        first = None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if first is None and _content(line):
                    first = (time.perf_counter() - sent) * 1000
        if first is not None:
            ttfts.append(first)
    return statistics.median(ttfts)


def resent_conversation_ttft(url: str, model: str, turns: int, reply_tokens: int = 16,
                             repeats: int = 3) -> list[float]:
    """TTFT (ms, from the server's timings) of each turn of a chat whose client resends the whole conversation: the
    median per turn over `repeats` conversations (one TTFT is a single prefill, at the mercy of a busy machine)."""
    per_turn: list[list[float]] = [[] for _ in range(turns)]
    for k in range(repeats):
        messages: list[dict[str, str]] = []
        for turn in range(turns):
            opener = f"Conversation {k + 1}. " if turn == 0 else ""
            messages.append({"role": "user",
                             "content": f"{opener}Turn {turn + 1}: tell me one more fact about lighthouses."})
            r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0}).json()
            messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            per_turn[turn].append(r["timings"]["ttft_ms"])
    return [statistics.median(t) for t in per_turn]


def speculation(url: str, model: str, bias: dict[str, int], repeats: int, max_tokens: int = 96) -> dict:
    """Serve-side speculation against plain decode (see the module docstring): per case, each repeat's aggregate
    tok/s per mode and the median ratio."""
    from .speculative import GROUNDED

    grounded = list(GROUNDED.values())
    cases = {"1 client ngram, grounded": (1, "ngram", grounded), "4 clients auto": (4, "auto", [PROMPT])}
    section: dict = {"repeats": repeats, "max_tokens": max_tokens, "cases": {}}
    for name, (clients, mode, contents) in cases.items():
        runs: dict[str, list[float]] = {"off": [], mode: []}
        for k in range(repeats):
            content = contents[k % len(contents)]
            for m in (("off", mode) if k % 2 == 0 else (mode, "off")):
                f = measure(url, model, clients, max_tokens, bias, "mlxchat serve", content, {"speculative": m})
                runs[m].append(f.aggregate_tok_s)
        ratio = statistics.median(s / p for s, p in zip(runs[mode], runs["off"]) if p)
        section["cases"][name] = {"clients": clients, "mode": mode, "tok_s": runs, "ratio": ratio}
        print(f"mlxchat serve  speculation, {name}: {statistics.median(runs['off']):.1f} -> "
              f"{statistics.median(runs[mode]):.1f} tok/s ({ratio:.2f}x plain, median of {repeats})", flush=True)
    return section


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {_last_line(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s: {_last_line(log)}")


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(nothing on stderr)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_cost(model: Any, rows: int, context: int = 64, steps: int = 12) -> float:
    """Median seconds of one greedy decode step of the model alone (its forward and argmax, no server) over `rows`
    sequences of `context` ids each: one row on its own KV cache, several in a `BatchKVCache`, as the scheduler's
    step loop holds them."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxchat.core.cache.kv_cache import prefill_chunk

    ids = [(7 * i + 3) % 1000 + 10 for i in range(context)]
    layers = make_prompt_cache(model)
    prefill_chunk(model, layers, ids)
    if rows > 1:  # every row the same prompt: one prefill, copied into each row of the batch by `merge`
        layers = [c.merge([c] * rows) for c in layers]
    inputs = mx.array([[ids[-1]]] * rows)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        inputs = mx.argmax(model(inputs, cache=layers)[:, -1, :], axis=-1)[:, None]
        mx.eval(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def row_bound(model: Any, rows: list[int], repeats: int = 5) -> dict[str, float]:
    """For each client count n > 1: how far aggregate tok/s can scale on this machine, n x (one row's step time /
    n rows' step time), measured on the model alone (`step_cost`), one row and n rows in turn `repeats` times (the
    median ratio: the machine's drift cancels). A server that adds nothing per step reaches it; where it is below a
    target, the machine's per-row cost (on a CPU, the kernel's arithmetic per row of x) makes the target
    unreachable."""
    bound = {}
    for n in (n for n in rows if n > 1):
        ratios = [step_cost(model, 1, steps=6) / step_cost(model, n, steps=6) for _ in range(repeats)]
        bound[str(n)] = n * statistics.median(ratios)
    return bound


def load_model_info(model_spec: str | None, folder: Path | None,
                    bound_rows: list[int] | None = None) -> tuple[list[int], dict[str, float]]:
    """The model's end-of-turn ids and, for `bound_rows`, the scaling bound per client count (`row_bound`, on the
    weights the server runs); with `folder`, also save the model there as an MLX folder for mlx_lm.server."""
    from mlxchat.core import Engine

    engine = Engine.load(model_spec)
    try:
        eos = sorted(engine.model.tokenizer.eos_ids)
        bound = row_bound(engine.model.model, bound_rows or [])
    finally:
        engine.close()
    if folder is not None:
        save_mlx_folder(model_spec, folder)
    return eos, bound


def save_mlx_folder(model_spec: str | None, folder: Path) -> None:
    """Save the engine's loaded model (the same weights) as an MLX folder for mlx_lm.server."""
    import mlx.nn as nn
    from mlx_lm.utils import save_config, save_model

    from mlxchat.core import Engine

    # MLX's own quantized layers (the GGUF's scales and biases, as the native kernel reads them), which mlx-lm
    # rebuilds from the config's per-layer "quantization" (8-bit embeddings, 4-bit layers).
    engine = Engine.load(model_spec, weights="quantized")
    try:
        m = engine.model
        save_model(folder, m.model)
        quantization = {path: {"group_size": mod.group_size, "bits": mod.bits}
                        for path, mod in m.model.named_modules()
                        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
        config = {**vars(m.model.args), "model_type": m.model.model_type}
        if quantization:
            config["quantization"] = {"group_size": 32, "bits": 4, **quantization}
        save_config(config, folder / "config.json")
        m.tokenizer.hf.save_pretrained(folder)
    finally:
        engine.close()


def run(clients: list[int], max_tokens: int, with_mlx_lm: bool, model_spec: str | None,
        turns: int = 10, spec_repeats: int = 0, new_client: bool = True) -> dict:
    """The section: `figures` per system and client count, mlxchat's TTFT (ms) per turn of a conversation resent
    while BUSY_UNDER_RESENT clients decode (`resent_ttft_ms`, with `turns`), a new client's TTFT (ms) alone and while
    BUSY_UNDER_NEW decode (`new_client_ttft_ms`, with `new_client`), with `spec_repeats` the speculation section
    (`speculation`), and the scaling bound per client count measured on the model alone (`bound`, `row_bound`)."""
    figures: list[ServerFigures] = []
    ttft: list[float] = []
    new_ttft: dict[str, float] = {}
    spec: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        eos, bound = load_model_info(model_spec, Path(tmp) if with_mlx_lm else None, clients)
        bias = {str(i): -100 for i in eos}
        port = _free_port()
        cmd = [sys.executable, "-m", "mlxchat.app.cli", "serve", "--port", str(port),
               "--max-concurrent", str(max(*clients, BUSY_UNDER_NEW + 1))] + \
            (["--model", model_spec] if model_spec else [])
        systems = [("mlxchat serve", cmd, {})]
        if with_mlx_lm:
            mport = _free_port()
            blas = {"LD_PRELOAD": "libopenblas.so.0"} if sys.platform.startswith("linux") else {}
            systems.append(("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", tmp, "--port",
                                              str(mport), "--decode-concurrency", str(max(clients))], blas))
        for system, command, env in systems:
            port = int(command[command.index("--port") + 1])
            url = f"http://127.0.0.1:{port}"
            log = Path(tmp) / f"{system}.log"  # what a server that never comes up said, for the error
            with log.open("wb") as out:
                proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=out, env={**os.environ, **env})
            try:
                _wait_ready(url, proc, log)
                # mlx_lm.server's /v1/models lists the Hugging Face cache (and fails without one): it serves its
                # --model as "default_model".
                model = "default_model" if system == "mlx_lm.server" else \
                    httpx.get(url + "/v1/models").json()["data"][0]["id"]
                measure(url, model, 1, 4, bias, system)  # warm-up
                for n in clients:
                    figures.append(measure(url, model, n, max_tokens, bias, system))
                    print(_row(figures[-1]), flush=True)
                if system != "mlxchat serve":  # mlx_lm.server reports no timings
                    continue
                if spec_repeats:
                    spec = speculation(url, model, bias, spec_repeats)
                if new_client:
                    new_ttft["alone_ms"] = new_client_ttft(url, model, "alone")
                    with busy_clients(url, model, BUSY_UNDER_NEW, bias):
                        new_ttft["busy_ms"] = new_client_ttft(url, model, "busy")
                    print(f"{system:14} new client: TTFT alone {new_ttft['alone_ms']:.0f} ms, while {BUSY_UNDER_NEW} "
                          f"decode {new_ttft['busy_ms']:.0f} ms ({new_ttft['busy_ms'] / new_ttft['alone_ms']:.2f}x)",
                          flush=True)
                if turns:
                    with busy_clients(url, model, BUSY_UNDER_RESENT, bias):
                        ttft = resent_conversation_ttft(url, model, turns)
                    print(f"{system:14} resent conversation, {BUSY_UNDER_RESENT} busy: TTFT turn 1 {ttft[0]:.0f} ms, "
                          f"turn {turns} {ttft[-1]:.0f} ms ({ttft[-1] / ttft[0]:.2f}x)", flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
    return {"clients": clients, "max_tokens": max_tokens, "figures": [asdict(f) for f in figures],
            "resent_ttft_ms": ttft, "resent_busy_clients": BUSY_UNDER_RESENT, "new_client_ttft_ms": new_ttft,
            "new_client_busy_clients": BUSY_UNDER_NEW, "speculation": spec, "bound": bound}


# The real-size part: the 1.1B-shaped model (bench/realsize.py's file), 4 and 8 clients, plain decode.
REALSIZE_CLIENTS = [1, 4, 8]


def server_case(clients: list[int], max_tokens: int, model_spec: str | None, turns: int,
                spec_repeats: int = 3, realsize_model: str | None = None) -> dict:
    """The `server` section of `mlxchat bench`: both servers, the same clients, the resent conversation, and
    serve-side speculation; with `realsize_model`, mlxchat's server alone on it (`realsize`: 1, 4 and 8 clients)."""
    section = run(clients, max_tokens, True, model_spec, turns, spec_repeats)
    if realsize_model is not None:
        try:
            section["realsize"] = {"model": Path(realsize_model).name,
                                   **run(REALSIZE_CLIENTS, max_tokens, False, realsize_model, 0, 0, new_client=False)}
        except Exception as e:  # noqa: BLE001 - the embedded model's figures stand on their own
            section["realsize_error"] = f"{type(e).__name__}: {e}"
    return section


def server_targets(section: dict | None) -> list[dict]:
    """The issue's targets: 4 clients >= 2.5x one client's aggregate tok/s and 8 >= 3.5x; every figure >=
    mlx_lm.server's; a new client's TTFT while 7 others decode < 2x its TTFT alone; the last turn of a conversation
    resent while 4 others decode within 1.2x the first turn's TTFT; with speculation measured, one client's grounded
    reply with ngram >= 1.4x plain and 4 clients with auto >= 0.97x plain."""
    def target(name: str, value: float | None, threshold: float, passed: bool | None, detail: str) -> dict:
        return {"name": name, "value": value, "threshold": threshold, "unit": "x", "passed": passed, "detail": detail}

    def scaling(part: dict, n: int, goal: float, label: str = "") -> dict:
        mine = {f["clients"]: f for f in part["figures"] if f["system"] == "mlxchat serve"}
        ours = {c: f["aggregate_tok_s"] for c, f in mine.items()}
        scale = ours[n] / ours[1] if 1 in ours and n in ours and ours[1] else None
        detail = f"{ours.get(1, 0):.1f} -> {ours.get(n, 0):.1f} tok/s" if scale is not None else "not measured"
        bound = (part.get("bound") or {}).get(str(n))
        if scale is not None and bound:
            # The most this CPU allows (`row_bound`): a target above it is out of reach here, whatever the server.
            detail += (f"; this CPU's bound {bound:.2f}x ({n} rows' step costs {n / bound:.2f}x one row's), "
                       f"{scale / bound:.0%} of it reached" + (", the target is above it" if bound < goal else ""))
            if mine[n].get("steady_tok_s") and mine[1].get("steady_tok_s"):
                steady = mine[n]["steady_tok_s"] / mine[1]["steady_tok_s"]
                detail += f"; while all {n} decode {steady:.2f}x ({steady / bound:.0%} of the bound)"
        return target(f"server{label}: {n} clients >= {goal}x one client's aggregate tok/s", scale, goal,
                      None if scale is None else scale >= goal, detail)

    if not section:
        return [target("server: 4 clients >= 2.5x one client's tok/s", None, 2.5, None, "not measured")]
    agg = {(f["system"], f["clients"]): f["aggregate_tok_s"] for f in section["figures"]}
    ours = {n: v for (s, n), v in agg.items() if s == "mlxchat serve"}
    vs = [v / agg[("mlx_lm.server", n)] for n, v in ours.items() if agg.get(("mlx_lm.server", n))]
    ttft = section["resent_ttft_ms"]
    growth = ttft[-1] / ttft[0] if len(ttft) > 1 and ttft[0] else None
    new = section.get("new_client_ttft_ms") or {}
    slow = new["busy_ms"] / new["alone_ms"] if new.get("alone_ms") and "busy_ms" in new else None
    busy_new, busy_resent = section.get("new_client_busy_clients", 7), section.get("resent_busy_clients", 0)
    spec = [target(f"server speculation: {name} >= {goal}x plain tok/s", c["ratio"], goal, c["ratio"] >= goal,
                   f"median of {len(c['tok_s']['off'])} paired runs")
            for (name, c), goal in zip((section.get("speculation") or {}).get("cases", {}).items(), (1.4, 0.97))]
    real = section.get("realsize")
    at_size = [scaling(real, 4, 2.5, f", {real['model']}"), scaling(real, 8, 3.5, f", {real['model']}")] \
        if real else []
    return [
        scaling(section, 4, 2.5),
        scaling(section, 8, 3.5),
        *at_size,
        target("server: aggregate tok/s >= mlx_lm.server's at every client count", min(vs) if vs else None, 1.0,
               None if not vs else min(vs) >= 1.0, "worst ratio over client counts"),
        target(f"server: a new client's TTFT while {busy_new} others decode < 2x alone", slow, 2.0,
               None if slow is None else slow < 2.0,
               f"{new['alone_ms']:.0f} -> {new['busy_ms']:.0f} ms" if slow is not None else "not measured"),
        target(f"server: turn-{len(ttft)} TTFT of a conversation resent while {busy_resent} others decode "
               "<= 1.2x turn 1", growth, 1.2, None if growth is None else growth <= 1.2,
               f"{ttft[0]:.0f} -> {ttft[-1]:.0f} ms" if growth is not None else "not measured"),
        *spec,
    ]


def summary_lines(section: dict | None) -> list[str]:
    if not section:
        return []
    spec = [f"  speculation, {name}: {c['ratio']:.2f}x plain tok/s (median of {len(c['tok_s']['off'])} paired runs)"
            for name, c in ((section.get("speculation") or {}).get("cases") or {}).items()]
    real = section.get("realsize")
    at_size = [f"Server on {real['model']} (mlxchat serve alone):"] + [
        "  " + _row(ServerFigures(**f)) for f in real["figures"]] if real else []
    bounds = [f"  this CPU's scaling bound (the model's step alone, n x one row's time / n rows'): {where} "
              + ", ".join(f"{n} clients {b:.2f}x" for n, b in part["bound"].items())
              for where, part in (("embedded", section), ("real size", real)) if part and part.get("bound")]
    return ["Server (streaming clients, same weights):"] + [
        "  " + _row(ServerFigures(**f)) for f in section["figures"]] + spec + at_size + bounds


def _row(f: ServerFigures) -> str:
    return (f"{f.system:14} {f.clients} clients: {f.aggregate_tok_s:6.1f} tok/s aggregate · gap p50 "
            f"{f.p50_gap_ms:6.1f} ms p99 {f.p99_gap_ms:6.1f} ms · TTFT {f.mean_ttft_ms:6.0f} ms · {f.tokens} tok")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxchat.bench.server", description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,2,4,8", help="concurrent clients per run, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mlx-lm", action="store_true", help="also run mlx_lm.server on the same weights")
    p.add_argument("--model", help="GGUF file or folder (default: the embedded model)")
    p.add_argument("--turns", type=int, default=5, help="turns of the resent-conversation TTFT check (0 skips)")
    p.add_argument("--spec-repeats", type=int, default=3,
                   help="paired runs of serve-side speculation against plain decode (0 skips)")
    p.add_argument("--json", help="write the figures (and the speculation section) to this JSON file")
    args = p.parse_args(argv)
    clients = [int(c) for c in re.split(r"[,\s]+", args.clients) if c]
    section = run(clients, args.max_tokens, args.mlx_lm, args.model, args.turns, args.spec_repeats)
    print("\n".join(f"{t['name']}: {t['value'] or 0:.2f} ({t['detail']})" for t in server_targets(section)
                     if t["value"] is not None))
    if args.json:
        Path(args.json).write_text(json.dumps({**section, "targets": server_targets(section)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
