"""The split section: one model over two processes on this machine (MLX's ring over loopback) against one process.

    python -m mlxchat.bench.split [--model PATH] [--max-tokens 32] [--repeats 2]

A worker (`mlxchat worker`) and rank 0 (this module with --rank0, printing one JSON line) run as processes of their
own, since a ring group lives as long as its process. Rank 0 answers the same greedy prompt as the one-process
engine, exactly `max_tokens` tokens (end-of-turn banned until then), `repeats` times, and reports decode tok/s,
TTFT and each rank's weights and peak memory. On one machine the split is slower (the two halves take turns, and
each token crosses the ring and the control channel once); what the figures show is the memory per rank and the
overhead per token. Whether the greedy tokens equal one process's is recorded too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mlxchat.core.distributed.hosts import write_loopback_hosts

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def _greedy(max_tokens: int) -> Any:
    from mlxchat.core import SamplingProfile

    return SamplingProfile(name="bench-greedy", temperature=0, min_tokens=max_tokens)


def _figures(engine: Any, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Best decode tok/s and TTFT over `repeats` replies (after a short one that warms caches and allocations up),
    and the first reply's tokens."""
    engine.generate(PROMPT, profile=_greedy(4), max_tokens=4)
    results = [engine.generate(PROMPT, profile=_greedy(max_tokens), max_tokens=max_tokens) for _ in range(repeats)]
    return {"decode_tokens_per_s": max(r.metrics.decode_tokens_per_s for r in results),
            "tpot_ms": min(r.metrics.tpot_s for r in results) * 1000,
            "ttft_s": min(r.metrics.ttft_s for r in results), "token_ids": list(results[0].token_ids),
            "peak_bytes": max(r.metrics.peak_memory_bytes for r in results)}


def _rank0(hosts: str, model: str | None, max_tokens: int, repeats: int) -> None:
    import mlxchat.core  # noqa: F401 - the optimized BLAS before MLX
    from mlxchat.core.distributed.leader import SplitEngine

    engine = SplitEngine.start(hosts, model)
    figures = _figures(engine, max_tokens, repeats)
    figures["ranks"] = {int(r): m for r, m in engine.worker_memory().items()}
    figures["split"] = list(engine.plan.split)
    print(json.dumps(figures), flush=True)
    engine.close()


def split_case(engine: Any, model: str | None, max_tokens: int, repeats: int, timeout_s: float = 600
               ) -> dict[str, Any]:
    """The `split` section of `mlxchat bench`: `model` (None: the embedded one, which `engine` has loaded) over 2
    processes vs `engine` in this one."""
    one = _figures(engine, max_tokens, repeats)
    with tempfile.TemporaryDirectory() as folder:
        hosts = Path(folder) / "hosts.json"
        write_loopback_hosts(hosts, 2)
        worker = subprocess.Popen([sys.executable, "-m", "mlxchat.app.cli", "worker", "--hosts", str(hosts),
                                   "--rank", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            rank0 = subprocess.run([sys.executable, "-m", "mlxchat.bench.split", "--rank0", str(hosts),
                                    *(["--model", str(model)] if model else []), "--max-tokens", str(max_tokens),
                                    "--repeats", str(repeats)],
                                   capture_output=True, text=True, timeout=timeout_s)
        finally:
            _stop(worker)
    if rank0.returncode != 0 or not rank0.stdout.strip():
        raise RuntimeError(f"rank 0 failed: {(rank0.stderr.strip().splitlines() or ['no output'])[-1]}")
    split = json.loads(rank0.stdout.strip().splitlines()[-1])
    equal = split.pop("token_ids") == one.pop("token_ids")
    return {"max_tokens": max_tokens, "repeats": repeats, "one_process": {**one, "weight_bytes":
                                                                         engine.model.weight_bytes},
            "split": split, "greedy_tokens_equal": equal,
            "overhead_ms_per_token": split["tpot_ms"] - one["tpot_ms"],
            "largest_rank_weights_vs_one": max(r["weight_bytes"] for r in split["ranks"].values())
            / engine.model.weight_bytes}


def _stop(worker: subprocess.Popen, wait_s: float = 30) -> None:
    """The worker leaves when rank 0 closes; one that does not within `wait_s` (rank 0 failed early) is killed."""
    try:
        worker.wait(wait_s)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def summary_lines(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    one, split = section["one_process"], section["split"]
    ranks = ", ".join(f"rank {r} {m['weight_bytes'] / 2**20:.0f} MiB weights / {m['peak_bytes'] / 2**20:.0f} MiB peak"
                      for r, m in sorted(section["split"]["ranks"].items(), key=lambda kv: int(kv[0])))
    return [f"Split over 2 processes (ring on loopback, layers {split['split']}), {section['max_tokens']} greedy "
            "tokens:",
            f"  one process: {one['decode_tokens_per_s']:.1f} tok/s (TPOT {one['tpot_ms']:.0f} ms), "
            f"{one['weight_bytes'] / 2**20:.0f} MiB weights, {one['peak_bytes'] / 2**20:.0f} MiB peak",
            f"  split:       {split['decode_tokens_per_s']:.1f} tok/s (TPOT {split['tpot_ms']:.0f} ms, "
            f"{section['overhead_ms_per_token']:+.1f} ms/token); {ranks}",
            f"  greedy tokens equal to one process: {'yes' if section['greedy_tokens_equal'] else 'NO'}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxchat.bench.split")
    p.add_argument("--model", help="GGUF file or MLX/HF folder (default: the embedded model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rank0", metavar="HOSTS", help=argparse.SUPPRESS)  # the split_case's rank-0 process
    args = p.parse_args(argv)
    if args.rank0:
        _rank0(args.rank0, args.model, args.max_tokens, args.repeats)
        return 0
    import mlxchat.core  # noqa: F401 - the optimized BLAS before MLX
    from mlxchat.core import Engine

    engine = Engine.load(args.model)
    print("\n".join(summary_lines(split_case(engine, args.model, args.max_tokens, args.repeats))))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
