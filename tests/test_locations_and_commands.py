"""One locations module and one profile resolver for the CLI and the TUI; tools' subcommands through entry points.

No model is loaded here: the profile store, the app's folders and the CLI's parser are all cheap."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mlxchat.app import cli
from mlxchat.app.app import make_app
from mlxchat.core.locations import Locations
from mlxchat.core.sampling.profile import ProfileError, ProfileStore, SamplingProfile


# --- folders and profiles --------------------------------------------------------------------------------------

def test_mlxchat_config_dir_is_the_same_folder_for_the_cli_and_the_tui(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path / "conf"))
    monkeypatch.setenv("MLXCHAT_DATA_DIR", str(tmp_path / "data"))
    app = make_app(engine=None, scan_hf_cache=False)
    assert ProfileStore().folder == app.profiles.folder == tmp_path / "conf" / "profiles"
    assert app.locations == Locations(tmp_path / "data", tmp_path / "conf")
    app.store.close()


def test_xdg_folders_are_honoured_when_the_mlxchat_variables_are_not_set(tmp_path, monkeypatch):
    monkeypatch.delenv("MLXCHAT_CONFIG_DIR", raising=False)
    monkeypatch.delenv("MLXCHAT_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xc"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xd"))
    assert Locations.resolve() == Locations(tmp_path / "xd" / "mlxchat", tmp_path / "xc" / "mlxchat")
    assert ProfileStore().folder == tmp_path / "xc" / "mlxchat" / "profiles"


def test_resolve_gives_a_preset_then_a_saved_profile_and_names_both_lists_otherwise(tmp_path):
    store = ProfileStore(tmp_path)
    store.save(SamplingProfile(name="mine", temperature=0.3))
    # A saved profile named like a preset (save refuses the name now; an older version wrote it).
    (tmp_path / "chat.toml").write_text("temperature = 1.9\n")
    assert store.resolve("mine").temperature == 0.3
    assert store.resolve("chat") == SamplingProfile.preset("chat")  # the preset wins, in the CLI and the TUI
    with pytest.raises(ProfileError, match=r"unknown profile 'nope'; presets: chat, .*saved profiles \(in .*\): "
                                           r"chat, mine"):
        store.resolve("nope")


def test_the_tui_default_profile_comes_from_the_same_resolver(tmp_path):
    ProfileStore(tmp_path / "config" / "profiles").save(SamplingProfile(name="mine", top_k=7))
    (tmp_path / "config" / "config.toml").write_text('profile = "mine"\n')
    app = make_app(data_dir=tmp_path / "data", config_dir=tmp_path / "config", engine=None, scan_hf_cache=False)
    assert app.default_profile().top_k == 7
    app.store.close()


# --- subcommands from tools --------------------------------------------------------------------------------------

def _install_tool(root: Path, entry: str, module: str | None = None, source: str = "") -> None:
    """A distribution on sys.path whose entry point registers an `mlxchat` subcommand (what pip writes)."""
    dist = root / "tool_pkg-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tool-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{cli.COMMANDS_GROUP}]\n{entry}\n")
    if module:
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def test_a_tool_registers_a_subcommand_that_mlxchat_runs(tmp_path, monkeypatch, capsys):
    _install_tool(tmp_path, "toy = toy_tool:register", "toy_tool", '''
        def register(sub):
            p = sub.add_parser("toy", help="a toy tool")
            p.add_argument("--n", type=int, required=True)
            p.set_defaults(command_runner=lambda args: print(f"toy {args.n}") or args.n)
    ''')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["toy", "--n", "3"]) == 3
    assert capsys.readouterr().out == "toy 3\n"
    with pytest.raises(SystemExit) as e:
        cli.main(["toy", "--n", "x"])
    assert e.value.code == 2 and "argument --n: invalid int value: 'x'" in capsys.readouterr().err  # one line


def test_bench_registers_its_flags_through_the_hook_and_app_never_imports_bench(tmp_path, monkeypatch, capsys):
    _install_tool(tmp_path, "bench = mlxchat.bench.command:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for flag in ("--quick", "--model", "--out", "--repeats", "--max-tokens", "--lengths", "--rotating-context",
                 "--rotating-decode", "--llama-threads", "--skip"):
        assert flag in out
    app_sources = Path(cli.__file__).parent.rglob("*.py")
    assert not [p for p in app_sources if "mlxchat.bench" in p.read_text() or "from ..bench" in p.read_text()]


def test_a_tool_that_fails_to_load_is_one_line_and_generate_still_parses(tmp_path, monkeypatch, capsys):
    _install_tool(tmp_path, "frob = no_such_module:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["frob"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the frob command could not be loaded from no_such_module:register" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
