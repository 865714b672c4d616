"""KV caches saved to disk (issue 25, core/cache/kv_store.py): a ~3,000-token conversation reopened in a new process,
its next turn's TTFT loaded from disk against a cold prefill (target: <= 0.15x, the same greedy text), the bytes a
saved conversation takes per 1k tokens, and how load time grows with the file's size.

This process writes the conversation (a fresh chat answering an exact-length prompt, its KV cache flushed to a
temporary folder); a child process (``python -m mlxchat.bench.kv_disk --child``) loads the model and reopens it
the way the TUI does (``ChatSession.replace_history`` and a new message), cold and from a copy of that folder in
turn, then times `KVStore.load` on synthetic caches of growing size. The files were just written, so they are read
from the page cache, as after a restart on a machine with memory to spare; a cold disk adds its read time.

    python -m mlxchat.bench.kv_disk [--model M] [--context 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import prompts
from .cases import _greedy

TARGET = 0.15  # TTFT from disk / TTFT of a cold prefill
NEXT = "Summarize that in one sentence."
SIZES = (512, 1024, 2048, 4096)  # tokens of the synthetic caches whose load is timed


def kv_disk_case(engine: Any, model: str | None, context_tokens: int = 3000, reply_tokens: int = 16,
                 repeats: int = 3) -> dict[str, Any]:
    """Write the conversation here, measure its reopening in a child process; see the module docstring."""
    folder = Path(tempfile.mkdtemp(prefix="mlxchat-kv-bench-"))
    try:
        msgs, _ = prompts.exact_prompt(engine.model.tokenizer, context_tokens, system=prompts.SYSTEM)
        writer = engine.with_kv_cache(folder / "kv")
        chat = writer.chat(system=prompts.SYSTEM, profile=_greedy(reply_tokens))
        first = chat.send(msgs[-1]["content"], max_tokens=reply_tokens).wait()
        writer.flush_kv_cache()
        history = [{"role": m.role, "content": m.content, "token_ids": list(m.token_ids)} for m in chat.messages[1:]]
        (folder / "history.json").write_text(json.dumps(history))
        files = [p for p in (folder / "kv").glob("*/*.safetensors") if not p.name.startswith(".")]
        saved_bytes = sum(p.stat().st_size for p in files)
        held = first.metrics.prompt_tokens + len(first.token_ids) - 1
        child = subprocess.run([sys.executable, "-m", "mlxchat.bench.kv_disk", "--child", str(folder),
                                "--repeats", str(repeats), "--reply-tokens", str(reply_tokens),
                                *(["--model", model] if model else [])],
                               capture_output=True, text=True, timeout=1800)
        if child.returncode != 0:
            raise RuntimeError(f"the child process failed: {child.stderr.strip().splitlines()[-1:]}")
        measured = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"context_tokens": context_tokens, "first_prefill_s": first.metrics.prefill_s, "saved_tokens": held,
            "saved_bytes": saved_bytes, "bytes_per_1k_tokens": saved_bytes / held * 1000 if held else None,
            **measured}


def _child(folder: Path, model: str | None, repeats: int, reply_tokens: int) -> dict[str, Any]:
    """In a new process: the conversation reopened cold and from disk, interleaved; then load time vs size."""
    from mlxchat.core import Engine

    engine = Engine.load(model)
    history = json.loads((folder / "history.json").read_text())
    runs: dict[str, list[Any]] = {"cold": [], "disk": []}
    for i in range(repeats):
        for kind in ("disk", "cold") if i % 2 == 0 else ("cold", "disk"):
            copy = folder / f"copy-{i}-{kind}"
            if kind == "disk":
                shutil.copytree(folder / "kv", copy)  # each run loads the file as saved, not one a run extended
            chat = engine.with_kv_cache(copy if kind == "disk" else None).chat(system=prompts.SYSTEM,
                                                                              profile=_greedy(reply_tokens))
            chat.replace_history(history)
            runs[kind].append(chat.send(NEXT, max_tokens=reply_tokens).wait())
    cold, disk = runs["cold"], runs["disk"]
    ttft = {k: statistics.median(r.metrics.ttft_s for r in v) for k, v in runs.items()}
    return {"prompt_tokens": disk[0].metrics.prompt_tokens, "disk_tokens": disk[0].metrics.disk_tokens,
            "ttft_cold_s": ttft["cold"], "ttft_disk_s": ttft["disk"],
            "ttft_cold_runs_s": [r.metrics.ttft_s for r in cold], "ttft_disk_runs_s": [r.metrics.ttft_s for r in disk],
            "ratio": ttft["disk"] / ttft["cold"] if ttft["cold"] else None,
            "same_text": len({r.text for r in cold + disk}) == 1, "load": _load_times(engine, folder / "sizes")}


def _load_times(engine: Any, folder: Path) -> list[dict[str, Any]]:
    """`KVStore.load` (header check, read, evaluate) of saved caches of growing size, shaped like the model's."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxchat.core.cache.kv_store import KVStore

    probe = engine.chat()
    probe.send("Hi", max_tokens=1).wait()
    keys = probe.cache.layers[0].state[0]
    _, heads, _, dim = keys.shape
    store = KVStore(folder, engine.model)
    rows = []
    for n in SIZES:
        ids = [n, *range(1000, 1000 + n - 1)]

        def save(ids: list[int] = ids, n: int = n) -> None:  # arrays are made on the thread that evaluates them
            store.save(ids, [KVCache.from_state((mx.zeros((1, heads, n, dim), keys.dtype),) * 2 + (n,))
                             for _ in range(engine.model.num_layers)])

        engine.run(save)
        store.flush()
        entry, _ = store.best([*ids, 0])
        assert entry is not None
        times = []
        for _ in range(3):
            began = time.perf_counter()
            assert engine.run(lambda ids=ids: store.load([*ids, 0])) is not None
            times.append(time.perf_counter() - began)
        rows.append({"tokens": n, "file_bytes": entry.size, "load_s": statistics.median(times)})
    return rows


def targets(section: dict[str, Any] | None) -> list[dict[str, Any]]:
    ratio = (section or {}).get("ratio")
    passed = None if ratio is None else ratio <= TARGET and section["same_text"]
    detail = "not measured" if ratio is None else (
        f"{section['ttft_cold_s']:.2f} s cold -> {section['ttft_disk_s']:.2f} s from disk, "
        f"{section['disk_tokens']} of {section['prompt_tokens']} tokens loaded, "
        f"{'same' if section['same_text'] else 'DIFFERENT'} greedy text")
    return [{"name": f"kv disk: TTFT of a reopened {(section or {}).get('context_tokens', 3000)}-token chat "
                     f"<= {TARGET}x a cold prefill, same text", "value": ratio, "threshold": TARGET, "unit": "x",
             "passed": passed, "detail": detail}]


def summary_lines(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    out = [f"KV cache on disk: a {section['context_tokens']}-token chat reopened in a new process: TTFT "
           f"{section['ttft_cold_s']:.2f} s cold, {section['ttft_disk_s']:.2f} s from disk ({section['ratio']:.3f}x); "
           f"{section['bytes_per_1k_tokens'] / 2**20:.1f} MiB on disk per 1k tokens",
           "  load time vs file size: " + ", ".join(f"{r['file_bytes'] / 2**20:.0f} MiB {r['load_s'] * 1000:.0f} ms"
                                                    for r in section["load"])]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxchat.bench.kv_disk", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file, MLX folder or repo id (default: the embedded model)")
    p.add_argument("--context", type=int, default=3000, help="tokens of the conversation (default: 3000)")
    p.add_argument("--repeats", type=int, default=3, help="cold and disk runs each, interleaved (default: 3)")
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(args.child, args.model, args.repeats, args.reply_tokens)))
        return 0
    from mlxchat.core import Engine

    engine = Engine.load(args.model)
    section = kv_disk_case(engine, args.model, args.context, args.reply_tokens, args.repeats)
    print(json.dumps(section, indent=1))
    print("\n".join(summary_lines(section)))
    from .stats import format_targets

    print(format_targets(targets(section)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
