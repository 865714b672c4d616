"""The backend description and the decisions taken from it (issue 17), on described backends: a Mac's GPU is
described, not mocked, so the same rules are checked on this CPU-only machine."""

from __future__ import annotations

import pytest

from mlxchat.core.model.backend import (
    Backend, KVOptions, clear_cache_after_prefill, kv_options, memory_warning, wants_generation_stream,
    wants_wired_limit,
)

MAC = Backend("gpu", "Apple M2 Max", 64 * 2**30, 48 * 2**30)
LINUX = Backend("cpu", "Intel(R) Xeon(R) Processor", 24 * 2**30, None)


def test_this_machine_is_described_as_mlx_reports_it() -> None:
    b = Backend.current()
    assert b.device == "cpu" and b.name and b.recommended_working_set is None
    assert b.memory_bytes and b.memory_bytes > 2**30
    assert b.line().startswith("cpu · ") and b.line().endswith(" GiB")


def test_wired_limit_and_generation_stream_only_on_a_gpu_that_reports_a_working_set() -> None:
    assert wants_wired_limit(MAC) and wants_generation_stream(MAC)
    assert not wants_wired_limit(LINUX) and not wants_generation_stream(LINUX)
    assert not wants_wired_limit(Backend("gpu", "some gpu", None, None))


def test_memory_warning_at_ninety_percent_of_the_working_set() -> None:
    limit = MAC.recommended_working_set
    assert memory_warning(MAC, int(0.9 * limit)) is None
    warning = memory_warning(MAC, int(0.95 * limit))
    assert warning is not None and "MiB" in warning and "\n" not in warning
    assert memory_warning(LINUX, 10**12) is None


def test_cache_is_freed_after_long_prefills_only() -> None:
    assert not clear_cache_after_prefill(100) and clear_cache_after_prefill(4096)


def test_kv_options_validate_and_refuse_the_rotating_window() -> None:
    assert kv_options(None) == KVOptions(None, 64) and not kv_options(None).quantized
    assert kv_options(8, 32) == KVOptions(8, 32) and kv_options(4).quantized
    with pytest.raises(ValueError, match="kv_bits must be one of 2, 3, 4, 6, 8, got 5"):
        kv_options(5)
    with pytest.raises(ValueError, match="kv_group_size must be one of 32, 64, 128, got 16"):
        kv_options(4, 16)
    with pytest.raises(ValueError, match="cannot be combined with a rotating window"):
        kv_options(8, rotating=True)


def test_a_quantized_kv_cache_answers_in_less_memory(engine) -> None:
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxchat.core import SamplingProfile

    greedy = SamplingProfile(temperature=0)
    prompt = "Tell me about the sea. " * 20
    plain, quantized = engine.chat(profile=greedy), engine.chat(profile=greedy, kv_bits=8)
    plain.send(prompt, max_tokens=8).wait()
    b = quantized.send(prompt, max_tokens=8).wait()
    assert b.text and b.metrics.completion_tokens == 8
    assert all(isinstance(c, QuantizedKVCache) for c in quantized.cache.layers)
    assert quantized.cache.size == plain.cache.size and quantized.cache.nbytes() < 0.5 * plain.cache.nbytes()
    with pytest.raises(ValueError, match="rotating window"):
        engine.chat(kv_bits=8, max_kv_size=512)


def test_the_engine_describes_its_device_and_weights(engine) -> None:
    line = engine.describe()
    assert line.startswith("cpu · ") and f"weights {engine.model.weights_path}" in line
