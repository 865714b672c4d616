"""Pilot helpers shared by the TUI tests: wait for a condition, send a message and wait for its reply."""

from __future__ import annotations

import time


async def wait_for(pilot, condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def type_and_send(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


async def reply(pilot, text: str, timeout: float = 60.0):
    """Type `text` into the chat input, send it, and return the finished reply's result."""
    screen = pilot.app.chat_screen
    before = screen.last_result
    screen.input.focus()
    await type_and_send(pilot, text)
    await wait_for(pilot, lambda: screen.last_result is not before and not screen.busy, timeout, "the reply")
    return screen.last_result
