"""The main chat screen: sidebar, transcript, input, live stats bar and footer.

It composes the widgets and routes messages: what to do with a message, a key or a token is decided by the
:class:`~mlxchat.app.conversation.ChatController` (no Textual there); the screen shows the outcome. Replies stream
through the :class:`~mlxchat.app.engine_worker.EngineWorker` bridge thread, whose messages carry their stream.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header

from ..conversation import ChatController, Refused, Reply, Turn, keeps
from ..engine_worker import EngineWorker, next_batch_s
from ..formatting import DONE, profile_summary, stats_line
from ..models import ModelPick, to_remember
from ..replay import ReplaySource
from ..widgets import (ChatInput, ConversationList, MessageView, Notice, Sidebar, StatsBar, TokenInspector, TokenStrip,
                       Transcript)
from .dialogs import Confirm, TextPrompt
from .model_picker import ModelPicker
from .profile_picker import ProfilePicker
from .replay import ReplayScreen

if TYPE_CHECKING:
    from mlxchat.core import Engine, SamplingProfile
    from mlxchat.core.events import GenerationResult
    from mlxchat.core.trace import TokenTrace

    from ..app import MlxChatApp

# Drawing streamed text costs the UI thread CPU that, on a small machine, the decoder would otherwise use. Batches
# start at 40 ms; when the UI's CPU time per batch would exceed this share of the time between batches, the
# batches grow (up to MAX_BATCH_S), so streaming into the TUI costs at most about this much decode speed.
UI_CPU_BUDGET = 0.04

BUSY = "A reply is still coming: Esc stops it"


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
    ]

    app: "MlxChatApp"

    def __init__(self) -> None:
        super().__init__(id="chat-screen")
        self._controller: ChatController | None = None  # made on mount, when the app's store and settings exist
        self.worker: EngineWorker | None = None
        self.editing = False
        self._ui_cpu_mark: float | None = None
        self._inspected: TokenStrip | None = None  # the heat strip whose token the inspector shows
        self._tracing: MessageView | None = None  # the reply being traced on demand (F7), while it is

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
        self._controller = ChatController(
            app.store, default_profile=app.default_profile, default_system=app.settings.system_prompt,
            max_tokens=app.max_tokens, kv_window=app.settings.kv_window,
            context_policy=app.settings.context_policy, exports=app.locations.exports, trace_k=app.settings.trace,
            notify=lambda message, severity: self.notify(message, severity=severity,
                                                         timeout=10 if severity == "error" else 5))
        self.worker = EngineWorker(self)
        self.query_one("#sidebar").display = app.settings.sidebar
        self.title = "mlxchat"
        self._show_chat_header()
        self.refresh_sidebar()
        self.input.focus()
        if app.settings.reopen_last and (recent := self.controller.conversations()):
            self.call_later(self.open_conversation, recent[0].id)
        if app.preloaded_engine is not None:
            self._engine_ready(app.preloaded_engine, app.model_spec, owned=False)
        else:
            self.load_model(app.model_spec)

    def shut_down(self) -> None:
        """The app is quitting: save what is in flight, stop the bridge, close the engine we loaded."""
        controller, self._controller = self._controller, None
        if controller is None:
            return
        controller.close()
        if self.worker is not None:
            self.worker.close()
        if controller.owns_engine and controller.engine is not None:
            controller.engine.close()

    def on_unmount(self) -> None:
        self.shut_down()

    def refresh_sidebar(self) -> None:
        self.query_one(ConversationList).show(self.controller.conversations(),
                                              self.controller.record.id if self.controller.record else None)

    def _show_chat_header(self) -> None:
        self.sub_title = self.controller.title
        self.stats.show_profile(self.controller.profile.name or "custom")

    def _show_ready(self) -> None:
        """The state line with nothing in flight: what is loaded, and none of the last chat's numbers."""
        engine = self.controller.engine
        if engine is not None:
            self.stats.show_state("idle", "● ready", f"{engine.name} · context {engine.context_length} · "
                                                      f"{engine.model.weights_path}")
        elif self.controller.loading:
            self.stats.show_state("loading", "◌ loading", "loading the model…")
        else:
            self.stats.show_state("error", "✗ no model", "no model loaded · F3 picks one")

    # --- the transcript follows the controller's turns -----------------------------------------------------------

    def _view(self, turn: Turn) -> MessageView:
        if turn.role == "assistant":
            if turn.streaming:
                stats = ""
            elif turn.error:
                stats = f"error: {turn.error}"
            else:
                stats = stats_line(turn.metrics, turn.finish_reason, turn.profile.get("name"))
            label = f"Assistant · {turn.model}" if turn.model else "Assistant"
            if (place := self.controller.branch_place(turn)) is not None:
                label += f"   < {place[0]}/{place[1]} >  [ ] switch"
            view = MessageView("assistant", turn.content, label=label, stats=stats, turn=turn)
            if turn.error:
                view.add_class("failed")
            return view
        if turn.role == "system":
            return MessageView("system", turn.content, label="System prompt, from here on", turn=turn)
        view = MessageView("user", turn.content, turn=turn)
        if turn.unsent:
            view.add_class("unsent")
            view.stats = "not sent · ctrl+t edits and sends it"
        return view

    async def _sync(self) -> None:
        """Make the transcript show the controller's turns: keep the views that match, replace the rest."""
        views, turns = self.transcript.messages, self.controller.turns
        same = 0
        while same < min(len(views), len(turns)) and views[same].turn is turns[same]:
            same += 1
        if same < len(views):
            await self.transcript.drop_from(views[same])
        new = [self._view(t) for t in turns[same:]]
        if new:
            await self.transcript.mount_all(new)
            for view in new:
                if view.turn is not None and view.turn.streaming:
                    view.start_stream()
        self.transcript.anchor()

    def _reply_view(self, reply: Reply) -> MessageView | None:
        for view in reversed(self.transcript.messages):
            if view.turn is reply.turn:
                return view
        return None

    # --- the engine ----------------------------------------------------------------------------------------------

    def load_model(self, spec: str | None) -> None:
        assert self.worker is not None
        self.controller.model_loading(spec)
        self.worker.load(spec)

    @on(EngineWorker.Loading)
    def _loading(self, event: EngineWorker.Loading) -> None:
        what = event.spec or "the embedded model"
        self.stats.show_state("loading", "◌ loading", f"loading {what}…")

    @on(EngineWorker.Loaded)
    async def _loaded(self, event: EngineWorker.Loaded) -> None:
        replaced = self.controller.engine is not None
        self._engine_ready(event.engine, event.spec, owned=True)
        if (entry := to_remember(event.spec)) is not None:  # a path is listed only once it has loaded
            self.app.store.add_model(*entry)
        await self.transcript.query(Notice).remove()  # "the model did not load" banners are answered now
        if replaced:
            self.notify(f"Loaded {event.engine.name} in {event.seconds:.1f} s", timeout=4)

    def _engine_ready(self, engine: "Engine", spec: str | None, *, owned: bool) -> None:
        old, started = self.controller.engine_ready(engine, spec, owned=owned)
        if old is not None and self.worker is not None:
            self.worker.call(old.close)  # after anything still queued for it
        self.title = f"mlxchat · {engine.name}"
        self._show_ready()
        if started is not None:
            self._follow(started)

    @on(EngineWorker.LoadFailed)
    async def _load_failed(self, event: EngineWorker.LoadFailed) -> None:
        message = str(event.error) or type(event.error).__name__
        self.notify(message, title="The model did not load", severity="error", timeout=10)
        if self.controller.load_failed() is not None:
            await self._sync()  # the reply that waited goes; its message stays, unanswered (ctrl+r)
        engine = self.controller.engine
        if engine is not None:
            self.stats.show_state("idle", "● ready", f"{engine.name} (kept; the new model failed: {message})")
            return
        self._show_ready()
        actions = {"pick_model": "Pick a model (F3)"}
        if event.spec is not None:
            actions = {"load_embedded": "Load the embedded model", **actions}
        await self.transcript.add(Notice(f"The model did not load: {message}", actions=actions))

    @on(Notice.Action)
    def _notice_action(self, event: Notice.Action) -> None:
        if event.action == "load_embedded":
            event.notice.remove()
            self.load_model(None)
        elif event.action == "pick_model":
            self.action_models()

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
        await self._started(reply)
        self.refresh_sidebar()
        return True

    async def _started(self, reply: Reply) -> None:
        await self._sync()
        if reply.stream is None:
            self._set_reply_stats(reply, "waiting for the model to load…")
            self.stats.show_state("waiting", "◌ waiting", "waiting for the model to load…")
        else:
            self._follow(reply)

    def _follow(self, reply: Reply) -> None:
        assert self.worker is not None and reply.stream is not None
        self.worker.follow(reply.stream)
        self._set_reply_stats(reply, "prefilling…")
        self.stats.show_state("prefill", "▷ prefill", "")
        self._ui_cpu_mark = None

    def _set_reply_stats(self, reply: Reply, text: str) -> None:
        view = self._reply_view(reply)
        if view is not None:
            view.set_stats(text)

    @on(EngineWorker.Prefill)
    def _prefill(self, event: EngineWorker.Prefill) -> None:
        reply = self.controller.on_prefill(event.stream, event.done, event.total)
        if reply is not None and reply is self.controller.reply:
            self.stats.show_prefill(event.done, event.total, reply.cached or 0)
            self._set_reply_stats(reply, f"prefill {event.done}/{event.total}")

    @on(EngineWorker.Tokens)
    async def _tokens(self, event: EngineWorker.Tokens) -> None:
        reply = self.controller.on_tokens(event.stream, event.text, event.count, event.metrics)
        if reply is None:
            return
        view = self._reply_view(reply)
        # No screen update in the middle of a batch: its text, the reply's stats and the stats line change together.
        with self.app.batch_update():
            if view is not None:
                await view.write(event.text)
                view.set_stats("generating…")  # the live numbers are in the stats bar; the final ones go here
            if reply is self.controller.reply and event.metrics is not None:
                self.stats.show_metrics(event.metrics, label="▶ decoding")
        self._pace_batches()

    def _pace_batches(self) -> None:
        """Set the batch length from the UI thread's CPU time per batch (which includes drawing the last one)."""
        now = time.thread_time()
        if self._ui_cpu_mark is not None and self.worker is not None:
            self.worker.batch_s = next_batch_s(self.worker.batch_s, now - self._ui_cpu_mark, UI_CPU_BUDGET)
        self._ui_cpu_mark = now

    @on(EngineWorker.Finished)
    async def _finished(self, event: EngineWorker.Finished) -> None:
        # The view is made final first: the reply counts as in flight until its view and its record are final.
        reply, result = self.controller.reply_for(event.stream), event.result
        if reply is None:
            return
        current = reply is self.controller.reply
        view = self._reply_view(reply)
        if view is not None:
            if keeps(result):
                await view.finish(result.text, stats_line(result.metrics, result.finish_reason,
                                                          result.profile.get("name")), result.finish_reason)
            else:
                await view.remove()
                self.notify("Stopped before the first token; ctrl+r asks again")
        self.controller.on_finished(event.stream, result)
        if current:
            self.stats.show_metrics(result.metrics, state="done",
                                    label=DONE.get(result.finish_reason, result.finish_reason))
            self.refresh_sidebar()

    @on(EngineWorker.Failed)
    async def _failed(self, event: EngineWorker.Failed) -> None:
        reply = self.controller.reply_for(event.stream)
        if reply is None:
            return
        current = reply is self.controller.reply
        view = self._reply_view(reply)
        if view is not None:
            await view.fail(str(event.error) or type(event.error).__name__)
        _, message = self.controller.on_failed(event.stream, event.error)
        if current:
            if reply.answers is not None and reply.answers.unsent:
                await self._sync_unsent(reply.answers)
            self.stats.show_state("error", "✗ error", message)
        engine = self.controller.engine
        if engine is not None and not engine.usable:
            self.notify("Press F3 and pick the model to load it on this machine; the conversation is kept.",
                        title="The split model stopped", severity="error", timeout=30)
        self.notify(message, title="The reply failed", severity="error", timeout=10)

    async def _sync_unsent(self, turn: Turn) -> None:
        for view in self.transcript.messages:
            if view.turn is turn:
                view.add_class("unsent")
                view.set_stats("not sent · ctrl+t edits and sends it")

    # --- actions -------------------------------------------------------------------------------------------------

    @on(ChatInput.StopRequested)
    async def _stop_requested(self) -> None:
        await self.action_stop()

    async def action_stop(self) -> None:
        """Esc: stop the reply (also during prefill, or while it waits for the model), or leave editing."""
        what = self.controller.stop()
        if what == "dropped":
            await self._sync()
            self._show_ready()
        elif what == "stopping":
            self.stats.show_state("stopping", "■ stopping…")
        elif self.editing:
            self._stop_editing()
            self.input.clear()

    async def _after_switch(self) -> None:
        """Show the chat the controller now holds (transcript, title, profile, a clean stats line), with the input
        focused."""
        self._stop_editing()
        await self.transcript.clear()
        await self._sync()
        self._show_chat_header()
        self._show_ready()  # the last chat's numbers go
        self.refresh_sidebar()
        self.input.focus()  # typing goes to the input, never to the sidebar's keys

    async def action_new_chat(self) -> None:
        self.controller.new_chat()
        await self._after_switch()

    def action_clear(self) -> None:
        if not self.controller.turns:
            self.notify("This chat has no messages", severity="warning")
            return
        count = sum(t.role != "system" for t in self.controller.turns)

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            try:
                self.controller.clear()
            except Refused as e:
                self.notify(str(e), severity=e.severity)
                return
            await self._after_switch()
            self.notify("Cleared the chat")

        self.app.push_screen(Confirm(f"Delete the {count} messages of this chat? This cannot be undone.",
                                     yes="Delete messages"), done)

    async def action_regenerate(self) -> None:
        try:
            reply = self.controller.regenerate()
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        await self._started(reply)

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
        await self._after_switch()

    @on(ConversationList.RenameRequested)
    def _rename(self, event: ConversationList.RenameRequested) -> None:
        conversation = self.app.store.conversation(event.conversation_id)

        def done(title: str | None) -> None:
            if title:
                self.controller.rename(conversation.id, title)
                self.sub_title = self.controller.title
                self.refresh_sidebar()

        self.app.push_screen(TextPrompt("Rename the conversation", conversation.title, accept="Rename"), done)

    @on(ConversationList.DeleteRequested)
    def _delete(self, event: ConversationList.DeleteRequested) -> None:
        conversation = self.app.store.conversation(event.conversation_id)

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            current = self.controller.record is not None and self.controller.record.id == conversation.id
            deleted = self.controller.delete(conversation.id)
            if current:
                await self._after_switch()
            self.refresh_sidebar()
            if deleted:
                self.notify(f"Deleted {conversation.title!r}")

        self.app.push_screen(Confirm(f"Delete {conversation.title!r} and its messages?", yes="Delete"), done)

    # --- profiles, system prompt, models -------------------------------------------------------------------------

    def set_profile(self, profile: "SamplingProfile") -> None:
        """Use ``profile`` from the next turn on (and remember it with the conversation)."""
        self.controller.set_profile(profile)
        self.stats.show_profile(profile.name or "custom")
        self.notify(f"Profile {profile.name or 'custom'}: {profile_summary(profile)}")

    def action_profiles(self) -> None:
        def done(profile: "SamplingProfile | None") -> None:
            if profile is not None:
                self.set_profile(profile)

        self.app.push_screen(ProfilePicker(self.app.profiles, self.controller.profile), done)

    def action_system_prompt(self) -> None:
        async def done(text: str | None) -> None:
            if text is None:
                return
            try:
                self.controller.set_system_prompt(text)
            except Refused as e:
                self.notify(str(e), severity=e.severity)
                return
            await self._sync()
            self.notify("System prompt set for this chat")

        self.app.push_screen(TextPrompt("System prompt for this chat", self.controller.system_prompt, accept="Set"),
                             done)

    def action_models(self) -> None:
        store = self.app.store

        def done(pick: ModelPick | None) -> None:
            engine = self.controller.engine
            # The model in use: nothing to reload, the chat's cache stays; unless it was split across machines and
            # lost one (core/distributed), when picking it again loads it on this machine.
            if pick is None or (pick.already_loaded and (engine is None or engine.usable)):
                return
            if self.busy:  # the reply would land in a session the new model does not have
                self.notify(f"{BUSY}, then pick the model again", severity="warning")
                return
            self.notify(f"Loading {pick.choice.label}…")
            self.load_model(pick.choice.spec)

        self.app.push_screen(
            ModelPicker(lambda: [*store.models(), *((p, Path(p).name) for p in self.app.settings.models)],
                        store.remove_model, self.controller.model_spec, scan_hf_cache=self.app.scan_hf_cache),
            done)

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

    # --- the sampler inspector: heat view, token inspector, branches, replay --------------------------------------

    def _target_reply(self) -> MessageView | None:
        """The reply under the cursor (the focused message, or the one holding the focus), else the last reply."""
        node = self.focused
        while node is not None and not isinstance(node, MessageView):
            node = node.parent
        if isinstance(node, MessageView) and node.role == "assistant":
            return node
        if self._inspected is not None and self._inspected.is_attached:  # the focus is in the inspector
            return self._inspected.query_ancestor(MessageView)
        return self.transcript.last("assistant")

    async def action_heat(self) -> None:
        """F7: show the reply under the cursor (or the last one) as tokens shaded by probability, or go back."""
        view = self._target_reply()
        if view is None:
            self.notify("No reply yet: the heat view shows a reply's tokens", severity="warning")
            return
        if view.strip is not None:
            self._close_inspector()
            await view.hide_heat()
            view.focus()
            return
        try:
            traces = self.controller.traces(view.turn)
            if traces is None:
                assert view.turn is not None
                source, length = self.controller.retrace(view.turn)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        if traces is None:  # written untraced: write it again, traced, with its seed (only now that it is asked for)
            if self._tracing is view:
                self.notify("Still tracing this reply…", timeout=3)
                return
            self._tracing = view
            self.notify("Tracing this reply: writing it again with its seed…", timeout=3)
            self._retrace(view, source, length)
            return
        await self._show_heat(view, traces)

    async def _show_heat(self, view: MessageView, traces: "list[TokenTrace]") -> None:
        strip = await view.show_heat(traces)
        strip.focus()
        strip.scroll_visible()

    @work(thread=True, group="retrace")
    def _retrace(self, view: MessageView, source: ReplaySource, length: int) -> None:
        engine = self.controller.engine
        assert engine is not None
        try:
            result = source.retrace(engine, self.controller.inspect_k, length)
        except Exception as e:  # noqa: BLE001 - an engine error (or a profile no longer valid): one line, chat goes on
            self.app.call_from_thread(self._retraced, view, None, str(e) or type(e).__name__)
            return
        self.app.call_from_thread(self._retraced, view, result)

    async def _retraced(self, view: MessageView, result: "GenerationResult | None", error: str = "") -> None:
        self._tracing = None
        if result is None:
            self.notify(f"Could not trace this reply: {error}", severity="error")
            return
        if view.turn is None or not view.is_attached:  # the chat changed meanwhile
            return
        try:
            traces = self.controller.attach_traces(view.turn, result)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        await self._show_heat(view, traces)

    def _show_token(self, strip: TokenStrip, index: int) -> None:
        view = strip.query_ancestor(MessageView)
        turn = view.turn
        assert turn is not None
        self._inspected = strip
        self.inspector.show(strip.traces[index], index, seed=turn.seed, profile=turn.profile.get("name"),
                            sampler=turn.sampler)
        self.inspector.add_class("-open")

    def _close_inspector(self) -> None:
        self.inspector.remove_class("-open")
        self._inspected = None

    @on(TokenStrip.Inspect)
    def _inspect(self, event: TokenStrip.Inspect) -> None:
        self._show_token(event.strip, event.index)
        self.inspector.table.focus()

    @on(TokenStrip.Moved)
    def _token_moved(self, event: TokenStrip.Moved) -> None:
        if self._inspected is event.strip:  # the open inspector follows the cursor
            self._show_token(event.strip, event.index)

    @on(TokenInspector.Closed)
    def _inspector_closed(self, event: TokenInspector.Closed) -> None:
        strip = self._inspected
        self._close_inspector()
        if strip is not None and strip.is_attached:
            strip.focus()
        else:
            self.input.focus()

    @on(TokenInspector.BranchRequested)
    async def _branch(self, event: TokenInspector.BranchRequested) -> None:
        strip = self._inspected
        if strip is None or not strip.is_attached:
            return
        turn = strip.query_ancestor(MessageView).turn
        assert turn is not None
        try:
            reply = self.controller.branch(turn, event.token_index, event.token_id)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        self._close_inspector()
        await self._started(reply)
        self.input.focus()

    @on(MessageView.BranchStep)
    async def _branch_step(self, event: MessageView.BranchStep) -> None:
        turn = event.view.turn
        if turn is None or turn.role != "assistant":
            return
        try:
            shown = self.controller.switch_branch(turn, event.step)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        self._close_inspector()
        await self._sync()
        for view in self.transcript.messages:
            if view.turn is shown:
                view.focus()

    def action_replay(self) -> None:
        """F9: answer the reply's messages again with one parameter changed (same seed), side by side."""
        view = self._target_reply()
        try:
            source = self.controller.replay_source(view.turn if view else None)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        assert self.controller.engine is not None
        self.app.push_screen(ReplayScreen(self.controller.engine, source, trace=self.controller.inspect_k))

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
                self.app.copy_to_clipboard(blocks[-1])
                self.notify(f"Copied the last code block ({len(blocks[-1].splitlines())} lines)")
                return
        self.notify("No code block in this chat", severity="warning")

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def action_export(self) -> None:
        def done(path: str | None) -> None:
            if not path:
                return
            try:
                written = self.controller.export_markdown(path)
            except OSError as e:
                self.notify(f"Cannot write {path}: {e.strerror}", severity="error")
                return
            self.notify(f"Exported to {written}", title="Export", timeout=8)

        self.app.push_screen(TextPrompt("Export the chat to Markdown", str(self.controller.default_export_path()),
                                        accept="Export"), done)
