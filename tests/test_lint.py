"""The code's habits that a linter can hold (pyproject.toml's [tool.ruff]): `ruff check` passes on the tree, and fails
when a copy of a module gets an unused import, a line past 120 characters or an untyped public function."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # --no-cache: no .ruff_cache is left in the working tree.
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_passes_ruff() -> None:
    done = _ruff(".")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("line", "code"), [
    ("import json", "F401"),
    ("WIDE = '" + "x" * 120 + "'", "E501"),
    ("def helper(value):\n    return value", "ANN001"),
])
def test_ruff_catches_what_the_configuration_forbids(tmp_path: Path, line: str, code: str) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "core").mkdir()
    source = (ROOT / "core" / "errors.py").read_text()
    (tmp_path / "core" / "errors.py").write_text(source + "\n\n" + line + "\n")
    done = _ruff("core/errors.py", cwd=tmp_path)
    assert done.returncode == 1 and code in done.stdout, done.stdout + done.stderr
