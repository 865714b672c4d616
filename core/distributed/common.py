"""What rank 0 and the workers share: joining the ring, free memory, memory reports, and how a worker's KV cache
mirrors rank 0's (its kind, and trimming to rank 0's offset before each forward pass)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

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


def memory_report(model: nn.Module) -> dict[str, int]:
    """This rank's weights (counted on the model: a sharded one holds slices), and MLX's active and peak memory."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return {"weight_bytes": weights, "active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()}


def model_shape(spec: str | Path | None) -> dict[str, int]:
    """Layers and attention heads of a model, from its GGUF header or config.json, without loading it."""
    from ..model import gguf, loader

    path = loader.embedded_model_path() if spec is None else Path(spec).expanduser()
    if not path.exists() and not path.suffix:
        path = loader.download(str(spec))
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        config = {**config, **config.get("text_config", {})}
        heads = int(config["num_attention_heads"])
        return {"layers": int(config["num_hidden_layers"]), "heads": heads,
                "kv_heads": int(config.get("num_key_value_heads") or heads)}
    header = gguf.read_header(path)
    m, arch = header.metadata, header.architecture
    heads = int(m[f"{arch}.attention.head_count"])
    return {"layers": int(m[f"{arch}.block_count"]), "heads": heads,
            "kv_heads": int(m.get(f"{arch}.attention.head_count_kv", heads))}


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


# --- the plan: what each rank loads and runs --------------------------------------------------------------------

PARALLEL_MODES = ("pipeline", "tensor")


@dataclass(frozen=True)
class Plan:
    """Rank 0's decision, sent to every worker as JSON: the model, its weight policy, and how it is split —
    "pipeline" (layers per rank in `split`, mlx-lm's order) or "tensor" (every layer's heads over all ranks)."""

    model: str | None
    weights: str
    parallel: str
    split: tuple[int, ...]

    def message(self) -> dict[str, Any]:
        return {"op": "plan", "model": self.model, "weights": self.weights, "parallel": self.parallel,
                "split": list(self.split)}

    @classmethod
    def of(cls, message: dict[str, Any]) -> "Plan":
        return cls(message.get("model"), message["weights"], message["parallel"],
                   tuple(int(n) for n in message["split"]))

    def describe(self, rank: int) -> str:
        if self.parallel == "tensor":
            return f"rank {rank}: 1/{len(self.split)} of every layer's heads"
        from ..model.split import Stage

        return Stage(rank, self.split).describe()

    def load(self, rank: int, group: Any) -> Any:  # noqa: ANN401 - mx.distributed.Group -> loader.LoadedModel
        """This rank's part: its stage's layers (read alone), or the whole model sharded by mlx-lm's `shard()`."""
        from ..model import native_decoder, native_linear
        from ..model.loader import load
        from ..model.split import Stage

        if self.parallel == "tensor":
            loaded = load(self.model, self.weights)  # type: ignore[arg-type]
            native_linear.use_mlx_layout(loaded.model)  # shard() slices the weights' rows and columns as MLX lays them
            loaded.model.shard(group)
            native_decoder.use_fused_layers(loaded.model)  # sharded projections: the layers' own calls again
            return loaded
        return load(self.model, self.weights, stage=Stage(rank, self.split))  # type: ignore[arg-type]

    def forward(self, model: nn.Module, inputs: mx.array, cache: list) -> mx.array:
        """A worker's part of one forward pass: evaluate it with the cache state."""
        from ..model.split import tensor_forward

        return tensor_forward(model, inputs, cache) if self.parallel == "tensor" else model.forward_stage(inputs, cache)
