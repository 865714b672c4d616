"""The dialogs the chat screen opens and what their answers do: clear the chat, rename or delete a conversation,
pick a profile, a system prompt or a model, export to Markdown. The chat screen routes its keys and the sidebar's
requests here; each answer goes to its :class:`~mlxchat.app.conversation.ChatController`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..conversation import Refused
from ..layout import fit_path
from ..models import ModelPick
from .dialogs import Confirm, TextPrompt
from .model_picker import ModelPicker
from .profile_picker import ProfilePicker

if TYPE_CHECKING:
    from mlxchat.core import SamplingProfile

    from .chat_host import ChatHost

BUSY = "A reply is still coming: Esc stops it"
TOAST_COLUMNS = 60  # Textual's toast: 60 columns wide, at most half the screen


class ChatDialogs:
    """One chat screen's dialogs."""

    def __init__(self, screen: "ChatHost") -> None:
        self.screen = screen

    def clear(self) -> None:
        screen, controller = self.screen, self.screen.controller
        if not controller.turns:
            screen.notify("This chat has no messages", severity="warning")
            return
        count = sum(t.role != "system" for t in controller.turns)

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            try:
                controller.clear()
            except Refused as e:
                screen.notify(str(e), severity=e.severity)
                return
            await screen.after_switch()
            screen.notify("Cleared the chat")

        screen.app.push_screen(Confirm(f"Delete the {count} messages of this chat? This cannot be undone.",
                                       yes="Delete messages"), done)

    def rename(self, conversation_id: int) -> None:
        screen = self.screen
        conversation = screen.app.store.conversation(conversation_id)

        def done(title: str | None) -> None:
            if title:
                screen.controller.rename(conversation.id, title)
                screen.show_title()
                screen.refresh_sidebar()

        screen.app.push_screen(TextPrompt("Rename the conversation", conversation.title, accept="Rename"), done)

    def delete(self, conversation_id: int) -> None:
        screen = self.screen
        conversation = screen.app.store.conversation(conversation_id)

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            controller = screen.controller
            current = controller.record is not None and controller.record.id == conversation.id
            deleted = controller.delete(conversation.id)
            if current:
                await screen.after_switch()
            screen.refresh_sidebar()
            if deleted:
                screen.notify(f"Deleted {conversation.title!r}")

        screen.app.push_screen(Confirm(f"Delete {conversation.title!r} and its messages?", yes="Delete"), done)

    def profiles(self) -> None:
        screen = self.screen

        def done(profile: "SamplingProfile | None") -> None:
            if profile is not None:
                screen.set_profile(profile)

        screen.app.push_screen(ProfilePicker(screen.app.profiles, screen.controller.profile), done)

    def system_prompt(self) -> None:
        screen = self.screen

        async def done(text: str | None) -> None:
            if text is None:
                return
            try:
                screen.controller.set_system_prompt(text)
            except Refused as e:
                screen.notify(str(e), severity=e.severity)
                return
            await screen.sync()
            screen.notify("System prompt set for this chat")

        screen.app.push_screen(TextPrompt("System prompt for this chat", screen.controller.system_prompt,
                                          accept="Set"), done)

    def models(self) -> None:
        screen = self.screen
        app, store = screen.app, screen.app.store

        def done(pick: ModelPick | None) -> None:
            engine = screen.controller.engine
            # The model in use: nothing to reload, the chat's cache stays; unless it was split across machines and
            # lost one (core/distributed), when picking it again loads it on this machine.
            if pick is None or (pick.already_loaded and (engine is None or engine.usable)):
                return
            if screen.busy:  # the reply would land in a session the new model does not have
                screen.notify(f"{BUSY}, then pick the model again", severity="warning")
                return
            screen.notify(f"Loading {pick.choice.label}…")
            screen.load_model(pick.choice.spec)

        app.push_screen(
            ModelPicker(lambda: [*store.models(), *((p, Path(p).name) for p in app.settings.models)],
                        store.remove_model, screen.controller.model_spec, scan_hf_cache=app.scan_hf_cache),
            done)

    def export(self) -> None:
        screen = self.screen

        def done(path: str | None) -> None:
            if not path:
                return
            try:
                written = screen.controller.export_markdown(path)
            except OSError as e:
                screen.notify(f"Cannot write {path}: {e.strerror}", severity="error")
                return
            # The path on its own line, fitted to the toast (60 columns, at most half the screen, less its padding
            # and border), so it never wraps mid-name.
            width = min(TOAST_COLUMNS, screen.size.width // 2) - 3
            screen.notify(f"Exported to\n{fit_path(Path(written), width)}", title="Export", timeout=8)

        screen.app.push_screen(TextPrompt("Export the chat to Markdown", str(screen.controller.default_export_path()),
                                          accept="Export"), done)
