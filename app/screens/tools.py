"""The tools screen (ctrl+o): config.toml's MCP servers and their tools, each on or off for this chat, and the
chat's tool choice; and the dialog that asks before a call runs. Thin: what is listed and toggled is
app/chat_tools.py's."""

from __future__ import annotations

import json

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Static

from ..chat_tools import ChatTools, ToolRow


class ToolsScreen(ModalScreen[None]):
    """Servers and tools, on/off per chat (space or enter), the tool choice (c); a server that did not start says
    why, and r tries it again."""

    BINDINGS = [
        Binding("escape,ctrl+o", "close", "Close", id="tools_close"),
        Binding("space,enter", "toggle", "Tool on/off", id="tools_toggle"),
        Binding("c", "choice", "Tool choice", id="tools_choice"),
        Binding("r", "restart", "Start servers again", id="tools_restart"),
    ]

    def __init__(self, tools: ChatTools) -> None:
        super().__init__(classes="dialog-screen")
        self.tools = tools
        self.rows: list[ToolRow] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog tools"):
            yield Static("Tools", classes="dialog-title")
            yield DataTable(id="tools-table", cursor_type="row", zebra_stripes=True)
            yield Static("", id="tools-choice", markup=False)
            yield Static("space: tool on/off for this chat · c: tool choice · r: start servers again · "
                         "servers: [mcp.servers.NAME] in config.toml", classes="field-label", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Close", id="tools-close")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("", "server", "tool", "description")
        self.refresh_rows()
        if not self.tools.started:
            self.action_restart()

    def refresh_rows(self) -> None:
        table = self.query_one(DataTable)
        at = table.cursor_row
        table.clear()
        self.rows = self.tools.rows()
        for row in self.rows:
            mark = ("●" if row.on else "○") if row.tool else "✗" if row.status != "starting" else "…"
            table.add_row(mark, row.source, row.tool or "—", row.description or row.status)
        if not self.rows:
            table.add_row("", "—", "—", "no MCP servers in config.toml: add [mcp.servers.NAME]")
        if self.rows:
            table.move_cursor(row=min(at, len(self.rows) - 1))
        self.query_one("#tools-choice", Static).update(f"tool choice for this chat: {self.tools.tool_choice}")

    def action_toggle(self) -> None:
        row = self.query_one(DataTable).cursor_row
        if 0 <= row < len(self.rows) and self.rows[row].tool:
            self.tools.toggle(self.rows[row].tool)
            self.refresh_rows()

    def action_choice(self) -> None:
        self.tools.cycle_choice()
        self.refresh_rows()

    @work(thread=True, exclusive=True, group="mcp-start")
    def action_restart(self) -> None:
        self.tools.start()
        self.app.call_from_thread(self.refresh_rows)

    @on(Button.Pressed, "#tools-close")
    def action_close(self) -> None:
        self.dismiss(None)


class ToolApproval(ModalScreen[str]):
    """Before a call runs: its tool and arguments; allow once (o, the focus), always for this tool (a), deny (d or
    escape). Dismissed with "once", "always" or "deny"."""

    AUTO_FOCUS = "#approve-once"
    BINDINGS = [
        Binding("o", "answer('once')", "Allow once", id="tool_allow_once"),
        Binding("a", "answer('always')", "Always for this tool", id="tool_allow_always"),
        Binding("d,escape", "answer('deny')", "Deny", id="tool_deny"),
    ]

    def __init__(self, name: str, source: str, arguments: str) -> None:
        super().__init__(classes="dialog-screen")
        self.tool, self.source, self.arguments = name, source, arguments

    def compose(self) -> ComposeResult:
        try:
            shown = json.dumps(json.loads(self.arguments), indent=2, ensure_ascii=False)
        except json.JSONDecodeError:
            shown = self.arguments
        with Vertical(classes="dialog tool-approval"):
            yield Static(f"The model calls {self.source}.{self.tool}", classes="dialog-title", markup=False)
            yield Static(shown, id="approve-arguments", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Allow once", variant="primary", id="approve-once")
                yield Button("Always for this tool", id="approve-always")
                yield Button("Deny", variant="error", id="approve-deny")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.action_answer((event.button.id or "").removeprefix("approve-"))

    def action_answer(self, decision: str) -> None:
        self.dismiss(decision)
