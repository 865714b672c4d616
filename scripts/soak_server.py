#!/usr/bin/env python
"""Server soak: `mlxchat serve` on 127.0.0.1 under many clients and faults for a bounded time (issue 28).

    make soak                                          # the chat soak (scripts/soak.py), then this one
    .venv/bin/python scripts/soak.py server            # = this script: 32 clients for 120 s
    .venv/bin/python scripts/soak_server.py --clients 32 --duration 120 --json out.json

`--clients` threads loop for `--duration` seconds, each drawing (seeded) what to send next: a greedy chat
completion streamed or not, one it abandons mid-stream or before the answer (a client timeout), a body over the
server's limit (declared, or chunked with no length), or a malformed one (not JSON, not UTF-8, wrong types, bad
values). A separate process asks `/health` every 0.1 s (so the clients' own threads cannot slow its clock).

Checks (any violation: exit 1, after the summary and the JSON):
- every answer is what it should be: completions 200 (or 429 when the queue is full, retried), oversize bodies 413
  (or the connection closed while still sending it), malformed ones 400 with an error message; never a 5xx, and
  no connection error on a request the client did not abandon;
- every completed reply equals the same request sent alone afterwards (greedy), streamed or not;
- `/health` answered every probe, each within `--health-ms` (100);
- memory is given back: once idle, MLX's active memory less the prefix cache (bounded by its own limit, reported)
  is within `--memory-slack` (10 %) of what it was before the load.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to five.",
             "Why is the sky blue?", "Name three planets.", "What does a compiler do?"]
MAX_TOKENS = (8, 16, 32)
# What a client sends next, and how often.
# Client i starts with the i-th kind (so even a short run mixes the faults in), then draws by weight.
KINDS = {"malformed": 16, "oversize": 6, "drop-stream": 15, "stream": 35, "plain": 20, "oversize-chunked": 3,
         "drop-plain": 5}
MALFORMED: list[bytes] = [
    b"{not json", b"\xff\xfe{}", b"[]", b'{"messages": "hello"}', b'{"messages": []}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}', b'{"prompt": 12}',
]
MiB = 2**20


@dataclass
class Tally:
    """What the clients saw; shared by their threads (list.append and Counter updates under the lock)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    replies: list[tuple[str, int, bool, str]] = field(default_factory=list)  # question, max_tokens, streamed, text
    violations: list[str] = field(default_factory=list)

    def note(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.sent[kind] += 1
            self.outcomes[f"{kind}: {outcome}"] += 1

    def bad(self, what: str) -> None:
        with self.lock:
            self.violations.append(what)


def _body(question: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def _stream_text(r: httpx.Response, stop_after: int | None) -> tuple[str, str | None]:
    """The streamed text and finish reason; with `stop_after`, return after that many deltas (the caller hangs up)."""
    text, finish, seen = [], None, 0
    for line in r.iter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"in-stream error: {chunk['error'].get('message')}")
        for choice in chunk.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
        seen += 1
        if stop_after is not None and seen >= stop_after:
            break
    return "".join(text), finish


def _completion(client: httpx.Client, url: str, kind: str, rng: random.Random, tally: Tally,
                requests: tuple[list[str], tuple[int, ...]] = (QUESTIONS, MAX_TOKENS)) -> None:
    question, max_tokens = rng.choice(requests[0]), rng.choice(requests[1])
    stream = kind in ("stream", "drop-stream")
    drop = kind.startswith("drop")
    while True:
        try:
            if stream:
                with client.stream("POST", url, json=_body(question, max_tokens, True), timeout=300) as r:
                    if r.status_code == 429:
                        r.read()
                    elif r.status_code != 200:
                        tally.bad(f"{kind}: status {r.status_code}: {r.read()[:200]!r}")
                        return
                    else:
                        text, finish = _stream_text(r, rng.randint(1, 6) if drop else None)
                        if drop:
                            tally.note(kind, "hung up mid-stream")
                            return
                        _record(tally, kind, question, max_tokens, True, text, finish)
                        return
            else:
                r = client.post(url, json=_body(question, max_tokens, False),
                                timeout=rng.uniform(0.05, 0.5) if drop else 300)
                if r.status_code == 200:
                    choice = r.json()["choices"][0]
                    _record(tally, kind, question, max_tokens, False, choice["message"]["content"],
                            choice["finish_reason"])
                    return
                if r.status_code != 429:
                    tally.bad(f"{kind}: status {r.status_code}: {r.text[:200]}")
                    return
        except httpx.TimeoutException:
            if drop:
                tally.note(kind, "timed out (hung up)")
            else:
                tally.bad(f"{kind}: timed out after 300 s")
            return
        except (httpx.HTTPError, RuntimeError) as e:
            tally.bad(f"{kind}: {type(e).__name__}: {e}")
            return
        tally.note(kind, "429, retried")
        time.sleep(rng.uniform(0.1, 0.4))


def _record(tally: Tally, kind: str, question: str, max_tokens: int, streamed: bool, text: str,
            finish: str | None) -> None:
    if finish not in ("stop", "length"):
        tally.bad(f"{kind}: finish reason {finish!r} for a request nobody cancelled")
        return
    tally.note(kind, "completed")
    with tally.lock:
        tally.replies.append((question, max_tokens, streamed, text))


def _oversize(client: httpx.Client, url: str, kind: str, limit: int, tally: Tally) -> None:
    payload = json.dumps(_body("x" * (limit + 4096), 8, False)).encode()
    content = payload if kind == "oversize" else (payload[i:i + 8192] for i in range(0, len(payload), 8192))
    try:
        r = client.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
    except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
        tally.note(kind, "closed while sending")  # the server answered 413 and closed before the body was all sent
        return
    except httpx.HTTPError as e:
        tally.bad(f"{kind}: {type(e).__name__}: {e}")
        return
    if r.status_code != 413:
        tally.bad(f"{kind}: status {r.status_code}, expected 413")
    else:
        tally.note(kind, "413")


def _malformed(client: httpx.Client, url: str, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(MALFORMED)
    try:
        r = client.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    except httpx.HTTPError as e:
        tally.bad(f"malformed {body[:40]!r}: {type(e).__name__}: {e}")
        return
    message = r.json().get("error", {}).get("message") if r.headers.get("content-type", "").startswith(
        "application/json") else None
    if r.status_code != 400 or not message or "\n" in message:
        tally.bad(f"malformed {body[:40]!r}: status {r.status_code}, message {message!r} (expected 400 and one line)")
    else:
        tally.note("malformed", "400")


def _client(base: str, index: int, seed: int, until: float, limit: int, tally: Tally,
            requests: tuple[list[str], tuple[int, ...]]) -> None:
    rng = random.Random(seed * 1000 + index)
    url = base + "/v1/chat/completions"
    kinds, weights = list(KINDS), list(KINDS.values())
    kind = kinds[index % len(kinds)]
    with httpx.Client() as client:
        while time.monotonic() < until:
            if kind.startswith("oversize"):
                _oversize(client, url, kind, limit, tally)
            elif kind == "malformed":
                _malformed(client, url, rng, tally)
            else:
                _completion(client, url, kind, rng, tally, requests)
            kind = rng.choices(kinds, weights)[0]


def _probe(base: str) -> None:
    """The probe process (`soak_server.py --probe URL`): GET /health every 0.1 s until its stdin closes, then print
    the latencies (ms) and failures as JSON."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    latencies, failures = [], []
    with httpx.Client() as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                r = client.get(base + "/health", timeout=10)
                if r.status_code != 200:
                    failures.append(f"status {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(f"{type(e).__name__}: {e}")
            latencies.append((time.perf_counter() - t) * 1000)
            stop.wait(max(0.0, 0.1 - (time.perf_counter() - t)))
    print(json.dumps([latencies, failures]))


def _health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=30).json()


def _idle_memory(base: str, timeout: float = 120) -> dict:
    """/health's memory once no request is running or waiting (abandoned requests leave at their next token)."""
    deadline = time.monotonic() + timeout
    quiet = 0  # readings in a row with nothing running (the last rows leave the batch just after their answers)
    while True:
        h = _health(base)
        quiet = quiet + 1 if (h["running"], h["waiting"]) == (0, 0) else 0
        if quiet == 3 or time.monotonic() > deadline:
            return h["memory"]
        time.sleep(0.2)


def _held(memory: dict) -> int:
    """Active memory less the prefix cache, which keeps (up to its bound) what finished requests computed."""
    return memory["active_bytes"] - memory["prefix_cache_bytes"]


def soak(base: str, *, clients: int, duration: float, max_body_bytes: int, seed: int = 0, health_ms: float = 100,
         memory_slack: float = 0.10, questions: list[str] = QUESTIONS,
         max_tokens: tuple[int, ...] = MAX_TOKENS) -> dict:
    """Run the load on the server at `base` (http://127.0.0.1:PORT) and check it; returns the summary. Completions
    draw from `questions` x `max_tokens` (each distinct one is replayed alone at the end)."""
    tally = Tally()
    # Warm-up: what the first request allocates once (and keeps) belongs in the baseline.
    with httpx.Client() as client:
        _completion(client, base + "/v1/chat/completions", "plain", random.Random(seed), tally)
    before = _idle_memory(base)
    # In its own process, so that the clients' threads (and their GIL) cannot slow the probe's clock.
    probe = subprocess.Popen([sys.executable, __file__, "--probe", base], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    started = time.monotonic()
    threads = [threading.Thread(target=_client, args=(base, i, seed, started + duration, max_body_bytes,
                                                      tally, (questions, max_tokens)), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load_s = time.monotonic() - started
    after = _idle_memory(base)
    latencies, failures = json.loads(probe.communicate(timeout=60)[0])

    # Every completed reply against the same request alone, one at a time.
    alone: dict[tuple[str, int], str] = {}
    with httpx.Client() as client:
        for question, max_tokens in sorted({(q, m) for q, m, _, _ in tally.replies}):
            r = client.post(base + "/v1/chat/completions", json=_body(question, max_tokens, False), timeout=300)
            alone[(question, max_tokens)] = r.json()["choices"][0]["message"]["content"]
    differ = [(q, m, s, t) for q, m, s, t in tally.replies if t != alone[(q, m)]]
    violations = list(tally.violations)
    if differ:
        q, m, s, t = differ[0]
        violations.append(f"{len(differ)} of {len(tally.replies)} completed replies differ from the request alone, "
                          f"e.g. {q!r} (max_tokens {m}, {'streamed' if s else 'plain'}): {t!r} vs "
                          f"{alone[(q, m)]!r}")
    if not tally.replies:
        violations.append("no request completed")
    slow = [x for x in latencies if x > health_ms]
    if slow or failures or not latencies:
        violations.append(f"/health: {len(slow)} of {len(latencies)} probes over {health_ms:.0f} ms (max "
                          f"{max(latencies, default=0):.0f} ms), {len(failures)} failed"
                          + (f" ({failures[0]})" if failures else ""))
    grown = _held(after) / _held(before) - 1
    if grown > memory_slack:
        violations.append(f"memory not given back: {_held(before) / MiB:.0f} MiB held before, {_held(after) / MiB:.0f} "
                          f"MiB after (+{grown:.0%} > {memory_slack:.0%}), prefix cache aside")
    ordered = sorted(latencies)
    return dict(
        clients=clients, duration_s=duration, load_s=load_s, requests=sum(tally.sent.values()),
        sent=dict(tally.sent), outcomes=dict(sorted(tally.outcomes.items())), completed=len(tally.replies),
        distinct_requests=len(alone), replies_differing=len(differ),
        health_probes=len(latencies), health_p50_ms=ordered[len(ordered) // 2] if ordered else None,
        health_p99_ms=ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else None,
        health_max_ms=ordered[-1] if ordered else None, health_over=len(slow), health_failures=len(failures),
        memory_before=before, memory_after=after, held_growth=grown, violations=violations, ok=not violations)


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return 0
    m = re.search(r"VmRSS:\s+(\d+) kB", status.read_text())
    return int(m.group(1)) * 1024 if m else 0


def _serve(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxchat.app.cli", "serve", "--host", "127.0.0.1", "--port",
                                 "0", *flags], stdout=subprocess.PIPE, stderr=out, text=True)
    for line in proc.stdout:
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep it drained
            return proc, m.group(1)
    raise RuntimeError(f"the server did not start: {log.read_text(errors='replace')[-500:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        _probe(argv[1])
        return 0
    p = argparse.ArgumentParser(prog="scripts/soak.py server", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-concurrent", type=int, default=8, help="the server's batch")
    p.add_argument("--max-body-mb", type=float, default=0.25,
                   help="the server's body limit (the oversize bodies exceed it)")
    p.add_argument("--health-ms", type=float, default=100.0)
    p.add_argument("--memory-slack", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = p.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="mlxchat-soak-server-")) / "server.log"
    proc, base = _serve(["--max-concurrent", str(args.max_concurrent), "--max-body-mb", str(args.max_body_mb)], log)
    try:
        rss_before = _rss(proc.pid)
        print(f"server {base} (log {log}) · {args.clients} clients for {args.duration:.0f} s", flush=True)
        summary = soak(base, clients=args.clients, duration=args.duration,
                       max_body_bytes=int(args.max_body_mb * MiB), seed=args.seed, health_ms=args.health_ms,
                       memory_slack=args.memory_slack)
        summary.update(rss_before=rss_before, rss_after=_rss(proc.pid), server_alive=proc.poll() is None)
        if proc.poll() is not None:
            summary["violations"].append(f"the server exited with {proc.returncode}")
            summary["ok"] = False
    finally:
        proc.terminate()
        proc.wait(30)
    _print(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


def _print(s: dict) -> None:
    print(f"{s['requests']} requests in {s['load_s']:.0f} s: " + ", ".join(f"{k} {v}" for k, v in s["sent"].items()))
    for k, v in s["outcomes"].items():
        print(f"  {k}: {v}")
    print(f"completed {s['completed']} replies over {s['distinct_requests']} distinct requests; "
          f"{s['replies_differing']} differ from the request alone")
    print(f"/health: {s['health_probes']} probes, p50 {s['health_p50_ms']:.1f} ms, p99 {s['health_p99_ms']:.1f} ms, "
          f"max {s['health_max_ms']:.1f} ms, {s['health_over']} over the limit, {s['health_failures']} failed")
    b, a = s["memory_before"], s["memory_after"]
    print(f"memory (MiB): active {b['active_bytes'] / MiB:.0f} -> {a['active_bytes'] / MiB:.0f}, prefix cache "
          f"{b['prefix_cache_bytes'] / MiB:.0f} -> {a['prefix_cache_bytes'] / MiB:.0f}, held without it "
          f"{_held(b) / MiB:.0f} -> {_held(a) / MiB:.0f} ({s['held_growth']:+.1%}); MLX buffer cache "
          f"{b['buffer_cache_bytes'] / MiB:.0f} -> {a['buffer_cache_bytes'] / MiB:.0f}"
          + (f"; RSS {s['rss_before'] / MiB:.0f} -> {s['rss_after'] / MiB:.0f}" if s.get("rss_before") else ""))
    if s["violations"]:
        print(f"\nFAILED: {len(s['violations'])} violation(s):")
        for v in s["violations"][:20]:
            print(f"  - {v}")
    else:
        print("\nOK: every answer as expected, every completed reply equal to the request alone, /health in time, "
              "memory given back")


if __name__ == "__main__":
    sys.exit(main())
