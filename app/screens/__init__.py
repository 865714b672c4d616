"""Screens: the main chat screen and its modal pickers."""

from .chat import ChatScreen
from .dialogs import Confirm, TextPrompt
from .help import HelpScreen
from .model_picker import ModelPicker
from .profile_picker import ProfilePicker
from .replay import ReplayScreen

__all__ = ["ChatScreen", "Confirm", "HelpScreen", "ModelPicker", "ProfilePicker", "ReplayScreen", "TextPrompt"]
