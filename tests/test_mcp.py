"""MCP tools (core/chat/mcp.py, core/chat/tool_loop.py, `generate --mcp`) against real MCP servers: `mcp-server-time`
from PyPI over stdio, tests/mcp_servers.py (built with the SDK: tools that fail, hang, crash their server, return huge
or non-text results) over stdio and over streamable HTTP on 127.0.0.1. The servers start once per module; the
tests that run the embedded model ask for its fixture (the model tier)."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlxchat.app.config import ConfigError, Settings
from mlxchat.app.export import markdown
from mlxchat.app.store import MIGRATIONS, Store
from mlxchat.app.turns import Turn
from mlxchat.core import SamplingProfile
from mlxchat.core.chat.mcp import MCPError, MCPServer
from mlxchat.core.chat.messages import ChatMessage
from mlxchat.core.chat.tool_loop import ToolCallEvent, ToolResultEvent, Toolbox, function_tool
from mlxchat.core.decode.tools import ToolCall

TEST_SERVER = str(Path(__file__).with_name("mcp_servers.py"))


@pytest.fixture(scope="module")
def test_server() -> Any:
    server = MCPServer.stdio("test", sys.executable, [TEST_SERVER], timeout=2)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def time_server() -> Any:
    server = MCPServer.stdio("time", sys.executable, ["-m", "mcp_server_time"])
    yield server
    server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url() -> Any:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, TEST_SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


# --- the client ------------------------------------------------------------------------------------------------------

def test_a_real_server_from_pypi_lists_and_answers(time_server) -> None:
    names = [t.name for t in time_server.start()]
    assert {"get_current_time", "convert_time"} <= set(names)
    outcome = time_server.call("get_current_time", {"timezone": "Etc/UTC"})
    assert outcome.ok and json.loads(outcome.text)["timezone"] == "Etc/UTC"


def test_a_tool_whose_schema_the_constraint_cannot_enforce_is_left_out_and_said(test_server) -> None:
    assert "distinct" not in [t.name for t in test_server.tools]
    [line] = test_server.skipped
    assert line.startswith("test's tool 'distinct' is left out (distinct: inputSchema: ") and "uniqueItems" in line


def test_every_failure_is_one_line_and_the_server_goes_on(test_server) -> None:
    assert test_server.call("add", {"a": 2, "b": 3}).text == "5"
    failed = test_server.call("fail", {"reason": "on purpose"})
    assert not failed.ok and "\n" not in failed.text and "fail" in failed.text
    started = time.monotonic()
    hung = test_server.call("hang", {})
    assert not hung.ok and "timed out" in hung.text and time.monotonic() - started < 5
    assert test_server.call("add", {"a": 1, "b": 1}).text == "2"  # the hung call did not stop the server


def test_a_huge_result_is_cut_and_a_picture_is_named(test_server) -> None:
    huge = test_server.call("huge", {"chars": 100_000})
    assert huge.ok and len(huge.text) < 8100 and "cut" in huge.note and "100000" in huge.note
    picture = test_server.call("picture", {})
    assert "image (image/png)" in picture.text and "not text" in picture.note


def test_a_server_that_crashes_mid_call_is_one_line_and_restarts() -> None:
    server = MCPServer.stdio("crashy", sys.executable, [TEST_SERVER], timeout=5)
    try:
        crashed = server.call("crash", {})
        assert not crashed.ok and "server stopped" in crashed.text and "\n" not in crashed.text
        assert server.call("add", {"a": 4, "b": 4}).text == "8"  # started again
    finally:
        server.close()
    assert not server.running


def test_a_server_that_does_not_start_says_why_in_one_line() -> None:
    with pytest.raises(MCPError, match=r"^MCP server gone \(/nonexistent/mcp\) did not start: .*No such file"):
        MCPServer.stdio("gone", "/nonexistent/mcp").start()
    script = "import sys; print('missing API key', file=sys.stderr); sys.exit(1)"
    box = Toolbox([MCPServer.stdio("broken", sys.executable, ["-c", script])])
    assert box.tools() == [] and box.notices == [
        f"MCP server broken ({sys.executable} -c {script}) did not start: missing API key"]


def test_a_toolbox_tries_a_broken_server_once_and_keeps_a_crashed_ones_tools() -> None:
    crashy = MCPServer.stdio("crashy", sys.executable, [TEST_SERVER], timeout=5)
    broken = MCPServer.stdio("broken", "/nonexistent/mcp")
    box = Toolbox([crashy, broken], start_on_use=False)
    try:
        assert box.tools() == [] and [s for s, _ in box.start(wait=False)] == ["crashy", "broken"]  # "starting"
        box.start()
        assert ["'distinct' is left out" in box.notices[0], "broken" in box.notices[1]] == [True, True]
        started = time.monotonic()
        assert box.tools(start=True) and len(box.notices) == 2  # not tried again, nothing said twice
        assert time.monotonic() - started < 0.5
        assert not box.run(ToolCall("c1", "crash", "{}")).ok and not crashy.running
        assert "add" in [t.name for t in box.tools()]  # listed while stopped: its next call starts it
        assert box.run(ToolCall("c2", "add", '{"a": 1, "b": 2}')).text == "3"
    finally:
        box.close()


def test_streamable_http(http_url: str) -> None:
    with MCPServer.http("web", http_url) as server:
        assert "add" in [t.name for t in server.tools]
        assert server.call("add", {"a": 20, "b": 22}).text == "42"


def test_python_functions_are_tools() -> None:
    def weather(city: str, days: int = 1, metric: bool = True) -> dict:
        """The forecast for a city.

        More text that is not the description."""
        return {"city": city, "days": days}

    tool = function_tool(weather)
    assert tool.description == "The forecast for a city."
    assert tool.parameters == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}
    box = Toolbox([weather])
    assert box.run(ToolCall("c1", "weather", '{"city": "Oslo"}')).text == '{"city": "Oslo", "days": 1}'
    bad = box.run(ToolCall("c2", "weather", '{"town": "Oslo"}'))
    assert not bad.ok and bad.text.startswith("weather failed: TypeError")


# --- config ----------------------------------------------------------------------------------------------------------

def test_config_servers(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[mcp.servers.time]\ncommand = "uvx"\nargs = ["mcp-server-time"]\nenv = { TZ = "UTC" }\n'
                    '[mcp.servers.web]\nurl = "http://127.0.0.1:9/mcp"\ntimeout = 5\n')
    settings = Settings.load(path)
    time_server, web = settings.mcp.server("time"), settings.mcp.server("web")
    assert (time_server.spec.command, time_server.spec.args, time_server.spec.env) == ("uvx", ("mcp-server-time",),
                                                                                      {"TZ": "UTC"})
    assert (web.spec.url, web.spec.timeout) == ("http://127.0.0.1:9/mcp", 5)
    with pytest.raises(ValueError, match="no MCP server named 'nope' in config.toml; configured: time, web"):
        settings.mcp.server("nope")
    for bad, says in (('[mcp.servers.x]\nargs = ["a"]\n', "either command"),
                      ('[mcp.servers.x]\ncommand = "a"\nurl = "http://h/"\n', "either command"),
                      ('[mcp.servers.x]\nurl = "ftp://h/"\n', "http://"),
                      ('[mcp.servers.x]\ncommand = "a"\ncwd = "/"\n', "mcp.servers.x.cwd")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=says):
            Settings.load(path)


# --- stored and exported -------------------------------------------------------------------------------------------

CALLS = ({"id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}', "round": 0, "source": "test",
          "result": "5", "ok": True},)


def test_calls_are_stored_and_a_version_3_database_keeps_everything(tmp_path: Path) -> None:
    db = tmp_path / "conversations.db"
    c = sqlite3.connect(db, isolation_level=None)
    for migrate in MIGRATIONS[:3]:
        migrate(c)
    c.execute("UPDATE schema_version SET version = 3")
    c.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('old', 1, 1)")
    c.execute("INSERT INTO messages (conversation_id, position, role, content, created_at, token_ids) "
              "VALUES (1, 0, 'user', 'hi', 1, NULL), (1, 1, 'assistant', 'hello', 1, '[1,2]')")
    # an alternative saved by version 3 (a tail's values lack the new column)
    c.execute("INSERT INTO forks VALUES (1, 1, 1, ?)", (json.dumps([{"messages": [
        ["assistant", "older", 1, "stop", None, None, None, None, None, None, None]], "forks": {}}, None]),))
    c.close()
    store = Store(db)
    assert store.version == 5
    assert [(m.content, m.token_ids, m.tool_calls) for m in store.messages(1)] == [("hi", (), ()),
                                                                                 ("hello", (1, 2), ())]
    store.select_branch(1, 1, 0)  # the old tail is written back as the active path
    assert [m.content for m in store.messages(1)] == ["hi", "older"]
    store.add_message(1, ChatMessage("assistant", "5 it is", tool_calls=CALLS))
    assert store.messages(1)[-1].tool_calls == CALLS


def test_export_shows_each_call_and_its_result() -> None:
    turns = [Turn(ChatMessage("user", "add 2 and 3")), Turn(ChatMessage("assistant", "It is 5.", tool_calls=CALLS))]
    text = markdown("t", turns)
    assert '**Tool call** `test.add` `{"a": 2, "b": 3}` — result\n\n```\n5\n```\n\nIt is 5.' in text


def test_a_reply_with_calls_is_what_the_model_saw() -> None:
    prompts = ChatMessage("assistant", "It is 5.", tool_calls=CALLS).as_prompts()
    assert [p["role"] for p in prompts] == ["assistant", "tool", "assistant"]
    assert prompts[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert prompts[1]["content"] == "5" and prompts[2]["content"] == "It is 5."


# --- with the model ----------------------------------------------------------------------------------------------

def test_engine_chat_calls_a_real_server_and_a_function(engine, test_server) -> None:
    asked = []

    def twice(n: int) -> int:
        """Double a number."""
        return 2 * n

    box = Toolbox([test_server, twice])
    box.disabled = {"fail", "hang", "crash", "huge", "picture"}  # a short prompt: add and twice
    chat = engine.chat(tools=box, tool_choice="required", profile=SamplingProfile(temperature=0), max_tool_steps=1,
                       approve=lambda call, source: asked.append((call.name, source)) or "once")
    events = list(chat.send("Add 2 and 3.", max_tokens=32))
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    results = [e for e in events if isinstance(e, ToolResultEvent)]
    assert calls and len(results) == len(calls) and asked[0] == (calls[0].call.name, "test")
    reply = chat.messages[-1]
    assert reply.role == "assistant" and reply.tool_calls[0]["name"] == calls[0].call.name
    assert reply.tool_calls[0]["result"] == results[0].outcome.text
    # the conversation goes on, the calls in its history
    assert chat.send("Thanks.", max_tokens=4, tool_choice="none").wait().finish_reason in ("stop", "length")
    assert len(chat.messages) == 4 and chat.messages[1].tool_calls == reply.tool_calls


def test_a_denied_or_failing_call_is_a_result_and_the_turn_goes_on(engine) -> None:
    def explode() -> str:
        """Always fails."""
        raise RuntimeError("kaboom")

    chat = engine.chat(tools=[explode], tool_choice="required", profile=SamplingProfile(temperature=0),
                       max_tool_steps=1)
    events = list(chat.send("Go.", max_tokens=24))
    [result] = [e for e in events if isinstance(e, ToolResultEvent)][:1]
    assert not result.outcome.ok and result.outcome.text == "explode failed: RuntimeError: kaboom"
    chat.approve = lambda call, source: "deny"
    events = list(chat.send("Again.", max_tokens=24, tool_choice="required"))
    denied = [e for e in events if isinstance(e, ToolResultEvent)][0]
    assert denied.decision == "deny" and denied.outcome.text == "the user denied this call of explode"


def _cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path, *argv: str
         ) -> tuple[int, str, str]:
    from mlxchat.app.cli import main

    config = tmp_path / "config" / "mlxchat"
    config.mkdir(parents=True, exist_ok=True)
    (config / "config.toml").write_text(f'[mcp.servers.test]\ncommand = {json.dumps(sys.executable)}\n'
                                        f'args = [{json.dumps(TEST_SERVER)}]\ntimeout = 2\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_without_a_terminal_or_yes_refuses_in_one_line(monkeypatch, capsys, tmp_path: Path) -> None:
    rc, out, err = _cli(monkeypatch, capsys, tmp_path, "generate", "hi", "--mcp", "test")
    assert rc == 2 and err == ("mlxchat: error: --mcp asks before each tool call and there is no terminal to ask "
                               "on: pass --yes to run every call without asking\n")
    rc, _, err = _cli(monkeypatch, capsys, tmp_path, "generate", "hi", "--mcp", "nope", "--yes")
    assert rc == 2 and err == "mlxchat: error: no MCP server named 'nope' in config.toml; configured: test\n"
    rc, _, err = _cli(monkeypatch, capsys, tmp_path, "generate", "hi", "--tool-choice", "required")
    assert rc == 2 and err.startswith("mlxchat: error: --tool-choice needs tools") and err.count("\n") == 1


def test_generate_mcp_json_holds_each_call(engine, monkeypatch, capsys, tmp_path: Path) -> None:
    from mlxchat.core import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model=None, **kw: engine))
    rc, out, err = _cli(monkeypatch, capsys, tmp_path, "generate", "Add 2 and 3.", "--mcp", "test",
                        "--tool-choice", "required", "--yes", "--json", "--max-tokens", "32", "--temperature", "0")
    assert rc == 0 and "Traceback" not in err, err
    data = json.loads(out)
    [first, *_] = data["tool_calls"]
    assert first["server"] == "test" and isinstance(first["arguments"], dict) and "result" in first
    assert f"mlxchat: tool call test.{first['name']} " in err
