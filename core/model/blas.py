"""Load an optimized BLAS for MLX's CPU backend before MLX initialises.

The Linux `mlx-cpu` wheel links a reference BLAS (about 1 GFLOP/s here). Loading a real one with
RTLD_GLOBAL before `import mlx` makes the dynamic linker resolve `cblas_sgemm` and friends to it:
prompt GEMMs ran 44x faster with Debian's OpenBLAS. macOS MLX uses Accelerate/Metal, so nothing is
done there. Set MLXCHAT_BLAS to a library path to choose one, or to "none" to keep the reference.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CANDIDATES = (
    "libopenblas.so.0",  # Debian/Ubuntu libopenblas0-pthread, found through ldconfig
    "libopenblas.so",
    "libmkl_rt.so.2",
    "libmkl_rt.so.3",
)

loaded: str | None = None


def _venv_candidates() -> list[str]:
    # PyPI's `mkl` wheel puts libmkl_rt into the environment's lib/ folder, outside ldconfig's view.
    return sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))


def preload() -> str | None:
    """Load the first optimized BLAS found; return its name, or None when only the reference is there."""
    global loaded
    if loaded is not None or not sys.platform.startswith("linux"):
        return loaded
    if "mlx.core" in sys.modules:
        return None  # too late: MLX has already bound its BLAS symbols
    choice = os.environ.get("MLXCHAT_BLAS", "")
    if choice.lower() == "none":
        return None
    for name in ([choice] if choice else [*_CANDIDATES, *_venv_candidates()]):
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = name
        return loaded
    return None
