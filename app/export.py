"""A chat as Markdown: the title, the model and profile, then every message in order, with a system prompt that was
changed mid-chat shown where it was set (it applies to the turns after it, not to the whole chat)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .formatting import profile_summary, stats_line, thought_line
from .turns import first_reply

if TYPE_CHECKING:
    from mlxchat.core.sampling.profile import SamplingProfile

    from .turns import Turn  # from turns.py, where it lives: conversation.py imports this module


def slug(text: str) -> str:
    return re.sub(r"[^\w]+", "-", text.lower()).strip("-")[:40] or "chat"


def default_path(folder: Path, title: str, now: float | None = None) -> Path:
    """A new file in ``folder`` named after the chat and the time, e.g. ``capital-of-france-20261203-101500.md``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return folder / f"{slug(title)}-{stamp}.md"


def markdown(title: str, turns: Sequence["Turn"], *, system_prompt: str = "", model: str | None = None,
             profile: "SamplingProfile | None" = None, now: float | None = None) -> str:
    """The chat as Markdown. ``system_prompt`` is the one the chat started with; later ones are system turns."""
    lines = [f"# {title}", ""]
    if model:
        lines.append(f"- model: {model}")
    if profile is not None:
        lines.append(f"- profile: {profile.name or 'custom'} ({profile_summary(profile)})")
    lines += [f"- exported: {time.strftime('%Y-%m-%d %H:%M', time.localtime(now))}", ""]
    if system_prompt:
        lines += ["## System", "", system_prompt, ""]
    for turn in turns:
        if turn.streaming or turn.unsent:
            continue
        if turn.role == "system":
            lines += ["## System (from here on)", "", turn.content, ""]
            continue
        lines += [f"## {'You' if turn.role == 'user' else 'Assistant'}", ""]
        if turn.role == "assistant" and turn.message.reasoning:  # a thinking model's reasoning, folded
            title = thought_line(turn.message.metrics)
            lines += ["<details>", f"<summary>{title}</summary>", "", turn.message.reasoning.rstrip(), "",
                      "</details>", ""]
        lines += tool_call_lines(turn.message.tool_calls)
        lines += [turn.content.rstrip(), ""]
        if turn.role == "assistant":
            m = turn.message
            stats = f"error: {turn.error}" if turn.error else stats_line(m.metrics, m.finish_reason,
                                                                         m.profile.get("name"),
                                                                         first_reply=turn is first_reply(turns))
            lines += [f"*{stats}*", ""]
    return "\n".join(lines)


def tool_call_lines(calls: Sequence[dict]) -> list[str]:
    """A reply's tool calls as Markdown: each call's tool and arguments, then its result in a fenced block."""
    lines: list[str] = []
    for c in calls:
        result = c.get("result")
        status = "not run" if result is None else ("result" if c.get("ok", True) else "failed")
        source = f"{c['source']}." if c.get("source") else ""
        lines += [f"**Tool call** `{source}{c.get('name', '?')}` `{c.get('arguments', '{}')}` — {status}"
                  + (f" ({c['note']})" if c.get("note") else ""), ""]
        if result is not None:
            fence = "````" if "```" in result else "```"
            lines += [fence, result.rstrip(), fence, ""]
    return lines


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
