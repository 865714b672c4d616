#!/usr/bin/env python
"""Fuzz the GGUF header/metadata reader (`core.model.gguf.read_header`): random and mutated files.

The property: for any bytes, `read_header` returns a header whose tensors all lie inside the file, or raises
`ModelLoadError` (one line, naming the file). Never another exception, never a hang, never an allocation
beyond a small multiple of the file's size (a length field claiming 2**60 must not allocate).

Mutations are structure-aware: the seed files are written field by field (core/model/gguf_writer.py), so a mutation can
aim at a length, a count, a type tag, a dimension or an offset, besides bit flips, truncations, insertions and splices.
tests/test_fuzz.py reuses the seeds and the mutators for a bounded in-suite run (hypothesis drives them there).

    .venv/bin/python scripts/fuzz_gguf.py --iterations 5000 --seed 1
    .venv/bin/python scripts/fuzz_gguf.py --iterations 20 --load   # also load passing files with the real loader

`--load` runs `core.model.loader.load` on mutated copies of a small real llama GGUF (tests/model_files.py) in a child
process, one file at a time, so a crash (a signal) of the process is seen as such.
"""

from __future__ import annotations

import argparse
import collections
import random
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

# The writer (it remembers where every field is, for the mutators) is core's, shared with the tests and the bench.
from mlxchat.core.model.gguf_writer import (ARRAY, BOOL, F32, F64, I8, I16, I32, I64, STRING, U8, U16, U32, U64, Field,
                                            build_gguf)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def seed_file(loadable: bool = False) -> tuple[bytes, list[Field]]:
    """A small GGUF using every metadata value type, nested and string arrays, and several tensor types.
    `loadable`: only what MLX's own GGUF reader (`mx.load`) reads (no float64, no nested arrays, no K-quants)."""
    rng = random.Random(0)
    meta = [
        ("general.architecture", STRING, "llama"),
        ("general.name", STRING, "fuzz seed ✓"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, 1),
        ("llama.context_length", U64, 256),
        ("llama.embedding_length", U32, 32),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.rope.freq_base", F32 if loadable else F64, 10000.0),
        ("u8", U8, 7), ("i8", I8, -7), ("u16", U16, 700), ("i16", I16, -700), ("i32", I32, -70000),
        ("i64", I64, -(2**40)), ("flag", BOOL, True),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<unk>", "<s>", "</s>", "a", "b", "ab"])),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [2, 3, 3, 1, 1, 1])),
        ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, 0.0, 0.0, -1.0, -2.0, -3.0])),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["a b"])),
        ("not.kept", ARRAY, (U16, [1, 2, 3, 4])),
        ("nested", ARRAY, (ARRAY, [(U8, [1, 2]), (STRING, ["x"])])),
        ("empty", ARRAY, (F64, [])),
    ]
    if loadable:
        meta = [m for m in meta if m[0] != "nested"]
    tensors = [
        ("token_embd.weight", (32, 6), 1, rng.randbytes(32 * 6 * 2)),     # F16
        ("output_norm.weight", (32,), 0, struct.pack("<32f", *[1.0] * 32)),  # F32
        ("blk.0.attn_q.weight", (32, 4), 2, rng.randbytes(4 * 18)),          # Q4_0
        ("blk.0.attn_k.weight", (32, 2), 8, rng.randbytes(2 * 34)),          # Q8_0
        ("blk.0.ffn_up.weight", (256,), 12, rng.randbytes(144)),             # Q4_K
        ("scalar", (), 26, rng.randbytes(4)),                                # I32, no dimensions
    ]
    if loadable:
        tensors[4:] = [("blk.0.ffn_up.weight", (64, 2), 3, rng.randbytes(4 * 20)),  # Q4_1
                       ("blk.0.ffn_down.weight", (4, 2), 30, rng.randbytes(16)),     # BF16
                       ("scalar", (), 0, rng.randbytes(4))]                           # F32, no dimensions
    return build_gguf(meta, tensors)


# --- mutations --------------------------------------------------------------------------------------------------

INTERESTING_64 = [0, 1, 2, 7, 8, 31, 32, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**60,
                  2**63 - 1, 2**63, 2**64 - 1]
INTERESTING_32 = [0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 13, 14, 29, 30, 31, 39, 255, 2**16, 2**31 - 1, 2**31,
                  2**32 - 1]


def _set_field(rng: random.Random, data: bytearray, f: Field) -> None:
    if f.width == 0 or f.offset + f.width > len(data):
        return
    if f.width == 8:
        pool = INTERESTING_64 + [len(data), len(data) - f.offset, len(data) + 1, rng.getrandbits(64)]
        value = rng.choice(pool)
        if rng.random() < 0.3:  # nudge the real value instead
            value = (struct.unpack_from("<Q", data, f.offset)[0] + rng.choice([-2, -1, 1, 2, 8, 4096])) % 2**64
        struct.pack_into("<Q", data, f.offset, value)
    elif f.width == 4:
        struct.pack_into("<I", data, f.offset, rng.choice(INTERESTING_32 + [rng.getrandbits(32)]))
    else:
        for i in range(f.width):
            data[f.offset + i] = rng.getrandbits(8)


def mutate(rng: random.Random, seed: bytes, fields: list[Field], n_ops: int | None = None) -> bytes:
    """Apply 1-4 random mutations to a copy of `seed`."""
    data = bytearray(seed)
    for _ in range(n_ops or rng.choice([1, 1, 1, 2, 3, 4])):
        op = rng.choice(OPS)
        data = op(rng, data, fields)
    return bytes(data)


def op_field(rng, data, fields):
    structural = [f for f in fields if f.kind != "scalar"] or fields
    _set_field(rng, data, rng.choice(structural))
    return data


def op_bitflip(rng, data, fields):
    for _ in range(rng.randint(1, 8)):
        if data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    return data


def op_byte(rng, data, fields):
    if data:
        data[rng.randrange(len(data))] = rng.choice([0, 1, 0x7F, 0x80, 0xFE, 0xFF, rng.getrandbits(8)])
    return data


def op_truncate(rng, data, fields):
    if rng.random() < 0.5 and fields:  # cut right at or just after a field boundary
        f = rng.choice(fields)
        cut = f.offset + rng.choice([0, 1, f.width - 1 if f.width else 0, f.width])
    else:
        cut = rng.randrange(len(data) + 1)
    return data[:max(0, min(cut, len(data)))]


def op_insert(rng, data, fields):
    i = rng.randrange(len(data) + 1)
    return data[:i] + bytearray(rng.randbytes(rng.choice([1, 4, 8, 13]))) + data[i:]


def op_delete(rng, data, fields):
    if not data:
        return data
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.choice([1, 4, 8, 13]):]


def op_splice(rng, data, fields):
    if len(data) < 2:
        return data
    a, b = sorted(rng.sample(range(len(data)), 2))
    at = rng.randrange(len(data))
    return data[:at] + data[a:b] + data[at:]


def op_random_tail(rng, data, fields):
    """Keep a valid prefix (magic, version, counts...) and replace the rest with noise."""
    keep = rng.randrange(min(len(data), 64) + 1)
    return data[:keep] + bytearray(rng.randbytes(rng.randrange(256)))


OPS = [op_field, op_field, op_field, op_bitflip, op_byte, op_truncate, op_insert, op_delete, op_splice,
       op_random_tail]


def random_file(rng: random.Random) -> bytes:
    """Pure noise, or noise behind a valid magic and version."""
    noise = rng.randbytes(rng.choice([0, 1, 3, 4, 8, 24, 100, 1000]))
    if rng.random() < 0.5:
        return noise
    return b"GGUF" + struct.pack("<I", rng.choice([2, 3])) + noise


# --- the property -----------------------------------------------------------------------------------------------

class PropertyViolation(AssertionError):
    pass


def check_bytes(data: bytes, path: Path, *, max_seconds: float = 2.0, trace_memory: bool = True) -> str:
    """Write `data` to `path` and read its header. Returns "ok" or "error: <message>"; raises PropertyViolation
    for anything but a header or a one-line ModelLoadError (another exception, too slow, too much memory)."""
    from mlxchat.core.errors import ModelLoadError
    from mlxchat.core.model.gguf import read_header

    path.write_bytes(data)
    if trace_memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        header = read_header(path)
        outcome = "ok"
    except ModelLoadError as e:
        message = str(e)
        if "\n" in message or str(path) not in message:
            raise PropertyViolation(f"error is not one line naming the file: {message!r}") from None
        outcome = "error: " + e.problem
    except BaseException as e:  # noqa: BLE001 - that is what is being looked for
        raise PropertyViolation(f"{type(e).__name__} escaped read_header: {e}"[:500]) from e
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
        if trace_memory:
            tracemalloc.stop()
    if elapsed > max_seconds:
        raise PropertyViolation(f"read_header took {elapsed:.1f} s on {len(data)} bytes")
    if peak > 8 * 2**20 + 16 * len(data):
        raise PropertyViolation(f"read_header allocated {peak / 2**20:.1f} MiB for {len(data)} bytes")
    if outcome == "ok":
        for t in header.tensors:
            if t.nbytes < 0 or t.offset < 0:
                raise PropertyViolation(f"tensor {t.name!r} has a negative size or offset")
        if not all(isinstance(k, str) for k in header.metadata):
            raise PropertyViolation("a metadata key is not a string")
    return outcome


def summarize(outcome: str) -> str:
    """An outcome's class: "ok", or the error message with its numbers taken out."""
    import re

    if outcome == "ok":
        return "ok"
    text = re.sub(r"'[^']*'", "'…'", outcome.removeprefix("error: "))
    return re.sub(r"\d+", "N", text)


# --- loading passing files with the real loader, in a child process ---------------------------------------------

CHILD = r"""
import sys, traceback
import mlxchat.core
from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.model import loader
from mlxchat.core.errors import ModelLoadError, MlxChatError
for path in sys.argv[1:]:
    print("START", path, flush=True)
    try:
        with Engine.load(path) as e:
            r = e.generate("hi", profile=SamplingProfile(temperature=0), max_tokens=3)
        print("LOADED", path, r.finish_reason, flush=True)
    except ModelLoadError as e:
        print("MODELLOADERROR", path, str(e).replace("\n", " | "), flush=True)
    except MlxChatError as e:
        print("OTHERERROR", path, type(e).__name__, str(e).replace("\n", " | "), flush=True)
    except BaseException as e:
        print("UNEXPECTED", path, type(e).__name__, str(e).replace("\n", " | ")[:300], flush=True)
# Skip interpreter finalization: an engine thread ending while it runs can abort the process (a known engine
# bug with its own test in tests/test_reliability.py), which would hide what is tested here.
import os
os._exit(0)
"""


def _children(code: str, paths: list[Path], *, per_file: float, total: float) -> dict[str, str]:
    """Run `code` over `paths` in a child process that prints "START path" then "<KIND> path <detail>" for each.
    When a child dies (a signal, an abort) or hangs on a file (over `per_file` seconds), that file is marked
    "CRASHED rc=..." or "HUNG" and a fresh child goes on with the next one."""
    import queue
    import threading

    outcomes: dict[str, str] = {}
    todo = [str(p) for p in paths]
    deadline = time.monotonic() + total
    while todo and time.monotonic() < deadline:
        proc = subprocess.Popen([sys.executable, "-c", code, *todo], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: ([lines.put(x) for x in proc.stdout], lines.put(None)), daemon=True).start()
        current = None
        hung = False
        while True:
            try:
                line = lines.get(timeout=max(0.1, min(per_file, deadline - time.monotonic())))
            except queue.Empty:
                hung = True
                proc.kill()
                break
            if line is None:
                break
            kind, _, rest = line.rstrip("\n").partition(" ")
            path, _, detail = rest.partition(" ")
            if kind == "START":
                current = path
            elif path == current:
                outcomes[path] = f"{kind} {detail}"
                current = None
        rc = proc.wait()
        stderr = proc.stderr.read().strip().splitlines()
        if current is None and rc == 0 and not hung:
            break
        if current is None:  # died between files: blame the next one
            current = next((t for t in todo if t not in outcomes), todo[-1])
        outcomes[current] = "HUNG" if hung else f"CRASHED rc={rc} {stderr[-1:]!r}"
        todo = todo[todo.index(current) + 1:]
    return outcomes


def load_in_child(paths: list[Path], timeout: float = 300, per_file: float = 60) -> dict[str, str]:
    """Load and run each file with the engine in a child process. Per path: "LOADED ...", "MODELLOADERROR ...",
    "OTHERERROR ...", "UNEXPECTED ..." (an exception that is no MlxChatError), "CRASHED rc=..." or "HUNG"."""
    return _children(CHILD, paths, per_file=per_file, total=timeout)


MX_CHILD = r"""
import sys
import mlxchat.core
import mlx.core as mx
for path in sys.argv[1:]:
    print("START", path, flush=True)
    try:
        arrays = mx.load(path)
        mx.eval(list(arrays.values()))
        print("LOADED", path, len(arrays), flush=True)
    except (RuntimeError, ValueError) as e:
        print("MXERROR", path, type(e).__name__, str(e).replace("\n", " ")[:200], flush=True)
import os
os._exit(0)
"""


def mx_load_in_children(paths: list[Path], timeout: float = 300) -> dict[str, str]:
    """`mx.load` each file (that passed read_header and check_loadable) in a child process. Per path: "LOADED n",
    "MXERROR ..." (a Python exception, which the loader reports as ModelLoadError), "CRASHED rc=..." or "HUNG"."""
    return _children(MX_CHILD, paths, per_file=30, total=timeout)


def loadable_mutants(rng: random.Random, folder: Path, n: int, max_tries: int = 100_000) -> list[Path]:
    """Mutated loadable seeds that pass read_header and check_loadable: what reaches `mx.load`."""
    from mlxchat.core.errors import ModelLoadError
    from mlxchat.core.model.gguf import check_loadable, read_header

    base, fields = seed_file(loadable=True)
    out: list[Path] = []
    for i in range(max_tries):
        if len(out) >= n:
            break
        p = folder / f"mx-{len(out)}.gguf"
        p.write_bytes(mutate(rng, base, fields))
        try:
            check_loadable(read_header(p))
        except ModelLoadError:
            continue
        out.append(p)
    return out


def tiny_model_mutants(rng: random.Random, folder: Path, n: int) -> list[Path]:
    """Copies of small real llama GGUFs with noise written into the tensor data, and a few with hyper-parameters
    changed in place, that all pass read_header. Two bases take turns: an F16 model (tests/model_files.py) and one
    holding every quantized type mlxchat reads, K-quants included (tests/quant_models.py), whose noise lands in
    block scales as well as codes."""
    from mlxchat.core.model.gguf import read_header
    from tests.model_files import tiny_llama_gguf
    from tests.quant_models import MIXED, quantized_llama

    bases = [tiny_llama_gguf(folder / "tiny.gguf"), quantized_llama(folder / "tiny-kquants.gguf", MIXED)]
    out = []
    for i in range(n):
        base = bases[(i // 2) % len(bases)]
        header = read_header(base)
        d = bytearray(base.read_bytes())
        if i % 2 == 0:  # noise over a tensor's bytes: NaN, inf or garbage weights
            t = rng.choice(header.tensors)
            start = header.data_start + t.offset
            for _ in range(rng.choice([1, 16, 1024])):
                d[start + rng.randrange(t.nbytes)] = rng.getrandbits(8)
            if rng.random() < 0.5:  # a whole tensor of 0xff (F16 NaN)
                d[start:start + t.nbytes] = b"\xff" * t.nbytes
        else:  # an integer hyper-parameter set to an odd value
            key = rng.choice(["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                              "llama.attention.head_count", "llama.attention.head_count_kv",
                              "llama.context_length", "llama.vocab_size"])
            raw = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", U32)
            at = d.index(raw) + len(raw)
            struct.pack_into("<I", d, at, rng.choice([0, 1, 3, 1000, 2**31, 2**32 - 1]))
        p = folder / f"mutant-{i}.gguf"
        p.write_bytes(bytes(d))
        read_header(p)  # they must pass the header check, or they test nothing new
        out.append(p)
    return out


# --- the standalone run -----------------------------------------------------------------------------------------

def run(iterations: int, seed: int, *, trace_memory: bool = True, verbose: bool = False) -> int:
    rng = random.Random(seed)
    base, fields = seed_file()
    counts: collections.Counter[str] = collections.Counter()
    failures = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        for i in range(iterations):
            data = random_file(rng) if rng.random() < 0.1 else mutate(rng, base, fields)
            try:
                counts[summarize(check_bytes(data, path, trace_memory=trace_memory))] += 1
            except PropertyViolation as e:
                failures.append((i, str(e), data))
                (Path(tmp).parent / f"gguf-fuzz-failure-{seed}-{i}.bin").write_bytes(data)
                if verbose:
                    print(f"case {i}: {e}")
    elapsed = time.perf_counter() - t0
    print(f"{iterations} cases in {elapsed:.1f} s (seed {seed}): {counts['ok']} parsed, "
          f"{iterations - counts['ok'] - len(failures)} ModelLoadError, {len(failures)} property violations")
    print(f"{len(counts) - ('ok' in counts)} distinct error messages; the most common:")
    for message, n in counts.most_common(25):
        if message != "ok":
            print(f"  {n:6d}  {message}")
    for i, message, _ in failures[:10]:
        print(f"VIOLATION case {i}: {message}")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", "-n", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--no-trace-memory", action="store_true", help="faster; skips the allocation check")
    ap.add_argument("--mx-load", type=int, default=0, metavar="N",
                    help="also mx.load N mutated files that pass the header checks, in child processes")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="also load N mutated copies of a tiny real model with the engine, in a child process")
    ap.add_argument("--verbose", "-v", action="store_true")
    args = ap.parse_args()
    rc = run(args.iterations, args.seed, trace_memory=not args.no_trace_memory, verbose=args.verbose)
    if args.mx_load:
        with tempfile.TemporaryDirectory() as tmp:
            paths = loadable_mutants(random.Random(args.seed), Path(tmp), args.mx_load)
            t0 = time.perf_counter()
            outcomes = mx_load_in_children(paths, timeout=600)
            kinds = collections.Counter(o.split()[0] for o in outcomes.values())
            print(f"mx.load on {len(paths)} mutants that pass read_header + check_loadable: {dict(kinds)} "
                  f"in {time.perf_counter() - t0:.1f} s")
            for p, o in outcomes.items():
                if o.startswith("CRASHED"):
                    keep = ROOT / "build" / "fuzz" / Path(p).name
                    keep.parent.mkdir(parents=True, exist_ok=True)
                    keep.write_bytes(Path(p).read_bytes())
                    print(f"  {o}: kept as {keep}")
                    rc = 1
    if args.load:
        with tempfile.TemporaryDirectory() as tmp:
            paths = tiny_model_mutants(random.Random(args.seed), Path(tmp), args.load)
            outcomes = load_in_child(paths, timeout=120 + 60 * args.load)
            kinds = collections.Counter(o.split()[0] for o in outcomes.values())
            print(f"loader on {len(paths)} mutated real models: {dict(kinds)}")
            for p, o in outcomes.items():
                if not o.startswith(("LOADED", "MODELLOADERROR")):
                    print(f"  {Path(p).name}: {o}")
                    rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
