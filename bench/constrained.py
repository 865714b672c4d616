"""Constrained decoding (issue 22): validity, cost and compile time of JSON Schema response formats.

* **Validity**: every schema of `SCHEMAS` (nested objects, enums, arrays with min/max items, string patterns,
  anyOf/const, $ref/$defs) answered at temperature 1.0 over several seeds; every output that ends with "stop" must
  validate with the ``jsonschema`` package (target 100 %). Outputs cut by max_tokens are counted, not validated.
* **Cost**: TPOT of greedy decoding under a schema whose replies run long (a list of records: structure and free
  strings mixed) against unconstrained greedy on the same prompt, interleaved repeats, medians (target <= 1.10x),
  and the host's mask time per token (`Metrics.constraint_mask_s`).
* **Compile time** per schema: building its matcher on the model's tokenizer (`Constraint.compile_s`).

All through the engine's public surface (`engine.generate` with a `SamplingProfile(response_format=...)`).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import jsonschema

from mlxchat.core import SamplingProfile

_NAME = {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
        "name": _NAME, "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                   "properties": {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size", "in_stock"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]},
                             "in_stock": {"type": "boolean"}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["tags", "scores"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 1, "maxItems": 3}}},
    "patterns": {"type": "object", "additionalProperties": False, "required": ["date", "email", "code"],
                 "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
                                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}},
    "anyof_const": {"type": "object", "additionalProperties": False, "required": ["version", "shape"], "properties": {
        "version": {"const": 2},
        "shape": {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["kind", "radius"],
             "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}},
            {"type": "object", "additionalProperties": False, "required": ["kind", "side"],
             "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1}}}]}}},
    "refs": {"$defs": {"person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                                  "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}}}},
             "type": "object", "additionalProperties": False, "required": ["author", "reviewers"], "properties": {
                 "author": {"$ref": "#/$defs/person"},
                 "reviewers": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2}}},
}
# For the cost: replies that run to max_tokens, mixing JSON structure with free text in strings.
LONG = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "bio", "age"],
    "properties": {"name": {"type": "string"}, "bio": {"type": "string"}, "age": {"type": "integer"}}}}
COST_PROMPT = "List many people with a short bio each, as JSON."


def _format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def validity(engine: Any, seeds: int, max_tokens: int) -> list[dict[str, Any]]:
    """Each schema at temperature 1.0 over `seeds` seeds: finish reasons, how many "stop" outputs validate, and
    the compile time of its matcher."""
    rows = []
    for name, schema in SCHEMAS.items():
        stops = valid = 0
        compile_s, mask_s, masks, invalid = [], 0.0, 0, []
        for seed in range(seeds):
            profile = SamplingProfile(temperature=1.0, seed=seed, response_format=_format(name, schema))
            r = engine.generate(f"Reply with a JSON object for the '{name}' example.", profile=profile,
                                max_tokens=max_tokens)
            compile_s.append(r.metrics.constraint_compile_s)
            mask_s, masks = mask_s + r.metrics.constraint_mask_s, masks + r.metrics.constraint_masks
            if r.finish_reason != "stop":
                continue
            stops += 1
            try:
                jsonschema.validate(json.loads(r.text), schema)
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                invalid.append(f"seed {seed}: {str(e).splitlines()[0]}: {r.text[:80]!r}")
        rows.append({"schema": name, "seeds": seeds, "stop": stops, "valid": valid, "invalid": invalid,
                     "compile_ms": statistics.median(compile_s) * 1000,
                     "mask_us_per_token": mask_s / masks * 1e6 if masks else None})
    return rows


def cost(engine: Any, tokens: int, repeats: int) -> dict[str, Any]:
    """Greedy TPOT under `LONG` vs unconstrained greedy forced to the same length (min_tokens), interleaved."""
    plain = SamplingProfile(temperature=0, min_tokens=tokens)
    constrained = SamplingProfile(temperature=0, response_format=_format("people", LONG))
    tpot: dict[str, list[float]] = {"plain": [], "constrained": []}
    # CPU time of the whole process per generated token (prefill included, the same short prompt for both): on a
    # machine other jobs load, wall-clock TPOT swings 2-3x between repeats, the work done much less.
    cpu: dict[str, list[float]] = {"plain": [], "constrained": []}
    mask_us = []
    for i in range(repeats):
        for label in (("plain", "constrained") if i % 2 == 0 else ("constrained", "plain")):
            profile = plain if label == "plain" else constrained
            started = time.process_time()
            r = engine.generate(COST_PROMPT, profile=profile, max_tokens=tokens)
            cpu[label].append((time.process_time() - started) / r.metrics.completion_tokens)
            tpot[label].append(r.metrics.tpot_s)
            if label == "constrained" and r.metrics.constraint_masks:
                mask_us.append(r.metrics.constraint_mask_s / r.metrics.constraint_masks * 1e6)
    med = {k: statistics.median(v) for k, v in tpot.items()}
    best = {k: min(v) for k, v in tpot.items()}  # other load only adds time: the less noisy gauge
    return {"tokens": tokens, "repeats": repeats, "tpot_s": tpot, "median_tpot_s": med,
            "ratio": med["constrained"] / med["plain"] if med["plain"] else None,
            "best_ratio": best["constrained"] / best["plain"] if best["plain"] else None,
            "cpu_s_per_token": cpu,
            "cpu_ratio": statistics.median(cpu["constrained"]) / statistics.median(cpu["plain"]),
            "mask_us_per_token": statistics.median(mask_us) if mask_us else None}


def constrained_case(engine: Any, seeds: int, max_tokens: int, cost_tokens: int, repeats: int) -> dict[str, Any]:
    rows = validity(engine, seeds, max_tokens)
    stops = sum(r["stop"] for r in rows)
    return {"schemas": rows, "stop_outputs": stops, "stop_valid": sum(r["valid"] for r in rows),
            "cost": cost(engine, cost_tokens, repeats)}


TPOT_VS_GREEDY = 1.10


def targets(c: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The issue's two targets, as bench/stats.py's target records (``passed`` None when not measured)."""
    def target(name: str, value: float | None, threshold: float, passed: bool | None, detail: str,
               unit: str) -> dict[str, Any]:
        return {"name": name, "value": value, "threshold": threshold, "unit": unit, "passed": passed,
                "detail": detail}

    stops = (c or {}).get("stop_outputs") or 0
    valid = c["stop_valid"] / stops if stops else None
    k = (c or {}).get("cost") or {}
    ratio = k.get("ratio")
    return [target("constrained 'stop' outputs valid at T=1: 100%", valid, 1.0, None if valid is None else valid == 1,
                   f"{c['stop_valid']}/{stops}" if stops else "not measured", ""),
            target(f"TPOT with a JSON schema <= {TPOT_VS_GREEDY:g}x unconstrained greedy", ratio, TPOT_VS_GREEDY,
                   None if ratio is None else ratio <= TPOT_VS_GREEDY,
                   f"median {ratio:.2f}x, best {k['best_ratio']:.2f}x, CPU time per token {k['cpu_ratio']:.2f}x"
                   if ratio is not None else "not measured", "x")]


def summary_lines(c: dict[str, Any] | None) -> list[str]:
    if not c:
        return []
    rate = f"{c['stop_valid']}/{c['stop_outputs']}" if c["stop_outputs"] else "no stop outputs"
    out = [f"Constrained decoding: {rate} 'stop' outputs valid at temperature 1.0 (target: all):"]
    for r in c["schemas"]:
        mask = f"{r['mask_us_per_token']:.0f} µs/token mask" if r["mask_us_per_token"] is not None else "no mask"
        out.append(f"  {r['schema']:>11}: {r['stop']}/{r['seeds']} stop, {r['valid']} valid, compile "
                   f"{r['compile_ms']:.1f} ms, {mask}" + (f"; INVALID: {r['invalid'][0]}" if r["invalid"] else ""))
    k = c["cost"]
    if k["ratio"] is not None:
        out.append(f"  greedy TPOT with a schema {k['ratio']:.2f}x unconstrained, best repeats {k['best_ratio']:.2f}x, "
                   f"CPU time per token {k['cpu_ratio']:.2f}x (target <= 1.10x; "
                   f"{k['median_tpot_s']['constrained'] * 1000:.1f} vs {k['median_tpot_s']['plain'] * 1000:.1f} ms, "
                   f"{k['tokens']} tokens, {k['repeats']} interleaved repeats), mask "
                   f"{k['mask_us_per_token']:.0f} µs/token")
    return out


__all__ = ["SCHEMAS", "constrained_case", "summary_lines", "targets"]
