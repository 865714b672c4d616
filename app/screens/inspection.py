"""The chat screen's side of the sampler inspector: the heat view (F7, tracing a reply written untraced on the
inference thread's queue), the token inspector below the transcript, branching from a candidate, ``[``/``]``
between branches, and the replay screen (F9). The chat screen routes its keys and messages here; what to do is
decided by :class:`~mlxchat.app.inspection.Inspection` (no Textual there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..conversation import Refused
from ..formatting import DONE
from ..inspection import Inspection
from ..turns import last_reply
from ..widgets import MessageView, TokenStrip
from .replay import ReplayScreen

if TYPE_CHECKING:
    from mlxchat.core.decode.events import GenerationResult
    from mlxchat.core.sampling.trace import TokenTrace

    from ..replay import ReplaySource
    from .chat_host import ChatHost


class InspectionPanel:
    """What the heat view and the inspector show, and which reply is being traced, for one chat screen."""

    def __init__(self, screen: "ChatHost", inspection: Inspection) -> None:
        self.screen = screen
        self.inspection = inspection
        self.inspected: TokenStrip | None = None  # the heat strip whose token the inspector shows
        self.tracing: MessageView | None = None  # the reply being traced on demand (F7), while it is

    def _refused(self, e: Refused) -> None:
        self.screen.notify(str(e), severity=e.severity)

    def target_reply(self) -> MessageView | None:
        """The reply under the cursor (the focused message, or the one holding the focus), else the last reply."""
        node = self.screen.focused
        while node is not None and not isinstance(node, MessageView):
            node = node.parent
        if isinstance(node, MessageView) and node.role == "assistant":
            return node
        if self.inspected is not None and self.inspected.is_attached:  # the focus is in the inspector
            return self.inspected.query_ancestor(MessageView)
        return self.screen.transcript.last("assistant")

    async def heat(self) -> None:
        """F7: show the reply under the cursor (or the last one) as tokens shaded by probability, or go back."""
        view = self.target_reply()
        if view is None:
            self.screen.notify("No reply yet: the heat view shows a reply's tokens", severity="warning")
            return
        if view.strip is not None:
            self.close()
            await view.hide_heat()
            view.focus()
            return
        try:
            traces = self.inspection.traces(view.turn)
            if traces is None:
                assert view.turn is not None
                source, length = self.inspection.retrace(view.turn)
        except Refused as e:
            self._refused(e)
            return
        if traces is None:  # written untraced: write it again, traced, with its seed (only now that it is asked for)
            if self.tracing is view:
                self.screen.notify("Still tracing this reply…", timeout=3)
                return
            self.tracing = view
            self.screen.notify("Tracing this reply: writing it again with its seed…", timeout=3)
            self.screen.run_worker(lambda: self._retrace(view, source, length), thread=True, group="retrace")
            return
        await self._show_heat(view, traces)

    async def _show_heat(self, view: MessageView, traces: "tuple[TokenTrace, ...]") -> None:
        strip = await view.show_heat(list(traces))
        strip.focus()
        strip.scroll_visible()

    def _retrace(self, view: MessageView, source: "ReplaySource", length: int) -> None:
        """On a worker thread: the rewrite waits for the engine's queue, not the UI."""
        engine = self.inspection.chat.engine
        assert engine is not None
        app = self.screen.app
        try:
            result = source.retrace(engine, self.inspection.inspect_k, length)
        except Exception as e:  # noqa: BLE001 - an engine error (or a profile no longer valid): one line, chat goes on
            app.call_from_thread(self._retraced, view, None, str(e) or type(e).__name__)
            return
        app.call_from_thread(self._retraced, view, result)

    async def _retraced(self, view: MessageView, result: "GenerationResult | None", error: str = "") -> None:
        self.tracing = None
        if result is None:
            self.screen.notify(f"Could not trace this reply: {error}", severity="error")
            return
        if view.turn is None or not view.is_attached:  # the chat changed meanwhile
            return
        try:
            traces = self.inspection.attach_traces(view.turn, result)
        except Refused as e:
            self._refused(e)
            return
        await self._show_heat(view, traces)

    def show_token(self, strip: TokenStrip, index: int) -> None:
        """Open (or move) the inspector on token ``index`` of ``strip``."""
        turn = strip.query_ancestor(MessageView).turn
        assert turn is not None
        self.inspected = strip
        message = turn.message
        self.screen.inspector.show(strip.traces[index], index, seed=message.seed,
                                   profile=message.profile.get("name"), sampler=message.sampler)
        self.screen.inspector.add_class("-open")

    def moved(self, strip: TokenStrip, index: int) -> None:
        if self.inspected is strip:  # the open inspector follows the cursor
            self.show_token(strip, index)

    def close(self) -> None:
        self.screen.inspector.remove_class("-open")
        self.inspected = None

    def closed(self) -> None:
        """The inspector was closed (Esc): the focus goes back to the tokens it showed."""
        strip = self.inspected
        self.close()
        if strip is not None and strip.is_attached:
            strip.focus()
        else:
            self.screen.input.focus()

    async def branch(self, token_index: int, token_id: int) -> None:
        """Enter on a candidate: continue the inspected reply with it instead, as a new branch."""
        strip = self.inspected
        if strip is None or not strip.is_attached:
            return
        turn = strip.query_ancestor(MessageView).turn
        assert turn is not None
        try:
            reply = self.inspection.branch(turn, token_index, token_id)
        except Refused as e:
            self._refused(e)
            return
        self.close()
        await self.screen.started(reply)
        self.screen.input.focus()

    async def step(self, view: MessageView, step: int) -> None:
        """``[``/``]`` on a message: show its previous/next branch."""
        turn = view.turn
        if turn is None or turn.role == "system":
            return
        try:
            shown = self.inspection.switch_branch(turn, step)
        except Refused as e:
            self._refused(e)
            return
        self.close()
        await self.screen.sync()
        for shown_view in self.screen.transcript.messages:
            if shown_view.turn is shown:
                shown_view.focus()
        # The state line showed the reply that was on screen: it now shows the one the branch leads to.
        last = last_reply(self.screen.controller.turns)
        if last is not None and last.message.metrics:
            self.screen.stats.show_metrics(last.message.metrics, state="done",
                                           label=DONE.get(last.message.finish_reason or "", "✓ done"))
        else:
            self.screen.show_ready()

    def replay(self) -> None:
        """F9: answer the reply's messages again with one parameter changed (same seed), side by side."""
        view = self.target_reply()
        try:
            source = self.inspection.replay_source(view.turn if view else None)
        except Refused as e:
            self._refused(e)
            return
        engine = self.inspection.chat.engine
        assert engine is not None
        self.screen.app.push_screen(ReplayScreen(engine, source, trace=self.inspection.inspect_k))
