"""MCP tools in the full-screen chat: app/chat_tools.py without a terminal, then the chat driven with Textual's
Pilot on the embedded model and the SDK-built test server (tests/mcp_servers.py) over stdio: ctrl+o's tools
screen, the approval dialog, the call shown in its reply, stored and exported."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from mlxchat.app.chat_tools import ChatTools, call_title
from mlxchat.app.config import MCPSettings
from mlxchat.app.export import markdown
from mlxchat.app.screens.tools import ToolApproval, ToolsScreen
from mlxchat.app.store import Store
from mlxchat.app.widgets.tool_calls import ToolCallBlock
from mlxchat.core.decode.tools import ToolCall

TEST_SERVER = str(Path(__file__).with_name("mcp_servers.py"))
SERVERS = {"test": {"command": sys.executable, "args": [TEST_SERVER], "timeout": 2}}


def test_chat_tools_lists_toggles_and_asks() -> None:
    asked = []

    def ask(call, source, answer) -> None:  # the UI answers later, from its own thread
        asked.append((call.name, source))
        threading.Timer(0.01, answer, ("always",)).start()

    tools = ChatTools(MCPSettings.model_validate({"servers": SERVERS}), ask=ask)
    try:
        assert [(r.source, r.status) for r in tools.rows()] == [("test", "starting")]
        tools.start()
        rows = tools.rows()
        assert {r.tool for r in rows} == {"add", "fail", "hang", "crash", "huge", "picture"} and all(r.on for r in rows)
        assert tools.toggle("hang") is False and "hang" not in [t.name for t in tools.toolbox.tools()]
        assert tools.cycle_choice() == "required"
        call = ToolCall("c1", "add", '{"a": 1, "b": 2}')
        assert tools.approve(call, "test") == "always" and tools.approve(call, "test") == "always"
        assert asked == [("add", "test")]  # asked once: "always" holds for the chat
        saved = tools.state()
        tools.new_chat()
        assert tools.always == set() and tools.toolbox.disabled == set() and tools.tool_choice == "auto"
        tools.restore(saved)
        assert (tools.always, tools.toolbox.disabled, tools.tool_choice) == ({"add"}, {"hang"}, "required")
        tools.restore("{not json")  # unreadable: the defaults
        assert (tools.always, tools.toolbox.disabled, tools.tool_choice) == (set(), set(), "auto")
        tools.ask = lambda call, source, answer: None  # nobody answers: quitting denies
        threading.Timer(0.05, tools.deny_waiting).start()
        assert tools.approve(call, "test") == "deny"
    finally:
        tools.close()
    assert call_title({"name": "add", "arguments": "{}", "source": "test", "result": "boom", "ok": False}) == \
        "⚙ test.add {} · failed: boom"


@pytest.mark.anyio
async def test_the_model_calls_a_tool_from_the_chat(engine, new_app, wait_for, send, tmp_path: Path):
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.toml").write_text(f'[mcp.servers.test]\ncommand = {json.dumps(sys.executable)}\n'
                                        f'args = [{json.dumps(TEST_SERVER)}]\ntimeout = 2\n')
    app = new_app(max_tokens=40, config_dir=config)
    async with app.run_test(size=(110, 32)) as pilot:
        screen = app.chat_screen
        tools = screen.controller.tools
        await wait_for(pilot, lambda: screen.controller.session is not None and tools.toolbox.servers[0].running,
                       what="the engine and the MCP server")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ToolsScreen)
        await wait_for(pilot, lambda: len(app.screen.rows) == 6, what="the tools listed")
        for name in ("fail", "hang", "crash", "huge", "picture"):  # only add stays on (the small model picks any)
            tools.toggle(name)
        app.screen.refresh_rows()
        await pilot.press("c")  # auto -> required: the small model must call
        assert tools.tool_choice == "required"
        await pilot.press("escape")
        assert screen.controller.session.tool_choice == "required"

        screen.input.focus()
        await send(pilot, "Add 2 and 3")
        await wait_for(pilot, lambda: isinstance(app.screen, ToolApproval), what="the approval dialog")
        assert app.screen.tool == "add"
        await pilot.press("a")  # always for this tool
        await wait_for(pilot, lambda: screen.controller.last_result is not None and not screen.busy, what="the turn")
        view = screen.transcript.messages[-1]
        block = view.query(ToolCallBlock).first()  # (the small model may call it again: the same result, then text)
        assert block.collapsed and block.title.startswith("⚙ test.add {") and "· done" in block.title
        reply = screen.controller.turns[-1].message
        assert reply.tool_calls[0]["name"] == "add" and reply.tool_calls[0]["result"] is not None

        # the next turn calls add again: allowed always, no dialog
        before = screen.controller.last_result
        await send(pilot, "Add 1 and 1")
        await wait_for(pilot, lambda: screen.controller.last_result is not before and not screen.busy,
                       what="the second turn")
        assert not isinstance(app.screen, ToolApproval)
        conversation = screen.controller.record.id
        exported = markdown("t", screen.controller.turns)
        # the chat's tool settings are its own: a new chat has the defaults, reopening this one brings them back
        await pilot.press("ctrl+n")
        assert (tools.tool_choice, tools.always, tools.toolbox.disabled) == ("auto", set(), set())
        screen.controller.open(conversation)
        assert (tools.tool_choice, tools.always) == ("required", {"add"}) and "hang" in tools.toolbox.disabled
        assert screen.controller.session.tool_choice == "required"
    store = Store(tmp_path / "data" / "conversations.db")
    stored = store.messages(conversation)
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[1].tool_calls == reply.tool_calls and stored[3].tool_calls
    assert "**Tool call** `test.add`" in exported
