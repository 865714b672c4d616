"""Speculative decoding (issue 23): decode speed with prompt lookup, `auto` and self-speculation against plain decode,
on input-grounded prompts (copy, rewrite, extract from a ~300-token text; edit a code block) and free-form chat;
acceptance, tokens per verify step, and the cost of a verify pass against its rows M.

Modes run alternately (off, ngram, auto; then reversed) on the same prompt; a speedup is the median over repeats
of plain's TPOT / the mode's TPOT in the same repeat (adjacent runs), so the machine's drift cancels. Every run is
greedy with `min_tokens` = `max_tokens` (the same length each time), and each mode's token ids are compared with
plain decode's (`exact`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from . import prompts
from .cases import _greedy

TEXT = (
    "The lighthouse keeper of Marrow Point kept a log for forty years. Each morning he wrote the wind, the height of "
    "the swell and the ships that passed. In the spring of 1911 he noted that the fishing fleet left before dawn "
    "and came back at noon with empty nets. In the summer the fleet stayed in the harbour for nine days because of "
    "fog. In the autumn a steamer called the Alder ran aground on the northern reef; the crew of twelve rowed to the "
    "point and slept in the keeper's kitchen. In the winter the lamp failed twice, once for an hour and once for a "
    "whole night, and the keeper walked to the village to send a telegram to the harbour master. The harbour master "
    "sent a new lens in March. The keeper retired in 1932 and his daughter, who had trimmed the wick since she was "
    "ten, kept the light until it was automated in 1950. The log is now in the town museum, next to the old lens."
)
CODE = '''def parse_line(line: str) -> dict[str, str]:
    """Split one "key = value" line of a config file into a dict with one entry."""
    if "=" not in line:
        raise ValueError(f"not a setting: {line!r}")
    key, value = line.split("=", 1)
    key, value = key.strip(), value.strip()
    if not key:
        raise ValueError(f"a setting needs a name: {line!r}")
    return {key: value}


def parse_config(text: str) -> dict[str, str]:
    """Every setting of a config file; blank lines and comments are skipped."""
    settings: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        settings.update(parse_line(line))
    return settings'''

GROUNDED = {
    "edit code": f"Rename the function parse_line to parse_setting everywhere and print the whole code:\n\n"
                 f"```python\n{CODE}\n```",
    "copy text": f"Copy this text exactly, word for word:\n\n{TEXT}",
    "rewrite text": f"Rewrite this text in the present tense:\n\n{TEXT}",
    "extract": f"List every year mentioned in this text, each with the sentence it appears in:\n\n{TEXT}",
}
FREE = {f"chat {i + 1}": q for i, q in enumerate(prompts.CHAT_QUESTIONS[:3])}
MODES = ("off", "ngram", "auto")
ROWS = (1, 2, 3, 4, 6, 8)


def _run(engine: Any, prompt: str, mode: str, max_tokens: int) -> dict[str, Any]:
    began = time.perf_counter()
    r = engine.generate(prompt, profile=_greedy(max_tokens), max_tokens=max_tokens, speculative=mode)
    m = r.metrics
    return {"ids": r.token_ids, "total_s": time.perf_counter() - began, "tpot_s": m.tpot_s, "draft": m.draft_tokens,
            "accepted": m.accepted_tokens, "steps": m.decode_steps, "tokens": m.completion_tokens}


def paired_speedup(plain: list[dict[str, Any]], runs: list[dict[str, Any]], key: str) -> float:
    """The median over repeats of plain's `key` / the mode's, each repeat's two runs adjacent: the machine's speed
    drifts by 10-20% over minutes here, which a ratio of two medians carried into the figure (a free-form prompt
    with no guess at all read 0.94x)."""
    return statistics.median(p[key] / r[key] for p, r in zip(plain, runs))


def _prompt_rows(engine: Any, prompts_: dict[str, str], kind: str, modes: tuple[str, ...], max_tokens: int,
                 repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, prompt in prompts_.items():
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                runs[mode].append(_run(engine, prompt, mode, max_tokens))
        plain = runs["off"]
        row: dict[str, Any] = {"prompt": name, "kind": kind,
                               "plain_tokens_per_s": 1 / statistics.median(x["tpot_s"] for x in plain)}
        for mode in modes[1:]:
            xs = runs[mode]
            draft, accepted = sum(x["draft"] for x in xs), sum(x["accepted"] for x in xs)
            row[mode] = {
                "speedup": paired_speedup(plain, xs, "tpot_s"),
                "speedup_end_to_end": paired_speedup(plain, xs, "total_s"),
                "acceptance": accepted / draft if draft else 0.0,
                "tokens_per_step": sum(x["tokens"] for x in xs) / max(1, sum(x["steps"] for x in xs)),
                "exact": all(x["ids"] == plain[0]["ids"] for x in xs),
            }
        rows.append(row)
    return rows


def verify_cost(engine: Any, rounds: int, context: int = 300) -> list[dict[str, Any]]:
    """Seconds of one forward pass of M rows over `context` cached tokens, as a verify step runs it (then trimmed
    back), against M = 1: what a guess costs when it is rejected. Medians of `rounds` alternating rounds."""
    import mlx.core as mx

    from mlxchat.core.cache.kv_cache import ConversationCache, prefill

    def measure() -> dict[int, float]:
        model = engine.model.model
        cache = ConversationCache(model)
        ids = engine.model.tokenizer.encode(TEXT * 4)[:context]
        list(prefill(model, cache.layers, ids, 512))
        times: dict[int, list[float]] = {m: [] for m in ROWS}
        for r in range(rounds):
            for m in ROWS if r % 2 == 0 else ROWS[::-1]:
                began = time.perf_counter()
                mx.eval(model(mx.array(ids[:m])[None], cache=cache.layers))
                times[m].append(time.perf_counter() - began)
                for c in cache.layers:
                    c.trim(m)
        return {m: statistics.median(ts) for m, ts in times.items()}

    medians = engine.run(measure)
    return [{"rows": m, "seconds": s, "vs_one_row": s / medians[1]} for m, s in medians.items()]


def self_speculation(engine: Any, layers: tuple[int, ...], max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """The first N layers of the model as its draft (`draft_model="self:N"`), on the code edit and a chat prompt."""
    from mlxchat.core.decode.speculative import load_draft

    rows, before = [], engine.draft
    try:
        for n in layers:
            engine.draft = engine.run(lambda n=n: load_draft(f"self:{n}", engine.model))
            for name, prompt in (("edit code", GROUNDED["edit code"]), ("chat 1", FREE["chat 1"])):
                plain, draft = [], []
                for r in range(repeats):
                    pair = (("off", plain), ("draft", draft))
                    for mode, out in pair if r % 2 == 0 else pair[::-1]:
                        out.append(_run(engine, prompt, mode, max_tokens))
                accepted, drafted = sum(x["accepted"] for x in draft), sum(x["draft"] for x in draft)
                rows.append({"layers": n, "prompt": name, "acceptance": accepted / drafted if drafted else 0.0,
                             "speedup": (statistics.median(x["tpot_s"] for x in plain)
                                         / statistics.median(x["tpot_s"] for x in draft)),
                             "exact": all(x["ids"] == plain[0]["ids"] for x in draft)})
    finally:
        engine.draft = before
    return rows


def speculative_case(engine: Any, max_tokens: int, repeats: int, self_layers: tuple[int, ...] = (8, 15)
                     ) -> dict[str, Any]:
    return {
        "max_tokens": max_tokens, "repeats": repeats,
        # Free-form prompts get twice the repeats: their target is a 3% margin, and their runs are plain decode.
        "prompts": (_prompt_rows(engine, GROUNDED, "grounded", MODES, max_tokens, repeats)
                    + _prompt_rows(engine, FREE, "free", ("off", "auto"), max_tokens, 2 * repeats)),
        "verify_cost": verify_cost(engine, 3 * repeats),
        "self_speculation": self_speculation(engine, self_layers, max_tokens, repeats) if self_layers else [],
    }


def summary_lines(spec: dict[str, Any] | None) -> list[str]:
    if not spec:
        return []
    out = [f"Speculative decoding ({spec['max_tokens']} greedy tokens, medians of {spec['repeats']} alternating "
           "repeats; speedup = plain TPOT / TPOT, end-to-end = whole request):"]
    for r in spec["prompts"]:
        parts = []
        for mode in ("ngram", "auto"):
            if mode in r:
                x = r[mode]
                parts.append(f"{mode} {x['speedup']:.2f}x (end-to-end {x['speedup_end_to_end']:.2f}x, accept "
                             f"{x['acceptance']:.0%}, {x['tokens_per_step']:.2f} tok/step"
                             f"{'' if x['exact'] else ', NOT EXACT'})")
        out.append(f"  {r['prompt']:>12} ({r['kind']}, plain {r['plain_tokens_per_s']:.1f} tok/s): " + "; ".join(parts))
    cost = ", ".join(f"M={c['rows']} {c['vs_one_row']:.2f}x" for c in spec["verify_cost"])
    out.append(f"  verify pass cost against one row: {cost}")
    for s in spec["self_speculation"]:
        out.append(f"  self:{s['layers']} on {s['prompt']}: accept {s['acceptance']:.0%}, {s['speedup']:.2f}x"
                   f"{'' if s['exact'] else ', NOT EXACT'}")
    return out


def targets(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Issue 23's targets as bench/stats.py's records: input-grounded prompts >= 2x with ngram (the moonshot 3x),
    free-form prompts >= 0.97x with auto."""
    if not spec:
        return []
    grounded = statistics.median(r["ngram"]["speedup"] for r in spec["prompts"] if r["kind"] == "grounded")
    free = min(r["auto"]["speedup"] for r in spec["prompts"] if r["kind"] == "free")
    return [
        {"name": "speculative ngram >= 2x plain on input-grounded prompts (median)", "value": grounded,
         "threshold": 2.0, "unit": "x", "passed": grounded >= 2.0, "detail": "moonshot 3x"},
        {"name": "speculative auto >= 0.97x plain on free-form prompts (worst)", "value": free, "threshold": 0.97,
         "unit": "x", "passed": free >= 0.97, "detail": "TPOT ratio"},
    ]
