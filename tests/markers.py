"""Skip markers that several test modules share."""

from __future__ import annotations

import pytest

from mlxchat.core import native

# Tests of the native ops, and snapshots of screens that show the native weight path and its numbers.
needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native extension unavailable: {native.unavailable_reason()}")
# The int8-activation matmul (weights="native-int8"): the native ops and AVX512-VNNI.
needs_int8 = pytest.mark.skipif(not native.int8_available(),
                                reason=f"int8 matmul unavailable: {native.int8_unavailable_reason()}")
