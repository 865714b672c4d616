"""The main chat screen: sidebar, transcript, input, live stats bar and footer.

It owns the conversation state (the engine, its ChatSession, the stored conversation, the profile) and the
EngineWorker whose messages it handles. Every reply is tracked by request id, so a reply that is stopped while
the user moves to another conversation still lands, complete, in the conversation it belongs to.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header

from ..engine_worker import BATCH_S, MAX_BATCH_S, EngineWorker
from ..formatting import DONE, profile_summary, stats_line
from ..models import ModelChoice
from ..store import Conversation, StoredMessage
from ..widgets import ChatInput, ConversationList, MessageView, Notice, Sidebar, StatsBar, Transcript
from .dialogs import Confirm, TextPrompt
from .model_picker import ModelPicker
from .profile_picker import ProfilePicker

if TYPE_CHECKING:
    from mlxchat.core import ChatSession, Engine, SamplingProfile, Stream
    from mlxchat.core.events import GenerationResult

    from ..app import MlxChatApp

StartFn = Callable[["ChatSession"], "Stream"]

# Drawing streamed text costs the UI thread CPU that, on a small machine, the decoder would otherwise use. Batches
# start at 40 ms; when the UI's CPU time per batch would exceed this share of the time between batches, the
# batches grow (up to MAX_BATCH_S), so streaming into the TUI costs at most about this much decode speed.
UI_CPU_BUDGET = 0.04


@dataclass
class Reply:
    """A reply in flight: where its text goes and where it is stored."""

    request_id: int
    conversation_id: int
    view: MessageView
    model: str
    cached: int | None = None
    discard: bool = False  # the conversation was cleared meanwhile: do not store it
    tokens: int = 0  # tokens streamed so far (0 when it fails: the engine rejected the prompt)


def slug(text: str) -> str:
    return re.sub(r"[^\w]+", "-", text.lower()).strip("-")[:40] or "chat"


class ChatScreen(Screen):
    AUTO_FOCUS = "#input"

    BINDINGS = [
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("ctrl+n", "new_chat", "New", id="new_chat"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
        Binding("ctrl+t", "edit_last", "Edit", id="edit_last"),
        Binding("ctrl+s", "export", "Export", id="export"),
        Binding("f2", "profiles", "Profile", id="profiles"),
        Binding("f3", "models", "Model", id="models"),
        Binding("ctrl+l", "clear", "Clear chat", id="clear", show=False),
        Binding("f5", "copy_reply", "Copy last reply", id="copy_reply", show=False),
        Binding("f8", "copy_code", "Copy last code block", id="copy_code", show=False),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", id="toggle_sidebar", show=False),
        Binding("f4", "system_prompt", "System prompt", id="system_prompt", show=False),
    ]

    app: "MlxChatApp"

    def __init__(self) -> None:
        super().__init__(id="chat-screen")
        self.engine: Engine | None = None
        self.owns_engine = False
        self.model_spec: str | None = None
        self.model_loading: str | bool = False
        self.load_error: str | None = None
        self.chat: ChatSession | None = None
        self.conversation: Conversation | None = None
        self.profile: SamplingProfile | None = None
        self.system_prompt: str = ""
        self.reply: Reply | None = None
        self._replies: dict[int, Reply] = {}
        self._deferred: tuple[str, MessageView] | None = None  # a message waiting for the model to load
        self._pending_messages: list[dict[str, Any]] = []  # the conversation, while there is no ChatSession
        self.last_result: GenerationResult | None = None
        self.editing = False
        self.worker: EngineWorker | None = None
        self._ui_cpu_mark: float | None = None
        self._starting = False  # between accepting a message and its reply being registered (awaits in between)

    # --- layout --------------------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
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
    def stats(self) -> StatsBar:
        return self.query_one(StatsBar)

    @property
    def busy(self) -> bool:
        return self.reply is not None or self._deferred is not None or self._starting

    def on_mount(self) -> None:
        app = self.app
        self.worker = EngineWorker(self)
        self.profile = app.default_profile()
        self.system_prompt = app.settings.system_prompt
        self.query_one("#sidebar").display = app.settings.sidebar
        self.title = "mlxchat"
        self.sub_title = "new chat"
        self.stats.show_profile(self.profile.name or "custom")
        self.refresh_sidebar()
        self.input.focus()
        if app.preloaded_engine is not None:
            self._engine_ready(app.preloaded_engine, app.model_spec, owned=False)
        else:
            self.load_model(app.model_spec)

    def on_unmount(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.owns_engine and self.engine is not None:
            self.engine.close()

    def refresh_sidebar(self) -> None:
        self.query_one(ConversationList).show(self.app.store.conversations(),
                                              self.conversation.id if self.conversation else None)

    # --- the engine ----------------------------------------------------------------------------------------------

    def load_model(self, spec: str | None) -> None:
        assert self.worker is not None
        self.model_loading = spec or "embedded"
        self.worker.load(spec)

    @on(EngineWorker.Loading)
    def _loading(self, event: EngineWorker.Loading) -> None:
        what = event.spec or "the embedded model"
        self.stats.show_state("loading", "◌ loading", f"loading {what}…")

    @on(EngineWorker.Loaded)
    async def _loaded(self, event: EngineWorker.Loaded) -> None:
        old, old_owned = self.engine, self.owns_engine
        self._engine_ready(event.engine, event.spec, owned=True)
        await self.transcript.query(Notice).remove()  # "the model did not load" banners are answered now
        if self.conversation is not None:
            self.app.store.update_conversation(self.conversation.id, model=event.engine.name)
        if old is not None:
            if old_owned and self.worker is not None:
                self.worker.call(old.close)  # after anything still queued for it
            self.notify(f"Loaded {event.engine.name} in {event.seconds:.1f} s", timeout=4)
        if self._deferred is not None:
            text, view = self._deferred
            self._deferred = None
            self._launch(lambda chat: chat.send(text, max_tokens=self.app.max_tokens), view)

    def _engine_ready(self, engine: "Engine", spec: str | None, *, owned: bool) -> None:
        messages = self._conversation_messages()
        self.engine, self.owns_engine, self.model_spec = engine, owned, spec
        self.model_loading = False
        self.load_error = None
        self._new_session(messages)
        self.title = f"mlxchat · {engine.name}"
        self.stats.show_state("idle", "● ready", f"{engine.name} · context {engine.context_length}")

    @on(EngineWorker.LoadFailed)
    async def _load_failed(self, event: EngineWorker.LoadFailed) -> None:
        self.model_loading = False
        message = str(event.error) or type(event.error).__name__
        self.notify(message, title="The model did not load", severity="error", timeout=10)
        if self._deferred is not None:
            text, view = self._deferred
            self._deferred = None
            await view.fail("the model did not load")
            self._pending_messages.append({"role": "user", "content": text})  # it stays, unanswered (ctrl+r)
        if self.engine is not None:
            self.stats.show_state("idle", "● ready", f"{self.engine.name} (kept; the new model failed: {message})")
            return
        self.load_error = message
        self.stats.show_state("error", "✗ no model", "no model loaded · F3 picks one")
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

    def _conversation_messages(self) -> list[dict[str, Any]]:
        """The conversation so far (no system message), from the session if there is one."""
        if self.chat is None:
            return list(self._pending_messages)
        return [m.as_prompt() for m in self.chat.messages if m.role != "system"]

    def _new_session(self, messages: list[dict[str, Any]]) -> None:
        """A fresh ChatSession holding ``messages``; its KV cache re-matches them by prefix on the next turn."""
        if self.engine is None:
            self.chat = None
            self._pending_messages = list(messages)
            return
        self.chat = self.engine.chat(system=self.system_prompt or None, profile=self.profile,
                                     max_kv_size=self.app.settings.kv_window)
        self.chat.replace_history(messages)
        self._pending_messages = []

    # --- sending -------------------------------------------------------------------------------------------------

    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        await self.submit(event.text)

    async def submit(self, text: str) -> bool:
        """Send ``text`` (or resend it, when editing the last message). False if it could not be sent now."""
        if self.busy:
            self.notify("A reply is still coming: Esc stops it", severity="warning")
            return False
        if self.engine is None and not self.model_loading:
            self.notify("No model is loaded: press F3 to pick one", severity="error")
            return False
        if self.editing and self.chat is None:
            self.notify("The model is still loading", severity="warning")
            return False
        self.input.clear()
        self.input.remember(text)
        self._starting = True
        try:
            if self.editing:
                await self._resend(text)
            else:
                await self._send(text)
        finally:
            self._starting = False
        return True

    def _ensure_conversation(self, first_text: str) -> Conversation:
        if self.conversation is None:
            title = " ".join(first_text.split())
            title = title if len(title) <= 48 else title[:47] + "…"
            self.conversation = self.app.store.create_conversation(
                title, system_prompt=self.system_prompt, profile=self._profile_dict(),
                model=self.engine.name if self.engine else self.model_spec)
            self.sub_title = self.conversation.title
        return self.conversation

    def _profile_dict(self) -> dict[str, Any]:
        return self.profile.model_dump(mode="json") if self.profile else {}

    async def _add_user(self, text: str) -> MessageView:
        conversation = self._ensure_conversation(text)
        stored = self.app.store.add_message(conversation.id, "user", text)
        view = MessageView("user", text, stored_position=stored.position)
        await self.transcript.add(view)
        return view

    async def _send(self, text: str) -> None:
        await self._add_user(text)
        await self._start(lambda chat: chat.send(text, max_tokens=self.app.max_tokens), text)
        self.refresh_sidebar()

    async def _start(self, start: StartFn, deferrable_text: str | None = None) -> None:
        name = self.engine.name if self.engine else "assistant"
        view = MessageView("assistant", label=f"Assistant · {name}")
        await self.transcript.add(view)
        view.start_stream()
        self.transcript.anchor()
        if self.chat is None:
            assert deferrable_text is not None
            self._deferred = (deferrable_text, view)
            view.set_stats("waiting for the model to load…")
            self.stats.show_state("waiting", "◌ waiting", "waiting for the model to load…")
            return
        self._launch(start, view)

    def _launch(self, start: StartFn, view: MessageView) -> None:
        assert self.chat is not None and self.worker is not None and self.conversation is not None
        chat = self.chat
        rid = self.worker.generate(lambda: start(chat))
        view.set_label(f"Assistant · {self.engine.name}" if self.engine else "Assistant")
        self.reply = Reply(rid, self.conversation.id, view, self.engine.name if self.engine else "")
        self._replies[rid] = self.reply
        view.set_stats("prefilling…")
        self.stats.show_state("prefill", "▷ prefill", "")
        self._ui_cpu_mark = None

    def _reply_for(self, request_id: int) -> Reply | None:
        return self._replies.get(request_id)

    @on(EngineWorker.Prefill)
    def _prefill(self, event: EngineWorker.Prefill) -> None:
        reply = self._reply_for(event.request_id)
        if reply is None:
            return
        if reply.cached is None:
            reply.cached = event.done
        if reply is self.reply:
            self.stats.show_prefill(event.done, event.total, reply.cached)
            if reply.view.is_attached:
                reply.view.set_stats(f"prefill {event.done}/{event.total}")

    @on(EngineWorker.Tokens)
    async def _tokens(self, event: EngineWorker.Tokens) -> None:
        reply = self._reply_for(event.request_id)
        if reply is None:
            return
        reply.tokens += event.count
        if reply.view.is_attached:
            await reply.view.write(event.text)
            reply.view.set_stats("generating…")  # the live numbers are in the stats bar; the final ones go here
        if reply is self.reply and event.metrics is not None:
            self.stats.show_metrics(event.metrics, label="▶ decoding")
        self._pace_batches()

    def _pace_batches(self) -> None:
        """Set the batch length from the UI thread's CPU time per batch (which includes drawing the last one)."""
        now = time.thread_time()
        if self._ui_cpu_mark is not None and self.worker is not None:
            needed = (now - self._ui_cpu_mark) / UI_CPU_BUDGET
            smoothed = 0.7 * self.worker.batch_s + 0.3 * needed
            self.worker.batch_s = min(MAX_BATCH_S, max(BATCH_S, smoothed))
        self._ui_cpu_mark = now

    @on(EngineWorker.Finished)
    async def _finished(self, event: EngineWorker.Finished) -> None:
        reply = self._replies.pop(event.request_id, None)
        if reply is None:
            return
        result = event.result
        current = reply is self.reply
        kept = bool(result.text) or result.finish_reason != "cancelled"  # what the ChatSession keeps, too
        stored: StoredMessage | None = None
        if kept and not reply.discard:
            stored = self.app.store.add_message(
                reply.conversation_id, "assistant", result.text, finish_reason=result.finish_reason,
                metrics=result.metrics.as_dict(), profile=result.profile, sampler=result.sampler, seed=result.seed,
                model=reply.model)
        line = stats_line(result.metrics, result.finish_reason, result.profile.get("name"))
        if reply.view.is_attached:
            if kept:
                reply.view.stored_position = stored.position if stored else None
                await reply.view.finish(result.text, line, result.finish_reason)
            else:
                await reply.view.remove()
                self.notify("Stopped before the first token; ctrl+r asks again")
        if current and reply is self.reply:  # (not replaced while the view was finishing)
            self.stats.show_metrics(result.metrics, state="done",
                                    label=DONE.get(result.finish_reason, result.finish_reason))
            self.refresh_sidebar()
            self.last_result = result
            self.reply = None  # last: the reply counts as running until its view and record are final

    @on(EngineWorker.Failed)
    async def _failed(self, event: EngineWorker.Failed) -> None:
        reply = self._replies.pop(event.request_id, None)
        if reply is None:
            return
        message = str(event.error) or type(event.error).__name__
        if reply.view.is_attached:
            await reply.view.fail(message)
        if reply is self.reply and reply.tokens == 0:
            message += self._unsend_last_user()
        self.notify(message, title="The reply failed", severity="error", timeout=10)
        if reply is self.reply:
            self.stats.show_state("error", "✗ error", message)
            self.reply = None

    def _unsend_last_user(self) -> str:
        """The engine rejected the prompt before any token (e.g. longer than the context): the last user message
        was not sent. Take it out of the session (core's ChatSession already drops a rejected ``send``/``edit_last``
        message; a rejected ``regenerate`` keeps it) and out of the store, or every later turn of this chat would
        fail the same way after a restart. Its view stays, marked unsent, for ctrl+t. Returns a note for the user."""
        chat, view = self.chat, self.transcript.last("user")
        if chat is None or view is None or view.has_class("unsent"):
            return ""
        last = chat.messages[-1] if chat.messages else None
        if last is not None and last.role == "user" and last.content == view.text:
            chat.drop_last_user()
        if view.stored_position is not None and self.conversation is not None:
            self.app.store.delete_messages_from(self.conversation.id, view.stored_position)
            view.stored_position = None
        view.add_class("unsent")
        view.set_stats("not sent · ctrl+t edits and sends it")
        return " · your message was not sent: ctrl+t edits it, or send another one"

    # --- actions -------------------------------------------------------------------------------------------------

    @on(ChatInput.StopRequested)
    def _stop_requested(self) -> None:
        self.action_stop()

    def action_stop(self) -> None:
        """Esc: stop the reply (also during prefill), or leave editing."""
        if self._deferred is not None:
            text, view = self._deferred
            self._deferred = None
            self._pending_messages.append({"role": "user", "content": text})
            view.remove()
            self.stats.show_state("loading", "◌ loading", "loading the model…")
            return
        if self.reply is not None and self.worker is not None:
            self.worker.cancel()
            self.stats.show_state("stopping", "■ stopping…")
            return
        if self.editing:
            self._stop_editing()
            self.input.clear()

    def _cancel_for_navigation(self, *, discard: bool = False) -> None:
        """Stop the reply in progress; it is still stored (unless ``discard``) in its own conversation."""
        if self._deferred is not None:
            self.action_stop()
        if self.reply is not None:
            self.reply.discard = discard
            if self.worker is not None:
                self.worker.cancel()
            if self.reply.view.is_attached:
                self.reply.view.remove()
            self.reply = None
        self._stop_editing()

    async def action_new_chat(self) -> None:
        self._cancel_for_navigation()
        self.conversation = None
        self.profile = self.app.default_profile()
        self.system_prompt = self.app.settings.system_prompt
        self._new_session([])
        await self.transcript.clear()
        self.stats.show_profile(self.profile.name or "custom")
        self.sub_title = "new chat"
        self.refresh_sidebar()
        self.input.focus()

    async def action_clear(self) -> None:
        self._cancel_for_navigation(discard=True)
        if self.conversation is not None:
            self.app.store.clear_messages(self.conversation.id)
        self._new_session([])
        await self.transcript.clear()
        self.notify("Cleared the chat")

    async def action_regenerate(self) -> None:
        if self.busy:
            self.notify("A reply is still coming: Esc stops it", severity="warning")
            return
        if self.chat is None:
            self.notify("The model is still loading", severity="warning")
            return
        if self.transcript.last("user") is None:
            self.notify("Nothing to regenerate yet", severity="warning")
            return
        if self.transcript.last("user").has_class("unsent"):
            self.notify("Your last message was not sent: ctrl+t edits it", severity="warning")
            return
        self._starting = True
        try:
            last = self.transcript.messages[-1]
            if last.role == "assistant":
                if last.stored_position is not None and self.conversation is not None:
                    self.app.store.delete_messages_from(self.conversation.id, last.stored_position)
                await self.transcript.drop_from(last)
            await self._start(lambda chat: chat.regenerate(max_tokens=self.app.max_tokens))
        finally:
            self._starting = False

    def action_edit_last(self) -> None:
        if self.busy:
            self.notify("A reply is still coming: Esc stops it", severity="warning")
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

    async def _resend(self, text: str) -> None:
        self._stop_editing()
        last = self.transcript.last("user")
        unsent = last is not None and last.has_class("unsent")  # not in the session: send it, edit nothing
        if last is not None:
            if last.stored_position is not None and self.conversation is not None:
                self.app.store.delete_messages_from(self.conversation.id, last.stored_position)
            await self.transcript.drop_from(last)
        await self._add_user(text)
        if unsent:
            await self._start(lambda chat: chat.send(text, max_tokens=self.app.max_tokens))
        else:
            await self._start(lambda chat: chat.edit_last(text, max_tokens=self.app.max_tokens))

    # --- conversations -------------------------------------------------------------------------------------------

    @on(ConversationList.Opened)
    async def _opened(self, event: ConversationList.Opened) -> None:
        await self.open_conversation(event.conversation_id)

    async def open_conversation(self, conversation_id: int) -> None:
        """Restore a saved conversation: its messages (with their stats), system prompt and profile."""
        from mlxchat.core import SamplingProfile

        self._cancel_for_navigation()
        store = self.app.store
        conversation = store.conversation(conversation_id)
        stored = store.messages(conversation_id)
        try:
            profile = SamplingProfile.model_validate(conversation.profile) if conversation.profile else None
        except ValidationError as e:
            self.notify(f"The saved profile is no longer valid ({e.errors()[0]['msg']}); using the default",
                        severity="warning")
            profile = None
        self.conversation = conversation
        self.profile = profile or self.app.default_profile()
        self.system_prompt = conversation.system_prompt or ""
        self._new_session([m.as_chat_message() for m in stored if m.role != "system"])
        await self.transcript.clear()
        views = []
        for m in stored:
            if m.role == "system":
                continue
            label = f"Assistant · {m.model}" if m.role == "assistant" and m.model else None
            stats = (stats_line(m.metrics or {}, m.finish_reason, (m.profile or {}).get("name"))
                     if m.role == "assistant" else "")
            view = MessageView(m.role, m.content, label=label, stats=stats, stored_position=m.position)
            view.finish_reason = m.finish_reason
            views.append(view)
        if views:
            await self.transcript.mount_all(views)
        self.transcript.anchor()
        self.sub_title = conversation.title
        self.stats.show_profile(self.profile.name or "custom")
        self.refresh_sidebar()

    @on(ConversationList.RenameRequested)
    def _rename(self, event: ConversationList.RenameRequested) -> None:
        store = self.app.store
        conversation = store.conversation(event.conversation_id)

        def done(title: str | None) -> None:
            if not title:
                return
            store.rename_conversation(conversation.id, title)
            if self.conversation and self.conversation.id == conversation.id:
                self.conversation = store.conversation(conversation.id)
                self.sub_title = self.conversation.title
            self.refresh_sidebar()

        self.app.push_screen(TextPrompt("Rename the conversation", conversation.title, accept="Rename"), done)

    @on(ConversationList.DeleteRequested)
    def _delete(self, event: ConversationList.DeleteRequested) -> None:
        store = self.app.store
        conversation = store.conversation(event.conversation_id)

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            if self.conversation and self.conversation.id == conversation.id:
                await self.action_new_chat()
            store.delete_conversation(conversation.id)
            self.refresh_sidebar()
            self.notify(f"Deleted {conversation.title!r}")

        self.app.push_screen(Confirm(f"Delete {conversation.title!r} and its messages?", yes="Delete"), done)

    # --- profiles, system prompt, models -------------------------------------------------------------------------

    def set_profile(self, profile: "SamplingProfile") -> None:
        """Use ``profile`` from the next turn on (and remember it with the conversation)."""
        self.profile = profile
        if self.chat is not None:
            self.chat.profile = profile
        if self.conversation is not None:
            self.app.store.update_conversation(self.conversation.id, profile=self._profile_dict())
        self.stats.show_profile(profile.name or "custom")
        self.notify(f"Profile {profile.name or 'custom'}: {profile_summary(profile)}")

    def action_profiles(self) -> None:
        assert self.profile is not None

        def done(profile: "SamplingProfile | None") -> None:
            if profile is not None:
                self.set_profile(profile)

        self.app.push_screen(ProfilePicker(self.app.profiles, self.profile), done)

    def action_system_prompt(self) -> None:
        def done(text: str | None) -> None:
            if text is None:
                return
            if self.busy:
                self.notify("A reply is still coming: Esc stops it", severity="warning")
                return
            self.system_prompt = text
            self._new_session(self._conversation_messages())
            if self.conversation is not None:
                self.app.store.update_conversation(self.conversation.id, system_prompt=text)
            self.notify("System prompt set for this chat")

        self.app.push_screen(TextPrompt("System prompt for this chat", self.system_prompt, accept="Set"), done)

    def action_models(self) -> None:
        store = self.app.store

        def add(path: str) -> None:
            resolved = str(Path(path).expanduser().resolve())
            store.add_model(resolved, Path(resolved).name)

        def done(choice: ModelChoice | None) -> None:
            if choice is None:
                return
            if self.busy:
                self._cancel_for_navigation()
            self.notify(f"Loading {choice.label}…")
            self.load_model(choice.spec)

        self.app.push_screen(
            ModelPicker(lambda: [*store.models(), *((p, Path(p).name) for p in self.app.settings.models)],
                        add, store.remove_model, self.model_spec, scan_hf_cache=self.app.scan_hf_cache), done)

    # --- copy, export, layout ------------------------------------------------------------------------------------

    def action_copy_reply(self) -> None:
        view = self.transcript.last("assistant")
        if view is None:
            self.notify("No reply to copy yet", severity="warning")
            return
        view.action_copy_message()

    def action_copy_code(self) -> None:
        for view in reversed(self.transcript.messages):
            if view.code_blocks():
                view.action_copy_code()
                return
        self.notify("No code block in this chat", severity="warning")

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    def default_export_path(self) -> Path:
        title = self.conversation.title if self.conversation else "chat"
        return self.app.locations.exports / f"{slug(title)}-{time.strftime('%Y%m%d-%H%M%S')}.md"

    def export_markdown(self, path: str | Path | None = None) -> Path:
        """Write the chat as Markdown (to ``path``, or a new file in the data folder's exports/)."""
        target = Path(path).expanduser() if path else self.default_export_path()
        lines = [f"# {self.conversation.title if self.conversation else 'New chat'}", ""]
        if self.engine is not None:
            lines.append(f"- model: {self.engine.name}")
        if self.profile is not None:
            lines.append(f"- profile: {self.profile.name or 'custom'} ({profile_summary(self.profile)})")
        lines += [f"- exported: {time.strftime('%Y-%m-%d %H:%M')}", ""]
        if self.system_prompt:
            lines += ["## System", "", self.system_prompt, ""]
        for view in self.transcript.messages:
            if view.streaming:
                continue
            lines += [f"## {'You' if view.role == 'user' else 'Assistant'}", "", view.text.rstrip(), ""]
            if view.role == "assistant" and view.stats:
                lines += [f"*{view.stats}*", ""]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines), encoding="utf-8")
        return target

    def action_export(self) -> None:
        def done(path: str | None) -> None:
            if not path:
                return
            try:
                written = self.export_markdown(path)
            except OSError as e:
                self.notify(f"Cannot write {path}: {e.strerror}", severity="error")
                return
            self.notify(f"Exported to {written}", title="Export", timeout=8)

        self.app.push_screen(TextPrompt("Export the chat to Markdown", str(self.default_export_path()),
                                        accept="Export"), done)
