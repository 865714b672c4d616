"""Shared fixtures: the real embedded model, loaded once per test run (loading costs seconds), and the helpers of
the TUI tests (an app factory on temporary folders, waiting with Pilot, sending a message and waiting for its
reply). Test modules get them as fixtures; none imports another test module."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import mlxchat.core  # noqa: F401 - loads the optimized BLAS before anything imports MLX
from mlxchat.core import Engine, SamplingProfile


@pytest.fixture(scope="session", autouse=True)
def _cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The cache folder (saved KV caches: the TUI and `mlxchat serve` use one by default) is a temporary one for the
    whole run, subprocesses included: tests never write to the user's ~/.cache."""
    previous = os.environ.get("MLXCHAT_CACHE_DIR")
    os.environ["MLXCHAT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if previous is None:
        os.environ.pop("MLXCHAT_CACHE_DIR", None)
    else:
        os.environ["MLXCHAT_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def engine() -> Engine:
    e = Engine.load()
    yield e
    e.close()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GGUF on the embedded model's real vocabulary, with a context of 256 (tests/model_files.py)."""
    from tests.model_files import tiny_llama_gguf

    return tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def thinking_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model with a Qwen3-style thinking template (tests/thinking_models.py)."""
    from tests.thinking_models import thinking_gguf

    return thinking_gguf(tmp_path_factory.mktemp("thinking") / "thinking.gguf")


@pytest.fixture(scope="session")
def thinking_engine(thinking_file: Path) -> Engine:
    """`thinking_file` loaded (one engine for every thinking test)."""
    e = Engine.load(thinking_file)
    yield e
    e.close()


@pytest.fixture()
def greedy() -> SamplingProfile:
    return SamplingProfile(temperature=0)


@pytest.fixture()
def profile_app() -> Callable[..., Any]:
    """``profile_app(store)``: a bare app that shows F2's profile picker over ``store``, the chat preset open."""
    from textual.app import App

    from mlxchat.app.screens import ProfilePicker

    class ProfileApp(App):
        CSS_PATH = "../app/app.tcss"

        def __init__(self, store: Any) -> None:
            super().__init__()
            self.store = store

        def on_mount(self) -> None:
            self.push_screen(ProfilePicker(self.store, SamplingProfile.preset("chat")))

    return ProfileApp


# --- a real server ----------------------------------------------------------------------------------------------

@pytest.fixture()
def serve() -> Iterator[Callable[..., str]]:
    """``serve(*flags)``: ``mlxchat serve`` in a subprocess on a free 127.0.0.1 port; returns its base URL (without
    ``/v1``). Every server started is stopped at the end of the test."""
    with _servers() as start:
        yield start


@pytest.fixture(scope="module")
def serve_module() -> Iterator[Callable[..., str]]:
    """``serve`` for a module whose tests share one server: stopped at the end of the module."""
    with _servers() as start:
        yield start


@contextmanager
def _servers() -> Iterator[Callable[..., str]]:
    procs: list[subprocess.Popen] = []

    def start(*flags: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "MLXCHAT_API_KEY"}
        proc = subprocess.Popen([sys.executable, "-m", "mlxchat.app.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                                 *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(proc)
        printed: list[str] = []
        for line in proc.stdout:
            printed.append(line)
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
                threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep it drained
                return m.group(1)
        raise RuntimeError(f"the server did not start: {''.join(printed)}")

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# --- the TUI ---------------------------------------------------------------------------------------------------

TUI_MAX_TOKENS = 4  # replies capped at a few tokens keep the TUI modules near a minute on two cores


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def new_app(tmp_path: Path, engine: Engine) -> Callable[..., Any]:
    """``new_app(**kw)``: the app from its factory, on this test's data and config folders, with the session's
    engine (``engine=None`` loads the model named by ``model=``), no Hugging Face cache scan, short replies."""
    from mlxchat.app.app import make_app

    def make(**kw: Any) -> Any:
        kw.setdefault("engine", engine)
        kw.setdefault("max_tokens", TUI_MAX_TOKENS)
        kw.setdefault("data_dir", tmp_path / "data")
        kw.setdefault("config_dir", tmp_path / "config")
        kw.setdefault("scan_hf_cache", False)
        return make_app(**kw)

    return make


async def _wait_for(pilot: Any, condition: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def _send(pilot: Any, text: str) -> None:
    """Type ``text`` into what has the focus and press Enter."""
    await pilot.press(*text)
    await pilot.press("enter")


async def _reply(pilot: Any, text: str, timeout: float = 60.0) -> Any:
    """Type ``text`` into the chat input, send it, and return the finished reply's GenerationResult."""
    screen = pilot.app.chat_screen
    before = screen.controller.last_result
    screen.input.focus()
    await _send(pilot, text)
    await _wait_for(pilot, lambda: screen.controller.last_result is not before and not screen.busy, timeout,
                    "the reply")
    return screen.controller.last_result


async def _ready(pilot: Any, timeout: float = 120.0) -> Any:
    """Wait until the chat screen has its engine; return the screen."""
    screen = pilot.app.chat_screen
    await _wait_for(pilot, lambda: screen.controller.session is not None, timeout, "the engine")
    return screen


@pytest.fixture()
def wait_for() -> Callable[..., Awaitable[None]]:
    """``await wait_for(pilot, condition, timeout=60, what=...)``: pause the app until ``condition()``."""
    return _wait_for


@pytest.fixture()
def send() -> Callable[..., Awaitable[None]]:
    return _send


@pytest.fixture()
def reply() -> Callable[..., Awaitable[Any]]:
    return _reply


@pytest.fixture()
def ready() -> Callable[..., Awaitable[Any]]:
    return _ready


# --- snapshots (pytest-textual-snapshot) -----------------------------------------------------------------------

@pytest.fixture
def snapshot(snapshot: Any) -> Any:
    """Keep the SVGs in tests/snapshots/<module>/ (snap_compare asks for its SVG extension; give it ours)."""
    from pytest_textual_snapshot import SVGImageExtension

    class InTestsFolder(SVGImageExtension):
        @classmethod
        def dirname(cls, *, test_location: Any) -> str:
            return str(Path(test_location.filepath).parent / "snapshots" / test_location.basename)

    class Redirect:
        def use_extension(self, _extension: Any) -> Any:
            return snapshot.use_extension(InTestsFolder)

    return Redirect()


# --- the fast tier ----------------------------------------------------------------------------------------------
# `make test-fast` (pytest -m "not model") runs what loads no model and starts no app or server: the edit-test loop.
# A test is in the model tier when it asks for a fixture that loads one, or when its module drives real processes,
# servers or apps throughout.
MODEL_FIXTURES = {"engine", "tiny", "tiny_engine", "small_context_engine", "new_app", "with_session_engine",
                  "server", "tight", "client", "sweep", "wheel", "bad_files", "serve", "serve_module",
                  "int8_engine", "thinking_file", "thinking_engine"}
MODEL_MODULES = {"test_crash_safety", "test_defects_cli", "test_packaging", "test_server", "test_server_batch",
                 "test_native", "test_lab_engine", "test_lab_tui", "test_tui", "test_app_reliability",
                 "test_distributed_load", "test_distributed_procs", "test_interrupts", "test_readme"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__.rsplit(".", 1)[-1] in \
                MODEL_MODULES:
            item.add_marker(pytest.mark.model)
