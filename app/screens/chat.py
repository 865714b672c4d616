"""The main chat screen: sidebar, transcript, input, live stats bar and footer.

It composes the widgets and routes messages: what to do with a message, a key or a token is decided by the
:class:`~mlxchat.app.conversation.ChatController` and :class:`~mlxchat.app.inspection.Inspection` (no Textual
there); the screen shows the outcome through three helpers: reply_feed.py (the transcript, and what the
:class:`~mlxchat.app.engine_worker.EngineWorker` bridge thread reports, keyed by stream), chat_dialogs.py (the
dialogs and their answers) and inspection.py (the heat view, the token inspector, branches, replay). The helpers
see the screen only through chat_host.py's ChatHost protocol, so none of them imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header

from .. import clipboard
from ..chat_tools import ChatTools
from ..conversation import ChatController, Refused, Reply
from ..engine_worker import EngineWorker
from ..formatting import profile_summary
from ..inspection import Inspection
from ..layout import COMPACT_FOOTER_COLUMNS, PALETTE_IN_FOOTER_COLUMNS, sidebar_shown
from ..widgets import (ChatInput, ConversationList, MessageView, Notice, Sidebar, StatsBar, TokenInspector, TokenStrip,
                       Transcript)
from .chat_dialogs import BUSY, ChatDialogs
from .inspection import InspectionPanel
from .reply_feed import ReplyFeed
from .tools import ToolApproval, ToolsScreen

if TYPE_CHECKING:
    from mlxchat.core import SamplingProfile

    from .chat_host import ChatApp


class ChatScreen(Screen):
    AUTO_FOCUS = "#input"

    BINDINGS = [
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("ctrl+n", "new_chat", "New", id="new_chat"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
        Binding("ctrl+t", "edit_last", "Edit", id="edit_last"),
        # Export is in the palette and F1; its footer slot shows the heat view, so F1 Help fits at 110 columns.
        Binding("ctrl+s", "export", "Export", id="export", show=False),
        Binding("f2", "profiles", "Profile", id="profiles"),
        Binding("f3", "models", "Model", id="models"),
        Binding("ctrl+l", "clear", "Clear chat", id="clear", show=False),
        Binding("f5", "copy_reply", "Copy last reply", id="copy_reply", show=False),
        Binding("f8", "copy_code", "Copy last code block", id="copy_code", show=False),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", id="toggle_sidebar", show=False),
        Binding("f4", "system_prompt", "System prompt", id="system_prompt", show=False),
        Binding("f6", "lab", "Lab", id="lab", show=False),
        # priority: the input (a TextArea) would take F7 as "select all" while it has the focus, which it mostly has
        Binding("f7", "heat", "Heat", id="heat_view", priority=True),
        Binding("f9", "replay", "Replay with a change", id="replay", show=False),
        Binding("ctrl+o", "tools", "Tools (MCP servers)", id="tools", show=False),
    ]

    @dataclass
    class ToolApprovalNeeded(Message):
        """The bridge thread waits for the user's answer on a tool call (app/chat_tools.py)."""

        call: Any
        source: str
        answer: Callable[[str], None]

    app: "ChatApp"  # MlxChatApp's base: app.py imports this module

    def __init__(self) -> None:
        super().__init__(id="chat-screen")
        self._controller: ChatController | None = None  # made on mount, when the app's store and settings exist
        self.editing = False
        self._feed: ReplyFeed | None = None  # the transcript and the engine worker's reports
        self.dialogs = ChatDialogs(self)
        self._panel: InspectionPanel | None = None  # the sampler inspector's side of this screen
        self._sidebar_toggled: bool | None = None  # ctrl+b's choice, once made; before it the width decides

    # --- layout --------------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield TokenInspector(id="inspector")
                yield ChatInput(id="input", history=self.app.store.recent_user_messages())
        yield StatsBar(id="stats")
        yield Footer()

    @property
    def focus_chain(self) -> list[Widget]:
        """Tab and shift+Tab go between the sidebar, the transcript, the input and the panels, not through every
        message: in the transcript ↑/↓ focus its messages (or a click does), and Tab goes on from there."""
        return [w for w in super().focus_chain if not isinstance(w, MessageView) or w.has_focus]

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def inspector(self) -> TokenInspector:
        return self.query_one(TokenInspector)

    @property
    def stats(self) -> StatsBar:
        return self.query_one(StatsBar)

    @property
    def controller(self) -> ChatController:
        assert self._controller is not None, "the chat screen is not mounted"
        return self._controller

    @property
    def busy(self) -> bool:
        return self._controller is not None and self._controller.busy

    def on_mount(self) -> None:
        app = self.app
        tools = None
        if app.settings.mcp.servers:  # MCP servers are configured: they start now, in the background
            tools = ChatTools(app.settings.mcp, ask=lambda call, source, answer: self.post_message(
                self.ToolApprovalNeeded(call, source, answer)))
            self.run_worker(lambda: self._start_tools(tools), thread=True, group="mcp-start", exit_on_error=False)
        self._controller = ChatController(
            app.store, default_profile=app.default_profile, default_system=app.settings.system_prompt,
            max_tokens=app.max_tokens, kv_window=app.settings.kv_window,
            context_policy=app.settings.context_policy, exports=app.locations.exports, trace_k=app.settings.trace,
            speculative=app.settings.speculative, reasoning_budget=app.settings.reasoning_budget,
            enable_thinking=app.settings.enable_thinking, tools=tools,
            notify=lambda message, severity: self.notify(message, severity=severity,
                                                         timeout=10 if severity == "error" else 5))
        self._panel = InspectionPanel(self, Inspection(self._controller))
        self._feed = ReplyFeed(self, EngineWorker(self, engine_options=app.settings.engine_options()))
        self.query_one("#sidebar").display = sidebar_shown(self.size.width, app.settings.sidebar, None)
        self.title = "mlxchat"
        self._show_chat_header()
        self.refresh_sidebar()
        self.input.focus()
        if app.settings.reopen_last and (recent := self.controller.conversations()):
            self.call_later(self.open_conversation, recent[0].id)
        if app.preloaded_engine is not None:
            self.feed.engine_ready(app.preloaded_engine, app.model_spec, owned=False)
        else:
            self.load_model(app.model_spec)

    def shut_down(self) -> None:
        """The app is quitting: save what is in flight, stop the bridge, close the engine we loaded."""
        controller, self._controller = self._controller, None
        if controller is None:
            return
        if controller.tools is not None:
            controller.tools.deny_waiting()  # a call waiting for approval is denied: its turn ends
            controller.save_tools()
        controller.close()
        if self._feed is not None:
            self._feed.worker.close()
        if controller.tools is not None:
            controller.tools.close()  # the MCP servers stop
        if controller.owns_engine and controller.engine is not None:
            controller.engine.close()

    def on_unmount(self) -> None:
        self.shut_down()

    def refresh_sidebar(self) -> None:
        self.query_one(ConversationList).show(self.controller.conversations(),
                                              self.controller.record.id if self.controller.record else None)

    def show_title(self) -> None:
        """The chat's title in the header ("new chat" until its first message names it)."""
        self.sub_title = self.controller.title

    def _show_chat_header(self) -> None:
        self.show_title()
        self.stats.show_profile(self.controller.profile.name or "custom")

    def show_ready(self) -> None:
        """The state line with nothing in flight: what is loaded, and none of the last chat's numbers."""
        engine = self.controller.engine
        if engine is not None:
            # Most important first: what does not fit the state line goes from the end (app/layout.py).
            self.stats.show_state("idle", "● ready", [engine.name, engine.model_kind(),
                                                      f"context {engine.context_length}",
                                                      *engine.decode_path().split(" · ")])
        elif self.controller.loading:
            self.stats.show_state("loading", "◌ loading", "loading the model…")
        else:
            self.stats.show_state("error", "✗ no model", "no model loaded · F3 picks one")

    # --- the transcript and the engine's reports (screens/reply_feed.py) ---------------------------------------

    @property
    def feed(self) -> ReplyFeed:
        assert self._feed is not None, "the chat screen is not mounted"
        return self._feed

    @property
    def worker(self) -> EngineWorker:
        return self.feed.worker

    async def sync(self) -> None:
        """Make the transcript show the controller's turns."""
        await self.feed.sync()

    async def started(self, reply: Reply) -> None:
        """Show a reply just started (or waiting for the model) and follow its stream."""
        await self.feed.started(reply)

    def load_model(self, spec: str | None) -> None:
        self.controller.model_loading(spec)
        self.feed.worker.load(spec)

    @on(EngineWorker.Loading)
    def _loading(self, event: EngineWorker.Loading) -> None:
        self.feed.loading(event.spec)

    @on(EngineWorker.Loaded)
    async def _loaded(self, event: EngineWorker.Loaded) -> None:
        await self.feed.loaded(event)

    @on(EngineWorker.LoadFailed)
    async def _load_failed(self, event: EngineWorker.LoadFailed) -> None:
        await self.feed.load_failed(event)

    @on(Notice.Action)
    def _notice_action(self, event: Notice.Action) -> None:
        if event.action == "load_embedded":
            event.notice.remove()
            self.load_model(None)
        elif event.action == "pick_model":
            self.action_models()

    @on(EngineWorker.Prefill)
    def _prefill(self, event: EngineWorker.Prefill) -> None:
        self.feed.prefill(event)

    @on(EngineWorker.Tokens)
    async def _tokens(self, event: EngineWorker.Tokens) -> None:
        await self.feed.tokens(event)

    @on(EngineWorker.Finished)
    async def _finished(self, event: EngineWorker.Finished) -> None:
        await self.feed.finished(event)

    @on(EngineWorker.Failed)
    async def _failed(self, event: EngineWorker.Failed) -> None:
        await self.feed.failed(event)

    @on(EngineWorker.ToolActivity)
    async def _tool_activity(self, event: EngineWorker.ToolActivity) -> None:
        await self.feed.tool_activity(event)

    @on(ToolApprovalNeeded)
    def _approve_tool(self, event: ToolApprovalNeeded) -> None:
        self.app.push_screen(ToolApproval(event.call.name, event.source, event.call.arguments),
                             lambda decision: event.answer(decision or "deny"))

    def _start_tools(self, tools: ChatTools) -> None:
        """On a worker thread: start the MCP servers; one that does not start is one line, and the chat goes on."""
        tools.start()
        for line in tools.toolbox.notices:
            self.app.call_from_thread(self.notify, line, title="Tools", severity="error", timeout=15)

    def action_tools(self) -> None:
        """ctrl+o: config.toml's MCP servers and their tools, on or off for this chat, and the tool choice."""
        tools = self.controller.tools
        if tools is None:
            self.notify(f"No MCP servers: add [mcp.servers.NAME] to {self.app.locations.config_file}",
                        severity="warning")
            return

        def closed(_: None) -> None:
            if self._controller is not None:
                if self._controller.session is not None:
                    self._controller.session.tool_choice = tools.tool_choice
                self._controller.save_tools()

        self.app.push_screen(ToolsScreen(tools), closed)

    # --- sending -------------------------------------------------------------------------------------------------

    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        await self.submit(event.text)

    async def submit(self, text: str) -> bool:
        """Send ``text`` (or resend it, when editing the last message). False if it could not be sent now."""
        try:
            reply = self.controller.resend(text) if self.editing else self.controller.send(text)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return False
        self._stop_editing()
        self.input.clear()
        self.input.remember(text)
        await self.started(reply)
        self.show_title()  # the first message names the chat
        self.refresh_sidebar()
        return True

    # --- actions -------------------------------------------------------------------------------------------------

    @on(ChatInput.StopRequested)
    async def _stop_requested(self) -> None:
        await self.action_stop()

    async def action_stop(self) -> None:
        """Esc: stop the reply (also during prefill, or while it waits for the model), or leave editing."""
        what = self.controller.stop()
        if what == "dropped":
            await self.sync()
            self.show_ready()
        elif what == "stopping":
            self.stats.show_state("stopping", "■ stopping…")
        elif self.editing:
            self._stop_editing()
            self.input.clear()

    async def after_switch(self) -> None:
        """Show the chat the controller now holds (transcript, title, profile, a clean stats line), with the input
        focused."""
        self._stop_editing()
        await self.transcript.clear()
        await self.sync()
        self._show_chat_header()
        self.show_ready()  # the last chat's numbers go
        self.refresh_sidebar()
        self.input.focus()  # typing goes to the input, never to the sidebar's keys

    async def action_new_chat(self) -> None:
        self.controller.new_chat()
        await self.after_switch()

    def action_clear(self) -> None:
        self.dialogs.clear()

    async def action_regenerate(self) -> None:
        try:
            reply = self.controller.regenerate()
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        await self.started(reply)

    def action_edit_last(self) -> None:
        if self.busy:
            self.notify(BUSY, severity="warning")
            return
        last = self.transcript.last("user")
        if last is None:
            self.notify("There is no message to edit yet", severity="warning")
            return
        self.editing = True
        self.input.load_text(last.text)
        self.input.move_cursor(self.input.document.end)
        self.input.add_class("editing")
        self.input.border_title = "editing your last message · Enter resends · Esc cancels"
        self.input.focus()

    def _stop_editing(self) -> None:
        self.editing = False
        self.input.remove_class("editing")
        self.input.border_title = None

    # --- conversations -------------------------------------------------------------------------------------------

    @on(ConversationList.Opened)
    async def _opened(self, event: ConversationList.Opened) -> None:
        await self.open_conversation(event.conversation_id)

    async def open_conversation(self, conversation_id: int) -> None:
        """Restore a saved conversation: its messages (with their stats), system prompt and profile."""
        self.controller.open(conversation_id)
        await self.after_switch()

    @on(ConversationList.RenameRequested)
    def _rename(self, event: ConversationList.RenameRequested) -> None:
        self.dialogs.rename(event.conversation_id)

    @on(ConversationList.DeleteRequested)
    def _delete(self, event: ConversationList.DeleteRequested) -> None:
        self.dialogs.delete(event.conversation_id)

    # --- profiles, system prompt, models -------------------------------------------------------------------------

    def set_profile(self, profile: "SamplingProfile") -> None:
        """Use ``profile`` from the next turn on (and remember it with the conversation)."""
        self.controller.set_profile(profile)
        self.stats.show_profile(profile.name or "custom")
        self.notify(f"Profile {profile.name or 'custom'}: {profile_summary(profile)}")

    def action_profiles(self) -> None:
        self.dialogs.profiles()

    def action_system_prompt(self) -> None:
        self.dialogs.system_prompt()

    def action_models(self) -> None:
        self.dialogs.models()

    def action_lab(self) -> None:
        """F6: the sampling lab (prompt sets, sweeps, side-by-side outputs, blind A/B) on the loaded model. The lab
        adds its screen through the ``mlxchat.screens`` entry point, so the app does not import it."""
        from ..tool_screens import ToolScreenUnavailable, open_tool_screen

        engine = self.controller.engine
        if engine is None:
            self.notify("the lab needs a loaded model: wait for it, or pick one with F3", severity="warning")
            return
        try:
            screen = open_tool_screen("lab", engine, self.app.locations.data)
        except ToolScreenUnavailable as e:
            self.notify(str(e), severity="error")
            return
        self.app.push_screen(screen)

    # --- the sampler inspector: heat view, token inspector, branches, replay (screens/inspection.py) -----------

    @property
    def inspection(self) -> Inspection:
        return self.panel.inspection

    @property
    def panel(self) -> InspectionPanel:
        assert self._panel is not None, "the chat screen is not mounted"
        return self._panel

    async def action_heat(self) -> None:
        await self.panel.heat()

    def action_replay(self) -> None:
        self.panel.replay()

    @on(TokenStrip.Inspect)
    def _inspect(self, event: TokenStrip.Inspect) -> None:
        self.panel.show_token(event.strip, event.index)
        self.inspector.table.focus()

    @on(TokenStrip.Moved)
    def _token_moved(self, event: TokenStrip.Moved) -> None:
        self.panel.moved(event.strip, event.index)

    @on(TokenInspector.Closed)
    def _inspector_closed(self, event: TokenInspector.Closed) -> None:
        self.panel.closed()

    @on(TokenInspector.BranchRequested)
    async def _branch(self, event: TokenInspector.BranchRequested) -> None:
        await self.panel.branch(event.token_index, event.token_id)

    @on(MessageView.BranchStep)
    async def _branch_step(self, event: MessageView.BranchStep) -> None:
        await self.panel.step(event.view, event.step)

    # --- copy, export, layout ------------------------------------------------------------------------------------

    def action_copy_reply(self) -> None:
        view = self.transcript.last("assistant")
        if view is None:
            self.notify("No reply to copy yet", severity="warning")
            return
        view.action_copy_message()

    def action_copy_code(self) -> None:
        """F8: the last code block of the chat (of the last message that has one)."""
        for view in reversed(self.transcript.messages):
            if blocks := view.code_blocks():
                how = clipboard.copy(self.app, blocks[-1])
                self.notify(f"Copied the last code block ({len(blocks[-1].splitlines())} lines) {how}")
                return
        self.notify("No code block in this chat", severity="warning")

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        self._sidebar_toggled = not sidebar.display
        sidebar.display = self._sidebar_toggled

    def on_resize(self) -> None:
        """Fit the width: the conversation list where there is room for it, the footer compact where it is narrow."""
        width = self.size.width
        self.query_one("#sidebar").display = sidebar_shown(width, self.app.settings.sidebar, self._sidebar_toggled)
        footer = self.query_one(Footer)
        footer.compact = width < COMPACT_FOOTER_COLUMNS
        footer.show_command_palette = width >= PALETTE_IN_FOOTER_COLUMNS  # ctrl+p works anyway; F1 lists it

    def action_export(self) -> None:
        self.dialogs.export()
