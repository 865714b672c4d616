"""Giving the C heap's free memory back to the system while a model loads.

glibc raises its mmap threshold each time a large block is freed, so big temporaries (a load's tensors converted
through NumPy, a layer's weights repacked) then come from the heap and stay in the process once freed: a 1.1B model's
load peaked at 2x the file in RSS for that alone. Trimming after each tensor and layer keeps the peak near the
model's size. Fixing the threshold instead (mallopt) would make every later large allocation a fresh mapping: decode at
2k tokens of context ran at half speed that way (the KV cache's copies are over 1 MB a layer).
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc's; another C library has none and keeps its own policy
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()


def give_back_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim); nothing elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while (left off if it was). A load makes ~100k tuples, dicts and
    modules (a vocabulary's, the model's), which ran the collector again and again, each time over every tracked
    object of the process (~300k after the imports): 0.045 s of the embedded model's tokenizer build, and a full
    collection of 0.032 s in the middle of swapping its layers. They form no cycles; refcounting frees them."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
