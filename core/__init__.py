"""mlxchat's engine: model loading, prefill/decode with KV caches, sampling, streaming and metrics.

The optimized BLAS must be loaded before anything imports MLX, so it happens first, here. The public names below are
imported when first used (PEP 562), not with the package: a module that needs no MLX (core/sampling/sampler_params.py,
which the CLI's parser reads for its flags) can be imported without the second that loading MLX takes.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .model import blas

blas.preload()

# Each public name and the module that defines it.
_EXPORTS = {
    "ChatSession": "chat.chat_session", "Engine": "engine", "Stream": "decode.worker",
    "ContextLengthError": "errors", "GenerationError": "errors", "MlxChatError": "errors", "ModelLoadError": "errors",
    "Done": "decode.events", "GenerationResult": "decode.events", "Metrics": "decode.events",
    "PrefillProgress": "decode.events", "TokenEvent": "decode.events",
    "SamplingProfile": "sampling.profile",
    "final_distribution": "sampling.chain",
}

if TYPE_CHECKING:
    from .chat.chat_session import ChatSession
    from .decode.worker import Stream
    from .engine import Engine
    from .errors import ContextLengthError, GenerationError, MlxChatError, ModelLoadError
    from .decode.events import Done, GenerationResult, Metrics, PrefillProgress, TokenEvent
    from .sampling.profile import SamplingProfile
    from .sampling.chain import final_distribution


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


__all__ = [
    "ChatSession", "ContextLengthError", "Done", "Engine", "GenerationError", "GenerationResult", "Metrics",
    "MlxChatError", "ModelLoadError", "PrefillProgress", "SamplingProfile", "Stream", "TokenEvent",
    "final_distribution",
]
