"""A built wheel, installed outside the repository, works: the presets are package data, and the layers install as
`mlxchat.*` rather than as generic top-level `core`/`app`/`bench` packages (issue 10).

The fresh environment borrows the dependencies of the test's own virtualenv through a `.pth` path line (no network,
no second copy of MLX); that adds a plain folder to `sys.path` and runs none of its `.pth` files, so the repository's
editable install is invisible there and only the wheel's copy of mlxchat can be imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools stages a wheel's files in build/lib.* and never removes one: a module moved or deleted since the last
    # build would still ship. The wheel is built from the sources as they are (the native build, in build/temp.*,
    # is kept and only relinks).
    for staged in (ROOT / "build").glob("lib.*"):
        shutil.rmtree(staged)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, cwd=out)
    (whl,) = out.glob("mlxchat-*.whl")
    return whl


def test_the_wheel_holds_one_mlxchat_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"mlxchat"}
    for preset in ("chat", "completion", "creative", "factual", "precise"):
        assert f"mlxchat/templates/presets/{preset}.toml" in names
        assert f"mlxchat/templates/rubrics/{preset}.toml" in names  # the lab judge's rubric per prompt set
    assert "mlxchat/templates/presets/longform.toml" in names  # a preset with no prompt set of its own
    assert "mlxchat/app/app.tcss" in names
    # The tools plug into the app through entry points: the lab's F6 screen as well as its subcommand.
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    groups = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[mlxchat.screens]\nlab = mlxchat.lab.screen:open_lab" in groups


def test_pyproject_lists_every_package() -> None:
    """setuptools installs the packages pyproject.toml lists one by one (core's stages among them); a package folder
    left out would ship only as data files, with a deprecation warning. So every one is listed."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"mlxchat." + ".".join(init.parent.relative_to(ROOT).parts)
               for layer in ("core", "app", "server", "lab", "bench", "templates")
               for init in (ROOT / layer).rglob("__init__.py")}
    assert folders - listed == set()


def test_an_installed_wheel_runs_a_preset_from_another_folder(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                    str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data")}
    where = subprocess.run([py, "-c", "import mlxchat.core, mlxchat.templates; print(mlxchat.core.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, check=True).stdout
    assert where.startswith(str(site))
    run = subprocess.run([env_dir / "bin" / "mlxchat", "generate", "What is the capital of France?",
                          "--profile", "chat", "--seed", "1", "--max-tokens", "8", "--json"],
                         capture_output=True, text=True, cwd=elsewhere, env=env, timeout=240)
    assert run.returncode == 0, run.stderr
    assert '"finish_reason"' in run.stdout and "Temperature(0.8)" in run.stdout
