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
# The optimized BLAS MLX did not get because it was imported before mlxchat (`late_notice` says so once).
missed: str | None = None
_noticed = False


def _venv_candidates() -> list[str]:
    # PyPI's `mkl` wheel puts libmkl_rt into the environment's lib/ folder, outside ldconfig's view.
    return sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))


def _first_loadable(choice: str) -> str | None:
    for name in ([choice] if choice else [*_CANDIDATES, *_venv_candidates()]):
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return name
    return None


def preload() -> str | None:
    """Load the first optimized BLAS found; return its name, or None when only the reference is there."""
    global loaded, missed
    if loaded is not None or not sys.platform.startswith("linux"):
        return loaded
    choice = os.environ.get("MLXCHAT_BLAS", "")
    if choice.lower() == "none":
        return None
    if "mlx.core" in sys.modules:
        # Too late: MLX has bound its BLAS symbols (loading one now was measured to change nothing: a 512x576x1536
        # GEMM stayed at ~160 ms). Found here, it is what to preload at start instead, unless the process was
        # started with one (LD_PRELOAD: 3 ms).
        if not any(key in os.environ.get("LD_PRELOAD", "") for key in ("blas", "mkl")):
            missed = _first_loadable(choice)
        return None
    loaded = _first_loadable(choice)
    return loaded


def late_notice() -> str | None:
    """Once per process, where MLX was imported before mlxchat and an optimized BLAS was there to load: one line
    saying so and what to do (None otherwise)."""
    global _noticed
    if missed is None or _noticed:
        return None
    _noticed = True
    return ("mlxchat: MLX was imported before mlxchat, so it keeps its reference BLAS and long prompts prefill "
            f"several times slower: import mlxchat before mlx, or start Python with LD_PRELOAD={missed}")
