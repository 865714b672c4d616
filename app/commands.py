"""Command palette providers: switch sampling profile (presets and user profiles, with their values)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from mlxchat.core import SamplingProfile


class ProfileCommands(Provider):
    """'Profile: chat — temperature 0.8 · top_p 0.9' for every preset and saved profile."""

    def _profiles(self) -> list[tuple[str, "SamplingProfile"]]:
        from .screens.profile_picker import load_entries

        return [(e.kind, e.profile) for e in load_entries(self.app.profiles) if e.profile is not None]  # type: ignore[attr-defined]

    async def startup(self) -> None:
        self._entries = self._profiles()

    def _use(self, profile: "SamplingProfile") -> None:
        screen = self.app.chat_screen  # type: ignore[attr-defined]
        screen.set_profile(profile)

    def _label(self, kind: str, profile: "SamplingProfile") -> tuple[str, str]:
        from .formatting import profile_summary

        return f"Profile: {profile.name} ({kind})", profile_summary(profile)

    async def discover(self) -> Hits:
        for kind, profile in self._entries:
            title, help_text = self._label(kind, profile)
            yield DiscoveryHit(title, partial(self._use, profile), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for kind, profile in self._entries:
            title, help_text = self._label(kind, profile)
            if (score := matcher.match(title)) > 0:
                yield Hit(score, matcher.highlight(title), partial(self._use, profile), help=help_text)
