"""Shared fixtures: the real embedded model, loaded once per test run (loading costs seconds)."""

from __future__ import annotations

import pytest

import mlxchat.core  # noqa: F401 - loads the optimized BLAS before anything imports MLX
from mlxchat.core import Engine, SamplingProfile


@pytest.fixture(scope="session")
def engine() -> Engine:
    e = Engine.load()
    yield e
    e.close()


@pytest.fixture()
def greedy() -> SamplingProfile:
    return SamplingProfile(temperature=0)
