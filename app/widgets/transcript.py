"""The transcript: user and assistant messages, the reply streaming in as Markdown, stats under each reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from markdown_it import MarkdownIt
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.geometry import Size
from textual.message import Message
from textual.widgets import Button, Markdown, Static
from textual.visual import VisualType, visualize
from textual.widget import Widget
from textual.widgets.markdown import MarkdownFence

from .. import clipboard, inspector
from ..formatting import wrap_fields
from ..turns import step_to
from ..textual_compat import MarkdownParagraph, OneLayout
from .inspector import TokenStrip

if TYPE_CHECKING:
    from mlxchat.core.trace import TokenTrace

    from ..conversation import Turn

_PARSER = MarkdownIt("gfm-like")  # stateless between parses; Markdown would otherwise build one per append


def _parser() -> MarkdownIt:
    return _PARSER


class ReplyParagraph(OneLayout, MarkdownParagraph):
    """A Markdown paragraph that asks for a layout only when its new text changes its height.

    While a reply streams, each batch extends the last paragraph; Textual's ``Static.update`` always asks for a
    layout, and a layout reflows the whole screen (every widget on it). Most batches add words
    to the paragraph's last line, so the paragraph measures its new text at its current width and repaints in place
    when the height is the same (``update(layout=False)``, which Textual offers for exactly this case)."""

    _measured: tuple[int, int] | None = None  # (width, height) of the text last set, as measured here

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        # Each batch's text arrives here through MarkdownBlock.set_content.
        height_changes = self._height_changes(content)  # measured always: the next batch compares with it
        super().update(content, layout=layout and height_changes)

    def _height_changes(self, content: VisualType) -> bool:
        width, height = self.size
        if not (self.is_mounted and width and height):
            self._measured = None
            return True  # not laid out yet: nothing to compare with
        try:
            # Both heights measured the way Textual measures this widget's content (its visual, its styles, the
            # width of its content area), so they can be compared.
            old = self._measured
            if old is None or old[0] != width:
                old = (width, self.visual.get_height(self.styles, width))
            new = visualize(self, content).get_height(self.styles, width)
        except Exception:  # noqa: BLE001 - it cannot be measured: take the safe path
            self._measured = None
            return True
        self._measured = (width, new)
        return new != old[1] or old[1] != height


class ReplyMarkdown(OneLayout, Markdown):
    """The reply's Markdown: Textual's, with paragraphs that repaint without a layout when they keep their height."""

    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": ReplyParagraph}


class FieldsLine(Widget):
    """A reply's stats line: its fields (value and unit, e.g. "118 MiB") wrap as wholes, never mid-field, which
    Textual's word wrap would do at any space."""

    DEFAULT_CSS = "FieldsLine { height: auto; }"

    def __init__(self, text: str = "", *, classes: str | None = None) -> None:
        super().__init__(classes=classes)
        self.text = text

    def update(self, text: str) -> None:
        self.text = text
        self.refresh(layout=True)

    def _content(self, width: int) -> Content:
        return Content("\n".join(wrap_fields(self.text, width)))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return self._content(width).get_height(self.styles, width)

    def render(self) -> Content:
        return self._content(self.content_size.width)


class MessageView(OneLayout, Vertical, can_focus=True):
    """One message. Focus it (a click, or Tab to the transcript and ↑/↓) to copy it (c) or its code blocks (k); a
    reply with branches shows ``< 1/2 >`` and [ / ] switch between them."""

    BINDINGS = [
        Binding("c", "copy_message", "Copy message", id="copy_message"),
        Binding("k", "copy_code", "Copy code block", id="copy_code_block"),
        # Not in the footer: a reply with branches says so in its label ("< 1/2 >  [ ] switch").
        Binding("left_square_bracket", "branch(-1)", "Previous branch", id="branch_previous", show=False),
        Binding("right_square_bracket", "branch(1)", "Next branch", id="branch_next", show=False),
    ]

    @dataclass
    class BranchStep(Message):
        """[ or ]: show the previous / next branch of this reply."""

        view: "MessageView"
        step: int

    _parts: list[str]  # the text, in the pieces it came in since it was last read

    def __init__(self, role: str, text: str = "", *, label: str | None = None, stats: str = "",
                 turn: "Turn | None" = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.text = text
        self.label = label or {"user": "You", "assistant": "Assistant"}.get(role, role.title())
        self.stats = stats
        self.turn = turn  # the controller's turn it shows
        self.finish_reason: str | None = None
        self._streaming = False
        self._code_index = 0

    def compose(self) -> ComposeResult:
        yield Static(self.label, classes="role", markup=False)
        if self.role == "assistant":
            yield ReplyMarkdown(self.text, classes="body", open_links=False, parser_factory=_parser)
        else:
            yield Static(self.text, classes="body", markup=False)
        yield FieldsLine(self.stats, classes="stats")

    @property
    def streaming(self) -> bool:
        return self._streaming

    @property
    def text(self) -> str:
        """The message's text. A streaming reply's batches are joined when it is read (to copy it, or at the end),
        not once per batch: joining all of them for each one cost O(reply) per batch, O(reply²) per reply."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @text.setter
    def text(self, text: str) -> None:
        self._parts = [text]

    # --- streaming -----------------------------------------------------------------------------------------------

    def start_stream(self) -> None:
        """Batches now append to the text this view shows (a reply shown again mid-stream keeps what came)."""
        self._streaming = True
        self.add_class("streaming")

    async def write(self, text: str) -> None:
        """Append a batch of the reply. Markdown.append re-parses only from the last top-level block on; it is
        awaited here, inside the caller's ``App.batch_update``, rather than handed to a MarkdownStream task (another
        task and queue per reply, and a screen update that could land between the text and the stats line). The
        bridge thread already coalesces what arrives while the UI is busy, which was MarkdownStream's job."""
        if not self._streaming:
            self.start_stream()
        if not text:
            return
        self._parts.append(text)
        await self.query_one(".body", Markdown).append(text)

    async def finish(self, text: str, stats: str, finish_reason: str | None = None) -> None:
        """End the stream and parse the final text once, in full."""
        self._streaming = False
        self.remove_class("streaming")
        self.text = text
        self.finish_reason = finish_reason
        await self.query_one(".body", Markdown).update(text)
        self.set_stats(stats)

    async def fail(self, error: str) -> None:
        partial = self.text
        await self.finish(partial, "")
        self.add_class("failed")
        self.set_stats(f"error: {error}")

    def set_label(self, label: str) -> None:
        self.label = label
        self.query_one(".role", Static).update(label)

    def action_branch(self, step: int) -> None:
        self.post_message(self.BranchStep(self, step))

    # --- the heat view -------------------------------------------------------------------------------------------

    @property
    def strip(self) -> TokenStrip | None:
        """The heat view's token strip, while it is shown."""
        strips = self.query(TokenStrip)
        return strips.first() if strips else None

    async def show_heat(self, traces: "list[TokenTrace]") -> TokenStrip:
        """Show the reply as its tokens shaded by probability (in place of the Markdown), with a legend."""
        await self.hide_heat()
        strip = TokenStrip(traces)
        legend = Static(inspector.heat_legend(), classes="heat-legend", markup=False)
        await self.mount(strip, legend, after=self.query_one(".body"))
        self.add_class("heat")
        return strip

    async def hide_heat(self) -> None:
        self.remove_class("heat")
        await self.query(".token-strip, .heat-legend").remove()

    def set_stats(self, stats: str) -> None:
        if stats != self.stats:
            self.stats = stats
            self.query_one(".stats", FieldsLine).update(stats)

    # --- copying -------------------------------------------------------------------------------------------------

    def code_blocks(self) -> list[str]:
        return [f.code for f in self.query(MarkdownFence)]

    def action_copy_message(self) -> None:
        how = clipboard.copy(self.app, self.text)
        self.app.notify(f"Copied the message ({len(self.text)} characters) {how}")

    def action_copy_code(self) -> None:
        blocks = self.code_blocks()
        if not blocks:
            self.app.notify("This message has no code block", severity="warning")
            return
        i = self._code_index % len(blocks)
        self._code_index += 1
        how = clipboard.copy(self.app, blocks[i])
        self.app.notify(f"Copied code block {i + 1}/{len(blocks)} {how}")

    @on(events.Click)
    def _click_code(self, event: events.Click) -> None:
        # A click on a code block copies it.
        node = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                self.app.notify(f"Copied the code block {clipboard.copy(self.app, node.code)}")
                return
            node = node.parent


class Notice(Vertical):
    """An error or information line in the transcript, optionally with action buttons."""

    class Action(Message):
        def __init__(self, notice: "Notice", action: str) -> None:
            super().__init__()
            self.notice, self.action = notice, action

        @property
        def control(self) -> "Notice":
            return self.notice

    def __init__(self, text: str, *, severity: str = "error", actions: dict[str, str] | None = None) -> None:
        super().__init__(classes=f"notice {severity}")
        self.text = text
        self.actions = actions or {}

    def compose(self) -> ComposeResult:
        yield Static(self.text, markup=False)
        if self.actions:
            with Horizontal(classes="notice-actions"):
                for action, label in self.actions.items():
                    yield Button(label, id=f"notice-{action}", compact=True)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.post_message(self.Action(self, (event.button.id or "").removeprefix("notice-")))


class Transcript(VerticalScroll):
    """The scrolling list of messages; anchored to the bottom while a reply streams. Tab reaches it; ↑/↓ then move
    the focus from message to message (each one's keys: c, k, [ and ]), page up/down scroll."""

    BINDINGS = [
        Binding("up", "step_message(-1)", "Previous message (focus it)", id="message_previous", show=False),
        Binding("down", "step_message(1)", "Next message (focus it)", id="message_next", show=False),
    ]

    @property
    def messages(self) -> list[MessageView]:
        return list(self.query_children(MessageView))

    def last(self, role: str | None = None) -> MessageView | None:
        for view in reversed(self.messages):
            if role is None or view.role == role:
                return view
        return None

    def action_step_message(self, step: int) -> None:
        messages = self.messages
        focused = self.screen.focused
        current = messages.index(focused) if isinstance(focused, MessageView) and focused in messages else None
        if (target := step_to(len(messages), current, step)) is not None:
            messages[target].focus()  # Textual scrolls a focused widget into view

    async def add(self, view: MessageView | Notice) -> MessageView | Notice:
        await self.mount(view)
        self.anchor()
        return view

    async def clear(self) -> None:
        await self.remove_children()

    async def drop_from(self, view: MessageView) -> None:
        """Remove ``view`` and everything after it."""
        children = list(self.children)
        await self.remove_children(children[children.index(view):])
