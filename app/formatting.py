"""How numbers read in the app: the live readouts and the per-message stats line (like LM Studio's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.cells import cell_len

FINISH = {"stop": "stop: end of reply", "length": "stop: max tokens", "cancelled": "stopped by you"}
FIELD_SEP = " · "  # between the fields of a stats line; a long line wraps only here (wrap_fields)
DONE = {"stop": "✓ done", "length": "✓ max tokens", "cancelled": "■ stopped"}


def fmt_bytes(n: float | None, sep: str = " ") -> str:
    """Binary units (KiB, MiB, GiB), as memory is counted and as the CLI prints it."""
    if not n:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{sep}{unit}" if n >= 100 or unit == "B" else f"{n:.1f}{sep}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: float | None, sep: str = " ") -> str:
    if not s:
        return "–"
    return f"{s * 1000:.0f}{sep}ms" if s < 1 else f"{s:.2f}{sep}s"


def fmt_rate(r: float | None) -> str:
    return f"{r:.1f} tok/s" if r else "– tok/s"


def _get(m: Any, key: str, default: Any = 0) -> Any:
    if isinstance(m, Mapping):
        return m.get(key, default) or default
    return getattr(m, key, default) or default


def decode_rate(m: Any) -> float:
    tpot = _get(m, "tpot_s", 0.0)
    return 1.0 / tpot if tpot else 0.0


def prefill_rate(m: Any) -> float:
    done = _get(m, "prompt_tokens") - _get(m, "cached_tokens")
    s = _get(m, "prefill_s", 0.0)
    return done / s if s and done > 0 else 0.0


def context(m: Any) -> str:
    used, limit, window = _get(m, "context_tokens"), _get(m, "context_limit"), _get(m, "kv_window", None)
    text = f"ctx {used}/{limit}" if limit else f"ctx {used}"
    if window:
        text += f" (window {window})"
    return text


def live_readouts(m: Any, width: int | None = None) -> str:
    """The stats bar while a reply streams (and after it, until the next one). Given the ``width`` it has, the
    readouts are written compactly when the full form does not fit; every readout is always there (the bar
    wraps what still does not fit)."""
    ttft, tpot, mem = _get(m, "ttft_s", 0.0), _get(m, "tpot_s", 0.0), _get(m, "peak_memory_bytes")
    tokens = f"in {_get(m, 'prompt_tokens')} out {_get(m, 'completion_tokens')}"
    full = " · ".join([f"TTFT {fmt_seconds(ttft)}", f"TPOT {fmt_seconds(tpot)}", fmt_rate(decode_rate(m)), tokens,
                       context(m), f"mem {fmt_bytes(mem)}"])
    if width is None or len(full) <= width:
        return full
    rate = decode_rate(m)
    return " ".join([f"TTFT {fmt_seconds(ttft, '')}", f"TPOT {fmt_seconds(tpot, '')}",
                     f"{rate:.1f}tok/s" if rate else "–tok/s", tokens, context(m),
                     f"mem {fmt_bytes(mem, '')}"])


def prefill_progress(done: int, total: int, cached: int = 0) -> tuple[int, str]:
    """Prefill progress as (percent, readout), both counting only the prompt tokens being prefilled (the cached
    ones are not work): e.g. (0, "0/4389 new tokens · 1024 cached · prompt 5413")."""
    todo = max(total - cached, 0)
    new = min(max(done - cached, 0), todo)
    pct = round(100 * new / todo) if todo else 100
    text = f"{new}/{todo} new tokens"  # after the state's "▷ prefill 20%": the word once
    if cached:
        text += f" · {cached} cached · prompt {total}"
    return pct, text


def speculation(m: Any) -> str | None:
    """What speculative decoding did in a reply ("speculative ngram: 62% accepted, 2.4 tok/step"), or None when it
    did not run (core/decode/speculative.py)."""
    mode = _get(m, "speculative", "off")
    if mode == "off":
        return None
    drafted, accepted, steps = _get(m, "draft_tokens"), _get(m, "accepted_tokens"), _get(m, "decode_steps")
    rate = f"{accepted / drafted:.0%} accepted" if drafted else "no guesses"
    # Without a guess every step made one token (the end-of-turn step counts a pass but no token): nothing to say.
    per_step = f", {_get(m, 'completion_tokens') / steps:.1f} tok/step" if steps and drafted else ""
    return f"speculative {mode}: {rate}{per_step}"


def stats_line(metrics: Mapping[str, Any] | Any, finish_reason: str | None = None,
               profile_name: str | None = None, *, first_reply: bool = False) -> str:
    """The line under a finished assistant message. A chat's `first_reply` finds on disk only what every chat
    starts with, its system prompt (saved by other chats): that is what it says, not "14 tokens from disk"."""
    m = metrics or {}
    parts = [
        fmt_rate(decode_rate(m)),
        f"{_get(m, 'completion_tokens')} tokens",
        f"{fmt_seconds(_get(m, 'ttft_s', 0.0))} to first token",
    ]
    if _get(m, "reasoning_tokens") or _get(m, "reasoning_s", 0.0):  # a thinking model: when its answer began
        parts.append(f"{fmt_seconds(_get(m, 'answer_ttft_s', 0.0))} to the answer")
    if finish_reason:
        parts.append(FINISH.get(finish_reason, f"stop: {finish_reason}"))
    prompt, cached = _get(m, "prompt_tokens"), _get(m, "cached_tokens")
    prefill = f"prompt {prompt} tok"
    if prompt - cached == 1:  # a rate over one token's prefill is noise, not a speed
        prefill += f" ({cached} cached, 1 new token)" if cached else " (1 new token)"
    else:
        if cached:
            prefill += f" ({cached} cached)"
        if rate := prefill_rate(m):
            prefill += f" at {rate:.0f} tok/s"
    parts.append(prefill)
    if disk := _get(m, "disk_tokens"):  # where the context came from: the KV cache saved on disk
        parts.append("system prompt cached" if first_reply else f"{disk:,} tokens from disk")
    parts += [context(m), f"peak {fmt_bytes(_get(m, 'peak_memory_bytes'))}"]
    if masks := _get(m, "constraint_masks"):  # a response_format held the reply to its grammar
        parts.append(f"constrained ({_get(m, 'constraint_mask_s', 0.0) / masks * 1000:.2f} ms/mask)")
    if (spec := speculation(m)) is not None:
        parts.append(spec)
    if profile_name:
        parts.append(f"profile {profile_name}")
    return FIELD_SEP.join(parts)


def thought_line(metrics: Mapping[str, Any] | Any, streaming: bool = False) -> str:
    """A thinking model's reasoning block title: "thought for 3.2 s · 412 tokens" ("thinking… 12 tokens" while it
    streams)."""
    tokens = _get(metrics or {}, "reasoning_tokens")
    if streaming:
        return f"thinking… {tokens} tokens"
    return f"thought for {_get(metrics or {}, 'reasoning_s', 0.0):.1f} s · {tokens} tokens"


def wrap_fields(line: str, width: int) -> list[str]:
    """``line``'s fields (joined by " · ") packed into rows of at most ``width`` cells, breaking only between
    fields, so that a value never parts from its unit ("118 / MiB"). A field wider than a row gets a row of its
    own (and wraps there)."""
    if width <= 0:  # not laid out yet
        return [line]
    rows: list[str] = []
    for field in line.split(FIELD_SEP):
        if rows and cell_len(rows[-1] + FIELD_SEP + field) <= width:
            rows[-1] += FIELD_SEP + field
        else:
            rows.append(field)
    return rows


def profile_summary(p: Any) -> str:
    """A profile's values in one line, e.g. 'temperature 0.8 · top_p 0.9': the temperature, then where they differ
    from the default, each sampler parameter that acts alone (core/sampling/sampler_params.py: not one that only goes
    with another, as dry_base with dry_multiplier) and the request's seed and limits."""
    from mlxchat.core.sampling.profile import SamplingProfile  # core loads MLX: only when a profile is shown
    from mlxchat.core.sampling.sampler_params import PARAMS

    default = SamplingProfile()
    names = [n for n, param in PARAMS.items() if param.goes_with is None] + ["seed", "max_tokens", "stop"]
    shown = []
    for name in names:
        value = getattr(p, name)
        if name == "temperature" or value != getattr(default, name):
            shown.append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
    return " · ".join(shown)
