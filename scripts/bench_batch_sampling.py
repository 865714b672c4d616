"""The host time of sampling one step of a batch's rows, on the embedded model's vocabulary size, interleaved rounds:
"before", row by row (each `Sampler.step`) with the draw as MLX's composed ops (the code before the batched path and
the native draw); "rows", row by row with the native draw; "one op", the rows whose chains allow it sampled
together (core/sampling/batch_sampling.py).

    .venv/bin/python scripts/bench_batch_sampling.py [--rows 4] [--rounds 15] [--steps 50]

Per step: `build` is the Python that builds the graph, `step` that and its evaluation (what a decode step waits for
on the CPU backend). Medians over rounds, in µs."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from mlxchat.core import SamplingProfile
from mlxchat.core.sampling import draw
from mlxchat.core.sampling.batch_sampling import sample_rows
from mlxchat.core.sampling.chain import Sampler

VOCAB = 49152  # the embedded model's
CHAINS = {
    "greedy": lambda i: SamplingProfile(temperature=0),
    "greedy+bias": lambda i: SamplingProfile(temperature=0, logit_bias={2: -100.0}),  # the server bench's rows
    "chat": lambda i: SamplingProfile.preset("chat").model_copy(update={"seed": i}),  # temperature 0.8, top-p 0.9
    "full": lambda i: SamplingProfile(temperature=0.6 + 0.1 * i, top_k=40, top_p=0.9, min_p=0.05, seed=i),
}


def _composed(logits: mx.array, ids: mx.array, words: mx.array) -> mx.array:
    return mx.argmax(logits - mx.log(-mx.log(draw.uniform_at(ids, words))), axis=-1)


def _round(profile: Callable[[int], SamplingProfile], rows: int, steps: int, logits: list[mx.array],
           mode: str) -> tuple[float, float]:
    samplers = [Sampler(profile(i), vocab_size=VOCAB, eos_ids=frozenset()) for i in range(rows)]
    native_draw = draw.gumbel_positions
    if mode == "before":
        draw.gumbel_positions = _composed
    try:
        return _steps(samplers, steps, logits, mode == "one op")
    finally:
        draw.gumbel_positions = native_draw


def _steps(samplers: list[Sampler], steps: int, logits: list[mx.array], batched: bool) -> tuple[float, float]:
    build = total = 0.0
    for x in logits[:steps]:
        mx.eval(x)
        t0 = time.perf_counter()
        if batched:
            tokens, _ = sample_rows(samplers, x)
        else:
            tokens = mx.stack([s.step(x[i])[0] for i, s in enumerate(samplers)])
        t1 = time.perf_counter()
        mx.eval(tokens)
        t2 = time.perf_counter()
        build, total = build + t1 - t0, total + t2 - t0
    return build / steps * 1e6, total / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    logits = [mx.array(rng.normal(0, 3, (args.rows, VOCAB)).astype(np.float32)) for _ in range(args.steps)]
    print(f"{args.rows} rows, vocabulary {VOCAB}, medians of {args.rounds} interleaved rounds of {args.steps} "
          "steps (µs)")
    modes = ("before", "rows", "one op")
    print(f"{'chain':<12}" + "".join(f"{m + ': build':>16} {'step':>6}" for m in modes) + f"{'one op / before':>17}")
    for name, profile in CHAINS.items():
        for mode in modes:  # warm up
            _round(profile, args.rows, 5, logits, mode)
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                times[mode].append(_round(profile, args.rows, args.steps, logits, mode))
        med = {m: [statistics.median(v) for v in zip(*times[m])] for m in modes}
        print(f"{name:<12}" + "".join(f"{med[m][0]:>16.0f} {med[m][1]:>6.0f}" for m in modes)
              + f"{med['one op'][1] / med['before'][1]:>17.2f}")


if __name__ == "__main__":
    main()
