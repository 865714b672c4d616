"""The real-size section (bench/realsize.py) on a tiny shape: the gguf-py writer, llama.cpp's quantizer and the cache,
the rows and the load children, the targets' logic. No timing assertions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mlxchat.bench import realsize as R
from mlxchat.bench.stats import format_targets
from mlxchat.core.model import gguf

TINY = R.Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)


def _without(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


# --- the files ----------------------------------------------------------------------------------------------------

def test_writer_makes_a_llama_in_llama_cpps_layout(tmp_path):
    pytest.importorskip("gguf")
    from tests.model_files import embedded_metadata

    params = R.write_llama_f16(tmp_path / "tiny.gguf", TINY)
    h = gguf.read_header(tmp_path / "tiny.gguf")
    src = embedded_metadata()
    vocab = len(src["tokenizer.ggml.tokens"])
    types = {t.name: t.type_name for t in h.tensors}
    assert len(types) == 2 * 9 + 3
    assert types["blk.1.ffn_down.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" in types  # untied, as TinyLlama is
    assert params == sum(t.nbytes // (2 if types[t.name] == "F16" else 4) for t in h.tensors)
    m = h.metadata
    assert (m["llama.embedding_length"], m["llama.block_count"], m["llama.attention.head_count"],
            m["llama.attention.head_count_kv"], m["llama.feed_forward_length"]) == (64, 2, 4, 2, 128)
    assert len(m["tokenizer.ggml.tokens"]) == vocab
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert m[key] == src[key]


def test_files_are_skipped_cleanly_without_llama_cpp(monkeypatch, tmp_path):
    _without(monkeypatch, "llama_cpp")
    assert "llama-cpp-python is not installed" in R.make_files(tmp_path, TINY)["reason"]
    section = R.realsize_case(quick=True, max_tokens=2, repeats=1, folder=tmp_path, shape=TINY)
    assert section["available"] is False
    (t,) = R.targets(section)
    assert t["passed"] is None and "not installed" in t["detail"]
    assert "n/a" in format_targets([t])
    assert "not run" in R.summary_lines(section)[0]
    assert not list(tmp_path.iterdir())  # nothing half-made


def test_files_are_skipped_cleanly_without_gguf_py(monkeypatch, tmp_path):
    pytest.importorskip("llama_cpp")
    _without(monkeypatch, "gguf")
    assert "gguf-py is not installed" in R.make_files(tmp_path, TINY)["reason"]


def test_files_are_quantized_by_llama_cpp_once_per_cache(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    first = R.make_files(tmp_path, TINY, quants=(R.Q4_0,), embedded=False)
    assert set(first["files"]) == {"llama h64 l2 Q4_0"} and first["reused"] == []
    assert set(first["made"]) == {"F16 (gguf-py)", "Q4_0"}
    q4 = gguf.read_header(first["files"]["llama h64 l2 Q4_0"])
    assert {t.type_name for t in q4.tensors if len(t.shape) == 2} == {"Q4_0"}  # pure
    assert not list(tmp_path.glob("*-f16.gguf*"))  # the F16 file is gone once quantized
    again = R.make_files(tmp_path, TINY, quants=(R.Q4_0,), embedded=False)
    assert again["made"] == {} and again["reused"] == ["llama h64 l2 Q4_0"]
    assert again["record"]["made_s"]["Q4_0"] == first["made"]["Q4_0"]  # the first run's times are kept
    assert "reused llama h64 l2 Q4_0" in "\n".join(R.summary_lines(_section([], again)))
    # The embedded model's Q4_K_M is a re-quantization, which llama.cpp refuses unless allowed: the same call here.
    q4_0, out = Path(first["files"]["llama h64 l2 Q4_0"]), tmp_path / "requantized.gguf"
    R.quantize(q4_0, out, R.Q4_K_M, requantize=True)
    assert "Q4_0" not in {t.type_name for t in gguf.read_header(out).tensors if len(t.shape) == 2}
    with pytest.raises(RuntimeError, match="could not quantize"):
        R.quantize(q4_0, tmp_path / "refused.gguf", R.Q4_K_M)
    assert not list(tmp_path.glob("refused*"))  # nothing half-written


# --- the rows -----------------------------------------------------------------------------------------------------

def test_rows_and_loads_on_a_tiny_file(tmp_path):
    from mlxchat.bench.native import synthetic_llama

    path, _ = synthetic_llama(tmp_path / "tiny-q4_0.gguf", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    f = R.file_case(str(path), "tiny Q4_0", [(32, 3), (50, 2)], repeats=1, load_repeats=1)
    # Without llama-cpp-python, or with a build that crashes on this machine, mlxchat runs alone and says why.
    systems = {"mlxchat"} if f.get("llama_cpp_error") else {"mlxchat", "llama.cpp"}
    assert {(r["system"], r["prompt_tokens"]) for r in f["rows"]} == {(s, n) for s in systems for n in (32, 50)}
    assert all(r["ttft_s"] > 0 and r["repeats"] == 1 for r in f["rows"])
    assert set(f["load"]) == systems and all(f["load"][s]["load_s"] > 0 for s in systems)
    ours = f["load"]["mlxchat"]
    assert ours["mlx_active_bytes"] > 0 and ours["weights_path"]
    decode, _, no_cliff, memory, load, peak = R.file_targets(f)
    assert no_cliff["value"] is not None and memory["value"] is not None
    assert (decode["value"] is None) == (load["value"] is None) == ("llama.cpp" not in systems)
    text = "\n".join(R.summary_lines(_section([f])))
    assert "50 prompt tokens: TTFT" in text and "fresh processes" in text


def test_a_file_mlxchat_refuses_is_reported_not_run(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    f = R.file_case(str(bad), "bad", [(32, 2)], repeats=1, load_repeats=1)
    assert f["mlxchat_error"] and "rows" not in f and "load" not in f
    targets = R.file_targets(f)
    assert [t["passed"] for t in targets] == [None] * 6
    assert all(t["detail"].startswith("mlxchat cannot load it: ") for t in targets)
    assert format_targets(targets).count("n/a") == 6


# --- targets ------------------------------------------------------------------------------------------------------

def _rows(ours: dict[int, tuple[float, float]], theirs: dict[int, tuple[float, float]]) -> list[dict]:
    """Rows from {prompt tokens: (TTFT s, decode tok/s)} per system."""
    return [{"system": s, "prompt_tokens": n, "ttft_s": ttft, "decode_tokens_per_s": tps, "repeats": 1,
             "generated_tokens": 32 if n in R.DECODE_LENGTHS else R.TTFT_ONLY_TOKENS}
            for s, figures in (("mlxchat", ours), ("llama.cpp", theirs)) for n, (ttft, tps) in figures.items()]


def _file(rows: list[dict], label: str = "1.1B Q4_0") -> dict:
    mb = 1_000_000
    return {"label": label, "file": "/x.gguf", "file_bytes": 700 * mb, "weights_path": "native q4", "rows": rows,
            "load": {"mlxchat": {"load_s": 4.0, "peak_load_bytes": 1000 * mb, "mlx_active_bytes": 800 * mb,
                                 "rss_growth_bytes": 800 * mb, "repeats": 2},
                     "llama.cpp": {"load_s": 0.5, "peak_load_bytes": 50 * mb, "mlx_active_bytes": None,
                                   "rss_growth_bytes": 40 * mb, "repeats": 2}}}


def _section(files: list[dict], making: dict | None = None) -> dict:
    making = making or {"folder": "/cache", "params": 1.1e9, "made": {"F16 (gguf-py)": 24.0, "Q4_0": 30.0},
                        "reused": [], "record": {}}
    return {"available": True, "making": making, "llama_cpp": None, "repeats": 2, "max_tokens": 32, "threads": 2,
            "files": files, "long": None}


def test_targets_from_figures():
    ours = {32: (0.2, 40.0), 50: (2.2, None), 512: (3.0, 38.0)}
    theirs = {32: (0.1, 61.0), 50: (0.15, None), 512: (2.0, 58.0)}
    decode, ttft, no_cliff, memory, load, peak = R.file_targets(_file(_rows(ours, theirs)))
    assert decode["passed"] is False and decode["value"] == pytest.approx(38 / 58)
    assert "32: 0.66x" in decode["detail"] and "512: 0.66x" in decode["detail"]
    assert ttft["passed"] is False and ttft["value"] == pytest.approx(1.5)
    # 32 -> 50 tokens: 2.2/50 over 0.2/32 = 7x per token (issue 35's cliff); 50 -> 512 falls.
    assert no_cliff["passed"] is False and no_cliff["value"] == pytest.approx((2.2 / 50) / (0.2 / 32))
    assert "32->50: 7.04x" in no_cliff["detail"]
    assert memory["passed"] is False and memory["value"] == pytest.approx(800 / 700)
    assert load["passed"] is False and load["value"] == pytest.approx(8.0)
    assert peak["passed"] is False and peak["value"] == pytest.approx(1000 / 700)
    assert all(t["name"].startswith("1.1B Q4_0: ") for t in (decode, ttft, no_cliff, memory, load, peak))

    fast = {32: (0.09, 70.0), 50: (0.13, None), 512: (1.0, 65.0)}
    f = _file(_rows(fast, theirs))
    f["load"]["mlxchat"] |= {"load_s": 0.9, "peak_load_bytes": 800 * 1_000_000, "mlx_active_bytes": 700 * 1_000_000}
    assert [t["passed"] for t in R.file_targets(f)] == [True] * 6


def test_long_prompt_targets_and_unavailable_sections():
    f = _file(_rows({2048: (10.0, 80.0)}, {2048: (9.0, 90.0)}), "embedded Q4_1")
    decode, ttft = R.long_targets(f)
    assert decode["passed"] is False and decode["value"] == pytest.approx(80 / 90)
    assert ttft["passed"] is False and ttft["value"] == pytest.approx(10 / 9)
    assert [t["passed"] for t in R.long_targets(None)] == [None, None]
    no_llama = {"label": "embedded Q4_1", "file_bytes": 1, "llama_cpp_error": "llama-cpp-python is not installed"}
    assert all("no llama.cpp to compare" in t["detail"] for t in R.long_targets(no_llama))
    # mlxchat alone (llama.cpp missing or crashing): what needs no peer is still measured.
    alone = _file([r for r in _rows({32: (0.2, 40.0), 50: (0.3, None)}, {}) if r["system"] == "mlxchat"])
    alone |= {"llama_cpp_error": "llama.cpp died of SIGSEGV"}
    del alone["load"]["llama.cpp"]
    decode, ttft, no_cliff, memory, load, peak = R.file_targets(alone)
    assert [t["passed"] for t in (decode, ttft, load)] == [None] * 3
    assert "no llama.cpp to compare: llama.cpp died of SIGSEGV" in load["detail"]
    assert no_cliff["value"] == pytest.approx((0.3 / 50) / (0.2 / 32)) and no_cliff["passed"] is True
    assert memory["passed"] is False and peak["passed"] is False
    assert "mlxchat alone: llama.cpp died of SIGSEGV" in "\n".join(R.summary_lines(_section([alone])))
    section = _section([_file(_rows({32: (0.2, 40.0)}, {32: (0.1, 60.0)})),
                        {"label": "1.1B Q4_K_M", "file_bytes": 1, "mlxchat_error": "ModelLoadError: Q4_K"}])
    section["long"] = f
    assert len(R.targets(section)) == 6 + 6 + 2
    text = "\n".join(R.summary_lines(section))
    assert "1.1B Q4_K_M (0 MB): mlxchat cannot load it: ModelLoadError: Q4_K" in text
    assert "2048 prompt tokens" in text and "made F16 (gguf-py) 24 s, Q4_0 30 s" in text


def test_cliff_needs_two_lengths():
    assert R.cliff(_file(_rows({32: (0.2, 40.0)}, {32: (0.1, 60.0)})))[0] is None


def test_how_llama_cpp_was_built():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 0 | LLAMAFILE = 1 | "
    b = R.parse_system_info(info, {"pni", "avx", "avx2", "avx512f", "avx512_vnni"})
    assert b["features"] == ["SSE3", "AVX", "AVX2", "AVX512", "LLAMAFILE"]
    assert b["missing_for_this_cpu"] == ["AVX512_VNNI"] and b["native"] is False
    assert R.parse_system_info(info, {"avx2"})["native"] is True
    assert R.parse_system_info(info, None)["native"] is None  # not an x86 Linux: unknown
    section = _section([]) | {"llama_cpp": b | {"version": "0.3.36"}}
    assert "without this CPU's AVX512_VNNI (GGML_NATIVE=OFF?)" in R.summary_lines(section)[1]
    amx = R.parse_system_info(info, {"avx512f", "amx_int8"}) | {"version": "0.3.36"}
    assert R.summary_lines(_section([]) | {"llama_cpp": amx})[1].endswith("without this CPU's AMX_INT8")


def test_the_bench_runs_the_section_and_prints_its_targets():
    import argparse

    from mlxchat.bench.run import FULL_RUN, QUICK_RUN, config_from_args, summary_text

    assert QUICK_RUN.realsize and FULL_RUN.realsize and QUICK_RUN.realsize_repeats < FULL_RUN.realsize_repeats
    assert "realsize" in config_from_args(argparse.Namespace(quick=True, skip=["realsize"])).skip
    section = _section([_file(_rows({32: (0.2, 40.0), 512: (3.0, 38.0)}, {32: (0.1, 61.0), 512: (2.0, 58.0)}))])
    section["targets"] = R.targets(section)
    text = summary_text({"targets": [], "realsize": section})
    assert "Real size: a 1.10B-parameter" in text
    assert "FAIL  1.1B Q4_0: decode >= 1x llama.cpp (every prompt length): 0.66x" in text.split("Targets:")[1]


def test_a_load_child_that_fails_leaves_the_rows_and_says_why():
    f = _file(_rows({32: (0.2, 40.0), 50: (0.3, None)}, {32: (0.1, 60.0), 50: (0.2, None)}))
    del f["load"]
    f["load_error"] = "mlxchat could not load x.gguf in a child process: MemoryError"
    decode, _, no_cliff, memory, load, peak = R.file_targets(f)
    assert decode["value"] is not None and no_cliff["value"] is not None
    assert all(t["passed"] is None and "MemoryError" in t["detail"] for t in (memory, load, peak))
    assert "loads: mlxchat could not load" in "\n".join(R.summary_lines(_section([f])))
