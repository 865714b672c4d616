"""Every use the app makes of Textual's internals, in one place, checked against the Textual it was written for.

Textual may change a private name in any release. pyproject.toml pins the major version (``textual>=8.2.6,<9``),
and this module refuses, on import, a Textual outside that range with a message that says which one to install
(a ``--no-deps`` install or a forced upgrade gets past pip's pin). Inside the range each helper checks what it
touches and degrades to Textual's plain behaviour when it is gone:

- ``OneLayout``: a mixin for widgets that never scroll, overriding the private ``Widget._size_updated`` so that a
  new size costs one layout instead of two. Without it: two layouts per resize, nothing else changes.
- ``keymap(app)``: the keymap in force (binding id -> keys), which ``App.set_keymap`` keeps in the private
  ``App._keymap`` with no getter. Without it: the default keys.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import textual
from textual.app import App
from textual.widget import Widget

SUPPORTED = ((8, 2, 6), (9, 0, 0))  # [lowest, first unsupported): pyproject.toml's "textual>=8.2.6,<9"


class TextualVersionError(ImportError):
    """The installed Textual is outside the range this module was written for."""


def release(version: str) -> tuple[int, int, int]:
    """``"8.2.6"`` -> ``(8, 2, 6)``; a pre-release or local suffix is ignored (``"9.0.0rc1"`` -> ``(9, 0, 0)``)."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def check_version(version: str) -> None:
    """Raise ``TextualVersionError`` unless ``version`` is in ``SUPPORTED``."""
    low, high = SUPPORTED
    if not low <= release(version) < high:
        wanted = f"textual>={'.'.join(map(str, low))},<{high[0]}"
        raise TextualVersionError(f"mlxchat's TUI needs {wanted} (app/textual_compat.py uses Textual internals "
                                  f"written for it); found textual {version}: pip install '{wanted}'")


check_version(textual.__version__)


def size_updated_takes_layout(widget_class: type) -> bool:
    """Whether ``widget_class._size_updated`` still takes the ``layout`` flag ``OneLayout`` passes."""
    size_updated = getattr(widget_class, "_size_updated", None)
    return callable(size_updated) and "layout" in inspect.signature(size_updated).parameters


class OneLayout:
    """For widgets that never scroll (a reply, its Markdown and their blocks): a new size needs no second layout.

    After a layout, Textual sets each resized widget's ``virtual_size``, a reactive that asks for another layout of
    the whole screen; that second pass matters to widgets that scroll their content. These only grow with their
    text, and the layout that resized them already placed everything, so each line a streaming reply wraps onto
    costs one layout instead of two. (If Textual's ``_size_updated`` changes, they lay out as any other widget.)"""

    if size_updated_takes_layout(Widget):
        def _size_updated(self, size: Any, virtual_size: Any, container_size: Any, layout: bool = True) -> bool:
            return super()._size_updated(size, virtual_size, container_size, layout=False)  # type: ignore[misc]


def keymap(app: App) -> Mapping[str, str]:
    """The keymap ``app.set_keymap`` put in force: binding id -> keys (empty: every binding on its default keys)."""
    found = getattr(app, "_keymap", None)
    return dict(found) if isinstance(found, Mapping) else {}
