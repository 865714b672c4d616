"""Running tests again on the AVX2 kernels where wider ones run: the kernel is chosen once per process
(MLXCHAT_NATIVE_ISA is read at the first call), so the AVX2 kernels that other CPUs run are checked in a child."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_on_avx2(check: str, calls: list[str]) -> None:
    """In a process with MLXCHAT_NATIVE_ISA=avx2: the statement `check` (that the AVX2 kernel is the one chosen),
    then each of `calls` (Python statements, e.g. a test function called with its parameters)."""
    env = {**os.environ, "MLXCHAT_NATIVE_ISA": "avx2"}
    code = ";".join(["from mlxchat.core import native", check, "import mlx.core as mx", *calls])
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)
