"""A reply's tool calls in the transcript: one collapsed block per call (its tool, arguments and state as the
title; its result inside), above the reply's text."""

from __future__ import annotations

from typing import Any

from textual.containers import Vertical
from textual.widgets import Collapsible, Static

from ..chat_tools import call_title


class ToolCallBlock(Collapsible):
    def __init__(self, record: dict[str, Any]) -> None:
        self.record = dict(record)
        super().__init__(Static(self._body(), classes="tool-result", markup=False), title=call_title(record),
                         collapsed=True, classes="tool-call")
        self._mark()

    def _body(self) -> str:
        result = self.record.get("result")
        return "(waiting for approval or the tool)" if result is None else str(result)

    def _mark(self) -> None:
        self.set_class(self.record.get("result") is not None and not self.record.get("ok", True), "failed")

    def update(self, record: dict[str, Any]) -> None:
        self.record = dict(record)
        self.title = call_title(record)
        self.query_one(".tool-result", Static).update(self._body())
        self._mark()


class ToolCalls(Vertical):
    """The calls of one reply, in order."""

    DEFAULT_CSS = "ToolCalls { height: auto; }"

    def __init__(self, records: tuple[dict[str, Any], ...] | list[dict[str, Any]] = ()) -> None:
        super().__init__(classes="tool-calls")
        self._initial = list(records)

    def compose(self):  # noqa: ANN201 - ComposeResult
        for record in self._initial:
            yield ToolCallBlock(record)

    async def show(self, record: dict[str, Any]) -> None:
        """Add the call `record` or update its block (matched by id)."""
        for block in self.query_children(ToolCallBlock):
            if block.record.get("id") == record.get("id"):
                block.update(record)
                return
        await self.mount(ToolCallBlock(record))
