"""KV caches saved to disk (core/cache/kv_store.py): a conversation reopened by a fresh engine loads its prefix instead
of prefilling it, with the same tokens as a cold prefill; files of another model, weight path or KV setting are never
used; broken files are removed with one warning; the folder keeps to its budget."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.model.backend import KVOptions
from mlxchat.core.cache.kv_store import KVStore, fingerprint

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
    # A one-off prompt loads a saved prefix too (and saves nothing).
    one_off = fresh.generate([m.as_prompt() for m in reopened.messages], profile=greedy, max_tokens=1)
    assert one_off.metrics.disk_tokens > held

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
    with caplog.at_level(logging.WARNING, logger="mlxchat.core.cache.kv_store"):
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
    with caplog.at_level(logging.WARNING, logger="mlxchat.core.cache.kv_store"):
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
    with caplog.at_level(logging.INFO, logger="mlxchat.core.cache.kv_store"):
        for first in (1, 2, 3):
            store.save([first, *range(100, 139)], _layers(model.num_layers, 40))
            store.flush()
            if first == 2:  # the first conversation is used again: the second is now the least recently used
                assert store.load([1, *range(100, 139), 7]) is not None
    assert len(store) == 2 and store.best([2, *range(100, 140)])[1] == 0
    assert store.best([1, *range(100, 140)])[1] == 40 and store.best([3, *range(100, 140)])[1] == 40
    assert any("evicted" in r.getMessage() for r in caplog.records)


def test_a_stored_chat_reopened_warms_its_cache_before_the_next_message(engine: Engine, tmp_path: Path):
    from mlxchat.app.conversation import ChatController
    from mlxchat.app.formatting import stats_line
    from mlxchat.app.store import Store

    def controller(store: Store, disk: Engine) -> ChatController:
        c = ChatController(store, default_profile=lambda: SamplingProfile(temperature=0), default_system=SYSTEM,
                           max_tokens=6, exports=tmp_path / "exports")
        c.engine_ready(disk, None, owned=False)
        return c

    def answer(c: ChatController, text: str):  # noqa: ANN202 - GenerationResult
        reply = c.send(text)
        result = reply.stream.wait()
        c.on_finished(reply.stream, result)  # what the chat screen does with the bridge thread's Finished
        return result

    store = Store(tmp_path / "conversations.db")
    first = engine.with_kv_cache(tmp_path / "kv")
    before = controller(store, first)
    answer(before, "Name a fruit.")
    first.flush_kv_cache()

    # Another controller on a fresh engine (a restart) opens the stored chat: its cache is loaded before any message.
    later = engine.with_kv_cache(tmp_path / "kv")
    after = controller(store, later)
    after.open(before.record.id)
    later.run(lambda: None)  # the warm-up queued on the inference thread is done
    loaded = after.session.cache.from_disk
    assert loaded > 0
    result = answer(after, "Name a colour.")
    assert result.metrics.disk_tokens == loaded and result.metrics.cached_tokens >= loaded
    assert f"{loaded:,} tokens from disk" in stats_line(result.metrics)
    assert "from disk" not in stats_line({**result.metrics.as_dict(), "disk_tokens": 0})
    store.close()


def test_the_servers_prefix_cache_spills_to_disk_and_a_restarted_one_serves_from_it(engine: Engine,
                                                                                    greedy: SamplingProfile,
                                                                                    tmp_path: Path):
    import queue

    from mlxchat.core.batch import BatchRequest, BatchScheduler
    from mlxchat.core.decode.events import Done

    def answer(s: BatchScheduler, messages: list[dict[str, str]]):  # noqa: ANN202 - GenerationResult
        q: queue.Queue = queue.Queue()
        s.submit(BatchRequest(engine.model.tokenizer.encode_chat(messages), greedy, q.put, max_tokens=4))
        while not isinstance(event := q.get(timeout=120), Done):
            assert not isinstance(event, BaseException), event
        return event.result

    turn1 = [{"role": "user", "content": "Tell me about cats in one sentence."}]
    # A prefix cache of 64 KiB evicts (and so spills) every entry as soon as it is stored.
    small = engine.with_kv_cache(tmp_path)
    first = answer(BatchScheduler(small, prefix_cache_bytes=64 * 2**10), turn1)
    small.flush_kv_cache()
    assert len(_files(tmp_path)) == 1
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And dogs?"}]

    # After a restart (a fresh store, an empty prefix cache) the resent conversation is loaded from disk.
    restarted = BatchScheduler(engine.with_kv_cache(tmp_path))
    second = answer(restarted, turn2)
    assert second.metrics.disk_tokens == second.metrics.cached_tokens >= first.metrics.prompt_tokens + 3
    assert second.token_ids == answer(BatchScheduler(engine, prefix_cache_bytes=0), turn2).token_ids
    # What the prefix cache holds in memory is saved when the server stops (`mlxchat serve` calls spill_all): the
    # longer conversation supersedes the file of its first turn.
    engine.run(restarted.prefix_cache.spill_all)
    restarted.disk.flush()
    [saved] = _files(tmp_path)
    assert len(restarted.disk.best(engine.model.tokenizer.encode_chat(turn2))[0].ids) > second.metrics.cached_tokens


def test_flags_and_config_keys_set_the_folder_and_budget(tmp_path: Path):
    from mlxchat.app.cli import build_parser, chat_options
    from mlxchat.app.config import ConfigError, Settings
    from mlxchat.server.cli import kv_cache_options

    default = Path(os.environ["MLXCHAT_CACHE_DIR"]) / "kv"  # tests/conftest.py: a temporary cache folder
    parse = build_parser().parse_args
    settings = chat_options(parse(["chat", "--kv-cache-dir", str(tmp_path), "--kv-cache-mb", "10"]))["settings"]
    assert settings == {"kv_cache_dir": str(tmp_path), "kv_cache_mb": 10.0}
    assert Settings(**settings).engine_options() == {"kv_cache_dir": tmp_path, "kv_cache_mb": 10.0}
    assert Settings().engine_options() == {"kv_cache_dir": default, "kv_cache_mb": 4096}
    assert Settings(kv_cache_mb=0).engine_options() == {"kv_cache_dir": None}
    with pytest.raises(ValueError, match="--kv-cache-mb must be at least 0"):
        chat_options(parse(["chat", "--kv-cache-mb", "-1"]))
    (tmp_path / "config.toml").write_text("kv_cache_mb = -5\n")
    with pytest.raises(ConfigError, match="kv_cache_mb"):
        Settings.load(tmp_path / "config.toml")
    assert kv_cache_options(parse(["serve"])) == {"kv_cache_dir": default, "kv_cache_mb": 4096}
    assert kv_cache_options(parse(["serve", "--kv-cache-dir", str(tmp_path), "--kv-cache-mb", "0"])) == {}



@pytest.mark.skipif(not os.environ.get("MLXCHAT_SLOW"), reason="two server starts: past the suite's time budget; "
                                                              "MLXCHAT_SLOW=1 runs it")
@pytest.mark.slow
@pytest.mark.model
def test_mlxchat_serve_restarted_serves_a_resent_conversation_from_disk(tmp_path: Path):
    """SIGTERM (a service manager's stop) ends `mlxchat serve` through its shutdown, which spills the prefix cache
    to the KV cache folder; a new server process answers the resent conversation from it."""
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    def serve_once(messages: list[dict[str, str]]) -> dict:
        proc = subprocess.Popen([sys.executable, "-m", "mlxchat.app.cli", "serve", "--port", "0", "--kv-cache-dir",
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            url = next(m.group(1) for line in proc.stdout
                       if (m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)))
            body = {"messages": messages, "max_tokens": 4, "temperature": 0}
            request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 128 + signal.SIGTERM
        finally:
            proc.kill()
        return answer

    turn1 = [{"role": "user", "content": "Tell me about the history of Rome. " * 10}]
    first = serve_once(turn1)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and len(_files(tmp_path)) == 1
    turn2 = turn1 + [first["choices"][0]["message"], {"role": "user", "content": "Shorter."}]
    cached = serve_once(turn2)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]


@pytest.mark.model
def test_a_script_that_exits_right_after_a_reply_leaves_it_on_disk(tmp_path: Path):
    """The reply's save is queued before its Done: a script whose last statement reads the reply still saves it
    (queued after the Done, interpreter exit stopped the inference thread first and the folder stayed empty)."""
    import subprocess
    import sys

    script = ("from mlxchat.core import Engine, SamplingProfile\n"
              f"engine = Engine.load(kv_cache_dir={str(tmp_path)!r})\n"
              "chat = engine.chat(profile=SamplingProfile(temperature=0))\n"
              "print(chat.send('Tell me about the history of Rome. ' * 20, max_tokens=4).wait().text)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    [saved] = _files(tmp_path)
    assert saved.stat().st_size > 2**20  # the whole prompt's keys and values, not an empty file
