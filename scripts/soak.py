#!/usr/bin/env python
"""Soak: a scripted 20-turn conversation on the embedded model with the rotating KV cache, saved turn by turn
through app/store.py, with every turn's speed and memory checked (issue 7). Too long for the default test run.

    make soak                                   # = this, then `scripts/soak.py server` (scripts/soak_server.py)
    .venv/bin/python scripts/soak.py --turns 20 --window 512 --max-tokens 64 --data-dir /tmp/soak --json out.json

Each turn stores the user message (as the app does, before the reply), streams the reply through
``ChatSession.send``, stores the reply with its metrics, and samples: prompt / cached / new tokens, TTFT, prefill and
decode tok/s, the KV cache's bytes and buffer length, the turn's peak memory (``Metrics.peak_memory_bytes``, from
``mx.get_peak_memory`` reset at each request) and the active memory after the turn. The window is small enough
that the conversation wraps it after a few turns.

Checks (any violation: exit 1, after printing the table, the summary and writing the JSON):
- every turn answers: non-empty text, finish reason ``stop`` or ``length``, no exception;
- the conversation outgrows the window (else the rotating cache was not exercised);
- the cache stays inside its bound: each layer's buffer holds at most window + prefill_step positions (a
  multi-token prefill chunk may sit on top of the window until the next decode step trims it), so its bytes are
  at most that many positions' worth;
- memory stays inside its bound: each turn's peak <= the active memory after loading + the cache bound +
  ``--activation-slack`` MiB (a prefill chunk's logits and the model's scratch), and the active memory after a turn
  never exceeds the first wrapped turn's by more than ``--growth-slack`` MiB (flat once the window is full);
- nothing is lost: the database is reopened (a new Store) at the end and holds every message, in order, with the
  same text, finish reasons and metrics, and passes ``PRAGMA integrity_check``.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxchat.core  # noqa: E402,F401 - loads the optimized BLAS before MLX
import mlx.core as mx  # noqa: E402

from mlxchat.app.store import Store  # noqa: E402
from mlxchat.core import Engine, SamplingProfile  # noqa: E402
from mlxchat.core.chat.messages import ChatMessage  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in two or three sentences."
QUESTIONS = [
    "Hello! What can you help me with today?",
    "What is the capital of France?",
    "Tell me one interesting fact about Paris.",
    "How tall is the Eiffel Tower, roughly?",
    "Why is the sky blue?",
    "Explain photosynthesis simply.",
    "What is 12 times 7?",
    "Write a haiku about the sea.",
    "Name three planets in our solar system.",
    "What does a compiler do?",
    "Give me a tip for learning a new language.",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a black cat.",
    "Why do leaves change color in autumn?",
    "What is a prime number? Give an example.",
    "How do bees make honey?",
    "Recommend a simple breakfast.",
    "What is the difference between weather and climate?",
    "Summarize what we talked about so far in one sentence.",
    "Thank you! Say goodbye in French.",
]
MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--window", type=int, default=512, help="rotating KV window (max_kv_size)")
    p.add_argument("--max-tokens", type=int, default=64, help="per reply")
    p.add_argument("--model", default=None, help="what Engine.load takes (default: the embedded model)")
    p.add_argument("--data-dir", type=Path, default=None, help="where conversations.db goes (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here (default: DATA_DIR/soak.json)")
    p.add_argument("--activation-slack", type=float, default=512.0, help="MiB above weights + cache for a peak")
    p.add_argument("--growth-slack", type=float, default=32.0, help="MiB of active-memory growth allowed once full")
    return p.parse_args(argv)


def keep_for(engine: Engine) -> int:
    """Tokens every prompt shares (the system message and the start of the first user turn): the rotating
    cache's ``keep``, so the system prompt is never rotated out."""
    enc = engine.model.tokenizer.encode_chat
    a = enc([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}])
    b = enc([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cache_shape(chat) -> tuple[int, int]:
    """(bytes, longest layer buffer in positions) of the session's KV cache."""
    cache = chat.cache
    if cache is None:
        return 0, 0
    longest = max((c.keys.shape[2] for c in cache.layers if not c.empty()), default=0)
    return cache.nbytes(), longest


def bytes_per_position(chat) -> int:
    cache = chat.cache
    total = 0
    for c in cache.layers:
        if not c.empty():
            _, heads, _, dim = c.keys.shape
            total += heads * dim * c.keys.dtype.size + heads * c.values.shape[3] * c.values.dtype.size
    return total


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["server"]:  # `soak.py server [...]`: the server's load/fault soak (scripts/soak_server.py)
        import soak_server

        return soak_server.main(argv[1:])
    args = parse_args(argv)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="mlxchat-soak-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    db_path = data_dir / "conversations.db"
    json_path = args.json or data_dir / "soak.json"
    violations: list[str] = []

    started = time.perf_counter()
    engine = Engine.load(args.model)
    load_s = time.perf_counter() - started
    mx.clear_cache()
    baseline = mx.get_active_memory()
    keep = keep_for(engine)
    profile = SamplingProfile(temperature=0)  # greedy: the same figures run after run
    chat = engine.chat(system=SYSTEM, profile=profile, max_kv_size=args.window, keep=keep)
    store = Store(db_path)
    conversation = store.create_conversation(f"soak {time.strftime('%Y-%m-%d %H:%M:%S')}", system_prompt=SYSTEM,
                                             profile=profile.model_dump(mode="json"), model=engine.name)
    print(f"model {engine.name} (loaded in {load_s:.1f} s) · window {args.window} · keep {keep} · "
          f"prefill step {engine.prefill_step} · {args.turns} turns × ≤{args.max_tokens} tokens · db {db_path}")
    print(f"active memory after load: {baseline / MiB:.0f} MiB")

    header = (f"{'turn':>4} {'prompt':>6} {'cached':>6} {'new':>5} {'out':>4} {'fin':>6} {'TTFT s':>7} "
              f"{'pre t/s':>8} {'dec t/s':>7} {'cache MiB':>9} {'buf':>5} {'peak MiB':>8} {'active MiB':>10}")
    print(header)
    print("-" * len(header))
    rows: list[dict] = []
    expected: list[tuple[str, str, str | None]] = []
    cache_bound = None
    wrapped_at = None
    for turn, question in enumerate(questions, 1):
        store.add_message(conversation.id, ChatMessage("user", question))
        expected.append(("user", question, None))
        try:
            stream = chat.send(question, max_tokens=args.max_tokens)
            result = stream.wait()
        except Exception as e:  # noqa: BLE001 - a violation, reported, then the run goes on
            violations.append(f"turn {turn}: the engine failed: {type(e).__name__}: {e}")
            print(f"{turn:>4} FAILED: {e}")
            continue
        m = result.metrics
        store.add_message(conversation.id, ChatMessage("assistant", result.text, finish_reason=result.finish_reason,
                          metrics=m.as_dict(), profile=result.profile, sampler=result.sampler, seed=result.seed,
                          model=engine.name))
        expected.append(("assistant", result.text, result.finish_reason))
        nbytes, buffer = cache_shape(chat)
        if cache_bound is None and nbytes:
            cache_bound = bytes_per_position(chat) * (args.window + engine.prefill_step)
        active = mx.get_active_memory()
        if wrapped_at is None and m.prompt_tokens + m.completion_tokens > args.window:
            wrapped_at = turn
        row = dict(turn=turn, prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens,
                   prefilled_tokens=m.prompt_tokens - m.cached_tokens, completion_tokens=m.completion_tokens,
                   finish_reason=result.finish_reason, ttft_s=m.ttft_s, prefill_tokens_per_s=m.prefill_tokens_per_s,
                   decode_tokens_per_s=m.decode_tokens_per_s, cache_bytes=nbytes, cache_buffer_positions=buffer,
                   context_tokens=m.context_tokens, peak_memory_bytes=m.peak_memory_bytes,
                   active_memory_bytes=active, wrapped=wrapped_at is not None, text=result.text)
        rows.append(row)
        print(f"{turn:>4} {m.prompt_tokens:>6} {m.cached_tokens:>6} {row['prefilled_tokens']:>5} "
              f"{m.completion_tokens:>4} {result.finish_reason:>6} {m.ttft_s:>7.2f} {m.prefill_tokens_per_s:>8.0f} "
              f"{m.decode_tokens_per_s:>7.1f} {nbytes / MiB:>9.1f} {buffer:>5} {m.peak_memory_bytes / MiB:>8.0f} "
              f"{active / MiB:>10.0f}", flush=True)
        if not result.text.strip() or result.finish_reason not in ("stop", "length"):
            violations.append(f"turn {turn}: no answer (finish {result.finish_reason}, text {result.text!r})")
        if buffer > args.window + engine.prefill_step:
            violations.append(f"turn {turn}: a KV buffer holds {buffer} positions > window {args.window} + "
                              f"prefill step {engine.prefill_step}")
        if cache_bound is not None and nbytes > cache_bound:
            violations.append(f"turn {turn}: the cache holds {nbytes / MiB:.1f} MiB > bound {cache_bound / MiB:.1f}")
    store.close()
    total_s = time.perf_counter() - started

    # Memory bounds.
    cache_bound = cache_bound or 0
    peak_bound = baseline + cache_bound + args.activation_slack * MiB
    for r in rows:
        if r["peak_memory_bytes"] > peak_bound:
            violations.append(f"turn {r['turn']}: peak {r['peak_memory_bytes'] / MiB:.0f} MiB > bound "
                              f"{peak_bound / MiB:.0f} MiB")
    if wrapped_at is None:
        violations.append(f"the conversation never outgrew the window of {args.window}: nothing rotated")
    else:
        full = next(r for r in rows if r["turn"] >= wrapped_at)
        limit = full["active_memory_bytes"] + args.growth_slack * MiB
        for r in rows:
            if r["turn"] > full["turn"] and r["active_memory_bytes"] > limit:
                violations.append(f"turn {r['turn']}: active memory {r['active_memory_bytes'] / MiB:.0f} MiB grew "
                                  f"more than {args.growth_slack:.0f} MiB past turn {full['turn']}'s "
                                  f"{full['active_memory_bytes'] / MiB:.0f} MiB")

    # Nothing lost: a new connection, through the app's store, and SQLite's own check.
    check = sqlite3.connect(db_path)
    integrity = check.execute("PRAGMA integrity_check").fetchone()[0]
    check.close()
    if integrity != "ok":
        violations.append(f"integrity_check: {integrity}")
    reopened = Store(db_path)
    stored = reopened.messages(conversation.id)
    reopened.close()
    got = [(s.role, s.content, s.finish_reason) for s in stored]
    if got != expected:
        lost = len(expected) - len(got)
        violations.append(f"the database does not hold the conversation as sent: {len(got)} messages stored, "
                          f"{len(expected)} expected ({lost} missing)" if lost else
                          "the database's messages differ from those sent")
    if [s.position for s in stored] != list(range(len(stored))):
        violations.append("stored positions are not 0..n-1")
    if any(s.role == "assistant" and not (s.metrics or {}).get("completion_tokens") for s in stored):
        violations.append("an assistant message was stored without its metrics")

    decode = [r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"]]
    ttft = [r["ttft_s"] for r in rows]
    summary = dict(
        model=engine.name, turns=args.turns, answered=sum(1 for r in rows if r["text"].strip()),
        window=args.window, keep=keep, prefill_step=engine.prefill_step, max_tokens=args.max_tokens,
        wrapped_at_turn=wrapped_at, resets=sum(1 for r in rows[1:] if r["cached_tokens"] == 0),
        load_s=load_s, total_s=total_s, ttft_s_median=sorted(ttft)[len(ttft) // 2] if ttft else None,
        ttft_s_max=max(ttft, default=None), decode_tokens_per_s_median=sorted(decode)[len(decode) // 2] if decode
        else None, baseline_active_bytes=baseline, cache_bound_bytes=cache_bound, peak_bound_bytes=peak_bound,
        max_cache_bytes=max((r["cache_bytes"] for r in rows), default=0),
        max_peak_memory_bytes=max((r["peak_memory_bytes"] for r in rows), default=0),
        active_memory_first_last=[rows[0]["active_memory_bytes"], rows[-1]["active_memory_bytes"]] if rows else None,
        messages_stored=len(stored), messages_expected=len(expected), integrity=integrity, database=str(db_path),
        violations=violations, ok=not violations)
    engine.close()
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"summary": summary, "turns": rows}, indent=2))

    print()
    print(f"answered {summary['answered']}/{args.turns} turns in {total_s:.0f} s · window wrapped at turn "
          f"{wrapped_at} · cache resets (full re-prefill) on {summary['resets']} turns")
    if rows:
        print(f"TTFT median {summary['ttft_s_median']:.2f} s, max {summary['ttft_s_max']:.2f} s · decode median "
              f"{summary['decode_tokens_per_s_median'] or 0:.1f} tok/s")
    print(f"cache ≤ {summary['max_cache_bytes'] / MiB:.1f} MiB (bound {cache_bound / MiB:.1f}) · peak ≤ "
          f"{summary['max_peak_memory_bytes'] / MiB:.0f} MiB (bound {peak_bound / MiB:.0f}) · active "
          + (" → ".join(f"{b / MiB:.0f}" for b in summary["active_memory_first_last"] or []) + " MiB"))
    print(f"database: {len(stored)}/{len(expected)} messages back after reopening, integrity {integrity}")
    print(f"figures: {json_path}")
    if violations:
        print(f"\nFAILED: {len(violations)} violation(s):")
        for v in violations:
            print(f"  - {v}")
        return 1
    print("\nOK: every turn answered, memory inside its bounds, nothing lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
