"""A Static for text that is redrawn while replies stream."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class LiveStatic(Static):
    """Redrawn often (a streaming reply, the timing pane, the status line): asks for a screen-wide layout pass,
    the expensive part of a redraw, only when its height changes. Rendering holds the GIL that the decode
    thread needs between kernels, so on CPU every millisecond saved here is decoding time."""

    _lines: int | None = None

    def show(self, content: Content | str) -> None:
        content = Content(content) if isinstance(content, str) else content
        width = self.content_region.width
        lines = content.get_height(self.styles, width) if width else None
        self.update(content, layout=lines is None or lines != self._lines)
        self._lines = lines
