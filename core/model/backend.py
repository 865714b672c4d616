"""The machine the engine computes on, described once, and the decisions taken from that description.

On Apple silicon MLX computes on the GPU (Metal) in unified memory; on Linux it runs its CPU backend. The practices
mlx-lm follows on a GPU (``mlx_lm/generate.py``) are decided here as pure functions of a ``Backend`` value, so they
are tested with described backends on any machine, without a mock of MLX:

* a wired-memory limit raised to the recommended working set while generating, with a warning when the model is
  close to it (mlx-lm's ``wired_limit`` does the raising; the engine calls it only where ``wants_wired_limit``);
* a dedicated generation stream for the decode loop on a GPU, so the async pipeline does not queue behind other
  work on the default stream (on the CPU backend there is one stream worth having);
* when to free MLX's buffer cache (``mx.clear_cache()``): after a long prefill and when a conversation closes;
* a quantized KV cache (``kv_bits``/``kv_group_size``, mlx-lm's ``QuantizedKVCache``) refused, with a reason, where
  it cannot work (with the rotating window, which mlx-lm does not combine with it).

``Backend.current()`` is the only function here that asks MLX anything.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

import mlx.core as mx

KV_BITS = (2, 3, 4, 6, 8)  # what mx.quantize supports
KV_GROUP_SIZES = (32, 64, 128)
# mlx-lm warns when a model takes more than this share of the recommended working set.
WIRED_WARNING_SHARE = 0.9
# A prefill of at least this many tokens leaves large temporary buffers in MLX's cache: free them afterwards.
CLEAR_CACHE_AFTER_PREFILL = 2048


@dataclass(frozen=True)
class Backend:
    """Where MLX computes: the device kind, its name, and the memory facts ``mx.device_info()`` reports."""

    device: Literal["cpu", "gpu"]
    name: str
    memory_bytes: int | None = None  # total memory the device can address (unified memory on Apple silicon)
    recommended_working_set: int | None = None  # Metal's max recommended working set; None on the CPU backend

    @classmethod
    def current(cls) -> Backend:
        info = mx.device_info()
        gpu = mx.default_device().type == mx.gpu
        name = str(info.get("device_name") or info.get("architecture") or ("gpu" if gpu else "cpu"))
        memory = info.get("memory_size") or _physical_memory()
        working_set = info.get("max_recommended_working_set_size")
        return cls("gpu" if gpu else "cpu", name, int(memory) if memory else None,
                   int(working_set) if working_set else None)

    @property
    def gpu(self) -> bool:
        return self.device == "gpu"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line for --stats, the TUI's model line and the bench: ``gpu · Apple M2 Max · 64 GiB``."""
        parts = [self.device, self.name]
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / 2**30:.0f} GiB")
        return " · ".join(parts)


def _physical_memory() -> int | None:
    """The machine's RAM, which is what the CPU backend computes in (its device_info does not report it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def wants_wired_limit(backend: Backend) -> bool:
    """Raise the wired limit while generating only where the device reports a recommended working set (Metal)."""
    return backend.gpu and backend.recommended_working_set is not None


def memory_warning(backend: Backend, model_bytes: int) -> str | None:
    """A one-line warning when the weights alone come close to what the GPU can keep resident (mlx-lm's rule)."""
    limit = backend.recommended_working_set
    if limit is None or model_bytes <= WIRED_WARNING_SHARE * limit:
        return None
    return (f"the model takes {model_bytes / 2**20:.0f} MiB, close to the {limit / 2**20:.0f} MiB this GPU keeps "
            "resident: generation may be slow; a smaller or more quantized model fits better")


def wants_generation_stream(backend: Backend) -> bool:
    """A separate stream for decode pays off where the device runs asynchronously to the host (a GPU)."""
    return backend.gpu


def clear_cache_after_prefill(prefilled_tokens: int) -> bool:
    return prefilled_tokens >= CLEAR_CACHE_AFTER_PREFILL


@dataclass(frozen=True)
class KVOptions:
    """How a conversation's KV cache stores keys and values. ``bits=None`` keeps them in the model's dtype."""

    bits: int | None = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None


def kv_options(bits: int | None, group_size: int = 64, *, rotating: bool = False) -> KVOptions:
    """Validated KV-cache options; a combination that cannot work is a ValueError that says why."""
    if bits is None:
        return KVOptions(None, group_size)
    if bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {group_size}")
    if rotating:
        raise ValueError("a quantized KV cache (kv_bits) cannot be combined with a rotating window (kv_window / "
                         "max_kv_size): use one of them")
    return KVOptions(bits, group_size)
