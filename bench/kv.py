"""The quantized KV cache (issue 17): KV memory at a long context with ``kv_bits`` 8 and 4 against the plain cache,
decode speed, and how many greedy tokens stay equal to the plain cache's.

Each variant answers the same exact-length prompt in a fresh ChatSession (``engine.chat(kv_bits=...)``), so the
figures come through the engine's public surface, as a user's chat would run."""

from __future__ import annotations

from typing import Any

from . import prompts
from .cases import _greedy

VARIANTS = (None, 8, 4)


def kv_case(engine: Any, context_tokens: int, decode_tokens: int) -> dict[str, Any]:
    msgs, _ = prompts.exact_prompt(engine.model.tokenizer, context_tokens - decode_tokens, system=prompts.SYSTEM)
    rows = []
    for bits in VARIANTS:
        chat = engine.chat(system=prompts.SYSTEM, profile=_greedy(decode_tokens), kv_bits=bits)
        result = chat.send(msgs[-1]["content"], max_tokens=decode_tokens).wait()
        rows.append({"kv_bits": bits, "kv_bytes": chat.cache.nbytes(), "context_tokens": chat.cache.size,
                     "decode_tokens_per_s": result.metrics.decode_tokens_per_s, "ttft_s": result.metrics.ttft_s,
                     "token_ids": list(result.token_ids)})
    plain = rows[0]["token_ids"]
    for row in rows:
        ids = row.pop("token_ids")
        row["equal_greedy_tokens"] = next((i for i, (a, b) in enumerate(zip(plain, ids)) if a != b),
                                          min(len(plain), len(ids)))
        row["kv_bytes_vs_plain"] = row["kv_bytes"] / rows[0]["kv_bytes"] if rows[0]["kv_bytes"] else None
    return {"context_tokens": context_tokens, "decode_tokens": decode_tokens, "variants": rows}


def summary_lines(kv: dict[str, Any] | None) -> list[str]:
    if not kv:
        return []
    out = [f"KV cache at {kv['context_tokens']} tokens of context ({kv['decode_tokens']} greedy tokens decoded):"]
    for r in kv["variants"]:
        name = "plain" if r["kv_bits"] is None else f"{r['kv_bits']}-bit"
        out.append(f"  {name:>6}: {r['kv_bytes'] / 2**20:6.1f} MiB ({r['kv_bytes_vs_plain']:.2f}x), decode "
                   f"{r['decode_tokens_per_s']:.1f} tok/s, {r['equal_greedy_tokens']}/{kv['decode_tokens']} greedy "
                   "tokens equal to plain")
    return out
