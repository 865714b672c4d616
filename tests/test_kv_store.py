"""KV caches saved to disk (core/kv_store.py): a conversation reopened by a fresh engine loads its prefix instead of
prefilling it, with the same tokens as a cold prefill; files of another model, weight path or KV setting are never
used; broken files are removed with one warning; the folder keeps to its budget."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.backend import KVOptions
from mlxchat.core.kv_store import KVStore, fingerprint

SYSTEM = "You are terse."


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*/*.safetensors") if not p.name.startswith("."))


def test_a_conversation_saved_by_one_engine_is_loaded_by_a_fresh_one(engine: Engine, greedy: SamplingProfile,
                                                                     tmp_path: Path, caplog: pytest.LogCaptureFixture):
    first = engine.with_kv_cache(tmp_path)
    chat = first.chat(system=SYSTEM, profile=greedy)
    a = chat.send("Name a fruit.", max_tokens=6).wait()
    assert a.metrics.disk_tokens == 0
    first.flush_kv_cache()
    [saved] = _files(tmp_path)
    history = chat.messages[1:]

    # A fresh engine (its own store, reading the folder) on the conversation reopened: the history is loaded.
    fresh = engine.with_kv_cache(tmp_path)
    reopened = fresh.chat(system=SYSTEM, profile=greedy)
    reopened.replace_history(history)
    warm = reopened.send("Name a colour.", max_tokens=6).wait()
    held = a.metrics.prompt_tokens + len(a.token_ids) - 1  # a reply cut by max_tokens never fed its last id
    assert warm.metrics.disk_tokens == warm.metrics.cached_tokens == held
    cold_chat = engine.chat(system=SYSTEM, profile=greedy)
    cold_chat.replace_history(history)
    cold = cold_chat.send("Name a colour.", max_tokens=6).wait()
    assert cold.metrics.cached_tokens == 0 and cold.token_ids == warm.token_ids
    fresh.flush_kv_cache()
    assert _files(tmp_path) != [saved] and len(_files(tmp_path)) == 1  # the longer save supersedes the shorter

    # Another KV setting never reads these files, and a rotating window saves nothing.
    quantized = fresh.chat(system=SYSTEM, profile=greedy, kv_bits=8)
    quantized.replace_history(history)
    assert quantized.send("Name a colour.", max_tokens=2).wait().metrics.disk_tokens == 0
    rotating = fresh.chat(system=SYSTEM, profile=greedy, max_kv_size=512)
    rotating.replace_history(history)
    assert rotating.send("Name a colour.", max_tokens=2).wait().metrics.disk_tokens == 0
    fresh.flush_kv_cache()
    assert len(list(tmp_path.iterdir())) == 2  # the default and the 8-bit setting, each in its own folder

    # A truncated file is removed with one warning and the reply is the cold one; so is a quantized chat reopened.
    [plain] = [p for p in _files(tmp_path) if p.parent.name == fresh.kv_store().fingerprint]
    plain.write_bytes(plain.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="mlxchat.core.kv_store"):
        again = engine.with_kv_cache(tmp_path).chat(system=SYSTEM, profile=greedy)
        again.replace_history(history)
        broken = again.send("Name a colour.", max_tokens=6).wait()
    assert len([r for r in caplog.records if "ignoring and removing" in r.getMessage()]) == 1
    assert not plain.exists() and broken.metrics.disk_tokens == 0 and broken.token_ids == cold.token_ids
    q = engine.with_kv_cache(tmp_path).chat(system=SYSTEM, profile=greedy, kv_bits=8)
    q.replace_history(quantized.messages[1:-1])
    assert q.warm().result() > a.metrics.prompt_tokens


def test_files_of_another_model_policy_or_kv_setting_are_never_used(engine: Engine, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture):
    model = engine.model
    base = fingerprint(model, KVOptions())
    assert fingerprint(model, KVOptions()) == base
    assert fingerprint(model, KVOptions(8)) != base
    assert fingerprint(dataclasses.replace(model, weights_path="fp32 (dequantized): asked for"), KVOptions()) != base
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(64))
    assert fingerprint(dataclasses.replace(model, source=str(other)), KVOptions()) != base

    # A file written for another fingerprint, put in this one's folder, is removed, not loaded; so are an
    # unreadable file and the temporary file of a save whose process died; a live one's is left alone.
    ours = KVStore(tmp_path, model)
    theirs = KVStore(tmp_path, dataclasses.replace(model, weights_path="fp32"))
    theirs.save([1, 2, 3], _layers(model.num_layers, 3))
    theirs.flush()
    [foreign] = list(theirs.folder.glob("*.safetensors"))
    moved = ours.folder / foreign.name
    os.replace(foreign, moved)
    (ours.folder / "garbage.safetensors").write_bytes(b"\x00" * 40)
    dead = ours.folder / ".abc.999999999.tmp.safetensors"
    live = ours.folder / f".abc.{os.getpid()}.tmp.safetensors"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="mlxchat.core.kv_store"):
        fresh = KVStore(tmp_path, model)
    assert len(fresh) == 0 and not moved.exists() and not (ours.folder / "garbage.safetensors").exists()
    assert not dead.exists() and live.exists()
    assert len([r for r in caplog.records if "ignoring and removing" in r.getMessage()]) == 2


def _layers(n: int, tokens: int, heads: int = 3, dim: int = 64) -> list[KVCache]:
    return [KVCache.from_state((mx.ones((1, heads, tokens, dim)), mx.ones((1, heads, tokens, dim)), tokens))
            for _ in range(n)]


def test_the_folder_keeps_to_its_budget_least_recently_used_first(engine: Engine, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture):
    model = engine.model
    one = 2 * model.num_layers * 3 * 40 * 64 * 4  # bytes of keys and values for 40 tokens
    store = KVStore(tmp_path, model, budget_bytes=int(2.5 * one))
    with caplog.at_level(logging.INFO, logger="mlxchat.core.kv_store"):
        for first in (1, 2, 3):
            store.save([first, *range(100, 139)], _layers(model.num_layers, 40))
            store.flush()
            if first == 2:  # the first conversation is used again: the second is now the least recently used
                assert store.load([1, *range(100, 139), 7]) is not None
    assert len(store) == 2 and store.best([2, *range(100, 140)])[1] == 0
    assert store.best([1, *range(100, 140)])[1] == 40 and store.best([3, *range(100, 140)])[1] == 40
    assert any("evicted" in r.getMessage() for r in caplog.records)
