"""Widgets, grouped by UI area."""

from .chat_input import ChatInput
from .inspector import TokenInspector, TokenStrip
from .sidebar import ConversationList, Sidebar
from .stats_bar import StatsBar
from .transcript import MessageView, Notice, Transcript

__all__ = ["ChatInput", "ConversationList", "MessageView", "Notice", "Sidebar", "StatsBar", "TokenInspector",
           "TokenStrip", "Transcript"]
