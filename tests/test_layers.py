"""The layers import downward only, core's stages too, and core, app, server and lab have no import circles
(docs/architecture.md §1): `lint-imports` checks pyproject.toml's contracts on the code, and catches each kind of
upward import, and each circle issue 38 broke, when one is added to a copy of it."""

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
    """`lint-imports` on a copy of the sources with ``line`` added to ``module`` (made if it is not there)."""
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
    # And core's, broken when it was grouped by stage: the session typing its engine (it takes a Host protocol), the
    # tool loop typing its session (a ToolSession protocol), the text layer taking a type from the token layer
    # (Sample lives with the sampler), the loader reaching up into distributed/ (the split model's classes are in
    # core/model/split.py).
    ("core/chat/chat_session.py", "if TYPE_CHECKING: from ..engine import Engine",
     "No cycles are allowed in mlxchat.core."),
    ("core/chat/tool_loop.py", "if TYPE_CHECKING: from .chat_session import ChatSession",
     "No cycles are allowed in mlxchat.core.chat."),
    ("core/decode/reply.py", "from .generate import StepLoop", "No cycles are allowed in mlxchat.core.decode."),
    ("core/model/loader.py", "def f(): from ..distributed import leader", "No cycles are allowed in mlxchat.core."),
])
def test_an_import_circle_is_caught(tmp_path: Path, module: str, line: str, caught: str) -> None:
    done = _lint_with_line(tmp_path, module, line)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "core, app, server and lab have no import circles BROKEN" in done.stdout
    assert caught in done.stdout


@pytest.mark.parametrize(("module", "line", "caught"), [
    # A stage importing one above it, even for a type: the model's stage typing a request, decode the session.
    ("core/model/loader.py", "if TYPE_CHECKING: from ..decode.reply import Request",
     "mlxchat.core.model.loader -> mlxchat.core.decode.reply"),
    ("core/decode/reply.py", "from ..chat import messages", "mlxchat.core.decode.reply -> mlxchat.core.chat.messages"),
    # The cache and sampling sit side by side, independent of each other.
    ("core/cache/kv_cache.py", "from ..sampling import draw",
     "mlxchat.core.cache.kv_cache -> mlxchat.core.sampling.draw"),
    # The bottom imports no stage: what every stage shares, and the native kernel.
    ("core/errors.py", "from .model import loader", "mlxchat.core.errors -> mlxchat.core.model.loader"),
    # And a module of core that takes no place among the stages.
    ("core/extra.py", "X = 1", "- mlxchat.core.extra"),
])
def test_cores_stages_import_downward_only(tmp_path: Path, module: str, line: str, caught: str) -> None:
    done = _lint_with_line(tmp_path, module, line)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "core's stages import downward only BROKEN" in done.stdout
    assert caught in done.stdout
