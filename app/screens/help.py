"""The help screen: every key binding (with the keys in effect after the config's remapping) and its id."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.keys import key_to_character
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static


# Keys a remap example may add: the first one no binding uses is shown, so the example never takes a used key.
SPARE_KEYS = ("f12", "f11", "ctrl+g", "ctrl+o", "ctrl+y")


def format_keys(keys: str) -> str:
    """A binding's keys as they are typed: a printable character as itself ("left_square_bracket" is "["), the
    rest by name ("enter", "up", "ctrl+j")."""
    return ", ".join(_key(k.strip()) for k in keys.split(",") if k.strip())


def _key(key: str) -> str:
    char = key_to_character(key)
    return char if char is not None and char.isprintable() and not char.isspace() else key


def remap_example(rows: list[tuple[str, str, str, str]], binding_id: str = "regenerate") -> str:
    """A `[keys]` line that adds to `binding_id` (else the first remappable row) a key no binding uses (F9 is
    Replay: it was the example's once)."""
    used = {k.strip() for keys, *_ in rows for k in keys.split(",")}
    spare = next(k for k in SPARE_KEYS if k not in used)
    keys, _, _, chosen = next((r for r in rows if r[3] == binding_id), None) or next(r for r in rows if r[3])
    return f'{chosen} = "{keys},{spare}"'


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "close", "Close", id="help_close")]

    def __init__(self, rows: list[tuple[str, str, str, str]], config_file: str) -> None:
        """rows: (keys, description, where, binding id)."""
        super().__init__(classes="dialog-screen")
        self.rows = rows
        self.config_file = config_file

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Static("Keys", classes="dialog-title")
            table: DataTable = DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("Keys", "Action", "Where", "Binding id")
            for keys, description, where, binding_id in self.rows:
                table.add_row(format_keys(keys), description, where, binding_id or "–")
            yield table
            yield Static(f"Remap a key by its binding id in {self.config_file}, e.g.\n[keys]\n"
                         f"{remap_example(self.rows)}\n"
                         "Mouse: click a message (c, k), a code block (copies it), a token in the heat view "
                         "(inspects it).", classes="help-note", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)
