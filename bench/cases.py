"""The cases beyond the side-by-side matrix: multi-turn chat, rotating cache, TUI path, roofline, weight formats."""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from . import prompts
from .stats import flatness, median
from .systems import FULL, GREEDY, EngineRunner, from_metrics


def _greedy(max_tokens: int) -> Any:
    from mlxchat.core import SamplingProfile

    return SamplingProfile(name="bench-greedy", temperature=0, min_tokens=max_tokens)


# --- multi-turn chat ---------------------------------------------------------------------------------------------

def chat_case(engine: Any, turns: int, reply_tokens: int) -> dict[str, Any]:
    """``turns`` turns of one ChatSession (plain cache), each reply exactly ``reply_tokens`` greedy tokens."""
    chat = engine.chat(system=prompts.SYSTEM, profile=_greedy(reply_tokens))
    rows = []
    for i in range(turns):
        question = prompts.CHAT_QUESTIONS[i % len(prompts.CHAT_QUESTIONS)]
        r = chat.send(question, max_tokens=reply_tokens).wait()
        m = r.metrics
        rows.append({"turn": i + 1, **from_metrics(m), "cached_tokens": m.cached_tokens,
                     "prefilled_tokens": m.prompt_tokens - m.cached_tokens, "context_tokens": m.context_tokens})
    first, last = rows[0]["ttft_s"], rows[-1]["ttft_s"]
    return {"turns_run": turns, "reply_tokens": reply_tokens, "turns": rows,
            "last_over_first_ttft": last / first if first else None,
            "median_ttft_s": median(r["ttft_s"] for r in rows)}


# --- rotating cache ----------------------------------------------------------------------------------------------

def rotating_case(engine: Any, context_tokens: int, decode_tokens: int, window: int, keep: int = 4,
                  every: int = 1000) -> dict[str, Any]:
    """One long request through a rotating window: a long real-text prompt (prefilled through the window), then
    ``decode_tokens`` generated tokens, up to ``context_tokens`` of context in all. Memory is sampled each time
    the context passes another ``every`` tokens: the peak since the request started (``mx.get_peak_memory``,
    reset by the engine at the start of each request) and the memory in use then (``mx.get_active_memory``)."""
    import mlx.core as mx

    from mlxchat.core.decode.events import Done, PrefillProgress, TokenEvent

    prompt_tokens = context_tokens - decode_tokens
    msgs, ids = prompts.exact_prompt(engine.model.tokenizer, prompt_tokens, system=prompts.SYSTEM)
    chat = engine.chat(system=prompts.SYSTEM, profile=_greedy(decode_tokens), max_kv_size=window, keep=keep)
    samples: list[dict[str, Any]] = []
    mark = every
    t0 = time.perf_counter()
    result = None

    def sample(context: int, phase: str, peak: int, kv_tokens: int | None) -> None:
        samples.append({"context_tokens": context, "phase": phase, "peak_memory_bytes": peak,
                        "active_memory_bytes": mx.get_active_memory(), "kv_tokens": kv_tokens,
                        "elapsed_s": time.perf_counter() - t0})

    # MLX's memory counters are process-wide allocator statistics: reading them here does no MLX work.
    for event in chat.send(msgs[-1]["content"], max_tokens=decode_tokens):
        if isinstance(event, PrefillProgress):
            if event.done >= mark:
                sample(event.done, "prefill", mx.get_peak_memory(), min(event.done, window))
                mark = (event.done // every + 1) * every
        elif isinstance(event, TokenEvent) and event.token_ids:
            m = event.metrics
            context = m.prompt_tokens + m.completion_tokens
            if context >= mark:
                sample(context, "decode", m.peak_memory_bytes, m.context_tokens)
                mark = (context // every + 1) * every
        elif isinstance(event, Done):
            result = event.result
    assert result is not None
    m = result.metrics
    last_context = m.prompt_tokens + m.completion_tokens
    if not samples or samples[-1]["context_tokens"] != last_context:
        sample(last_context, "end", m.peak_memory_bytes, m.context_tokens)
    return {"max_kv_size": window, "keep": keep, "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
            "context_tokens": last_context, "completion_tokens": m.completion_tokens, "samples": samples,
            "result": from_metrics(m), "flatness": flatness(samples, 2000),
            "active_flatness": flatness(samples, 2000, "active_memory_bytes"),
            "weight_bytes": engine.model.weight_bytes}


# --- TUI path vs headless ----------------------------------------------------------------------------------------

TUI_TEXT_TOKENS = 96
# The rich reply of the TUI's second row: what a chat answer with structure looks like (headings, a list, a table,
# two code blocks), written by the model itself under a grammar that allows only this text, so both paths decode the
# same tokens at a real decode pace and the TUI renders real Markdown as it streams.
MARKDOWN_REPLY = """## Reading a CSV file in Python

There are two common ways:

1. The `csv` module, in the standard library.
2. **pandas**, for analysis.

| Way | Needs | Good for |
|---|---|---|
| csv | nothing | small files |
| pandas | pip install | tables, statistics |

### With the csv module

```python
import csv

with open("data.csv", newline="") as f:
    for row in csv.DictReader(f):
        print(row["name"], row["age"])
```

### With pandas

```python
import pandas as pd

df = pd.read_csv("data.csv")
print(df.describe())
```

Both read the header row as column names."""
MARKDOWN_PROMPT = "How do I read a CSV file in Python? Show two ways with code."
MARKDOWN_MAX_TOKENS = 1024  # a cap above the reply's length: the grammar ends it


def _tui_text(engine: Any) -> str:
    msgs, _ = prompts.exact_prompt(engine.model.tokenizer, TUI_TEXT_TOKENS, system=prompts.SYSTEM)
    return msgs[-1]["content"]


def _markdown_profile() -> Any:
    """Greedy, held to MARKDOWN_REPLY by a Lark grammar of that one string (JSON's escapes are Lark's)."""
    import json

    from mlxchat.core import SamplingProfile

    return SamplingProfile(name="bench-markdown", temperature=0,
                           response_format={"type": "grammar", "grammar": f"start: {json.dumps(MARKDOWN_REPLY)}"})


def _headless(engine: Any, system: str | None, text: str, max_tokens: int, profile: Any) -> dict[str, Any]:
    chat = engine.chat(system=system, profile=profile)
    return from_metrics(chat.send(text, max_tokens=max_tokens).wait().metrics)


async def _tui_runs(engine: Any, max_tokens: int, repeats: int, markdown: bool = False) -> dict[str, Any]:
    from mlxchat.app.app import make_app

    text = MARKDOWN_PROMPT if markdown else _tui_text(engine)
    profile = _markdown_profile() if markdown else _greedy(max_tokens)
    headless, tui = [], []
    with tempfile.TemporaryDirectory(prefix="mlxchat-bench-") as d:
        app = make_app(engine=engine, data_dir=os.path.join(d, "data"), config_dir=os.path.join(d, "config"),
                       max_tokens=max_tokens, scan_hf_cache=False)
        system = app.settings.system_prompt or None
        async with app.run_test(headless=True, size=(120, 40)) as pilot:
            screen = app.chat_screen
            deadline = time.monotonic() + 60
            while screen.controller.session is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the app did not get its engine within 60 s")
                await pilot.pause(0.05)
            for _ in range(repeats):
                # Headless: the same ChatSession call, with the app's loop blocked (so it costs nothing meanwhile).
                headless.append(_headless(engine, system, text, max_tokens, profile))
                # The real TUI: a new chat, the same profile, the text submitted as the user would send it.
                await screen.action_new_chat()
                screen.set_profile(profile)
                posted_before = screen.worker.batches_posted if screen.worker else 0
                started, ui_started = time.perf_counter(), time.thread_time()  # the app runs on this thread
                if not await screen.submit(text):
                    raise RuntimeError("the chat screen refused the message")
                deadline = time.monotonic() + 600
                while screen.busy:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the TUI reply did not finish within 600 s")
                    # A plain sleep, not pilot.pause(): pause() posts a callback to every widget on the screen and
                    # forces a screen update each time, which no user's TUI does; polled every 20 ms that was more
                    # UI-thread CPU per token than the TUI's own drawing, charged to the TUI path. Every 0.25 s: TPOT
                    # comes from the reply's own timings, and the poll's wakeups are the bench's, not the TUI's.
                    await asyncio.sleep(0.25)
                wall, ui_cpu = time.perf_counter() - started, time.thread_time() - ui_started
                result = screen.controller.last_result
                if result is None:
                    raise RuntimeError("the TUI reply finished without a result")
                batches = (screen.worker.batches_posted if screen.worker else 0) - posted_before
                # The UI thread's CPU per token: what drawing the reply costs, a figure the machine's load moves
                # far less than decode speed; in all (the new chat, the message, the final Markdown) and while it
                # streamed (its first batch to its last: what competes with decoding).
                n = max(1, result.metrics.completion_tokens)
                tui.append({**from_metrics(result.metrics), "wall_s": wall, "ui_batches": batches,
                            "ui_cpu_ms_per_token": ui_cpu * 1000 / n,
                            "streaming_ui_cpu_ms_per_token": screen.feed.streaming_ui_cpu_s * 1000 / n})
    return {"path": "textual App.run_test (app.app.make_app, the real ChatScreen, headless terminal)",
            "headless_samples": headless, "tui_samples": tui}


def _worker_runs(engine: Any, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Fallback when the app cannot be built: engine -> EngineWorker thread -> coalesced batches to a sink."""
    from mlxchat.app.engine_worker import EngineWorker

    class Sink:
        def __init__(self) -> None:
            self.messages: list[Any] = []
            self.done = threading.Event()

        def post_message(self, message: Any) -> bool:
            self.messages.append(message)
            if isinstance(message, (EngineWorker.Finished, EngineWorker.Failed)):
                self.done.set()
            return True

    text = _tui_text(engine)
    headless, tui = [], []
    for _ in range(repeats):
        headless.append(_headless(engine, prompts.SYSTEM, text, max_tokens, _greedy(max_tokens)))
        sink = Sink()
        worker = EngineWorker(sink)  # type: ignore[arg-type]
        chat = engine.chat(system=prompts.SYSTEM, profile=_greedy(max_tokens))
        worker.follow(chat.send(text, max_tokens=max_tokens))
        sink.done.wait(600)
        worker.close()
        fin = [m for m in sink.messages if isinstance(m, EngineWorker.Finished)]
        if not fin:
            raise RuntimeError("the worker path failed")
        tui.append({**from_metrics(fin[0].result.metrics), "ui_batches": worker.batches_posted})
    return {"path": "app.engine_worker.EngineWorker to a message sink (the Textual app was not available)",
            "headless_samples": headless, "tui_samples": tui}


def tui_case(engine: Any, max_tokens: int, repeats: int, *, markdown: bool = False) -> dict[str, Any]:
    """Decode tok/s through the real TUI against the same ChatSession call made headless, interleaved: plain prose
    of `max_tokens`, or with `markdown` the rich reply MARKDOWN_REPLY (its own length)."""
    try:
        import mlxchat.app.app  # noqa: F401
        out = asyncio.run(_tui_runs(engine, MARKDOWN_MAX_TOKENS if markdown else max_tokens, repeats, markdown))
    except ImportError as e:
        if markdown:
            raise  # the Markdown row measures the app's rendering: without the app there is nothing to measure
        out = _worker_runs(engine, max_tokens, repeats)
        out["fallback_reason"] = f"{type(e).__name__}: {e}"
    from .stats import summarize

    h, t = summarize(out["headless_samples"]), summarize(out["tui_samples"])
    out["headless"], out["tui"] = h, t
    hd, td = h["decode_tokens_per_s"], t["decode_tokens_per_s"]
    out["slowdown_pct"] = (1 - td / hd) * 100 if hd and td else None
    out["max_tokens"] = max_tokens
    out["reply"] = "markdown" if markdown else "prose"
    return out


# --- roofline: memory bandwidth ----------------------------------------------------------------------------------

def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm: page faults, caches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


def memory_bandwidth(engine: Any, nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """Read bandwidth from summing a ``nbytes`` float32 array: numpy on one thread, numpy on every core (each
    thread its own slice; numpy releases the GIL in the reduction), and MLX (``mx.sum``, on the inference thread).
    The largest is the roofline's bandwidth."""
    import numpy as np

    a = np.ones(nbytes // 4, np.float32)
    one = nbytes / _timed(lambda: a.sum(), repeats)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)

    def threaded() -> None:
        ts = [threading.Thread(target=p.sum) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    many = nbytes / _timed(threaded, repeats)
    parts = a = None  # the GB goes before MLX makes its own

    def mlx_sum() -> float:
        import mlx.core as mx

        x = mx.ones((nbytes // 4,), dtype=mx.float32)
        mx.eval(x)
        return nbytes / _timed(lambda: mx.eval(x.sum()), repeats)

    mlx = engine.run(mlx_sum)
    methods = {"numpy_1_thread": one, f"numpy_{n}_threads": many, "mlx_sum": mlx}
    best = max(methods, key=methods.get)
    return {"bytes_read": nbytes, "repeats": repeats, "methods_bytes_per_s": methods,
            "bandwidth_bytes_per_s": methods[best], "method": best}


def gguf_bytes_per_token(path: str) -> int | None:
    """The bytes of the GGUF's weights one token reads (the embedding table once, as the tied output head)."""
    try:
        from mlxchat.core.model import gguf

        header = gguf.read_header(__import__("pathlib").Path(path))
    except Exception:  # noqa: BLE001 - not a GGUF: no figure
        return None
    names = {t.name for t in header.tensors}
    total = sum(t.nbytes for t in header.tensors)
    if "output.weight" in names:  # untied: the embedding is only looked up, one row a token
        total -= sum(t.nbytes for t in header.tensors if t.name == "token_embd.weight")
    return total


def roofline(bandwidth: float, weight_bytes: int, gguf_bytes: int | None,
             decode_by_system: dict[str, float | None]) -> dict[str, Any]:
    """Ceiling tok/s = bandwidth / bytes read per token; the fraction of it each system's decode reached.
    mlxchat and mlx-lm read the weights as loaded (``weight_bytes``); llama.cpp reads the GGUF's own bytes."""
    ceiling = bandwidth / weight_bytes
    gguf_ceiling = bandwidth / gguf_bytes if gguf_bytes else None
    fractions = {}
    for system, tps in decode_by_system.items():
        c = gguf_ceiling if system == "llama.cpp" else ceiling
        fractions[system] = {"decode_tokens_per_s": tps, "ceiling_tokens_per_s": c,
                             "fraction": tps / c if tps and c else None}
    return {"bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_token": weight_bytes,
            "ceiling_tokens_per_s": ceiling, "gguf_bytes_per_token": gguf_bytes,
            "gguf_ceiling_tokens_per_s": gguf_ceiling, "systems": fractions}


# --- weight formats MLX offers on this backend -------------------------------------------------------------------

def _matrices(model: Any) -> list[Any]:
    """The fp32 weight matrix of every projection one token multiplies by (the tied embedding as the head)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxchat.core.model.native_linear import NativeQuantizedEmbedding, NativeQuantizedLinear, mlx_weights

    out = []
    tied = not hasattr(model, "lm_head")
    for name, mod in model.named_modules():
        is_embed = isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding))
        if is_embed and not tied:
            continue
        if isinstance(mod, (NativeQuantizedLinear, NativeQuantizedEmbedding)):
            w = mx.dequantize(*mlx_weights(mod), mod.group_size, mod.bits)
        elif isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(mod.weight, mod.scales, getattr(mod, "biases", None), mod.group_size, mod.bits)
        elif isinstance(mod, (nn.Linear, nn.Embedding)):
            w = mod.weight
        else:
            continue
        out.append(w.astype(mx.float32))
    return out


def weight_formats(engine: Any, repeats: int = 5, formats: tuple[str, ...] = ("fp32", "bf16", "fp16", "q8", "q4"),
                   bandwidth: float | None = None) -> list[dict[str, Any]]:
    """Per format: the time of all the GEMVs of one token (every projection and the output head, one graph, no
    attention), so the ceiling tok/s that format allows on MLX's CPU backend, and the bytes it reads. The median of
    the repeats is the figure; ``gemv_s_min`` (the best repeat) shows what an idle machine would give."""

    def job() -> list[dict[str, Any]]:
        import mlx.core as mx

        base = _matrices(engine.model.model)
        mx.eval(base)
        rows = []
        for fmt in formats:
            if fmt in ("q4", "q8"):
                bits = 4 if fmt == "q4" else 8
                qs = [mx.quantize(w, group_size=32, bits=bits) for w in base]
                mx.eval(qs)
                xs = [mx.ones((1, w.shape[1]), dtype=mx.float32) for w in base]
                nbytes = sum(a.nbytes for q in qs for a in q)

                def step(qs: list = qs, xs: list = xs, bits: int = bits) -> None:  # bound now, not at the loop's end
                    mx.eval([mx.quantized_matmul(x, *q, transpose=True, group_size=32, bits=bits)
                             for x, q in zip(xs, qs)])
            else:
                dtype = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[fmt]
                ws = base if fmt == "fp32" else [w.astype(dtype) for w in base]
                mx.eval(ws)
                xs = [mx.ones((1, w.shape[1]), dtype=dtype) for w in ws]
                nbytes = sum(w.nbytes for w in ws)

                def step(ws: list = ws, xs: list = xs) -> None:
                    mx.eval([x @ w.T for x, w in zip(xs, ws)])
            times = _times(step, repeats)
            t = statistics.median(times)
            rows.append({"format": fmt, "bytes_per_token": nbytes, "gemv_s": t, "gemv_s_min": min(times),
                         "ceiling_tokens_per_s": 1 / t,
                         "effective_bytes_per_s": nbytes / t,
                         "bandwidth_ceiling_tokens_per_s": bandwidth / nbytes if bandwidth else None})
            del step
        return rows

    return engine.run(job)


__all__ = ["EngineRunner", "GREEDY", "chat_case", "gguf_bytes_per_token", "memory_bandwidth", "roofline",
           "rotating_case", "tui_case", "weight_formats"]


# --- sampler traces (issue 14) -----------------------------------------------------------------------------------

TRACE_K = 10  # candidates per token: an inspector's table
STEP_ROUNDS = 7  # interleaved rounds of sampler steps per variant, on the same logits (median of the rounds)
STEPS_PER_ROUND = 20


def trace_case(engine: Any, messages: list[dict[str, str]], max_tokens: int, repeats: int,
               k: int = TRACE_K) -> dict[str, Any]:
    """What ``trace=k`` costs with the full chain: TPOT untraced and traced (interleaved repeats, medians), and the
    sampler step alone on the model's real logits (``Sampler.step`` against ``Tracer.step`` + ``take``, each
    evaluated to a token id), which the model's own step-to-step noise on a busy machine would otherwise hide."""
    profile = EngineRunner(engine).profile(FULL, max_tokens)
    tpot: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(repeats):
        for traced in ((False, True) if rep % 2 == 0 else (True, False)):
            r = engine.generate(messages, profile=profile, max_tokens=max_tokens, trace=k if traced else 0)
            tpot[traced].append(r.metrics.tpot_s)
    off, on = median(tpot[False]), median(tpot[True])
    step = engine.run(lambda: _sampler_steps(engine, messages, profile, k))
    return {"k": k, "max_tokens": max_tokens, "repeats": repeats, "untraced_tpot_s": off, "traced_tpot_s": on,
            "per_token_s": on - off, "overhead_pct": (on / off - 1) * 100 if off else None, **step}


def _sampler_steps(engine: Any, messages: list[dict[str, str]], profile: Any, k: int) -> dict[str, Any]:
    """On the inference thread: seconds per sampler step, plain and traced, on one real row of logits."""
    import mlx.core as mx

    from mlxchat.core.sampling.chain import Sampler
    from mlxchat.core.sampling.tracing import Tracer

    m = engine.model
    logits = m.model(mx.array(m.tokenizer.encode_chat(messages))[None])[0, -1]
    mx.eval(logits)

    plain = Sampler(profile, vocab_size=logits.size, eos_ids=m.tokenizer.eos_ids)
    tracer = Tracer(Sampler(profile, vocab_size=logits.size, eos_ids=m.tokenizer.eos_ids), k,
                    lambda i: m.tokenizer.decode([i]))
    steps = {False: lambda: plain.step(logits)[0].item(),
             True: lambda: tracer.take(tracer.step(logits)[0].item())}
    times: dict[bool, list[float]] = {False: [], True: []}
    for rnd in range(STEP_ROUNDS + 1):  # interleaved rounds, the first a warm-up; the median is robust to load
        for traced in ((False, True) if rnd % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                steps[traced]()
            if rnd:
                times[traced].append((time.perf_counter() - t0) / STEPS_PER_ROUND)
    plain_s, traced_s = median(times[False]), median(times[True])
    return {"step_s": plain_s, "traced_step_s": traced_s, "step_rounds": STEP_ROUNDS,
            "steps_per_round": STEPS_PER_ROUND}
