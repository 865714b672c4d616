"""The help screen: every key binding (with the keys in effect after the config's remapping) and its id."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static


def format_keys(keys: str) -> str:
    return ", ".join(k.strip() for k in keys.split(",") if k.strip())


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
                table.add_row(format_keys(keys), description, where, binding_id)
            yield table
            yield Static(f"Remap a key in {self.config_file}, e.g.\n[keys]\nregenerate = \"ctrl+r,f9\"\n"
                         "Mouse: click a message, then c copies it and k its code blocks; click a code block "
                         "to copy it. In the heat view (F7), click a token to inspect it.", classes="help-note",
                         markup=False)

    def action_close(self) -> None:
        self.dismiss(None)
