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


def check_local(path: str) -> str | None:
    """Why ``path`` cannot be a model, or None if it looks like one (a .gguf file or a folder with config.json)."""
    p = Path(path).expanduser()
    if not p.exists():
        return f"{p}: no such file or folder"
    if p.is_file() and p.suffix.lower() != ".gguf":
        return f"{p}: not a .gguf file"
    if p.is_dir() and not (p / "config.json").exists():
        return f"{p}: not a model folder (no config.json)"
    return None


def local_choices(paths: list[tuple[str, str]]) -> list[ModelChoice]:
    out = []
    for path, label in paths:
        problem = check_local(path)
        out.append(ModelChoice(str(Path(path).expanduser()), label, "local", problem or path))
    return out


def hf_cache_choices(cache_dir: str | Path | None = None) -> list[ModelChoice]:
    """Model repos in the Hugging Face cache that have a config and safetensors weights (what the loader reads)."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(cache_dir)
    except Exception:  # noqa: BLE001 - no cache, or an unreadable one: nothing to offer
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        for rev in revisions:
            snap = Path(rev.snapshot_path)
            if (snap / "config.json").exists() and any(snap.glob("*.safetensors")):
                size = repo.size_on_disk_str
                out.append(ModelChoice(str(snap), repo.repo_id, "hf-cache", f"{size} · {rev.commit_hash[:8]}"))
                break
    return out
