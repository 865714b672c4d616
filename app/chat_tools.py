"""The chat's tools (no Textual here; tests/test_mcp_tui.py drives it): config.toml's MCP servers as one
`Toolbox` (core/chat/tool_loop.py) for the app, started in the background when a chat first has a model and stopped on
exit; per chat, which tools are on, the tool choice, and which tools are allowed always; and the approval of each
call, asked of the UI from the bridge thread that runs the turn.

The bridge thread iterates a turn's `ToolStream`; before each call it calls `approve(call, source)`, which hands
the question to the UI (`ask`: the screen's, posting a message the screen answers with a dialog) and waits for the
answer. A question nobody answers (the app quits, the turn is stopped) is answered "deny"."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxchat.core.chat.tool_loop import Decision, Toolbox
    from mlxchat.core.decode.tools import ToolCall

    from .config import MCPSettings


@dataclass
class ToolRow:
    """One line of the tools screen: a tool of a server (or a server that did not start: `tool` is "")."""

    source: str
    tool: str
    description: str
    on: bool
    status: str = ""  # a server's "starting" or why it did not start


class ChatTools:
    """See the module docstring. `ask(call, source, answer)` shows the question and calls `answer(decision)` once
    the user has decided (from any thread); it is called on the bridge thread."""

    CHOICES = ("auto", "required", "none")

    def __init__(self, mcp: "MCPSettings", ask: Callable[["ToolCall", str, Callable[[str], None]], None] | None = None
                 ) -> None:
        from mlxchat.core.chat.tool_loop import Toolbox

        self.toolbox: Toolbox = Toolbox([mcp.server(name) for name in mcp.servers], start_on_use=False)
        self.ask = ask
        self.tool_choice = "auto"
        self.always: set[str] = set()  # tools this chat runs without asking
        self._pending: list[Future[str]] = []
        self._lock = threading.Lock()
        self._started = False

    @property
    def configured(self) -> bool:
        return bool(self.toolbox.servers)

    def start(self) -> None:
        """Start the servers (blocking: call it from a worker thread); once per app, and again for those that did
        not start when the tools screen asks."""
        self._started = True
        self.toolbox.start(retry=True)

    @property
    def started(self) -> bool:
        return self._started

    def new_chat(self) -> None:
        """Another chat: every tool on again, nothing allowed always, the choice back to auto."""
        self.toolbox.disabled.clear()
        self.always.clear()
        self.tool_choice = "auto"

    def state(self) -> str:
        """This chat's tool settings as JSON (what the store keeps per conversation)."""
        return json.dumps({"disabled": sorted(self.toolbox.disabled), "always": sorted(self.always),
                           "tool_choice": self.tool_choice}, sort_keys=True)

    def restore(self, state: str | None) -> None:
        """A chat's saved tool settings (None or unreadable: the defaults)."""
        self.new_chat()
        try:
            saved = json.loads(state) if state else {}
            self.toolbox.disabled.update(str(x) for x in saved.get("disabled", ()))
            self.always.update(str(x) for x in saved.get("always", ()))
            if saved.get("tool_choice") in self.CHOICES:
                self.tool_choice = saved["tool_choice"]
        except (json.JSONDecodeError, AttributeError, TypeError):
            self.new_chat()

    def rows(self) -> list[ToolRow]:
        """What the tools screen lists (never starting a server)."""
        rows = []
        for source, tools in self.toolbox.start(wait=False):
            if isinstance(tools, str):
                rows.append(ToolRow(source, "", "", False, tools))
                continue
            rows += [ToolRow(source, t.name, t.description.split("\n")[0], t.name not in self.toolbox.disabled)
                     for t in tools]
        return rows

    def toggle(self, tool: str) -> bool:
        """Turn `tool` on or off for this chat; returns whether it is on now."""
        disabled = self.toolbox.disabled
        if tool in disabled:
            disabled.discard(tool)
            return True
        disabled.add(tool)
        return False

    def cycle_choice(self) -> str:
        self.tool_choice = self.CHOICES[(self.CHOICES.index(self.tool_choice) + 1) % len(self.CHOICES)]
        return self.tool_choice

    # --- approval (called on the bridge thread) ----------------------------------------------------------------------

    def approve(self, call: "ToolCall", source: str) -> "Decision":
        if call.name in self.always:
            return "always"
        if self.ask is None:
            return "deny"
        answer: Future[str] = Future()
        with self._lock:
            self._pending.append(answer)
        try:
            self.ask(call, source, lambda decision: answer.done() or answer.set_result(decision))
            decision = answer.result()
        finally:
            with self._lock:
                self._pending.remove(answer)
        if decision == "always":
            self.always.add(call.name)
        return decision if decision in ("once", "always") else "deny"  # type: ignore[return-value]

    def deny_waiting(self) -> None:
        """Answer every question still open with "deny" (the app quits, the turn was stopped)."""
        with self._lock:
            for answer in self._pending:
                if not answer.done():
                    answer.set_result("deny")

    def close(self) -> None:
        self.deny_waiting()
        self.toolbox.close()


def call_title(record: dict[str, Any]) -> str:
    """A call's one-line title in the transcript: its tool, arguments and state."""
    args = record.get("arguments") or "{}"
    if len(args) > 80:
        args = args[:79] + "…"
    source = f"{record['source']}." if record.get("source") else ""
    if record.get("result") is None:
        state = "waiting"
    elif record.get("ok", True):
        state = "done"
    else:
        state = "failed: " + " ".join(str(record["result"]).split())[:120]
    note = f" · {record['note']}" if record.get("note") else ""
    return f"⚙ {source}{record.get('name', '?')} {args} · {state}{note}"
