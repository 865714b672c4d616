"""KV caches saved to disk, so a conversation reopened after a restart (or resent to the server) loads its prefix
instead of prefilling it again.

One file per saved prefix, in mlx-lm's prompt-cache format (`save_prompt_cache`: safetensors, the cache classes and
their meta state in the header), under ``<folder>/<fingerprint>/``. The fingerprint names the model file (its path,
size and a hash of its first MiB, where GGUF and safetensors keep their headers), the weight path that computes with
it, the device and the MLX version, and the KV options (quantized bits and group size): keys and values computed
any other way are never loaded. Each file's header also holds the fingerprint and the exact token ids it holds, so
the folder is its own index: `KVStore` reads the headers (a few KiB each) once and matches a prompt against them,
a longer conversation reusing a shorter saved prefix and a shorter one trimming a longer file.

Saving never blocks the inference thread: there the cache is cut to what it holds (views, about a millisecond), and
a writer thread of its own writes it to a temporary file, fsyncs it and renames it into place, so a crash (kill -9)
loses at most the save in progress. A file that is truncated, corrupt or unreadable is removed with one warning, and
the prompt is prefilled as if there were none. The folder is kept under a byte budget by removing the least
recently used files (each load or save touches its file). docs/architecture.md §14 has the whole picture.

Only plain and quantized caches are saved: a rotating window forgets the middle of the conversation, so its ids no
longer say what it holds (`persistable`).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from ..model.backend import KVOptions
from ..model.loader import LoadedModel
from .kv_cache import reusable

log = logging.getLogger(__name__)

FORMAT = "mlxchat-kv-1"
DEFAULT_BUDGET_MB = 4096
SUFFIX = ".safetensors"
HEADER_BYTES = 1 << 20  # of each model file hashed into the fingerprint: a GGUF's or safetensors' header
SAVEABLE = (KVCache, QuantizedKVCache)
EXIT_WAIT_S = 10.0  # how long interpreter exit waits for the queued writes (then for the one being written)


def fingerprint(model: LoadedModel, kv: KVOptions) -> str:
    """What keys and values depend on besides the token ids, hashed: the model's files, the weight path, the device,
    MLX's version and the KV options."""
    h = hashlib.sha256(FORMAT.encode())
    source = Path(model.source)
    files = sorted(p for p in source.iterdir() if p.suffix in (".json", ".safetensors", ".gguf")) \
        if source.is_dir() else [source] if source.exists() else []
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(HEADER_BYTES))
    # "native q4/q8 (avx512-vnni fixed24)": the policy and the kernel, not the thread count (the math is the same).
    path = re.sub(r", \d+ threads?\)", ")", model.weights_path)
    h.update(f"|{model.source}|{path}|{mx.default_device()}|{mx.__version__}|{kv.bits}|{kv.group_size}".encode())
    return h.hexdigest()[:24]


def persistable(layers: list) -> bool:
    """Whether these caches can be saved and trimmed back: plain or quantized ones, not a rotating window."""
    return bool(layers) and all(type(c) in SAVEABLE for c in layers)


@dataclass
class _Entry:
    path: Path
    ids: tuple[int, ...]
    size: int


def _header(path: Path) -> dict:
    """A safetensors file's JSON header, checked against the file's size (a truncated file fails here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, 100 * 2**20):
            raise ValueError("header length past the end of the file")
        header = json.loads(f.read(n))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{size} bytes, the header describes {8 + n + end}")
    return header


class KVStore:
    """The saved KV caches of one model and KV setting, in `folder` (shared with other models' subfolders, and
    bounded as a whole by `budget_bytes`). Call `load`/`snapshot` on the inference thread; `save` queues the write."""

    def __init__(self, folder: str | Path, model: LoadedModel, kv: KVOptions = KVOptions(),
                 budget_bytes: int = DEFAULT_BUDGET_MB * 2**20) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the KV cache budget must be at least 0 MB, got {budget_bytes / 2**20:g}")
        self.root = Path(folder).expanduser()
        self.fingerprint = fingerprint(model, kv)
        self.folder = self.root / self.fingerprint
        self.budget = budget_bytes
        self.num_layers = model.num_layers
        self._lock = threading.Lock()  # guards `_entries` between the inference thread and the writer
        self._entries: dict[Path, _Entry] = {}
        self._listed = -1  # the folder's mtime when it was last read: another process may save into it too
        self.folder.mkdir(parents=True, exist_ok=True)
        self._refresh()
        self._writer = _Writer.shared()

    def _refresh(self) -> None:
        """Index the files saved since the folder was last read (by this process or another), forget the removed
        ones, and remove the temporary files of saves whose process died (kill -9 mid-save)."""
        try:
            listed = self.folder.stat().st_mtime_ns
        except OSError:
            return
        if listed == self._listed:
            return
        self._listed = listed
        present = set()
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.startswith("."):
                _remove_if_orphaned(path)
                continue
            present.add(path)
            with self._lock:
                known = path in self._entries
            if not known:
                self._index(path)
        with self._lock:
            for gone in set(self._entries) - present:
                del self._entries[gone]

    def _index(self, path: Path) -> None:
        try:
            meta = _header(path).get("__metadata__", {})
            if meta.get("0.format") != FORMAT or meta.get("0.fingerprint") != self.fingerprint:
                raise ValueError("written for another model, weight path or KV setting")
            ids = tuple(int(x) for x in meta["0.ids"].split(",")) if meta.get("0.ids") else ()
            if not ids:
                raise ValueError("no token ids")
        except FileNotFoundError:
            return  # removed meanwhile (another process evicted it)
        except (OSError, ValueError, KeyError, json.JSONDecodeError, struct.error) as e:
            self._discard(path, e)
            return
        with self._lock:
            self._entries[path] = _Entry(path, ids, path.stat().st_size)

    def _discard(self, path: Path, why: object) -> None:
        log.warning("kv cache: ignoring and removing %s (%s)", path, why)
        with self._lock:
            self._entries.pop(path, None)
        path.unlink(missing_ok=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def best(self, prompt: Sequence[int]) -> tuple[_Entry | None, int]:
        """The saved file sharing the longest prefix with `prompt` (at most all but its last id, which must run for
        the logits), and that length."""
        self._refresh()
        with self._lock:
            entries = list(self._entries.values())
        best, length = None, 0
        for e in entries:
            n = reusable(e.ids, prompt)
            if n > length:
                best, length = e, n
        return best, length

    def load(self, prompt: Sequence[int], longer_than: int = 0) -> tuple[list, int] | None:
        """On the inference thread: the caches of the longest saved prefix of `prompt`, trimmed to it, and its
        length; None when none is longer than `longer_than` ids (what a cache in memory holds already). A file that
        cannot be read is removed (one warning)."""
        entry, length = self.best(prompt)
        if entry is None or length <= longer_than:
            return None
        try:
            _header(entry.path)  # truncated since it was indexed?
            layers = load_prompt_cache(str(entry.path))
            if len(layers) != self.num_layers or not persistable(layers) or \
                    any(c.offset != len(entry.ids) for c in layers):
                raise ValueError("its caches do not match the model or its token ids")
            mx.eval([c.state for c in layers])
        except FileNotFoundError:  # evicted meanwhile (by another store on this folder, or another process)
            with self._lock:
                self._entries.pop(entry.path, None)
            return None
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, the prompt is prefilled instead
            self._discard(entry.path, e)
            return None
        for c in layers:
            c.trim(len(entry.ids) - length)
        _touch(entry.path)
        return layers, length

    def snapshot(self, ids: Sequence[int], layers: list) -> list | None:
        """On the inference thread: `layers` cut to exactly `ids`, evaluated, that the writer can save while the
        conversation goes on (None when there is nothing worth saving)."""
        if not ids or not persistable(layers) or any(c.offset != len(ids) for c in layers):
            return None
        n = len(ids)
        with self._lock:
            if any(e.ids[:n] == tuple(ids) for e in self._entries.values()):
                return None  # a saved file holds it already (e.g. a conversation loaded and not taken further)
        # The caches' buffers grow in steps of 256 positions: save what they hold. The cut is a view of them; a turn
        # that writes into a buffer while the writer still holds its view writes to a copy (MLX never writes in
        # place into a buffer another array shares), so the file holds the ids it names.
        copy = [type(c).from_state(_cut(c.state, n)) for c in layers]
        mx.eval([c.state for c in copy])
        return copy

    def save(self, ids: Sequence[int], layers: list) -> None:
        """Queue `snapshot(ids, layers)` to be written in the background; saved prefixes of it are then removed."""
        copy = self.snapshot(ids, layers)
        if copy is not None:
            self._writer.put(lambda: self._write(tuple(ids), copy))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until the saves queued so far are written (the bench and tests read the folder afterwards)."""
        done = threading.Event()
        self._writer.put(done.set)
        done.wait(timeout)

    def _write(self, ids: tuple[int, ...], layers: list) -> None:
        """On the writer thread: write to a temporary file, fsync it, rename it into place, then drop the files this
        one supersedes and keep the folder under its budget."""
        name = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
        path = self.folder / f"{name}{SUFFIX}"
        tmp = self.folder / f".{name}.{os.getpid()}.tmp{SUFFIX}"
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "ids": ",".join(map(str, ids))}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_prompt_cache(str(tmp), layers, meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kv cache: could not save %d tokens to %s (%s)", len(ids), self.folder, e)
            tmp.unlink(missing_ok=True)
            return
        entry = _Entry(path, ids, path.stat().st_size)
        with self._lock:
            self._entries[path] = entry
            # A saved prefix of this conversation is superseded: this file can be trimmed to it.
            stale = [e for e in self._entries.values() if e is not entry and entry.ids[:len(e.ids)] == e.ids]
            for e in stale:
                del self._entries[e.path]
        for e in stale:
            e.path.unlink(missing_ok=True)
        self._evict()

    def _evict(self) -> None:
        """Remove the least recently used files of the whole store folder (every model's) until it fits the budget."""
        files = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget:
                break
            log.info("kv cache: evicted %s (%.1f MB) to stay under %.0f MB", path.name, size / 2**20,
                     self.budget / 2**20)
            with self._lock:
                self._entries.pop(path, None)
            path.unlink(missing_ok=True)
            total -= size


def _cut(state: object, n: int) -> object:
    """A cache state (KVCache's or QuantizedKVCache's) with its arrays cut to the first `n` positions."""
    if isinstance(state, (tuple, list)):
        return type(state)(_cut(x, n) for x in state)
    return state[..., :n, :] if isinstance(state, mx.array) else state


def _remove_if_orphaned(tmp: Path) -> None:
    """Remove a temporary file (``.<name>.<pid>.tmp.safetensors``) whose writing process is gone."""
    try:
        pid = int(tmp.name.split(".")[2])
        os.kill(pid, 0)
    except ProcessLookupError:
        tmp.unlink(missing_ok=True)
    except (ValueError, IndexError, OSError):
        pass


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # the LRU order is the files' mtimes
    except OSError:
        pass


class _Writer:
    """One background thread for every store's writes, in order. Like the inference thread it never exits (a
    thread that ran MLX must not end before the interpreter: core/decode/worker.py). At interpreter exit the queued
    writes get EXIT_WAIT_S to finish (a chat's last reply is often the last one queued); then the one being written is
    finished and the rest are dropped, so the thread is not inside MLX when the interpreter finalises."""

    _shared: "_Writer | None" = None
    _made = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._closing = False
        threading.Thread(target=self._run, name="mlxchat-kv-writer", daemon=True).start()
        atexit.register(self._halt)

    @classmethod
    def shared(cls) -> "_Writer":
        with cls._made:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def put(self, job: Callable[[], None]) -> None:
        with self._done:
            if self._closing:
                return
            self._pending += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if not self._closing:
                    job()
            except Exception:  # noqa: BLE001 - a failed save must not stop the later ones
                log.exception("kv cache: a save failed")
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _halt(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self._pending == 0, EXIT_WAIT_S)
            self._closing = True
            self._done.wait_for(lambda: self._pending == 0, EXIT_WAIT_S)
