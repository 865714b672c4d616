"""`mlxchat generate --mcp NAME [--mcp NAME...] [--tool-choice auto|required|none] [--yes]`: the tool loop of
core/chat/tool_loop.py on the command line, with the MCP servers of config.toml's ``[mcp.servers.NAME]``.

Each call is shown on stderr (its name and arguments, then its result in one line) and, without ``--yes``, asked on
the terminal (allow once / always for this tool / deny); with no terminal to ask on and no ``--yes`` the command
refuses in one line before loading anything. ``--json`` holds each call, its arguments and its result."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

TOOL_CHOICES = ("auto", "required", "none")
RESULT_SHOWN = 200  # characters of a result shown on stderr (all of it goes to the model and into --json)


def add_tool_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mcp", action="append", default=[], metavar="NAME",
                   help="let the model call the tools of config.toml's [mcp.servers.NAME] (repeatable)")
    p.add_argument("--tool-choice", choices=TOOL_CHOICES,
                   help="with --mcp: auto (the model decides; the default), required (its first reply must call a "
                        "tool) or none")
    p.add_argument("--yes", "-y", action="store_true", help="with --mcp: run every tool call without asking")


def tool_servers(args: argparse.Namespace) -> list[Any]:
    """The --mcp servers (not started), checked before the model loads: a bad flag or name raises ValueError."""
    if not args.mcp:
        if args.tool_choice is not None:
            raise ValueError("--tool-choice needs tools: add --mcp NAME (an [mcp.servers.NAME] of config.toml)")
        return []
    if not args.yes and not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise ValueError("--mcp asks before each tool call and there is no terminal to ask on: pass --yes to run "
                         "every call without asking")
    from mlxchat.core.locations import Locations

    from .config import Settings

    settings = Settings.load(Locations.resolve().config_file)  # a bad config.toml is an error here (ConfigError)
    names = list(dict.fromkeys(args.mcp))
    return [settings.mcp.server(name) for name in names]


def ask_on_terminal(call: Any, source: str) -> str:  # noqa: ANN401 - core.decode.tools.ToolCall
    """Ask the user on the terminal whether `call` may run: "once", "always" or "deny"."""
    while True:
        print(f"mlxchat: run {source}.{call.name} {call.arguments}? [y]es once, [a]lways for this tool, [n]o: ",
              end="", file=sys.stderr, flush=True)
        try:
            answer = input().strip().lower()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return "deny"
        if answer in ("y", "yes", ""):
            return "once"
        if answer in ("a", "always"):
            return "always"
        if answer in ("n", "no"):
            return "deny"


def start_with_tools(engine: Any, prompt: str, profile: Any, args: argparse.Namespace,  # noqa: ANN401
                     servers: list[Any]) -> Any:  # noqa: ANN401 - core types
    """The turn as a ToolStream (core/chat/tool_loop.py) over `servers`."""
    from mlxchat.core.chat.tool_loop import AlwaysAllowed

    approve = None if args.yes else AlwaysAllowed(ask_on_terminal)
    chat = engine.chat(system=args.system, profile=profile, tools=servers, tool_choice=args.tool_choice or "auto",
                       approve=approve, speculative=args.speculative or "off",
                       reasoning_budget=getattr(args, "reasoning_budget", None),
                       enable_thinking=getattr(args, "enable_thinking", None))
    return chat.send(prompt, max_tokens=args.max_tokens, stop=args.stop)


def show_event(event: Any) -> bool:  # noqa: ANN401 - a stream's event
    """Write a tool event's line to stderr; False for any other event."""
    from mlxchat.core.chat.tool_loop import ToolCallEvent, ToolNotice, ToolResultEvent

    if isinstance(event, ToolCallEvent):
        print(f"\nmlxchat: tool call {event.source}.{event.call.name} {event.call.arguments}", file=sys.stderr)
    elif isinstance(event, ToolResultEvent):
        o = event.outcome
        text = " ".join(o.text.split())
        shown = text if len(text) <= RESULT_SHOWN else text[:RESULT_SHOWN] + "…"
        status = "result" if o.ok else ("denied" if event.decision == "deny" else "failed")
        print(f"mlxchat: {status}: {shown}{f' ({o.note})' if o.note else ''}", file=sys.stderr)
    elif isinstance(event, ToolNotice):
        print(f"mlxchat: note: {event.message}", file=sys.stderr)
    else:
        return False
    return True


def calls_json(stream: Any) -> list[dict[str, Any]]:  # noqa: ANN401 - a ToolStream
    """--json's ``tool_calls``: each call, its arguments, and its result."""
    out = []
    for call, source, outcome, decision in getattr(stream, "calls", ()):
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = call.arguments
        out.append({"id": call.id, "name": call.name, "server": source, "arguments": arguments,
                    "decision": decision, **outcome.as_dict()})
    return out


def close_servers(servers: list[Any]) -> None:
    for server in servers:
        server.close()
