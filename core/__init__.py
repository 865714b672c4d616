"""mlxchat's engine: model loading, prefill/decode with KV caches, sampling, streaming and metrics.

The optimized BLAS must be loaded before anything imports MLX, so it happens first, here.
"""

from . import blas

blas.preload()

from .engine import ChatSession, Engine, Stream  # noqa: E402
from .errors import ContextLengthError, GenerationError, MlxChatError, ModelLoadError  # noqa: E402
from .events import Done, GenerationResult, Metrics, PrefillProgress, TokenEvent  # noqa: E402
from .profile import SamplingProfile  # noqa: E402
from .sampling import final_distribution  # noqa: E402

__all__ = [
    "ChatSession", "ContextLengthError", "Done", "Engine", "GenerationError", "GenerationResult", "Metrics",
    "MlxChatError", "ModelLoadError", "PrefillProgress", "SamplingProfile", "Stream", "TokenEvent",
    "final_distribution",
]
