"""The benchmark's arithmetic and text: medians, per-case summaries, ratios to peers, targets, the stdout table.

Pure Python on plain dicts (what the JSON holds), so it is tested on synthetic numbers, without MLX.

A *sample* is one generation: ``{"ttft_s", "tpot_s", "prefill_tokens_per_s", "decode_tokens_per_s",
"peak_memory_bytes", "prompt_tokens", "completion_tokens"}`` (``peak_memory_bytes`` may be None: llama.cpp's
allocations are not visible to MLX). A *case* is one system on one prompt length with one sampler:
``{"system", "prompt_tokens", "sampler", "samples": [...], "median": {...}}``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

OURS = "mlxchat"
MLX_LM = "mlx-lm"
LLAMA_CPP = "llama.cpp"
SYSTEM_ORDER = (OURS, MLX_LM, LLAMA_CPP)

METRICS = ("ttft_s", "tpot_s", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes",
           "completion_tokens")

# The targets on this machine (the numbers printed in the pass/fail lines).
DECODE_VS_MLX_LM = 1.5  # decode tok/s >= 1.5x mlx-lm's, at every prompt length (greedy)
TTFT_VS_MLX_LM = 1.0  # TTFT <= mlx-lm's, at every prompt length (greedy)
CHAIN_OVERHEAD_PCT = 5.0  # full sampler chain TPOT <= 5% over greedy
TUI_SLOWDOWN_PCT = 5.0  # TUI decode tok/s <= 5% under headless
CHAT_TTFT_GROWTH = 1.2  # last-turn TTFT <= 1.2x turn-1 TTFT
ROTATING_FLAT_PCT = 10.0  # rotating-cache peak memory within 10% from 2k tokens of context to the end
DECODE_VS_LLAMA_CPP = 1.0  # issue 24: decode tok/s >= llama.cpp's on the same GGUF, at every prompt length (greedy)
TTFT_LLAMA_CPP_LENGTH = 512  # issue 24: TTFT <= llama.cpp's at this prompt length


def median(values: Iterable[float | int | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max of each metric over the samples (one per repeat)."""
    out: dict[str, Any] = {"repeats": len(samples)}
    for key in METRICS:
        values = [s.get(key) for s in samples if s.get(key) is not None]
        out[key] = median(values)
        if key in ("tpot_s", "ttft_s") and values:
            out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def make_case(system: str, prompt_tokens: int, sampler: str, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"system": system, "prompt_tokens": prompt_tokens, "sampler": sampler, "samples": list(samples),
            "median": summarize(samples)}


def find_case(cases: Iterable[dict[str, Any]], system: str, prompt_tokens: int, sampler: str) -> dict | None:
    for c in cases:
        if c["system"] == system and c["prompt_tokens"] == prompt_tokens and c["sampler"] == sampler:
            return c
    return None


def systems_in(cases: Iterable[dict[str, Any]]) -> list[str]:
    present = {c["system"] for c in cases}
    return [s for s in SYSTEM_ORDER if s in present] + sorted(present - set(SYSTEM_ORDER))


def compute_ratios(cases: Sequence[dict[str, Any]], ours: str = OURS) -> list[dict[str, Any]]:
    """For each of our cases and each peer measured on the same prompt length and sampler: ours / peer.

    ``decode`` and ``prefill`` ratios above 1 mean we are faster; a ``ttft`` ratio below 1 means we answer
    sooner. All come from medians of the same run. ``decode_best`` and ``ttft_best`` compare the best repeat of
    each instead (other load on the machine only ever adds time, so these are the less noisy gauge)."""
    out = []
    for c in cases:
        if c["system"] != ours:
            continue
        for peer in systems_in(cases):
            if peer == ours:
                continue
            p = find_case(cases, peer, c["prompt_tokens"], c["sampler"])
            if p is None:
                continue
            a, b = c["median"], p["median"]
            out.append({"prompt_tokens": c["prompt_tokens"], "sampler": c["sampler"], "peer": peer,
                        "decode": ratio(a["decode_tokens_per_s"], b["decode_tokens_per_s"]),
                        "ttft": ratio(a["ttft_s"], b["ttft_s"]),
                        "prefill": ratio(a["prefill_tokens_per_s"], b["prefill_tokens_per_s"]),
                        "decode_best": ratio(b.get("tpot_s_min"), a.get("tpot_s_min")),
                        "ttft_best": ratio(a.get("ttft_s_min"), b.get("ttft_s_min"))})
    return out


def find_ratio(ratios: Iterable[dict[str, Any]], prompt_tokens: int, sampler: str, peer: str) -> dict | None:
    for r in ratios:
        if r["prompt_tokens"] == prompt_tokens and r["sampler"] == sampler and r["peer"] == peer:
            return r
    return None


def chain_overhead(cases: Sequence[dict[str, Any]], system: str = OURS) -> list[dict[str, Any]]:
    """Per prompt length: how much longer a token takes with the full sampler chain than greedy, in %."""
    out = []
    for g in cases:
        if g["system"] != system or g["sampler"] != "greedy":
            continue
        f = find_case(cases, system, g["prompt_tokens"], "full")
        if f is None:
            continue
        r = ratio(f["median"]["tpot_s"], g["median"]["tpot_s"])
        out.append({"system": system, "prompt_tokens": g["prompt_tokens"],
                    "greedy_tpot_s": g["median"]["tpot_s"], "full_tpot_s": f["median"]["tpot_s"],
                    "overhead_pct": None if r is None else (r - 1) * 100})
    return out


def flatness(samples: Sequence[dict[str, Any]], start_tokens: int = 2000,
             key: str = "peak_memory_bytes") -> dict[str, Any] | None:
    """Growth of ``key`` from the first sample at or past ``start_tokens`` of context to the last sample, in %."""
    later = [s for s in samples if s["context_tokens"] >= start_tokens and s.get(key) is not None]
    if len(later) < 2:
        return None
    first, last = later[0], later[-1]
    lo, hi = min(s[key] for s in later), max(s[key] for s in later)
    return {"from_tokens": first["context_tokens"], "to_tokens": last["context_tokens"],
            "from_bytes": first[key], "to_bytes": last[key],
            "growth_pct": (last[key] / first[key] - 1) * 100 if first[key] else None,
            "spread_pct": (hi / lo - 1) * 100 if lo else None}


# --- targets -----------------------------------------------------------------------------------------------------

def _target(name: str, value: float | None, threshold: float, passed: bool | None, detail: str,
            unit: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "threshold": threshold, "unit": unit, "passed": passed, "detail": detail}


def _per_length(ratios: Sequence[dict[str, Any]], lengths: Sequence[int], metric: str,
                peer: str) -> list[tuple[int, float]]:
    """(prompt length, greedy ratio against `peer`) for each length that has one."""
    return [(n, r[metric]) for n in lengths
            if (r := find_ratio(ratios, n, "greedy", peer)) is not None and r[metric] is not None]


def _every_length(name: str, per: list[tuple[int, float]], threshold: float, at_least: bool) -> dict[str, Any]:
    """A target over every prompt length: its worst ratio against `threshold` (>= when `at_least`, else <=)."""
    worst = (min if at_least else max)(per, key=lambda x: x[1]) if per else None
    passed = None if worst is None else (worst[1] >= threshold if at_least else worst[1] <= threshold)
    return _target(name, worst[1] if worst else None, threshold, passed,
                   ", ".join(f"{n}: {v:.2f}x" for n, v in per) or "not measured", "x")


def _llama_cpp_targets(ratios: Sequence[dict[str, Any]], lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Issue 24's targets against llama.cpp on the same GGUF: greedy decode >= 1.0x at every prompt length, and TTFT
    <= llama.cpp's at 512 prompt tokens."""
    ttft = [(n, v) for n, v in _per_length(ratios, lengths, "ttft", LLAMA_CPP) if n == TTFT_LLAMA_CPP_LENGTH]
    return [
        _every_length(f"decode >= {DECODE_VS_LLAMA_CPP:g}x llama.cpp (greedy, same GGUF, every prompt length)",
                      _per_length(ratios, lengths, "decode", LLAMA_CPP), DECODE_VS_LLAMA_CPP, at_least=True),
        _every_length(f"TTFT <= llama.cpp's at {TTFT_LLAMA_CPP_LENGTH} prompt tokens (greedy)", ttft, 1.0,
                      at_least=False),
    ]


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets as pass/fail records. ``passed`` is None when the case was not measured."""
    cases = results.get("cases", [])
    ratios = results.get("ratios", [])
    lengths = sorted({c["prompt_tokens"] for c in cases if c["system"] == OURS})
    out = [
        _every_length(f"decode >= {DECODE_VS_MLX_LM:g}x mlx-lm (greedy, every prompt length)",
                      _per_length(ratios, lengths, "decode", MLX_LM), DECODE_VS_MLX_LM, at_least=True),
        _every_length("TTFT <= mlx-lm's (greedy, every prompt length)",
                      _per_length(ratios, lengths, "ttft", MLX_LM), TTFT_VS_MLX_LM, at_least=False),
    ]
    over = [o for o in results.get("chain_overhead", []) if o["system"] == OURS and o["overhead_pct"] is not None]
    worst = max(over, key=lambda o: o["overhead_pct"]) if over else None
    out.append(_target(
        f"full sampler chain <= {CHAIN_OVERHEAD_PCT:g}% TPOT over greedy",
        worst["overhead_pct"] if worst else None, CHAIN_OVERHEAD_PCT,
        None if not over else worst["overhead_pct"] <= CHAIN_OVERHEAD_PCT,
        ", ".join(f"{o['prompt_tokens']}: {o['overhead_pct']:+.1f}%" for o in over) or "not measured", "%"))
    # Both TUI rows, plain prose and a Markdown-heavy reply, are held to the target: the worse one is the value.
    tui = results.get("tui") or {}
    rows = [(name, r) for name, r in (("prose", tui), ("markdown", tui.get("markdown") or {}))
            if r.get("slowdown_pct") is not None]
    slow = max((r["slowdown_pct"] for _, r in rows), default=None)
    out.append(_target(
        f"TUI path <= {TUI_SLOWDOWN_PCT:g}% decode tok/s under headless (prose and Markdown replies)",
        slow, TUI_SLOWDOWN_PCT, None if slow is None or len(rows) < 2 else slow <= TUI_SLOWDOWN_PCT,
        "; ".join(f"{name}: headless {r['headless']['decode_tokens_per_s']:.1f} tok/s, TUI "
                  f"{r['tui']['decode_tokens_per_s']:.1f} tok/s" for name, r in rows) + f" ({tui.get('path', '?')})"
        if rows else tui.get("error", "not measured"), "%"))
    chat = results.get("chat") or {}
    growth = chat.get("last_over_first_ttft")
    turns = chat.get("turns_run")
    out.append(_target(
        f"turn-{turns or 'N'} TTFT <= {CHAT_TTFT_GROWTH:g}x turn-1 TTFT",
        growth, CHAT_TTFT_GROWTH, None if growth is None else growth <= CHAT_TTFT_GROWTH,
        (f"turn 1 {chat['turns'][0]['ttft_s'] * 1000:.0f} ms, turn {turns} "
         f"{chat['turns'][-1]['ttft_s'] * 1000:.0f} ms") if growth is not None else chat.get("error", "not measured"),
        "x"))
    rot = results.get("rotating") or {}
    flat = rot.get("flatness")
    growth = flat.get("growth_pct") if flat else None
    out.append(_target(
        f"rotating cache peak memory flat within {ROTATING_FLAT_PCT:g}% (2k tokens -> end)",
        growth, ROTATING_FLAT_PCT, None if growth is None else abs(growth) <= ROTATING_FLAT_PCT,
        (f"{flat['from_bytes'] / 2**20:.0f} MiB at {flat['from_tokens']} tokens -> "
         f"{flat['to_bytes'] / 2**20:.0f} MiB at {flat['to_tokens']}") if flat else rot.get("error", "not measured"),
        "%"))
    if any(c["system"] == LLAMA_CPP for c in cases):  # only where llama-cpp-python was installed for the run
        out += _llama_cpp_targets(ratios, lengths)
    return out


def format_targets(targets: Sequence[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[t["passed"]]
        value = "" if t["value"] is None else f"{t['value']:.2f}{t['unit']}  "
        lines.append(f"  {mark}  {t['name']}: {value}({t['detail']})")
    return "\n".join(lines)


# --- the table ---------------------------------------------------------------------------------------------------

def spread_pct(m: dict[str, Any], key: str = "tpot_s") -> float | None:
    """Half the range of the repeats, as a percentage of their median: how noisy a figure is."""
    lo, hi, mid = m.get(f"{key}_min"), m.get(f"{key}_max"), m.get(key)
    if lo is None or hi is None or not mid:
        return None
    return (hi - lo) / 2 / mid * 100


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def format_table(cases: Sequence[dict[str, Any]], ratios: Sequence[dict[str, Any]]) -> str:
    """One row per (prompt length, sampler, system): medians, and on our rows the ratio to each peer."""
    peers = [s for s in systems_in(cases) if s != OURS]
    head = ["prompt", "sampler", "system", "TTFT ms", "prefill tok/s", "decode tok/s", "TPOT ms", "TPOT ±%",
            "peak MiB"]
    for p in peers:
        head += [f"decode /{p}", f"TTFT /{p}"]
    rows = [head]
    order = {s: i for i, s in enumerate(systems_in(cases))}
    for c in sorted(cases, key=lambda c: (c["prompt_tokens"], c["sampler"] != "greedy", order[c["system"]])):
        m = c["median"]
        row = [str(c["prompt_tokens"]), c["sampler"], c["system"], _fmt(m["ttft_s"], ".0f", 1000),
               _fmt(m["prefill_tokens_per_s"], ".0f"), _fmt(m["decode_tokens_per_s"], ".1f"),
               _fmt(m["tpot_s"], ".1f", 1000), _fmt(spread_pct(m), ".0f"),
               _fmt(m["peak_memory_bytes"], ".0f", 1 / 2**20)]
        for p in peers:
            r = find_ratio(ratios, c["prompt_tokens"], c["sampler"], p) if c["system"] == OURS else None
            row += [_fmt_ratio(r and r["decode"]), _fmt_ratio(r and r["ttft"])]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    left = {0: False, 1: True, 2: True}
    lines = []
    for k, r in enumerate(rows):
        cells = [cell.ljust(w) if left.get(i) else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
