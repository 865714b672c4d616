"""Skip markers that several test modules share."""

from __future__ import annotations

import pytest

from mlxchat.core import native

# Tests of the native ops, and snapshots of screens that show the native weight path and its numbers.
needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native extension unavailable: {native.unavailable_reason()}")
