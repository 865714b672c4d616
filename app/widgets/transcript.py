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
from textual.geometry import Region, Size
from textual.message import Message
from textual.widgets import Button, Collapsible, Markdown, Static
from textual.strip import Strip
from textual.style import Style
from textual.visual import RenderOptions
from textual.widget import Widget
from textual.widgets.markdown import MarkdownFence

from .. import clipboard, inspector
from ..formatting import wrap_fields
from ..turns import step_to
from ..textual_compat import OneLayout
from .inspector import TokenStrip
from .tool_calls import ToolCalls

if TYPE_CHECKING:
    from mlxchat.core.sampling.trace import TokenTrace

    from ..conversation import Turn

_PARSER = MarkdownIt("gfm-like")  # stateless between parses; Markdown would otherwise build one per parse


def _parser() -> MarkdownIt:
    return _PARSER


class OpenBlock(OneLayout, Widget):
    """The block of a streaming reply that is still being written, as its plain text: one lightweight widget that
    each batch extends, parsed as Markdown only once it closes.

    Drawn with Textual's line API: a batch wraps again only the text's last line and repaints only the rows it
    changed (a ``Static`` wrapped and repainted its whole text every batch). A layout reflows and repaints the whole
    screen, so the block keeps rows of ``room`` for its text: from its first layout, enough that the reply fills the
    transcript below the message it answers (the question stays at the top of the screen, the reply streams in
    below it, nothing scrolls), and at least two thirds of it; past that, a third of the screen more at a time.
    Growing the room is the only layout a streaming reply asks for."""

    DEFAULT_CSS = "OpenBlock { height: auto; }"

    def __init__(self, text: str = "", *, classes: str | None = None) -> None:
        super().__init__(classes=classes)
        self.text = text
        self.room = 0  # rows kept for the text, beyond the slack (its height is the larger of the text and `rows_kept`)
        self._filled = False  # the room was set from the screen (see fill_room)
        self._width = 0  # what _rows were wrapped to
        self._forget()

    def _forget(self) -> None:
        """Drop the rows: the text, its width or its style changed."""
        self._rows: list[Strip] = []
        self._whole = 0  # text[:_whole] is whole lines (up to a newline), wrapped into _rows[:_whole_rows]
        self._whole_rows = 0
        self._wrapped = -1  # the length of the text _rows show

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._forget()  # another theme: the rows' colours

    def slack(self) -> int:
        """The least room below the text: a sixth of the terminal's height (4 lines at 24 rows, 8 from 48)."""
        return max(2, min(8, self.screen.size.height // 6))

    def rows_kept(self) -> int:
        """The rows the text may fill without a layout: the room, and never less than the slack."""
        return max(self.room, self.slack())

    def on_resize(self) -> None:
        if not self._filled:  # the first layout placed the reply: fill the screen below its question, once
            self._filled = True
            self.call_after_refresh(self.fill_room)  # once its message has been placed too

    def fill_room(self) -> None:
        """Room enough that the message before this reply sits at the top of the transcript's viewport and the reply
        ends at its bottom: what a layout placed is measured, so margins and labels count. After a long question, at
        least two thirds of the viewport (the question's end stays in view): most replies then stream with no layout."""
        transcript = next((a for a in self.ancestors if isinstance(a, Transcript)), None)
        reply = next((a for a in self.ancestors if isinstance(a, MessageView)), None)
        if transcript is None or reply is None or reply not in transcript.children:
            return
        views = transcript.messages
        at = views.index(reply)
        # In the transcript's own coordinates: where it is scrolled to may lag the layout that placed the reply.
        top = (views[at - 1] if at else reply).virtual_region.y
        shown = reply.virtual_region_with_margin.bottom - top
        viewport = transcript.scrollable_content_region.height
        room = max(self.size.height + viewport - shown, viewport * 2 // 3)
        if room != self.room:
            self.room = room
            self.refresh(layout=True)

    def extend(self, text: str) -> None:
        """Append ``text``: its rows are wrapped and repainted; a layout only when they outgrow the room."""
        start = self._whole_rows
        self.text += text
        self._wrap(self._width)
        self._repaint(start)

    def replace(self, text: str) -> None:
        """Show ``text`` in place of what the block had (its start went into a closed block): the rows below the
        text stay as many as they were, so the reply keeps its height across the screen's layout for the new block."""
        below = max(0, self.rows_kept() - len(self._rows))
        self.text = text
        self._forget()
        self._wrap(self._width)
        self.room = len(self._rows) + below
        self.refresh(layout=True)

    def _repaint(self, start: int) -> None:
        if len(self._rows) > self.rows_kept():
            self.room = len(self._rows) + max(self.slack(), self.screen.size.height // 3)
            self.refresh(layout=True)
        elif self._width:
            self.refresh(Region(0, start, self._width, len(self._rows) - start))

    def _wrap(self, width: int) -> None:
        """Bring ``_rows`` up to the text at ``width``: whole lines are wrapped once, the last line every time."""
        if width != self._width:
            self._width = width
            self._forget()
        if not width or self._wrapped == len(self.text):
            return
        self._wrapped = len(self.text)
        cut = self.text.rfind("\n") + 1
        del self._rows[self._whole_rows:]
        if cut > self._whole:
            self._rows += self._strips(self.text[self._whole:cut - 1], width)
            self._whole, self._whole_rows = cut, len(self._rows)
        if cut < len(self.text):
            self._rows += self._strips(self.text[cut:], width)

    def _strips(self, text: str, width: int) -> list[Strip]:
        # As shown: plain text (never read as markup: "[/b]" in a reply raised), wrapped as a Static wraps it. Plain
        # text has no named styles to look up, so Style.parse is never called.
        return Content(text).render_strips(width, None, self.visual_style, RenderOptions(Style.parse, self.styles))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        self._wrap(width)
        return max(len(self._rows), self.rows_kept())

    def render_line(self, y: int) -> Strip:
        self._wrap(self.size.width)
        if y < len(self._rows):
            return self._rows[y]
        return Strip.blank(self.size.width, self.visual_style.rich_style)


def closed_length(text: str) -> int:
    """How much of a streaming reply's Markdown ``text`` is blocks that what follows can no longer change: all
    before its last top-level block (what Textual's ``Markdown.append`` assumes too, re-parsing from there). 0 while
    the text is one block."""
    starts = [t.map[0] for t in _PARSER.parse(text) if t.level == 0 and t.map is not None and t.nesting >= 0]
    if not starts or starts[-1] == starts[0]:
        return 0
    offset = 0
    for _ in range(starts[-1]):
        offset = text.index("\n", offset) + 1
    return offset


# Blocks whose Textual widgets cost ~50 ms of the UI thread to mount (a table's cells, a code block's highlighting):
# while the reply streams they stay as their text, and are drawn once with the whole reply at its end.
COSTLY_BLOCKS = ("fence", "table_open", "code_block")


class ClosedText(OneLayout, Static):
    """Closed blocks shown as their text while the reply streams (see COSTLY_BLOCKS)."""


class MessageText(OneLayout, Static):
    """A message's label, or a user's text: plain text that grows only with its content (no second layout)."""


def closed_block(text: str) -> Widget:
    """The widget for closed blocks of a streaming reply: Markdown, or their text where that costs too much now."""
    if any(t.type in COSTLY_BLOCKS for t in _PARSER.parse(text)):
        return ClosedText(text.rstrip("\n"), classes="closed-block closed-text", markup=False)
    return ReplyMarkdown(text, classes="closed-block", open_links=False, parser_factory=_parser)


class StreamedReply(OneLayout, Vertical):
    """A reply as it streams: closed blocks parsed once, as Markdown, when they close (code blocks and tables as
    their text, see COSTLY_BLOCKS), and the open one as plain text (``OpenBlock``). Appending to one Markdown widget
    parsed and rendered its open block again on every batch (a code block highlighted again, a table laid out
    again, its widgets mounted again): ~20 ms of the UI thread a batch on a reply with code blocks, where prose costs
    ~3, and the UI thread takes that CPU from decode (the bench's TUI Markdown row). The finished reply is parsed
    once, in full, by its ``ReplyMarkdown``."""

    DEFAULT_CSS = "StreamedReply { height: auto; }"
    # Closed blocks wait for this many lines, then mount together: each mount costs two layouts of the screen (the
    # block, then Textual's Markdown mounts its own blocks), where repainting the open block's lines costs ~1 ms.
    MIN_LINES = 24

    def __init__(self, text: str = "") -> None:
        super().__init__(classes="streamed")
        self._tail = OpenBlock(text, classes="open-block")  # the text not yet in a closed block

    def compose(self) -> ComposeResult:
        yield self._tail

    async def append(self, text: str) -> None:
        if not self.is_attached:  # removed (the app quits) while a batch was on its way: nothing left to draw
            return
        tail = self._tail
        opened = tail.text + text
        # Closed blocks of MIN_LINES lines need that many newlines in the open text: no parse before that, or for a
        # batch that ends no line.
        if ("\n" in text and opened.count("\n") >= self.MIN_LINES and (cut := closed_length(opened))
                and opened.count("\n", 0, cut) >= self.MIN_LINES):
            await self.mount(closed_block(opened[:cut]), before=tail)
            tail.replace(opened[cut:])
            return
        tail.extend(text)


class ThinkingBlock(Collapsible):
    """A thinking model's reasoning, above its answer: collapsed to one line ("thought for 3.2 s · 412 tokens"),
    expanded (a click, or Enter on its title) to read it. It streams in while the model thinks."""

    DEFAULT_CSS = "ThinkingBlock { height: auto; }"

    def __init__(self, text: str = "", title: str = "thinking…") -> None:
        self._parts = [text]
        super().__init__(Static(text, classes="thinking-text", markup=False), title=title, collapsed=True,
                         classes="thinking")

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0]

    def append(self, text: str) -> None:
        self._parts.append(text)
        if not self.collapsed:  # a collapsed block draws nothing: its text is set when it opens, or at the end
            self.query_one(".thinking-text", Static).update(self.text)

    def show_all(self) -> None:
        self.query_one(".thinking-text", Static).update(self.text)

    def _watch_collapsed(self, collapsed: bool) -> None:
        super()._watch_collapsed(collapsed)
        if not collapsed and self.is_mounted:
            self.show_all()


class ReplyMarkdown(OneLayout, Markdown):
    """A reply's Markdown (a finished reply, or a streaming one's closed blocks): Textual's, laid out once a size."""


class FieldsLine(OneLayout, Widget):
    """A reply's stats line: its fields (value and unit, e.g. "118 MiB") wrap as wholes, never mid-field, which
    Textual's word wrap would do at any space."""

    DEFAULT_CSS = "FieldsLine { height: auto; }"

    def __init__(self, text: str = "", *, classes: str | None = None) -> None:
        super().__init__(classes=classes)
        self.text = text

    def update(self, text: str) -> None:
        """Show ``text``: repainted in place while it takes as many lines as before ("prefill 96/512", then
        "generating…" each batch); the screen is laid out again only when its height changes."""
        width = self.content_size.width
        before = self._content(width).get_height(self.styles, width) if width else None
        self.text = text
        self.refresh(layout=before is None or self._content(width).get_height(self.styles, width) != before)

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
                 turn: "Turn | None" = None, reasoning: str = "", thought: str = "", streaming: bool = False) -> None:
        """``streaming``: a reply still coming, shown from the start as it streams (no second layout at its first
        batch)."""
        super().__init__(classes=f"message {role}" + (" streaming" if streaming else ""))
        self.role = role
        self.text = text
        self.label = label or {"user": "You", "assistant": "Assistant"}.get(role, role.title())
        self.stats = stats
        self.turn = turn  # the controller's turn it shows
        self.finish_reason: str | None = None
        # What shows the reply while it streams (its text so far, then each batch); None once it is final.
        self._stream = StreamedReply(text) if streaming else None
        self._code_index = 0
        self.reasoning, self.thought = reasoning, thought  # a thinking model's reasoning, and its block's title

    def compose(self) -> ComposeResult:
        yield MessageText(self.label, classes="role", markup=False)
        if self.reasoning:
            yield ThinkingBlock(self.reasoning, self.thought or "thought")
        if self.role == "assistant" and self.turn is not None and self.turn.message.tool_calls:
            yield ToolCalls(self.turn.message.tool_calls)
        if self.role == "assistant" and self._stream is not None:
            yield ReplyMarkdown("", classes="body", open_links=False, parser_factory=_parser)
            yield self._stream
        elif self.role == "assistant":
            yield ReplyMarkdown(self.text, classes="body", open_links=False, parser_factory=_parser)
        else:
            yield MessageText(self.text, classes="body", markup=False)
        yield FieldsLine(self.stats, classes="stats")

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

    async def write(self, text: str) -> None:
        """Append a batch of the reply (the view was made ``streaming``) to its ``StreamedReply``. Awaited inside the
        caller's ``App.batch_update``, so the text and the stats line change in one screen update; the bridge thread
        coalesces what arrives while the UI is busy."""
        assert self._stream is not None, "a reply streams into a view made with streaming=True, until it finishes"
        if not text:
            return
        self._parts.append(text)
        if self.is_attached:  # else the app is quitting: the reply is saved from its parts, nothing more is drawn
            await self._stream.append(text)

    @property
    def thinking(self) -> ThinkingBlock | None:
        blocks = self.query(ThinkingBlock)
        return blocks.first() if blocks else None

    async def think(self, text: str, title: str) -> None:
        """Append a batch of a thinking model's reasoning to its block (made by the first batch)."""
        block = self.thinking
        if block is None:
            block = ThinkingBlock("", title)
            await self.mount(block, before=self.query_one(".body"))
        self.reasoning += text
        block.append(text)
        self.set_thought(title)

    def set_thought(self, title: str) -> None:
        """The thinking block's title ("thought for 3.2 s · 412 tokens")."""
        self.thought = title
        if (block := self.thinking) is not None:
            block.title = title

    async def finish(self, text: str, stats: str, finish_reason: str | None = None) -> None:
        """End the stream and parse the final text once, in full."""
        self.remove_class("streaming")
        self.text = text
        self.finish_reason = finish_reason
        if self._stream is not None:
            # The reply keeps the screen's room it streamed into until the next message: the screen stays still
            # when the reply ends, rather than sliding the conversation down under a short reply. Never more than the
            # screen: a reply that outgrew it ends at the bottom, with no blank rows of room below it.
            kept = self.outer_size.height
            if isinstance(self.parent, Transcript) and (screen := self.parent.scrollable_content_region.height):
                kept = min(kept, screen)
            self.styles.min_height = kept
            await self._stream.remove()
            self._stream = None
        await self.query_one(".body", Markdown).update(text)
        self.set_stats(stats)

    async def fail(self, error: str) -> None:
        partial = self.text
        await self.finish(partial, "")
        self.add_class("failed")
        self.set_stats(f"error: {error}")

    async def show_tool_call(self, record: dict) -> None:
        """Show a call of this reply (its tool and arguments), or its result once it has one: a collapsed block
        above the reply's text (app/widgets/tool_calls.py)."""
        calls = self.query_children(ToolCalls)
        if not calls:
            await self.mount(ToolCalls(), before=self.query_one(".body"))
        await self.query_children(ToolCalls).first().show(record)

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


class Transcript(OneLayout, VerticalScroll):
    """The scrolling list of messages; anchored to the bottom while a reply streams. Tab reaches it; ↑/↓ then move
    the focus from message to message (each one's keys: c, k, [ and ]), page up/down scroll.

    A streaming reply grows its virtual height at every line it adds; the layout that placed the reply already
    scrolled the anchored list and its scrollbars follow that size on their own (a scrollbar that appears asks for
    its own layout), so a new virtual size needs no second layout of the screen (``OneLayout``)."""

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
        await self.append(view)
        return view

    def on_resize(self) -> None:
        # A streaming reply's room was measured for the old height (the stats bar below wraps onto a second row once
        # a reply decodes at 80 columns; the terminal resized): measured again, the question stays at the top.
        for block in self.query(OpenBlock).results(OpenBlock):
            block.call_after_refresh(block.fill_room)

    async def append(self, *views: MessageView | Notice) -> None:
        """Mount ``views`` at the end (the last reply gives back the room it kept) and follow the end."""
        for message in self.messages[-1:]:
            message.styles.min_height = None
        await self.mount_all(views)
        self.anchor()

    async def clear(self) -> None:
        await self.remove_children()

    async def drop_from(self, view: MessageView) -> None:
        """Remove ``view`` and everything after it."""
        children = list(self.children)
        await self.remove_children(children[children.index(view):])
