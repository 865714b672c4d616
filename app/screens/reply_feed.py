"""The chat screen's transcript kept in step with its controller, and what the engine's bridge thread reports shown
on it: a model loading, loaded or failed; a reply's prefill, its token batches (paced to the UI's CPU budget), its
end or failure. The chat screen routes the :class:`~mlxchat.app.engine_worker.EngineWorker`'s messages here; what
they change in the chat is decided by the :class:`~mlxchat.app.conversation.ChatController`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..conversation import Reply, Turn, keeps
from ..engine_worker import BATCH_S, EngineWorker, next_batch_s
from ..formatting import DONE, stats_line, thought_line
from ..inspection import Inspection
from ..models import to_remember
from ..turns import first_reply
from ..widgets import MessageView, Notice

if TYPE_CHECKING:
    from mlxchat.core import Engine

    from .chat_host import ChatHost

# Drawing streamed text costs the UI thread CPU that, on a small machine, the decoder would otherwise use: on 2
# cores the decoder's pool keeps both busy, and each millisecond of the UI thread's work cost decoding one to two
# (the bench's TUI rows). Batches start at 40 ms; each next one waits until drawing the last fits this share of
# the UI thread's time (up to MAX_BATCH_S). A batch costs 2-5 ms (its handler, then a screen update, in which
# Textual repaints every widget of the containers the update touches), so on this machine a reply is drawn about
# 5 times a second and the TUI decodes within 1-3.5% of the headless speed (at 4%: 8-10 updates a second and 8-12%
# slower); a machine that draws faster gets more updates for the same share.
UI_CPU_BUDGET = 0.01


def _placed(label: str, turn: Turn) -> str:
    """A message's label with its place among its alternatives, when it has any."""
    place = Inspection.branch_place(turn)
    return label if place is None else f"{label}   < {place[0]}/{place[1]} >  [ ] switch"


class ReplyFeed:
    """The transcript and the stats bar of one chat screen, following its controller and its engine worker."""

    def __init__(self, screen: "ChatHost", worker: EngineWorker) -> None:
        self.screen = screen
        self.worker = worker
        self._ui_cpu_mark: float | None = None
        # The UI thread's CPU from the reply's first batch to its last: what drawing it took from decoding (the
        # bench's TUI rows report it per token).
        self.streaming_ui_cpu_s = 0.0

    # --- the transcript follows the controller's turns -----------------------------------------------------------

    @staticmethod
    def view(turn: Turn, first: bool = False) -> MessageView:
        """A turn as a message view: its text, label (model, branch place) and stats line (`first`: the chat's first
        reply)."""
        if turn.role == "assistant":
            message = turn.message
            if turn.streaming:
                stats = ""
            elif turn.error:
                stats = f"error: {turn.error}"
            else:
                stats = stats_line(message.metrics, message.finish_reason, message.profile.get("name"),
                                   first_reply=first)
            label = f"Assistant · {message.model}" if message.model else "Assistant"
            view = MessageView("assistant", turn.content, label=_placed(label, turn), stats=stats, turn=turn,
                               reasoning=message.reasoning, streaming=turn.streaming,
                               thought=thought_line(message.metrics, streaming=turn.streaming))
            if turn.error:
                view.add_class("failed")
            return view
        if turn.role == "system":
            return MessageView("system", turn.content, label="System prompt, from here on", turn=turn)
        view = MessageView("user", turn.content, label=_placed("You", turn), turn=turn)
        if turn.unsent:
            view.add_class("unsent")
            view.stats = "not sent · ctrl+t edits and sends it"
        return view

    async def sync(self) -> None:
        """Make the transcript show the controller's turns: keep the views that match, replace the rest."""
        transcript = self.screen.transcript
        views, turns = transcript.messages, self.screen.controller.turns
        same = 0
        while same < min(len(views), len(turns)) and views[same].turn is turns[same]:
            same += 1
        if same < len(views):
            await transcript.drop_from(views[same])
        first = first_reply(turns)
        new = [self.view(t, t is first) for t in turns[same:]]
        if new:
            await transcript.append(*new)
        transcript.anchor()

    def _reply_view(self, reply: Reply) -> MessageView | None:
        for view in reversed(self.screen.transcript.messages):
            if view.turn is reply.turn:
                return view
        return None

    def _set_reply_stats(self, reply: Reply, text: str) -> None:
        view = self._reply_view(reply)
        if view is not None:
            view.set_stats(text)

    async def _show_unsent(self, turn: Turn) -> None:
        for view in self.screen.transcript.messages:
            if view.turn is turn:
                view.add_class("unsent")
                view.set_stats("not sent · ctrl+t edits and sends it")

    # --- the model -----------------------------------------------------------------------------------------------

    def loading(self, spec: str | None) -> None:
        what = spec or "the embedded model"
        self.screen.stats.show_state("loading", "◌ loading", f"loading {what}…")

    async def loaded(self, event: EngineWorker.Loaded) -> None:
        screen = self.screen
        replaced = screen.controller.engine is not None
        self.engine_ready(event.engine, event.spec, owned=True)
        if (entry := to_remember(event.spec)) is not None:  # a path is listed only once it has loaded
            screen.app.store.add_model(*entry)
        await screen.transcript.query(Notice).remove()  # "the model did not load" banners are answered now
        if replaced:
            screen.notify(f"Loaded {event.engine.name} in {event.seconds:.1f} s", timeout=4)

    def engine_ready(self, engine: "Engine", spec: str | None, *, owned: bool) -> None:
        screen = self.screen
        old, started = screen.controller.engine_ready(engine, spec, owned=owned)
        if old is not None:
            self.worker.call(old.close)  # after anything still queued for it
        screen.title = f"mlxchat · {engine.name}"
        screen.show_ready()
        if started is not None:
            self._follow(started)

    async def load_failed(self, event: EngineWorker.LoadFailed) -> None:
        screen = self.screen
        message = str(event.error) or type(event.error).__name__
        screen.notify(message, title="The model did not load", severity="error", timeout=10)
        if screen.controller.load_failed() is not None:
            await self.sync()  # the reply that waited goes; its message stays, unanswered (ctrl+r)
        engine = screen.controller.engine
        if engine is not None:
            screen.stats.show_state("idle", "● ready", f"{engine.name} (kept; the new model failed: {message})")
            return
        screen.show_ready()
        actions = {"pick_model": "Pick a model (F3)"}
        if event.spec is not None:
            actions = {"load_embedded": "Load the embedded model", **actions}
        await screen.transcript.add(Notice(f"The model did not load: {message}", actions=actions))

    # --- a reply -------------------------------------------------------------------------------------------------

    async def started(self, reply: Reply) -> None:
        """Show a reply just started (or waiting for the model) and follow its stream."""
        await self.sync()
        if reply.stream is None:
            self._set_reply_stats(reply, "waiting for the model to load…")
            self.screen.stats.show_state("waiting", "◌ waiting", "waiting for the model to load…")
        else:
            self._follow(reply)

    def _follow(self, reply: Reply) -> None:
        assert reply.stream is not None
        self.worker.follow(reply.stream)
        self.screen.input.cursor_blink = False  # each blink is a screen update, twice a second, that decoding pays for
        self._set_reply_stats(reply, "prefilling…")
        self.screen.stats.show_state("prefill", "▷ prefill", "")
        self._ui_cpu_mark = None
        self.worker.batch_s = BATCH_S  # what the last reply's drawing cost says nothing about this one's
        self.streaming_ui_cpu_s = 0.0

    def prefill(self, event: EngineWorker.Prefill) -> None:
        controller = self.screen.controller
        reply = controller.on_prefill(event.stream, event.done, event.total)
        if reply is not None and reply is controller.reply:
            self.screen.stats.show_prefill(event.done, event.total, reply.cached or 0)
            self._set_reply_stats(reply, f"prefill {event.done}/{event.total}")

    async def tokens(self, event: EngineWorker.Tokens) -> None:
        controller = self.screen.controller
        reply = controller.on_tokens(event.stream, event.text, event.count, event.metrics, event.reasoning)
        if reply is None:
            return
        view = self._reply_view(reply)
        # No screen update in the middle of a batch: its text, the reply's stats and the stats line change together.
        with self.screen.app.batch_update():
            if view is not None:
                if event.reasoning:  # a thinking model's reasoning, in its own collapsed block above the answer
                    await view.think(event.reasoning, thought_line(event.metrics, streaming=True))
                elif view.thinking is not None and event.text and event.metrics is not None:
                    view.set_thought(thought_line(event.metrics))  # the reasoning closed: its time is known
                await view.write(event.text)
                view.set_stats("generating…")  # the live numbers are in the stats bar; the final ones go here
            if reply is controller.reply and event.metrics is not None:
                thinking = bool(event.reasoning) and not event.text  # a thinking model still reasoning
                self.screen.stats.show_metrics(event.metrics, label="▶ thinking" if thinking else "▶ decoding")
        self._pace_batches()

    def _pace_batches(self) -> None:
        """Set the batch length from the UI thread's CPU time per batch (which includes drawing the last one)."""
        now = time.thread_time()
        if self._ui_cpu_mark is not None:
            self.streaming_ui_cpu_s += now - self._ui_cpu_mark
            self.worker.batch_s = next_batch_s(now - self._ui_cpu_mark, UI_CPU_BUDGET)
        self._ui_cpu_mark = now

    async def finished(self, event: EngineWorker.Finished) -> None:
        # The view is made final first: the reply counts as in flight until its view and its record are final.
        screen, controller = self.screen, self.screen.controller
        screen.input.cursor_blink = True
        reply, result = controller.reply_for(event.stream), event.result
        if reply is None:
            return
        current = reply is controller.reply
        view = self._reply_view(reply)
        if view is not None:
            if keeps(result):
                if result.reasoning and view.thinking is not None:
                    view.set_thought(thought_line(result.metrics))
                    view.thinking.show_all()
                await view.finish(result.text, stats_line(result.metrics, result.finish_reason,
                                                          result.profile.get("name"),
                                                          first_reply=reply.turn is first_reply(controller.turns)),
                                  result.finish_reason)
            else:
                await view.remove()
                screen.notify("Stopped before the first token; ctrl+r asks again")
        controller.on_finished(event.stream, result)
        if current and reply.replaced is not None and not reply.kept:  # a branch that came to nothing
            await self.sync()  # gives back what it had replaced
        if current:
            screen.stats.show_metrics(result.metrics, state="done",
                                      label=DONE.get(result.finish_reason, result.finish_reason))
            screen.refresh_sidebar()

    async def tool_activity(self, event: EngineWorker.ToolActivity) -> None:
        """A call of a turn with tools: shown in its reply (name and arguments, then the result, collapsed); a
        tools notice (a server that did not start, the step limit) as a notification."""
        reply = self.screen.controller.reply_for(event.stream)
        e = event.event
        if not hasattr(e, "call"):
            self.screen.notify(e.message, title="Tools", severity="warning", timeout=10)
            return
        view = self._reply_view(reply) if reply is not None else None
        if view is None:
            return
        record = {"id": e.call.id, "name": e.call.name, "arguments": e.call.arguments, "source": e.source,
                  "result": None}
        if hasattr(e, "outcome"):
            record |= e.outcome.as_dict()
            if e.decision == "deny":
                record["note"] = "denied"
        else:
            view.set_stats(f"calling {e.source}.{e.call.name}…")
        await view.show_tool_call(record)

    async def failed(self, event: EngineWorker.Failed) -> None:
        screen, controller = self.screen, self.screen.controller
        screen.input.cursor_blink = True
        reply = controller.reply_for(event.stream)
        if reply is None:
            return
        current = reply is controller.reply
        view = self._reply_view(reply)
        if view is not None:
            await view.fail(str(event.error) or type(event.error).__name__)
        _, message = controller.on_failed(event.stream, event.error)
        if current:
            if reply.replaced is not None:  # a failed branch gives back what it had replaced
                await self.sync()
            if reply.answers is not None and reply.answers.unsent:
                await self._show_unsent(reply.answers)
            screen.stats.show_state("error", "✗ error", message)
        engine = controller.engine
        if engine is not None and not engine.usable:
            screen.notify("Press F3 and pick the model to load it on this machine; the conversation is kept.",
                          title="The split model stopped", severity="error", timeout=30)
        screen.notify(message, title="The reply failed", severity="error", timeout=10)
