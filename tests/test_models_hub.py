"""Models by name (issue 12 item 17): `mlxchat pull / models / rm` and core.model.hub, against a Hugging Face cache the
test builds (a real snapshot layout with a tiny loadable model and a repo mlxchat cannot load); no network."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from mlxchat.app.cli import main
from mlxchat.app.models import hf_cache_choices
from mlxchat.app.store import Store
from mlxchat.core.model import hub
from tests.model_files import hf_cache_with_tiny_model


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hub"
    hf_cache_with_tiny_model(root, "mlxchat-test/tiny-llama")
    other = root / "models--someone--notes" / "snapshots" / ("f" * 40)
    other.mkdir(parents=True)
    (other / "README.md").write_text("not a model mlxchat loads\n")
    (root / "models--someone--notes" / "refs").mkdir()
    (root / "models--someone--notes" / "refs" / "main").write_text("f" * 40)
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub is reachable here: fail fast instead of timing out
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("MLXCHAT_DATA_DIR", str(tmp_path / "data"))  # no local models the user added elsewhere
    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path / "config"))
    return root


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_models_lists_the_cache_with_sizes_and_what_loads(cache: Path, capsys) -> None:
    models = hub.cached_models()
    assert [(m.repo_id, m.loadable) for m in models] == [("mlxchat-test/tiny-llama", True),
                                                         ("someone/notes", False)]
    assert models[0].size_bytes > 100_000 and models[0].snapshot.name == "0123456789abcdef0123456789abcdef01234567"
    rc, out, _ = run(capsys, "models")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["MODEL", "ARCH", "SIZE", "LAST", "USED", "LOADABLE", "QUANTIZATION"]
    # Each row says the architecture and the quantization mix the file or config.json holds.
    assert lines[1].startswith("SmolLM2-135M-Instruct (embedded)  llama") and " yes " in lines[1]
    assert lines[1].endswith("Q4_1: Q4_1 210, F32 61, Q8_0 1")
    assert lines[2].startswith("mlxchat-test/tiny-llama") and "MiB" in lines[2] and lines[2].rstrip().endswith("yes")
    assert " llama " in lines[2]
    assert lines[3].startswith("someone/notes") and lines[3].endswith("no")
    # The F3 picker offers only what loads, from the same listing.
    assert [c.label for c in hf_cache_choices()] == ["mlxchat-test/tiny-llama"]


def test_models_on_an_empty_or_missing_cache_lists_the_embedded_one_and_says_how_to_fetch(
        tmp_path: Path, monkeypatch, capsys) -> None:
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("MLXCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLXCHAT_CONFIG_DIR", str(tmp_path / "config"))
    rc, out, err = run(capsys, "models")
    assert rc == 0 and out.splitlines()[1].startswith("SmolLM2-135M-Instruct (embedded)")
    assert "mlxchat pull ORG/NAME" in err
    assert not (tmp_path / "data").exists()  # listing created no database


def test_models_lists_the_local_files_f3_offers(cache: Path, tmp_path: Path, capsys) -> None:
    """What the user added in F3 (kept in the database) and config.toml's `models`, with what F3 would say."""
    added, configured, gone = tmp_path / "mine.gguf", tmp_path / "other.gguf", tmp_path / "gone.gguf"
    added.write_bytes(b"GGUF" + bytes(1000))
    configured.write_bytes(b"GGUF" + bytes(10))
    store = Store(tmp_path / "data" / "conversations.db")
    store.add_model(str(added))
    store.add_model(str(gone))
    store.close()
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text(f'models = ["{configured}", "{added}"]\n')
    rc, out, err = run(capsys, "models")
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rc == 0 and list(rows)[:4] == ["SmolLM2-135M-Instruct", str(gone), str(added), str(configured)]
    assert "1004 B" in rows[str(added)] and rows[str(gone)].endswith("no")
    # A GGUF magic and zeros: listed, read without loading, and said why it cannot load, one line each.
    assert rows[str(added)].endswith("no")
    assert f"mlxchat: note: {added} cannot load: GGUF version 0 is not supported (2 and 3 are)" in err.splitlines()
    assert f"mlxchat: note: {gone} cannot load: {gone}: no such file or folder" in err.splitlines()


def test_pull_finds_a_cached_repo_offline_and_an_unreachable_hub_is_one_line(cache: Path, capsys) -> None:
    rc, out, _ = run(capsys, "pull", "mlxchat-test/tiny-llama")
    assert rc == 0 and "mlxchat-test/tiny-llama" in out and "0123456789abcdef" in out
    rc, out, err = run(capsys, "pull", "mlxchat-test/absent")
    assert rc == 2 and out == "" and err.splitlines() == [err.strip()]
    assert "mlxchat: error: mlxchat-test/absent: the Hugging Face hub cannot be reached" in err
    for wrong in ("not a repo id!", "something"):  # the hub takes a bare NAME too, and then it went online
        rc, _, err = run(capsys, "pull", wrong)
        assert rc == 2 and err == f"mlxchat: error: {wrong!r} is not a repo id: type ORG/NAME, e.g. " \
                                  "`mlxchat pull mlx-community/SmolLM2-135M-Instruct`\n"


def test_rm_asks_unless_yes_and_deletes_the_repo(cache: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # a script: no terminal to ask on
    rc, _, err = run(capsys, "rm", "someone/notes")
    assert rc == 2 and "pass --yes" in err and (cache / "models--someone--notes").exists()
    rc, out, _ = run(capsys, "rm", "someone/notes", "--yes")
    assert rc == 0 and out.startswith("deleted someone/notes")
    assert not (cache / "models--someone--notes").exists()
    assert [m.repo_id for m in hub.cached_models()] == ["mlxchat-test/tiny-llama"]
    rc, _, err = run(capsys, "rm", "someone/notes", "--yes")
    assert rc == 2 and "someone/notes is not in the Hugging Face cache" in err
