"""The mlxchat Textual app: ``MlxChatApp``, the ``make_app`` factory the tests reuse, and ``run_tui`` for the CLI.

App-wide concerns live here and in the top-level modules (posting's layout): settings (``config.py``), the
conversation's logic (``conversation.py``), the conversation store (``store.py``), Markdown export (``export.py``),
the engine bridge (``engine_worker.py``) and command palette providers (``commands.py``); the folders come from
``mlxchat.core.locations``, shared with the CLI. The UI itself is in ``screens/`` and ``widgets/``, styled by
``app.tcss``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import termios
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from mlxchat.core.locations import Locations
from mlxchat.core.chat.messages import ContextPolicy
from mlxchat.core.sampling.profile import ProfileError, ProfileStore, SamplingProfile

from . import textual_compat
from .commands import ProfileCommands
from .config import ConfigError, Settings
from .conversation import Refused
from .screens import ChatScreen, Confirm, HelpScreen, ModelPicker, ProfilePicker, ReplayScreen, TextPrompt
from .screens.chat_host import ChatApp
from .screens.tools import ToolApproval, ToolsScreen
from .store import Store, StoreError
from .widgets import ChatInput, ConversationList, MessageView, TokenInspector, TokenStrip, Transcript

if TYPE_CHECKING:
    from mlxchat.core import Engine


INTERRUPTED = 130  # the exit status after SIGINT, as shells report it (128 + 2)
HUNG_UP = 129  # the exit status once the terminal is gone (128 + SIGHUP)

# The palette's "Context policy: ..." commands: what each does once a chat no longer fits the model's context.
CONTEXT_POLICY_HELP: dict[ContextPolicy, str] = {
    "truncate": "A chat longer than the context drops its oldest turns (the system prompt stays)",
    "rotate": "A chat longer than the context runs through a rotating KV window (kv_window; default the context)",
    "error": "A chat longer than the context is refused, to be shortened by hand",
}


class MlxChatApp(ChatApp):
    CSS_PATH = "app.tcss"
    TITLE = "mlxchat"
    COMMANDS = App.COMMANDS | {ProfileCommands}
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True, show=False),
        Binding("f1", "help", "Help", id="help"),
        Binding("f10", "toggle_theme", "Light/dark", id="toggle_theme", show=False),
    ]

    def __init__(self, *, locations: Locations, model: str | None = None, engine: "Engine | None" = None,
                 max_tokens: int | None = None, scan_hf_cache: bool = True, profile: str | None = None,
                 system_prompt: str | None = None, settings: dict[str, Any] | None = None,
                 sampling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.locations = locations
        self.problems: list[str] = []
        try:
            self.settings = Settings.load(locations.config_file)
        except ConfigError as e:
            self.settings = Settings()
            self.problems.append(str(e))
        overrides = {k: v for k, v in (("profile", profile), ("system_prompt", system_prompt)) if v is not None}
        overrides.update(settings or {})
        if overrides:
            self.settings = self.settings.model_copy(update=overrides)
        self.sampling = sampling or {}  # the command line's sampler flags, over each new chat's profile
        self.model_spec = model if model is not None else self.settings.model
        self.preloaded_engine = engine
        self.max_tokens = max_tokens if max_tokens is not None else self.settings.max_tokens
        self.scan_hf_cache = scan_hf_cache
        self.profiles = ProfileStore(locations.profiles)
        try:
            self.store = Store(locations.database)
            self.store_error: str | None = None
        except StoreError as e:
            # Never touch the user's file: run on a throwaway database and say so.
            self.store = Store(":memory:")
            self.store_error = str(e)
            self.problems.append(f"{e}. Conversations are not saved in this session.")
        self.chat_screen = ChatScreen()

    # --- start and stop ------------------------------------------------------------------------------------------

    def get_default_screen(self) -> Screen:
        return self.chat_screen

    def on_mount(self) -> None:
        # The theme picked in the app (F10, palette) is remembered, until config.toml's theme itself changes.
        theme = self.settings.theme
        if self.store.get_setting("theme_config") == theme:
            theme = self.store.get_setting("theme") or theme
        if theme not in self.available_themes:
            self.problems.append(f"unknown theme {theme!r}; themes: {', '.join(sorted(self.available_themes))}")
            theme = "textual-dark"
        self.theme = theme
        self._theme_ready = True
        if not self.is_headless and sys.__stdin__ is not None and sys.__stdin__.isatty():
            self.set_interval(1.0, self._check_terminal)
        known = {binding_id for _, _, _, binding_id in self.binding_rows(remapped=False)}
        unknown = sorted(set(self.settings.keys) - known)
        if unknown:
            self.problems.append(f"{self.locations.config_file}: keys: no binding with id {', '.join(unknown)} "
                                 "(F1 lists the ids)")
        self.set_keymap({k: v for k, v in self.settings.keys.items() if k in known})
        for problem in self.problems:
            self.notify(problem, severity="error", timeout=15)

    def on_load(self) -> None:
        # `kill -INT` (the terminal's ctrl+c is a key here, not a signal) quits as ctrl+q does, saving a reply in
        # flight, with the shell's exit status for an interrupt; Python's default raised KeyboardInterrupt wherever
        # the main thread happened to be, or nowhere useful while Textual waited. From Load on, before Textual takes
        # the terminal: the command line's handler leaves at once, which would leave it in the app's modes.
        # SIGHUP (the terminal closed) likewise, saving a reply in flight instead of dying with it.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # no signals off the main thread
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGINT, partial(self._leave, INTERRUPTED))
            loop.add_signal_handler(signal.SIGHUP, partial(self._leave, HUNG_UP))

    def _leave(self, status: int) -> None:
        # Quitting while the chat screen mounts removed its widgets under its on_mount (NoMatches, exit status 1):
        # quit once it is up.
        if not self.chat_screen.is_mounted:
            self.set_timer(0.05, partial(self._leave, status))
            return
        self.exit(None, status)

    def _check_terminal(self) -> None:
        # A terminal closed under `make chat` hangs up make, the session's leader, alone: the app lived on, and
        # Textual's input thread spun on the hung-up terminal (every read returns at once, empty), 30-70% of a core
        # for good. A hung-up terminal fails tcgetattr with EIO.
        try:
            termios.tcgetattr(sys.__stdin__.fileno())
        except (termios.error, OSError, ValueError):
            self._leave(HUNG_UP)

    def on_unmount(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop = asyncio.get_running_loop()
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGHUP)
        self.chat_screen.shut_down()  # saves a reply in flight: before the store closes
        self.store.close()

    def watch_theme(self, theme: str) -> None:
        if getattr(self, "_theme_ready", False):  # a change by the user (not the initial one): remember it
            self.store.set_setting("theme", theme)
            self.store.set_setting("theme_config", self.settings.theme)

    # --- profiles ------------------------------------------------------------------------------------------------

    def default_profile(self) -> SamplingProfile:
        """The config's profile: a preset or a saved user profile (the chat preset if it cannot be found)."""
        name = self.settings.profile
        try:
            profile = self.profiles.resolve(name)
        except ProfileError as e:
            self.notify(f"profile {name!r}: {e}; using the chat preset", severity="warning")
            profile = SamplingProfile.preset("chat")
        return profile.model_copy(update=self.sampling)

    # --- help, theme, palette ------------------------------------------------------------------------------------

    BINDING_SCOPES: list[tuple[str, type]] = []  # filled below, after the classes exist

    def binding_rows(self, *, remapped: bool = True) -> list[tuple[str, str, str, str]]:
        """(keys, description, where, id) for every binding of the app's screens and widgets, with the keymap
        applied; Textual's own (Tab, the palette: no id, so not remappable) and the keys a widget handles itself."""
        keymap = textual_compat.keymap(self) if remapped else {}
        rows = []
        seen = set()
        for where, cls in self.BINDING_SCOPES:
            for b in cls.BINDINGS:
                if not isinstance(b, Binding) or (b.id or b.key) in seen or (cls is Screen and b.action.endswith(
                        "copy_text")):  # Textual's select-and-copy: the app copies by c, k, F5 and F8
                    continue
                seen.add(b.id or b.key)
                rows.append((keymap.get(b.id, b.key) if b.id else b.key, b.description or b.action, where, b.id or ""))
        return rows + [(self.COMMAND_PALETTE_BINDING, "Command palette (every action by name)", "app", ""),
                       *WIDGET_KEYS]

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(self.binding_rows(), str(self.locations.config_file)))

    def action_toggle_theme(self) -> None:
        s = self.settings
        self.theme = s.light_theme if self.theme == s.dark_theme or self.current_theme.dark else s.dark_theme

    def set_context_policy(self, policy: ContextPolicy) -> None:
        """The palette's Context policy commands: for this session's chats (config.toml's context_policy keeps it)."""
        try:
            self.chat_screen.controller.set_context_policy(policy)
        except Refused as e:
            self.notify(str(e), severity=e.severity)
            return
        self.notify(f"context_policy = {policy} for this session (set it in config.toml to keep it)")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat_screen
        yield SystemCommand("New chat", "Start a new conversation", chat.action_new_chat)
        yield SystemCommand("Sampling profile…", "Pick or edit the profile for this chat", chat.action_profiles)
        yield SystemCommand("Model…", "Pick a model: embedded, local files, Hugging Face cache", chat.action_models)
        yield SystemCommand("System prompt…", "Set the system prompt of this chat", chat.action_system_prompt)
        yield SystemCommand("Regenerate", "Answer the last message again", chat.action_regenerate)
        yield SystemCommand("Edit last message", "Edit and resend your last message", chat.action_edit_last)
        yield SystemCommand("Export to Markdown…", "Write this chat to a Markdown file", chat.action_export)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard", chat.action_copy_reply)
        yield SystemCommand("Copy last code block", "Copy a code block of the chat", chat.action_copy_code)
        yield SystemCommand("Clear chat", "Delete the messages of this chat", chat.action_clear)
        yield SystemCommand("Heat view", "Shade the last reply's tokens by probability; Enter inspects one",
                            chat.action_heat)
        yield SystemCommand("Replay with a change…", "Run the last reply again with one parameter changed, "
                            "side by side", chat.action_replay)
        for policy, help_text in CONTEXT_POLICY_HELP.items():
            yield SystemCommand(f"Context policy: {policy}", help_text, partial(self.set_context_policy, policy))
        yield SystemCommand("Toggle light/dark", "Switch between the light and dark theme", self.action_toggle_theme)
        yield SystemCommand("Toggle sidebar", "Show or hide the conversation list", chat.action_toggle_sidebar)
        yield SystemCommand("Keys", "Show the key bindings", self.action_help)


MlxChatApp.BINDING_SCOPES = [("app", MlxChatApp), ("any screen", Screen), ("chat", ChatScreen), ("input", ChatInput),
                             ("transcript", Transcript), ("message", MessageView), ("sidebar", ConversationList),
                             ("heat view", TokenStrip), ("inspector", TokenInspector),
                             ("profiles (F2)", ProfilePicker), ("models (F3)", ModelPicker),
                             ("replay (F9)", ReplayScreen), ("dialogs", TextPrompt), ("dialogs", Confirm),
                             ("tools (ctrl+o)", ToolsScreen), ("tool call", ToolApproval),
                             ("help (F1)", HelpScreen)]
# Keys that a widget of Textual's handles itself (no Binding of ours to list): F1 says them too.
WIDGET_KEYS = [("enter", "Continue from this candidate (a branch)", "inspector", ""),
               ("enter", "Open the highlighted chat", "sidebar", "")]


def make_app(model: str | None = None, data_dir: str | Path | None = None, config_dir: str | Path | None = None,
             max_tokens: int | None = None, *, engine: "Engine | None" = None, scan_hf_cache: bool = True,
             profile: str | None = None, system_prompt: str | None = None, settings: dict[str, Any] | None = None,
             sampling: dict[str, Any] | None = None) -> MlxChatApp:
    """Build the app.

    model: what ``Engine.load`` takes (None: the config's model, else the embedded one); data_dir / config_dir:
    override the XDG folders; max_tokens: per reply (None: the config's); profile / system_prompt / settings:
    override the config's values (new chats' defaults); sampling: sampler settings over new chats' profile;
    engine: an already loaded Engine (tests share one), which the app does not close; scan_hf_cache: let the model
    picker look in the Hugging Face cache."""
    return MlxChatApp(locations=Locations.resolve(data_dir, config_dir), model=model, engine=engine,
                      max_tokens=max_tokens, scan_hf_cache=scan_hf_cache, profile=profile,
                      system_prompt=system_prompt, settings=settings, sampling=sampling)


def run_tui(model: str | None = None, **kw: Any) -> int:
    """Open the full-screen chat (``mlxchat`` with no arguments, ``mlxchat chat --model X``); returns the exit
    status (130 after SIGINT, 129 once the terminal is gone)."""
    app = make_app(model=model, **kw)
    app.run()
    return app.return_code or 0
