"""The layers import downward only, and app has no import circles (docs/architecture.md §1): `lint-imports` checks
pyproject.toml's contracts on the code, and catches each kind of upward import, and each circle issue 38 broke, when
one is added to a copy of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "app", "server", "lab", "bench")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # --no-cache: no cache folder is left in the working tree.
    return subprocess.run([str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_import_downward_only() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _python_files_only(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not (Path(folder, n).is_dir() and n != "__pycache__") and not n.endswith(".py")]


def _lint_with_line(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on a copy of the sources with ``line`` added to ``module``."""
    # A copy of the sources, found on PYTHONPATH before the editable install. `mlxchat` stays a namespace package
    # (no __init__.py), as installed: grimp reads each layer as a root only in a namespace.
    package = tmp_path / "mlxchat"
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, package / layer, ignore=_python_files_only)
    with (package / module).open("a") as f:
        f.write(f"\n{line}\n")
    return _lint(tmp_path, {**os.environ, "PYTHONPATH": str(tmp_path)})


@pytest.mark.parametrize(("module", "line", "caught"), [
    ("core/engine.py", "from mlxchat.app import formatting", "mlxchat.core.engine -> mlxchat.app.formatting"),
    ("core/decode/events.py", "import textual", "mlxchat.core.decode.events -> textual"),
    ("app/tool_screens.py", "import mlxchat.lab.screen", "mlxchat.app.tool_screens -> mlxchat.lab.screen"),
    ("app/formatting.py", "import mlx.core", "mlxchat.app.formatting -> mlx"),
    ("server/app.py", "from mlxchat.app import store", "mlxchat.server.app -> mlxchat.app.store"),
    ("lab/runner.py", "from mlxchat.bench import stats", "mlxchat.lab.runner -> mlxchat.bench.stats"),
])
def test_an_upward_import_is_caught(tmp_path: Path, module: str, line: str, caught: str) -> None:
    done = _lint_with_line(tmp_path, module, line)
    assert done.returncode == 1, done.stdout + done.stderr
    assert caught in done.stdout


@pytest.mark.parametrize(("module", "line", "caught"), [
    # The circles issue 38 broke: a chat screen helper typing its screen, export.py typing Turn through
    # conversation.py, the chat screen typing the app that imports it. Under TYPE_CHECKING they count all the same.
    ("app/screens/reply_feed.py", "if TYPE_CHECKING: from .chat import ChatScreen",
     "No cycles are allowed in mlxchat.app.screens."),
    ("app/screens/chat_dialogs.py", "from .chat import ChatScreen", "No cycles are allowed in mlxchat.app.screens."),
    ("app/export.py", "if TYPE_CHECKING: from .conversation import Turn", "No cycles are allowed in mlxchat.app."),
    ("app/screens/chat.py", "if TYPE_CHECKING: from ..app import MlxChatApp", "No cycles are allowed in mlxchat.app."),
    # And the server's and the lab's: ServerConfig lives with the service, the lab's runner knows no Target.
    ("server/service.py", "if TYPE_CHECKING: from .app import create_app", "No cycles are allowed in mlxchat.server."),
    ("lab/runner.py", "if TYPE_CHECKING: from .target import Target", "No cycles are allowed in mlxchat.lab."),
])
def test_an_import_circle_is_caught(tmp_path: Path, module: str, line: str, caught: str) -> None:
    done = _lint_with_line(tmp_path, module, line)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "app, server and lab have no import circles BROKEN" in done.stdout
    assert caught in done.stdout
