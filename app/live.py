"""Statics for text that is redrawn while replies stream."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


def redraw(static: Static, content: Content, lines: int | None) -> int | None:
    """``static.update(content)``, asking for a screen-wide layout pass (the expensive part of a redraw) only
    when its height changes from ``lines``; returns the new height (None while it has no width yet)."""
    width = static.content_region.width
    height = content.get_height(static.styles, width) if width else None
    static.update(content, layout=height is None or height != lines)
    return height


class LiveStatic(Static):
    """Redrawn often (a streaming reply, the timing pane, the status line): lays the screen out again only when
    its height changes. Rendering holds the GIL that the decode thread needs between kernels, so on CPU every
    millisecond saved here is decoding time."""

    _lines: int | None = None

    def show(self, content: Content | str) -> None:
        content = Content(content) if isinstance(content, str) else content
        self._lines = redraw(self, content, self._lines)
