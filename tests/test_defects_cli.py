"""`mlxchat generate` under Ctrl-C, and `--stop ""` (issue 12 items 1 and 21), with real processes on the embedded
model: SIGINT while the model loads or while the reply streams always ends with exit 130, no traceback and no core
dump, and what was generated stays printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxchat.app.cli import main
from mlxchat.core import Engine

PROMPT = "Tell me a very long story about a cat and a dog."


def start(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxchat.app.cli", "generate", PROMPT, "--max-tokens", "2000",
                             "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "PYTHONFAULTHANDLER": "1"})


def finish(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    try:
        return proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack, for the failure message
        out, err = proc.communicate()
        pytest.fail(f"still running 120 s after Ctrl-C:\n{err.decode()[-3000:]}")


def test_ctrl_c_while_loading_or_streaming_exits_130_without_a_traceback(tmp_path: Path) -> None:
    # Side by side, to fit a busy two-core machine: three interrupted before any token (1.5, 3 and 5 s after the
    # start: importing MLX, then loading the model), three after the reply has started, each at a different delay.
    # (Not earlier: in the first ~0.3 s Python itself is starting, before any of mlxchat's code runs.)
    loading = [start(tmp_path) for _ in range(3)]
    streaming = [start(tmp_path) for _ in range(3)]
    twice = start(tmp_path)  # for a second Ctrl-C while the first is still landing (below), side by side too
    for proc, delay in zip(loading, (1.5, 1.5, 2.0)):
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    firsts = []
    for proc, delay in zip(streaming, (0.0, 0.3, 1.0)):
        firsts.append(proc.stdout.read(1))  # the reply has started
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
    # A second Ctrl-C while the first is still landing leaves at once, with the same exit code.
    twice.stdout.read(1)
    twice.send_signal(signal.SIGINT)
    twice.send_signal(signal.SIGINT)
    for proc, first in [*((p, b"") for p in loading), *zip(streaming, firsts)]:
        out, err = finish(proc)
        text = (first + out).decode()
        assert proc.returncode == 130, (proc.returncode, err.decode()[-2000:])
        assert b"Traceback" not in err and b"Fatal Python error" not in err and b"terminate" not in err, err.decode()
        if first:
            assert len(text.strip()) >= 1 and text.endswith("\n")  # the partial reply, ended by a newline
    _, err = finish(twice)
    assert twice.returncode == 130 and b"Traceback" not in err


def test_an_empty_stop_string_is_one_line_naming_the_flag(capsys, monkeypatch) -> None:
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model for nothing")))
    rc = main(["generate", "hi", "--stop", "</s>", "--stop", ""])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines() == [err.strip()] and "--stop" in err and "empty" in err, err


# --- a prompt longer than the context (item 7): the flags that apply here, and the policies they choose ----------

LONG = "All work and no play makes Jack a dull boy. " * 60  # ~660 tokens; the tiny model's context is 256


def test_a_prompt_longer_than_the_context_names_the_flags(tiny: Path, capsys) -> None:  # noqa: F811
    rc = main(["generate", LONG, "--model", str(tiny), "--max-tokens", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "context of 256" in err
    assert "--context-policy truncate" in err and "--context-policy rotate" in err
    assert "max_kv_size" not in err and "kv_window" not in err  # the Python / config names do not apply here


def test_truncate_keeps_the_end_of_the_prompt_and_rotate_runs_through_a_window(tiny: Path, capsys) -> None:  # noqa: F811
    rc = main(["generate", LONG + "The end.", "--model", str(tiny), "--max-tokens", "3", "--temperature", "0",
               "--context-policy", "truncate", "--json"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert rc == 0 and "(--context-policy truncate)" in err and "was cut to its last" in err
    assert 200 < result["metrics"]["prompt_tokens"] <= 256 - 3  # room left for the reply
    rc = main(["generate", LONG, "--model", str(tiny), "--max-tokens", "3", "--kv-window", "64", "--json"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert rc == 0 and err == "" and result["metrics"]["kv_window"] == 64
    assert result["metrics"]["prompt_tokens"] > 256 and result["metrics"]["completion_tokens"] >= 1


@pytest.mark.parametrize("argv, expected", [
    (["--kv-window", "8"], "--kv-window must be at least 16 tokens, got 8"),
    (["--kv-window", "64", "--context-policy", "truncate"], "--kv-window goes with --context-policy rotate"),
    (["--context-policy", "drop"], "argument --context-policy: invalid choice: 'drop'"),
])
def test_bad_context_flags_are_one_line(capsys, monkeypatch, argv: list[str], expected: str) -> None:
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model for nothing")))
    try:
        rc = main(["generate", "hi", *argv])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and expected in err and err.count("\n") == 1, err


def test_a_prompt_argument_that_is_not_utf8_is_one_line_without_python_advice(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mlxchat.app.cli", "generate", b"caf\xe9"], capture_output=True,
                          env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in err and "errors=" not in err
