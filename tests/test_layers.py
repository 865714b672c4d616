"""The layers import downward only (docs/architecture.md §1): `lint-imports` checks pyproject.toml's contracts on
the code, and catches each kind of upward import when one is added to a copy of it."""

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


@pytest.mark.parametrize(("module", "line", "caught"), [
    ("core/engine.py", "from mlxchat.app import formatting", "mlxchat.core.engine -> mlxchat.app.formatting"),
    ("core/events.py", "import textual", "mlxchat.core.events -> textual"),
    ("app/tool_screens.py", "import mlxchat.lab.screen", "mlxchat.app.tool_screens -> mlxchat.lab.screen"),
    ("app/formatting.py", "import mlx.core", "mlxchat.app.formatting -> mlx"),
    ("server/app.py", "from mlxchat.app import store", "mlxchat.server.app -> mlxchat.app.store"),
    ("lab/runner.py", "from mlxchat.bench import stats", "mlxchat.lab.runner -> mlxchat.bench.stats"),
])
def test_an_upward_import_is_caught(tmp_path: Path, module: str, line: str, caught: str) -> None:
    # A copy of the sources, found on PYTHONPATH before the editable install. `mlxchat` stays a namespace package
    # (no __init__.py), as installed: grimp reads each layer as a root only in a namespace.
    package = tmp_path / "mlxchat"
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, package / layer, ignore=_python_files_only)
    with (package / module).open("a") as f:
        f.write(f"\n{line}\n")
    done = _lint(tmp_path, {**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert caught in done.stdout
