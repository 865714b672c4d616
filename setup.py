"""Builds mlxchat's optional native kernel (core/native, an MLX C++ extension) with CMake; pyproject.toml has the rest.

Optional on purpose: when CMake, a C++ compiler or the build itself fails, the install still succeeds without the
extension, and the loader falls back to fp32 weights with a one-line notice saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "mlxchat.core.native._ext"


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: str) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = str(Path(sourcedir).resolve())


class OptionalCMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            self._cmake(ext)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"mlxchat: the native kernel was not built ({e}); quantized models will run as fp32 on the CPU",
                  file=sys.stderr)

    def _cmake(self, ext: CMakeExtension) -> None:
        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build = Path(self.build_temp).resolve() / ext.name
        build.mkdir(parents=True, exist_ok=True)
        configure = ["cmake", "-S", ext.sourcedir, "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"]
        if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)], check=True)

    def get_outputs(self) -> list[str]:
        # A failed optional build leaves no file; list only what exists so the wheel/editable install still works.
        return [p for p in super().get_outputs() if os.path.exists(p)]


setup(ext_modules=[CMakeExtension(NATIVE, "core/native")], cmdclass={"build_ext": OptionalCMakeBuild})
