"""Models by name in the standard Hugging Face cache, as `ollama pull / list / rm` do: fetch a repo id, list what is
cached (size, last used, whether mlxchat can load it), remove a repo. No MLX here: listing and removing are file
work, and a pull fetches exactly the files `loader.load` reads for a repo id (its HUB_PATTERNS)."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MlxChatError
from .loader import HUB_PATTERNS, looks_like_repo_id


class HubError(MlxChatError):
    """A pull, listing or removal that failed; the message is one line for the user."""


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    size_bytes: int
    last_used: float  # seconds since the epoch: the newest access time of the repo's files
    snapshot: Path  # the newest revision's folder (what Engine.load reads)
    revision: str
    loadable: bool  # a config.json and safetensors weights: what mlxchat loads from a repo


def _cache_dir(cache_dir: str | Path | None) -> str | Path:
    # Read now, not at import: scan_cache_dir's own default is fixed when huggingface_hub first loads it.
    from huggingface_hub import constants

    return cache_dir or constants.HF_HUB_CACHE


def _scan(cache_dir: str | Path | None) -> Any:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(_cache_dir(cache_dir))
    except CacheNotFound:
        return None
    except OSError as e:
        raise HubError(f"cannot read the Hugging Face cache: {e.strerror or e}") from None


def cached_models(cache_dir: str | Path | None = None) -> list[CachedModel]:
    """Every model repo in the cache (default: HF_HUB_CACHE), by repo id."""
    info = _scan(cache_dir)
    out = []
    for repo in sorted(info.repos if info else [], key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        snap = Path(rev.snapshot_path)
        loadable = (snap / "config.json").is_file() and any(snap.glob("*.safetensors"))
        out.append(CachedModel(repo.repo_id, repo.size_on_disk, repo.last_accessed, snap, rev.commit_hash, loadable))
    return out


def _reporting_tqdm(progress: Callable[[int, int], None]) -> type:
    """A tqdm that draws nothing and calls `progress(done, total)` (files) instead: a full-screen app owns the
    terminal, so huggingface_hub's own bars must not write to it."""
    from tqdm import tqdm

    class Reporting(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)  # huggingface_hub's own bar takes a logger name; tqdm does not
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            progress(int(self.n), int(self.total or 0))
            return shown

    return Reporting


def pull(repo_id: str, *, cache_dir: str | Path | None = None,
         progress: Callable[[int, int], None] | None = None) -> Path:
    """Download `repo_id` (the files mlxchat loads) into the cache; return its snapshot folder. Without `progress`,
    huggingface_hub draws its progress bar on stderr; with it, `progress(files done, files)` is called instead."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError, \
        RepositoryNotFoundError

    # The hub also takes a bare NAME (its legacy models), so "something" went to the network and came back as
    # "cannot be reached"; mlxchat loads repo ids only as ORG/NAME, so say that instead.
    if not looks_like_repo_id(repo_id):
        raise _not_a_repo_id(repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, cache_dir=_cache_dir(cache_dir),
                                      tqdm_class=_reporting_tqdm(progress) if progress else None))
    except HFValidationError:
        raise _not_a_repo_id(repo_id) from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such model on the Hugging Face hub (or it is private: log in with "
                       "`hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{repo_id}: the Hugging Face hub cannot be reached (offline?); try again with a network")\
            from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"{repo_id}: download failed: {first}") from None


def _not_a_repo_id(repo_id: str) -> HubError:
    return HubError(f"{repo_id!r} is not a repo id: type ORG/NAME, e.g. "
                    "`mlxchat pull mlx-community/SmolLM2-135M-Instruct`")


def find(repo_id: str, cache_dir: str | Path | None = None) -> CachedModel | None:
    return next((m for m in cached_models(cache_dir) if m.repo_id == repo_id), None)


def remove(repo_id: str, cache_dir: str | Path | None = None) -> int:
    """Delete every cached revision of `repo_id`; return the bytes freed."""
    info = _scan(cache_dir)
    repo = next((r for r in (info.repos if info else []) if r.repo_type == "model" and r.repo_id == repo_id), None)
    if repo is None:
        raise HubError(f"{repo_id} is not in the Hugging Face cache (`mlxchat models` lists what is)")
    strategy = info.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
    try:
        strategy.execute()
    except OSError as e:
        raise HubError(f"cannot delete {repo_id}: {e.strerror or e}") from None
    return strategy.expected_freed_size
