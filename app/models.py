"""Which models the model picker offers: the embedded one, local GGUF files / MLX folders the user added, and the
models already in the Hugging Face cache (found offline, loaded from their snapshot folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelChoice:
    spec: str | None  # what Engine.load takes; None is the embedded model
    label: str
    source: str  # "embedded" | "local" | "hf-cache"
    detail: str = ""


EMBEDDED = ModelChoice(None, "SmolLM2-135M-Instruct (embedded)", "embedded", "Q4_1 GGUF shipped with mlxchat")


@dataclass(frozen=True)
class ModelPick:
    """What the model picker returns: the choice, and whether it is the model already loaded (nothing to do)."""

    choice: ModelChoice
    already_loaded: bool = False


def check_local(path: str) -> str | None:
    """Why ``path`` cannot be a model, or None if it looks like one (a GGUF file or a folder with config.json)."""
    p = Path(path).expanduser()
    if not p.exists():
        return f"{p}: no such file or folder"
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            return f"{p}: not a .gguf file"
        try:
            with p.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            return f"{p}: cannot read it ({e.strerror})"
        if magic != b"GGUF":
            return f"{p}: not a GGUF file (it does not start with GGUF)"
    if p.is_dir() and not (p / "config.json").exists():
        return f"{p}: not a model folder (no config.json)"
    return None


def to_remember(spec: str | None, cache_dir: str | Path | None = None) -> tuple[str, str] | None:
    """The (path, label) to add to the picker's local models once ``spec`` has loaded, or None: the embedded model,
    a repo id and a snapshot in the Hugging Face cache are listed without it."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        return None  # a repo id
    from huggingface_hub import constants

    cache = Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve()
    resolved = path.resolve()
    if resolved.is_relative_to(cache):
        return None
    return str(resolved), resolved.name


def local_choices(paths: list[tuple[str, str]]) -> list[ModelChoice]:
    out = []
    for path, label in paths:
        problem = check_local(path)
        out.append(ModelChoice(str(Path(path).expanduser()), label, "local", problem or path))
    return out


def hf_cache_choices(cache_dir: str | Path | None = None) -> list[ModelChoice]:
    """Model repos in the Hugging Face cache that mlxchat can load (a config and safetensors weights)."""
    from mlxchat.core.hub import HubError, cached_models

    from .formatting import fmt_bytes

    try:
        models = cached_models(cache_dir)
    except HubError:  # an unreadable cache: nothing to offer from it
        return []
    return [ModelChoice(str(m.snapshot), m.repo_id, "hf-cache", f"{fmt_bytes(m.size_bytes)} · {m.revision[:8]}")
            for m in models if m.loadable]
