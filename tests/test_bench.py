"""The benchmark's own logic: medians, ratios, targets, the table, the JSON schema, exact-length prompts, and one
tiny real run on the embedded model. No timing assertions: speed is the benchmark's business, not the tests'."""

from __future__ import annotations

import argparse
import copy
import json
import math

import pytest

from mlxchat.bench import prompts, report, stats
from mlxchat.bench.run import Config, config_from_args, run, summary_text
from mlxchat.bench.systems import FULL, GREEDY, EngineRunner, MlxLmRunner, from_times, make_llama_cpp


def sample(tpot: float, ttft: float = 0.2, prompt: int = 32, n: int = 8, peak: int | None = 600 << 20) -> dict:
    return {"ttft_s": ttft, "tpot_s": tpot, "prefill_tokens_per_s": prompt / ttft, "decode_tokens_per_s": 1 / tpot,
            "peak_memory_bytes": peak, "prompt_tokens": prompt, "completion_tokens": n}


def synthetic_cases() -> list[dict]:
    return [
        stats.make_case("mlxchat", 32, "greedy", [sample(0.05), sample(0.04), sample(0.06)]),
        stats.make_case("mlxchat", 32, "full", [sample(0.052), sample(0.042), sample(0.062)]),
        stats.make_case("mlx-lm", 32, "greedy", [sample(0.1, 0.4), sample(0.08, 0.3), sample(0.09, 0.5)]),
        stats.make_case("llama.cpp", 32, "greedy", [sample(0.012, 0.1, peak=None)] * 3),
        stats.make_case("mlxchat", 512, "greedy", [sample(0.06, 1.0, 512)]),
        stats.make_case("mlx-lm", 512, "greedy", [sample(0.08, 0.9, 512)]),
    ]


def synthetic_results() -> dict:
    cases = synthetic_cases()
    rot_samples = [{"context_tokens": c, "phase": "prefill", "peak_memory_bytes": b, "active_memory_bytes": b,
                    "kv_tokens": min(c, 2048), "elapsed_s": c / 1000}
                   for c, b in ((1024, 600 << 20), (2048, 650 << 20), (10240, 660 << 20), (20000, 670 << 20))]
    turns = [{"turn": i + 1, **sample(0.05, 0.2 + 0.01 * i), "cached_tokens": 0, "prefilled_tokens": 10,
              "context_tokens": 50 * (i + 1)} for i in range(5)]
    results = {
        "schema_version": report.SCHEMA_VERSION, "created": "2026-12-03T10:00:00+00:00", "quick": True,
        "elapsed_s": 1.0, "machine": {"cpu_count": 2}, "model": {"name": "tiny", "weight_bytes": 540_000_000},
        "config": {}, "cases": cases, "ratios": stats.compute_ratios(cases),
        "chain_overhead": stats.chain_overhead(cases),
        "chat": {"turns_run": 5, "reply_tokens": 8, "turns": turns, "last_over_first_ttft": 0.24 / 0.2},
        "rotating": {"max_kv_size": 2048, "keep": 4, "prompt_tokens": 18000, "decode_tokens": 2000,
                     "context_tokens": 20000, "completion_tokens": 2000, "result": sample(0.05, 9.0, 18000, 2000),
                     "samples": rot_samples, "flatness": stats.flatness(rot_samples), "weight_bytes": 540_000_000},
        "tui": {"path": "synthetic", "headless": {"decode_tokens_per_s": 20.0, "ttft_s": 0.2},
                "tui": {"decode_tokens_per_s": 19.5, "ttft_s": 0.2}, "slowdown_pct": 2.5, "tui_samples": [],
                "markdown": {"path": "synthetic", "reply": "markdown", "slowdown_pct": 4.0,
                             "headless": {"decode_tokens_per_s": 20.0, "ttft_s": 0.2},
                             "tui": {"decode_tokens_per_s": 19.2, "ttft_s": 0.2},
                             "tui_samples": [{"ui_cpu_ms_per_token": 0.8}]}},
        "roofline": {"bandwidth_bytes_per_s": 2e10, "weight_bytes_per_token": 5.4e8, "ceiling_tokens_per_s": 37.0,
                     "gguf_bytes_per_token": 9e7, "gguf_ceiling_tokens_per_s": 222.0,
                     "systems": {"mlxchat": {"decode_tokens_per_s": 20.0, "ceiling_tokens_per_s": 37.0,
                                             "fraction": 20 / 37}},
                     "bandwidth": {"bytes_read": 1 << 30, "repeats": 3, "method": "numpy_2_threads",
                                   "methods_bytes_per_s": {"numpy_1_thread": 1e10, "numpy_2_threads": 2e10}}},
        "formats": [{"format": "q4", "bytes_per_token": 8e7, "gemv_s": 0.01, "ceiling_tokens_per_s": 100.0,
                     "effective_bytes_per_s": 8e9, "bandwidth_ceiling_tokens_per_s": 250.0}],
        "errors": {},
    }
    results["targets"] = stats.evaluate_targets(results)
    return results


# --- pure arithmetic ---------------------------------------------------------------------------------------------

def test_median_ignores_missing_values():
    assert stats.median([3, 1, 2]) == 2
    assert stats.median([4, None, 1, 2, 3]) == 2.5
    assert stats.median([None, float("nan")]) is None
    assert stats.median([]) is None


def test_ratio_handles_missing_and_zero():
    assert stats.ratio(3.0, 2.0) == 1.5
    assert stats.ratio(None, 2.0) is None
    assert stats.ratio(1.0, 0) is None


def test_summarize_takes_the_median_of_each_metric():
    m = stats.summarize([sample(0.05), sample(0.04), sample(0.06, peak=None)])
    assert m["repeats"] == 3
    assert m["tpot_s"] == pytest.approx(0.05)
    assert m["decode_tokens_per_s"] == pytest.approx(20.0)
    assert m["peak_memory_bytes"] == 600 << 20  # None samples left out
    assert (m["tpot_s_min"], m["tpot_s_max"]) == (0.04, 0.06)


def test_ratios_compare_our_medians_with_each_peer_in_the_same_case():
    ratios = stats.compute_ratios(synthetic_cases())
    r = stats.find_ratio(ratios, 32, "greedy", "mlx-lm")
    assert r["decode"] == pytest.approx(20.0 / (1 / 0.09))
    assert r["ttft"] == pytest.approx(0.2 / 0.4)
    assert r["decode_best"] == pytest.approx(0.08 / 0.04)  # best repeat against best repeat
    assert r["ttft_best"] == pytest.approx(0.2 / 0.3)
    assert stats.find_ratio(ratios, 32, "greedy", "llama.cpp")["decode"] == pytest.approx(0.012 / 0.05)
    # no peer ran the full chain at 32, nor llama.cpp at 512: no ratio invented
    assert stats.find_ratio(ratios, 32, "full", "mlx-lm") is None
    assert stats.find_ratio(ratios, 512, "greedy", "llama.cpp") is None
    assert all(r["peer"] != "mlxchat" for r in ratios)


def test_chain_overhead_is_the_tpot_increase_in_percent():
    (o,) = stats.chain_overhead(synthetic_cases())
    assert o["prompt_tokens"] == 32
    assert o["overhead_pct"] == pytest.approx(4.0)


def test_flatness_measures_growth_from_2k_to_the_end():
    samples = [{"context_tokens": c, "peak_memory_bytes": b} for c, b in ((1000, 50), (2000, 100), (9000, 104),
                                                                          (20000, 105))]
    f = stats.flatness(samples)
    assert (f["from_tokens"], f["to_tokens"]) == (2000, 20000)
    assert f["growth_pct"] == pytest.approx(5.0)
    assert stats.flatness(samples[:2]) is None  # one sample past 2k: nothing to compare


def test_targets_pass_fail_and_not_measured():
    results = synthetic_results()
    targets = results["targets"]
    assert len(targets) == 8  # the last two: llama.cpp ran (issue 24's targets)
    decode, ttft, chain, tui, chat, rot, llama_decode, llama_ttft = targets
    assert llama_decode["passed"] is False and llama_decode["value"] == pytest.approx(0.012 / 0.05)
    assert llama_ttft["passed"] is None  # no llama.cpp run at 512 prompt tokens
    assert decode["passed"] is False  # 512: 0.06 vs 0.08 s/token is only 1.33x
    assert decode["value"] == pytest.approx(0.08 / 0.06)
    assert ttft["passed"] is False and ttft["value"] == pytest.approx(1.0 / 0.9)  # slower at 512
    assert chain["passed"] is True and chain["value"] == pytest.approx(4.0)
    assert tui["passed"] is True and tui["value"] == pytest.approx(4.0)  # the worse of prose and Markdown
    # The Markdown row alone over the target fails the TUI target; without it the target is not measured.
    slow_md = {**results, "tui": {**results["tui"], "markdown": {**results["tui"]["markdown"], "slowdown_pct": 9.0}}}
    assert stats.evaluate_targets(slow_md)[3]["passed"] is False
    prose_only = {**results, "tui": {k: v for k, v in results["tui"].items() if k != "markdown"}}
    assert stats.evaluate_targets(prose_only)[3]["passed"] is None
    assert chat["passed"] is True and "turn-5" in chat["name"]
    assert rot["passed"] is True and rot["value"] == pytest.approx((670 / 650 - 1) * 100)
    assert [t["name"].split(" ")[0] for t in targets] == ["decode", "TTFT", "full", "TUI", "turn-5", "rotating",
                                                          "decode", "TTFT"]
    # A section that did not run gives "not measured", never a pass.
    empty = stats.evaluate_targets({"cases": [], "ratios": [], "chain_overhead": [], "chat": None,
                                    "rotating": None, "tui": None})
    assert [t["passed"] for t in empty] == [None] * 6
    text = stats.format_targets(empty)
    assert text.count("n/a") == 6


def test_table_has_one_row_per_case_and_ratio_columns():
    cases = synthetic_cases()
    text = stats.format_table(cases, stats.compute_ratios(cases))
    lines = text.splitlines()
    assert len(lines) == 2 + len(cases)
    assert "decode /mlx-lm" in lines[0] and "TTFT /llama.cpp" in lines[0]
    ours = next(line for line in lines if line.lstrip().startswith("32 ") and "mlxchat" in line and "greedy" in line)
    assert "1.80x" in ours and "0.50x" in ours  # decode and TTFT vs mlx-lm
    llama_row = next(line for line in lines if "llama.cpp" in line and not line.lstrip().startswith("prompt"))
    assert "—" in llama_row  # no memory figure for llama.cpp, no ratios on a peer's row
    widths = {len(line) for line in lines[:2]}
    assert len(widths) == 1  # the header and the rule line up


def test_from_times_uses_the_engine_definitions():
    s = from_times(10.0, [10.5, 10.6, 10.7, 10.8], prompt_tokens=100, peak=None)
    assert s["ttft_s"] == pytest.approx(0.5)
    assert s["tpot_s"] == pytest.approx(0.1)
    assert s["decode_tokens_per_s"] == pytest.approx(10.0)
    assert s["prefill_tokens_per_s"] == pytest.approx(200.0)
    assert s["completion_tokens"] == 4


# --- the JSON schema and the plot ----------------------------------------------------------------------------------

def test_schema_accepts_results_and_rejects_broken_ones(tmp_path):
    results = synthetic_results()
    report.validate(results)
    path, latest = report.write_json(results, tmp_path, "20261203-100000")
    assert path.name == "bench-20261203-100000.json" and latest.name == "latest.json"
    loaded = json.loads(latest.read_text())
    report.validate(loaded)
    assert loaded["schema_version"] == report.SCHEMA_VERSION
    for breakage in (lambda r: r.pop("cases"), lambda r: r.update(schema_version=99),
                     lambda r: r["cases"][0]["median"].pop("tpot_s"),
                     lambda r: r["cases"][0].update(sampler="fancy"),
                     lambda r: r["targets"][0].update(passed="yes"),
                     lambda r: r["cases"][0]["samples"][0].update(ttft_s="fast")):
        broken = copy.deepcopy(results)
        breakage(broken)
        with pytest.raises(report.SchemaError):
            report.validate(broken)


def test_json_never_holds_nan(tmp_path):
    results = synthetic_results()
    results["cases"][0]["median"]["ttft_s"] = float("nan")
    path, _ = report.write_json(results, tmp_path, "x")
    assert json.loads(path.read_text())["cases"][0]["median"]["ttft_s"] is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = report.plot(synthetic_results(), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_text_mentions_every_section():
    text = summary_text(synthetic_results())
    for needle in ("Full sampler chain", "Chat, 5 turns", "Rotating cache", "TUI vs headless, markdown reply",
                   "Roofline: memory",
                   "mlxchat: 20.0 tok/s = 54% of 37", "q4:", "Targets:"):
        assert needle in text


# --- configuration ---------------------------------------------------------------------------------------------

def test_config_from_cli_flags():
    cfg = config_from_args(argparse.Namespace(quick=True, lengths="32,2048", repeats=5, skip=["tui"]))
    assert cfg.quick and cfg.prompt_lengths == (32, 2048) and cfg.repeats == 5
    assert cfg.skip == frozenset({"tui"})
    # The quick set runs the full chain at 1,024 only (DRY over a 1k-token history); without 1,024, the longest.
    assert cfg.full_chain_lengths == (2048,)
    assert config_from_args(argparse.Namespace(quick=True)).full_chain_lengths == (1024,)
    with pytest.raises(ValueError, match="--skip"):
        config_from_args(argparse.Namespace(skip=["everything"]))
    assert config_from_args(argparse.Namespace()).prompt_lengths == (32, 512, 2048)


def test_llama_cpp_is_optional(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    runner, why = make_llama_cpp("/nonexistent.gguf", [2], 256)
    assert runner is None and "not installed" in why


# --- on the real embedded model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [32, 96, 512])
def test_prompts_have_exactly_the_asked_token_count(engine, n):
    tok = engine.model.tokenizer
    msgs, ids = prompts.exact_prompt(tok, n)
    assert len(ids) == n
    assert tok.encode_chat(msgs) == ids
    assert msgs[0] == {"role": "system", "content": prompts.SYSTEM}
    assert msgs[1]["content"].startswith(prompts.INSTRUCTION)


def test_too_short_a_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="too short"):
        prompts.exact_prompt(engine.model.tokenizer, 5)


def test_runners_generate_exactly_max_tokens(engine):
    msgs, ids = prompts.exact_prompt(engine.model.tokenizer, 32)
    for runner in (EngineRunner(engine), MlxLmRunner(engine)):
        for spec in (GREEDY, FULL):
            s = runner.run(msgs, ids, spec, 3)
            assert s["completion_tokens"] == 3, (runner.name, spec.name)
            assert s["prompt_tokens"] == 32
            assert s["ttft_s"] > 0 and s["tpot_s"] > 0
            assert s["peak_memory_bytes"] > engine.model.weight_bytes // 2


def test_tiny_run_end_to_end(engine, tmp_path):
    cfg = Config(quick=True, prompt_lengths=(32,), max_tokens=3, repeats=1, full_chain_lengths=(32,), chat_turns=2,
                 chat_reply_tokens=2, rotating_context=160, rotating_decode=4, rotating_window=64, tui_repeats=1,
                 tui_tokens=3, format_repeats=1, bandwidth_bytes=1 << 24,
                 skip=frozenset({"tui", "formats", "server", "split", "constrained", "speculative"}),
                 kv_context=128, kv_decode=4)  # contexts past the 64-token window and the KV groups, no longer
    results = run(cfg, out_dir=tmp_path, engine=engine)
    saved = json.loads((tmp_path / "latest.json").read_text())
    report.validate(saved)
    assert saved["errors"] == {} or set(saved["errors"]) <= {"plot"}, saved["errors"]
    systems = {c["system"] for c in saved["cases"]}
    assert {"mlxchat", "mlx-lm"} <= systems
    assert all(s["completion_tokens"] == 3 for c in saved["cases"] for s in c["samples"])
    assert stats.find_ratio(saved["ratios"], 32, "greedy", "mlx-lm") is not None
    tr = saved["trace"]
    assert tr["k"] == 10 and tr["untraced_tpot_s"] > 0 and tr["traced_step_s"] > tr["step_s"] > 0
    assert saved["chat"]["turns_run"] == 2 and len(saved["chat"]["turns"]) == 2
    assert saved["chat"]["turns"][1]["cached_tokens"] > 0  # the second turn reused the cache
    rot = saved["rotating"]
    assert rot["context_tokens"] == 160 and rot["completion_tokens"] == 4
    assert rot["samples"][-1]["context_tokens"] == 160
    assert saved["roofline"]["ceiling_tokens_per_s"] > 0
    kv = {v["kv_bits"]: v for v in saved["kv"]["variants"]}
    assert set(kv) == {None, 8, 4} and kv[8]["kv_bytes"] < kv[None]["kv_bytes"] and kv[None]["equal_greedy_tokens"] == 4
    assert saved["backend"]["device"] == "cpu" and "weights" in saved["backend"]["line"]
    # Two more where llama-cpp-python is installed (never a dependency: the bench's peer column).
    assert len(saved["targets"]) == 6 + 2 * ("llama.cpp" in systems)
    assert results["_paths"]["json"].endswith(".json")
    assert not math.isnan(saved["elapsed_s"])


def test_server_targets_from_figures():
    from mlxchat.bench.server import server_targets

    def fig(system, clients, tok_s):
        return {"system": system, "clients": clients, "tokens": 64, "aggregate_tok_s": tok_s, "p50_gap_ms": 80.0,
                "p99_gap_ms": 120.0, "mean_ttft_ms": 300.0}

    section = {"figures": [fig("mlxchat serve", 1, 13.0), fig("mlxchat serve", 4, 38.0),
                           fig("mlx_lm.server", 1, 8.0), fig("mlx_lm.server", 4, 40.0)],
               "resent_ttft_ms": [250.0, 260.0, 400.0], "resent_busy_clients": 4,
               "new_client_ttft_ms": {"alone_ms": 300.0, "busy_ms": 450.0}, "new_client_busy_clients": 7}
    scale, scale8, versus, new_client, resent = server_targets(section)
    assert scale["passed"] is True and scale["value"] == pytest.approx(38 / 13)
    assert scale8["passed"] is None and "8 clients" in scale8["name"]  # not measured in this section
    assert versus["passed"] is False and versus["value"] == pytest.approx(38 / 40)
    assert new_client["passed"] is True and new_client["value"] == pytest.approx(1.5)
    assert "7 others" in new_client["name"]
    assert resent["passed"] is False and resent["value"] == pytest.approx(1.6) and "turn-3" in resent["name"]
    assert "4 others" in resent["name"]
    assert server_targets(None)[0]["passed"] is None
    spec = {"cases": {"1 client ngram, grounded": {"ratio": 1.5, "tok_s": {"off": [40.0], "ngram": [60.0]}},
                      "4 clients auto": {"ratio": 0.95, "tok_s": {"off": [90.0], "auto": [85.5]}}}}
    one, four = server_targets({**section, "speculation": spec})[5:]
    assert (one["passed"], one["threshold"], four["passed"], four["threshold"]) == (True, 1.4, False, 0.97)
    assert "ngram" in one["name"] and "4 clients auto" in four["name"]


def test_server_targets_show_the_cpus_bound_and_the_real_size_part():
    from mlxchat.bench.server import server_targets

    def figures(*tok_s):
        return [{"system": "mlxchat serve", "clients": n, "tokens": 64, "aggregate_tok_s": v, "p50_gap_ms": 8.0,
                 "p99_gap_ms": 12.0, "mean_ttft_ms": 50.0, "steady_tok_s": v * (1.0 if n == 1 else 1.1)}
                for n, v in zip((1, 4, 8), tok_s)]

    section = {"figures": figures(100.0, 180.0), "resent_ttft_ms": [], "bound": {"4": 2.0},
               "realsize": {"model": "tiny.gguf", "figures": figures(20.0, 44.0, 60.0), "bound": {"4": 2.6, "8": 3.2}}}
    four, eight, real4, real8 = server_targets(section)[:4]
    # 1.8x where the machine allows 2.0x: a FAIL against 2.5x that says the target is above what this CPU allows.
    assert four["passed"] is False and "bound 2.00x" in four["detail"] and "90% of it" in four["detail"]
    assert "the target is above it" in four["detail"] and eight["passed"] is None
    assert "tiny.gguf" in real4["name"] and real4["value"] == pytest.approx(2.2) and real4["passed"] is False
    assert "85% of it" in real4["detail"] and "the target is above it" not in real4["detail"]
    assert real8["value"] == pytest.approx(3.0) and "8 rows' step costs 2.50x" in real8["detail"]
    # The steady rate (every client decoding) against the same bound: 1.98x of 2.0x.
    assert "while all 4 decode 1.98x (99% of the bound)" in four["detail"]


def test_speculative_speedup_pairs_each_repeats_adjacent_runs():
    from mlxchat.bench.speculative import paired_speedup

    # The machine's speed moves between repeats; each repeat's pair ran back to back. Two of three pairs say the mode
    # is slower (0.83x); a ratio of the two sides' medians (0.030 / 0.020) would say 1.5x faster.
    plain = [{"tpot_s": 0.010}, {"tpot_s": 0.030}, {"tpot_s": 0.050}]
    mode = [{"tpot_s": 0.012}, {"tpot_s": 0.020}, {"tpot_s": 0.060}]
    assert paired_speedup(plain, mode, "tpot_s") == pytest.approx(0.010 / 0.012)


def test_the_scaling_bound_times_the_model_alone_over_one_and_several_rows(engine):
    from mlxchat.bench.server import row_bound, step_cost

    # The model's own step over 3 rows in a BatchKVCache, as the scheduler holds them (no server).
    assert 0 < step_cost(engine.model.model, 3, context=16, steps=2) < 5
    bound = row_bound(engine.model.model, [1, 2])
    assert list(bound) == ["2"] and 0.5 < bound["2"] <= 2.5  # n x one row's time / n rows': about n at most
