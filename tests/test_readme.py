"""The README's Python blocks run as written, each in a fresh interpreter, as a new user would paste them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_the_readme_has_python_blocks() -> None:
    assert len(python_blocks()) >= 2  # "From Python" and speculative decoding


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.splitlines()[2][:40])
def test_a_readme_python_block_runs(block: str, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "the block printed nothing"
