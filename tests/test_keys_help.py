"""F1's help is generated from the bindings (issue 37 item 5): every key of the app's screens and widgets is
listed, with its keys as they are typed, and the remap example takes a key no binding uses. No model, no terminal."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

from textual.binding import Binding

import mlxchat.app
from mlxchat.app.app import make_app
from mlxchat.app.screens.help import format_keys, remap_example


def app_binding_ids() -> set[str]:
    """The id of every Binding a class of mlxchat.app declares."""
    ids = set()
    for info in pkgutil.walk_packages(mlxchat.app.__path__, "mlxchat.app."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                ids |= {b.id for b in cls.__dict__.get("BINDINGS", ()) if isinstance(b, Binding) and b.id}
    return ids


def test_every_binding_of_the_app_is_in_the_help(tmp_path: Path) -> None:
    rows = make_app(data_dir=tmp_path / "data", config_dir=tmp_path / "config", scan_hf_cache=False).binding_rows()
    listed = {binding_id for *_, binding_id in rows}
    assert app_binding_ids() - listed == set()
    keys = {(format_keys(k), where) for k, _, where, _ in rows}
    # The keys a newcomer missed: branches, a message's code block, the heat view's, Tab, the candidates' Enter.
    assert {("[", "message"), ("]", "message"), ("k", "message"), ("n", "heat view"), ("tab", "any screen"),
            ("enter", "inspector"), ("up", "transcript")} <= keys


def test_the_remap_example_adds_a_key_that_nothing_uses(tmp_path: Path) -> None:
    rows = make_app(data_dir=tmp_path / "data", config_dir=tmp_path / "config", scan_hf_cache=False).binding_rows()
    binding_id, keys = remap_example(rows).split(" = ")
    used = {k for row in rows for k in row[0].split(",")}
    added = keys.strip('"').split(",")[-1]
    assert binding_id == "regenerate" and added not in used  # F9, the old example's key, is Replay
