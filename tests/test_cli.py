"""The `mlxchat generate` command on bad input (issue 7): exit code 2 and exactly one stderr line starting
"mlxchat: error:", never a traceback.

Most cases call `app.cli.main` in this process (the modules are already imported, and the embedded model, where one
is needed, is the session's engine); a handful run `python -m mlxchat.app.cli` as real processes, side by side, to show
the same at the process level, including a real answer to a prompt full of control characters.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mlxchat.app.cli import main
from mlxchat.core import Engine, SamplingProfile
from mlxchat.core.sampling.profile import ProfileStore
from tests.bad_models import BAD_NAMES, bad_model_files

ROOT = Path(__file__).resolve().parent.parent
PRESETS = "presets: chat, completion, creative, factual, longform, precise"


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxchat: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture()
def cli(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Run `main(argv)` with optional stdin bytes; user profiles live in a fresh folder. Returns (rc, out, err)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))

    def run(*argv: str, stdin: bytes | None = None) -> tuple[int, str, str]:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse
            rc = e.code
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture()
def with_session_engine(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """`Engine.load()` in the CLI returns the session's embedded engine instead of loading it again."""
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: engine))
    return engine


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory, tiny: Path):
    return bad_model_files(tmp_path_factory.mktemp("cli-bad"), tiny)


# --- model paths -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_model_is_one_line_naming_file_and_cause(cli, bad_files, name: str) -> None:
    path, expected = bad_files[name]
    rc, out, err = cli("generate", "hi", "--model", str(path))
    line = one_error_line(err)
    assert rc == 2 and out == "" and str(path) in line and expected in line, line


# --- prompts -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, stdin, expected", [
    (["generate", ""], None, "the prompt is empty"),
    (["generate", "  \t\n"], None, "the prompt is empty"),
    (["generate", "-"], b"", "the prompt is empty"),
    (["generate", "-"], b"\n\n  \n", "the prompt is empty"),
    (["generate", "-"], b"caf\xe9 au lait", "stdin is not valid UTF-8 (byte 0xe9 at offset 3)"),
    (["generate", "-"], b"\xff\xfeh\x00i\x00", "stdin is not valid UTF-8 (byte 0xff at offset 0)"),
    (["generate", "-"], "ok \u20ac".encode()[:-1], "stdin is not valid UTF-8"),  # cut inside a character
])
def test_bad_prompts_fail_before_the_model_loads(cli, monkeypatch, argv, stdin, expected) -> None:
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model for nothing")))
    rc, out, err = cli(*argv, stdin=stdin)
    assert rc == 2 and expected in one_error_line(err)


def test_a_100k_character_prompt_is_one_line(cli, with_session_engine) -> None:
    rc, _, err = cli("generate", "-", stdin=("All work and no play makes Jack a dull boy. " * 2300).encode())
    line = one_error_line(err)
    assert rc == 2 and "context of 8192" in line


def test_control_characters_in_a_prompt_get_an_answer(cli, with_session_engine) -> None:
    rc, out, err = cli("generate", "-", "--temperature", "0", "--max-tokens", "6", "--json",
                       stdin=b"Say \x1b[31mhi\x1b[0m\r\nnow\x00 please\x07")
    assert rc == 0 and err == ""
    result = json.loads(out)
    assert result["finish_reason"] in ("stop", "length") and result["metrics"]["completion_tokens"] >= 1


# --- options and profiles ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--temperature", "2.5"], "temperature must be between 0 and 2 (0 means greedy), got 2.5"),
    (["--temperature", "-1"], "temperature must be between 0 and 2"),
    (["--temperature", "nan"], "temperature must be between 0 and 2 (0 means greedy), got nan"),
    (["--top-p", "0"], "top_p must be greater than 0 and at most 1, got 0.0"),
    (["--top-p", "1.5"], "top_p must be greater than 0 and at most 1"),
    (["--top-k", "-1"], "top_k must be at least 0"),
    (["--min-p", "2"], "min_p must be between 0 and 1"),
    (["--seed", "-3"], "seed must be between 0 and"),
    (["--seed", str(2**64)], "seed must be between 0 and 18446744073709551615"),
    (["--max-tokens", "0"], "max_tokens must be at least 1, got 0"),
    (["--max-tokens", "-5"], "max_tokens must be at least 1, got -5"),
    (["--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
    (["--top-k", "1.5"], "argument --top-k: invalid int value: '1.5'"),
    (["--temperature"], "argument --temperature: expected one argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--profile", "wild"], f"unknown profile 'wild'; {PRESETS}; saved profiles (in "),
    (["--profile", "../../etc/passwd"], f"unknown profile '../../etc/passwd'; {PRESETS}"),
])
def test_bad_options_are_one_line(cli, monkeypatch, argv: list[str], expected: str) -> None:
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model for nothing")))
    rc, out, err = cli("generate", "hi", *argv)
    assert rc == 2 and out == "" and expected in one_error_line(err)


@pytest.mark.parametrize("argv, expected", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["generate"], "the following arguments are required: prompt"),
])
def test_bad_commands_are_one_line(cli, argv: list[str], expected: str) -> None:
    rc, _, err = cli(*argv)
    assert rc == 2 and expected in one_error_line(err)


@pytest.mark.parametrize("content, expected", [
    (b"temperature = = 2\n", "not valid TOML"),
    (b"\xff\xfe\x00garbage", "not valid TOML"),
    (b"temperature = 7.0\n", "temperature must be between 0 and 2"),
    (b"colour = 'blue'\n", "colour: Extra inputs are not permitted"),
    (b"top_k = 'many'\n", "top_k"),
    (b"", None),  # an empty file is a profile of defaults
])
def test_a_saved_profile_that_is_corrupt_is_reported_and_left_as_is(cli, with_session_engine, tmp_path: Path,
                                                                     content: bytes, expected: str | None) -> None:
    """Decision: `--profile NAME` naming a corrupt saved profile is an error (exit 2, one line naming the file),
    not a silent fall-back to defaults: a script that asked for settings by name must not get others. The file
    is never rewritten. (The TUI, which lists every profile, reports it and goes on with the defaults.)"""
    folder = tmp_path / "config" / "mlxchat" / "profiles"
    folder.mkdir(parents=True)
    path = folder / "mine.toml"
    path.write_bytes(content)
    rc, out, err = cli("generate", "hi", "--profile", "mine", "--max-tokens", "2")
    if expected is None:
        assert rc == 0 and err == ""
    else:
        line = one_error_line(err)
        assert rc == 2 and str(path) in line and expected in line, line
    assert path.read_bytes() == content
    assert ProfileStore(folder).list() == ["mine"]


def test_a_saved_profile_and_a_preset_are_used(cli, with_session_engine, tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "config" / "mlxchat" / "profiles")
    store.save(SamplingProfile(name="terse", temperature=0, max_tokens=3))
    rc, out, _ = cli("generate", "hi", "--profile", "terse", "--json")
    assert rc == 0 and json.loads(out)["sampler"] == "greedy" and json.loads(out)["metrics"]["completion_tokens"] <= 3
    rc, out, _ = cli("generate", "hi", "--profile", "precise", "--max-tokens", "2", "--json")
    assert rc == 0 and json.loads(out)["sampler"] == "greedy"
    assert tomllib.loads(store._path("terse").read_text())["max_tokens"] == 3


def test_generate_samples_with_the_configs_default_profile_and_says_which(cli, with_session_engine,
                                                                           tmp_path: Path) -> None:
    # Unflagged: config.toml's default profile (the chat preset), never the raw distribution ("sample" alone).
    rc, out, _ = cli("generate", "hi", "--max-tokens", "2", "--json")
    assert rc == 0 and json.loads(out)["profile"] == "chat" and json.loads(out)["sampler"] == "TopP(0.9) → " \
        "Temperature(0.8) → sample"
    rc, _, err = cli("generate", "hi", "--max-tokens", "2", "--temperature", "0", "--stats")
    assert rc == 0 and "profile chat: greedy" in err
    config = tmp_path / "config" / "mlxchat"
    config.mkdir(parents=True)
    (config / "config.toml").write_text('profile = "precise"\n')
    rc, out, _ = cli("generate", "hi", "--max-tokens", "2", "--json")
    assert rc == 0 and (json.loads(out)["profile"], json.loads(out)["sampler"]) == ("precise", "greedy")
    (config / "config.toml").write_text('profile = 3\n')  # a broken config: a note, and the chat preset
    rc, out, err = cli("generate", "hi", "--max-tokens", "2", "--json")
    assert rc == 0 and json.loads(out)["profile"] == "chat" and err.startswith("mlxchat: note: ")


# --- as real processes -------------------------------------------------------------------------------------------

def test_real_processes_give_one_line_or_an_answer(bad_files, tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    runs = {
        "truncated model": (["generate", "hi", "--model", str(bad_files["cut in the tensor table"][0])], b"",
                            "truncated"),
        "float64 metadata (a crash of mx.load before)": (["generate", "hi", "--model",
                                                          str(bad_files["float64 metadata"][0])], b"", "float64"),
        "invalid UTF-8 on stdin": (["generate", "-"], b"\xc3\x28 broken", "stdin is not valid UTF-8"),
        "unknown preset": (["generate", "hi", "--profile", "wild"], b"", PRESETS),
        "bad option value": (["generate", "hi", "--top-k", "abc"], b"", "invalid int value: 'abc'"),
        "control characters, tiny model": (["generate", "-", "--model", str(tiny), "--temperature", "0",
                                            "--max-tokens", "5", "--json"], b"hi\x00 \x1b[31mred\r\n\x7f", None),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "app.cli", *argv], cwd=ROOT, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (argv, _, _) in runs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(runs[name][1], timeout=240)
        expected = runs[name][2]
        if expected is None:
            assert proc.returncode == 0, (name, err.decode())
            assert json.loads(out)["metrics"]["completion_tokens"] >= 1
        else:
            assert proc.returncode == 2, (name, proc.returncode, err.decode())
            assert expected in one_error_line(err.decode()), name


def test_stats_of_an_empty_reply_say_there_was_no_decode_rather_than_zero() -> None:
    from mlxchat.app.cli import format_stats
    from mlxchat.core.decode.events import Metrics

    empty = format_stats(Metrics(prompt_tokens=40, ttft_s=6.47, prefill_s=6.47))
    assert "TTFT 6.47 s" in empty and "no decode rate" in empty and "0.0 tok/s" not in empty
    assert "decode 20.0 tok/s (TPOT 50 ms)" in format_stats(Metrics(completion_tokens=8, tpot_s=0.05))
