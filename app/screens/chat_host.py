"""What the chat screen's helpers (reply_feed.py, chat_dialogs.py, inspection.py) use of the screen, as a protocol,
and the app the chat screen runs in, as a base class: the helpers are typed against :class:`ChatHost`, so none of
them imports screens/chat.py (which imports them), and the chat screen against :class:`ChatApp`, so it does not
import app.py (which imports the screens).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from textual.app import App

if TYPE_CHECKING:
    from textual.geometry import Size
    from textual.notifications import SeverityLevel
    from textual.widget import Widget

    from mlxchat.core import Engine, SamplingProfile
    from mlxchat.core.locations import Locations
    from mlxchat.core.sampling.profile import ProfileStore

    from ..config import Settings
    from ..conversation import ChatController, Reply
    from ..store import Store
    from ..widgets import ChatInput, StatsBar, TokenInspector, Transcript


class ChatApp(App[None]):
    """The Textual app as the chat screen sees it: what the screen reads of its settings and stores. MlxChatApp
    (app.py) sets them; a base class rather than a protocol, so the screen's ``app`` stays a Textual App."""

    store: Store
    settings: Settings
    locations: Locations
    profiles: ProfileStore
    model_spec: str | None
    preloaded_engine: Engine | None
    max_tokens: int | None
    scan_hf_cache: bool
    default_profile: Callable[[], SamplingProfile]


class ChatHost(Protocol):
    """The chat screen as its helpers see it: its widgets, its controller, and what it shows on their behalf."""

    title: str | None

    @property
    def app(self) -> ChatApp: ...

    @property
    def controller(self) -> ChatController: ...

    @property
    def transcript(self) -> Transcript: ...

    @property
    def input(self) -> ChatInput: ...

    @property
    def inspector(self) -> TokenInspector: ...

    @property
    def stats(self) -> StatsBar: ...

    @property
    def busy(self) -> bool: ...

    @property
    def size(self) -> Size: ...

    @property
    def focused(self) -> Widget | None: ...

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None) -> None: ...

    def run_worker(self, work: Callable[[], Any], *, group: str = "default", thread: bool = False) -> Any: ...

    def show_ready(self) -> None: ...

    def show_title(self) -> None: ...

    def refresh_sidebar(self) -> None: ...

    def set_profile(self, profile: SamplingProfile) -> None: ...

    def load_model(self, spec: str | None) -> None: ...

    def after_switch(self) -> Awaitable[None]: ...

    def sync(self) -> Awaitable[None]: ...

    def started(self, reply: Reply) -> Awaitable[None]: ...
