"""Which models the model picker (and `mlxchat models`) offers: the embedded one, local GGUF files / MLX folders
the user added, and the models already in the Hugging Face cache (found offline, loaded from their snapshot
folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxchat.core.locations import Locations


@dataclass(frozen=True)
class ModelChoice:
    spec: str | None  # what Engine.load takes; None is the embedded model
    label: str
    source: str  # "embedded" | "local" | "hf-cache"
    detail: str = ""


EMBEDDED = ModelChoice(None, "SmolLM2-135M-Instruct (embedded)", "embedded", "llama · Q4_1 GGUF shipped with mlxchat")


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
    """The picker's local models; each detail says what the file holds ("llama · Q4_K_M: Q4_K 25, ...") and where it
    is, or why it cannot load."""
    out = []
    for path, label in paths:
        model = _local(path, Path(path).expanduser())
        facts = " · ".join(x for x in (model.architecture, model.quantization) if x)
        detail = f"{facts} · {path}" if facts else path
        out.append(ModelChoice(str(Path(path).expanduser()), label, "local",
                               f"cannot load: {model.problem}" if model.problem else detail))
    return out


def hf_cache_choices(cache_dir: str | Path | None = None) -> list[ModelChoice]:
    """Model repos in the Hugging Face cache that mlxchat can load (a config and safetensors weights)."""
    from mlxchat.core.model.hub import HubError, cached_models

    from .formatting import fmt_bytes

    try:
        models = cached_models(cache_dir)
    except HubError:  # an unreadable cache: nothing to offer from it
        return []
    return [ModelChoice(str(m.snapshot), m.repo_id, "hf-cache", f"{fmt_bytes(m.size_bytes)} · {m.revision[:8]}")
            for m in models if m.loadable]


@dataclass(frozen=True)
class LocalModel:
    """A model on this machine outside the Hugging Face cache, as `mlxchat models` lists it."""

    name: str  # what --model takes (a path), or the embedded model's label
    size_bytes: int
    last_used: float | None  # the newest access time of its files
    loadable: bool
    architecture: str = ""
    quantization: str = ""  # "Q4_K_M: Q4_K 25, Q6_K 5, F32 9", "MLX 4-bit (group 64)"
    problem: str | None = None  # why it cannot load, when the file says so


def saved_models(locations: Locations) -> tuple[list[tuple[str, str]], list[str]]:
    """F3's local models as (path, label), those the app remembered and config.toml's `models`, and a line for each
    place that could not be read. The database is read only if it exists: a listing must not create it."""
    from .config import ConfigError, Settings
    from .store import Store, StoreError

    saved: list[tuple[str, str]] = []
    problems: list[str] = []
    if locations.database.exists():
        try:
            store = Store(locations.database)
        except StoreError as e:
            problems.append(str(e))
        else:
            try:
                saved += store.models()
            finally:
                store.close()
    try:
        saved += [(p, Path(p).name) for p in Settings.load(locations.config_file).models]
    except ConfigError as e:
        problems.append(str(e))
    unique: dict[str, str] = {}
    for path, label in saved:  # a path in both places is listed once, where it first comes
        unique.setdefault(str(Path(path).expanduser()), label)
    return list(unique.items()), problems


def local_models(saved: list[tuple[str, str]]) -> list[LocalModel]:
    """The embedded model and the `saved` paths: F3's list without the Hugging Face cache."""
    from mlxchat.core.errors import ModelLoadError
    from mlxchat.core.model.loader import embedded_model_path

    try:
        embedded = [_local(EMBEDDED.label, embedded_model_path())]
    except ModelLoadError:  # the package that ships it is not installed
        embedded = [LocalModel(EMBEDDED.label, 0, None, False)]
    return embedded + [_local(path, Path(path)) for path, _ in saved]


def _local(name: str, path: Path) -> LocalModel:
    """A model on disk with what its header or config.json says of it."""
    problem = check_local(str(path))
    if problem is not None:
        return LocalModel(name, *_on_disk(path), False, problem=problem)
    from mlxchat.core.model.loader import inspect

    facts = inspect(path)
    return LocalModel(name, *_on_disk(path), facts.problem is None, facts.architecture, facts.quantization,
                      facts.problem)


def _on_disk(path: Path) -> tuple[int, float | None]:
    """Bytes of a file or a folder's files, and their newest access time (0 and None for what cannot be read)."""
    try:
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        stats = [f.stat() for f in files]
    except OSError:
        return 0, None
    return sum(s.st_size for s in stats), max((s.st_atime for s in stats), default=None)
