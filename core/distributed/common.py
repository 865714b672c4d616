"""What rank 0 and the workers share: joining the ring, free memory, memory reports, and how a worker's KV cache
mirrors rank 0's (its kind, and trimming to rank 0's offset before each forward pass)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

PROTOCOL = 1  # bumped when the messages change: a worker of another mlxchat version is refused at the handshake
# Free memory within this ratio counts as equal: an even split, so two ranks of one machine get the same layers.
EVEN_WITHIN = 1.10


def join_ring(hosts_path: Path, rank: int) -> Any:  # noqa: ANN401 - mx.distributed.Group
    """MLX's ring backend, configured as `mlx.launch` would (MLX_HOSTFILE, MLX_RANK), without SSH. Blocks until
    every rank has joined: callers bound the wait (the ring has no timeout of its own)."""
    os.environ["MLX_HOSTFILE"] = str(hosts_path)
    os.environ["MLX_RANK"] = str(rank)
    return mx.distributed.init(strict=True, backend="ring")


def free_memory() -> int:
    """Bytes this machine can give a model: Metal's recommended working set less what MLX holds, else the kernel's
    MemAvailable."""
    if mx.metal.is_available():
        info = mx.device_info()
        return max(0, int(info.get("max_recommended_working_set_size", 0)) - mx.get_active_memory())
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def layer_weights(free: list[int]) -> list[float]:
    """Weights for `split_layers`: each rank's free memory, or equal when they are within EVEN_WITHIN."""
    low, high = min(free), max(free)
    return [1.0] * len(free) if low > 0 and high / low < EVEN_WITHIN else [float(f) for f in free]


def memory_report(weight_bytes: int) -> dict[str, int]:
    return {"weight_bytes": weight_bytes, "active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()}


# --- the KV cache a worker keeps for each of rank 0's ---------------------------------------------------------

def cache_spec(layers: list) -> dict[str, Any]:
    """The kind of rank 0's per-layer caches, for the worker to build the same kind for its own layers."""
    first = layers[0]
    if isinstance(first, QuantizedKVCache):
        return {"kind": "quantized", "group_size": first.group_size, "bits": first.bits}
    if isinstance(first, RotatingKVCache):
        return {"kind": "rotating", "max_size": first.max_size, "keep": first.keep}
    return {"kind": "plain"}


def make_caches(spec: dict[str, Any], model: nn.Module) -> list:
    kind = spec.get("kind")
    if kind == "quantized":
        return [QuantizedKVCache(group_size=int(spec["group_size"]), bits=int(spec["bits"])) for _ in model.layers]
    if kind == "rotating":
        return [RotatingKVCache(max_size=int(spec["max_size"]), keep=int(spec["keep"])) for _ in model.layers]
    if kind == "plain":
        return make_prompt_cache(model)
    raise ValueError(f"unknown cache kind {kind!r}")


def align(layers: list, offset: int) -> bool:
    """Bring a worker's caches to rank 0's `offset` before a forward pass (rank 0 trimmed them to reuse a prefix).
    False when they cannot be (a wrapped rotating cache): the caller starts them again, as rank 0 did."""
    current = layers[0].offset
    if current == offset:
        return True
    if current > offset and all(c.is_trimmable() for c in layers):
        for c in layers:
            c.trim(current - offset)
        return True
    return False


def is_plain(layers: list) -> bool:
    return all(type(c) is KVCache for c in layers)
