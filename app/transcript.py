"""The chat transcript: one ``MessageView`` per message, and the prompt input.

Acceptance highlights: an assistant reply is shown either as Markdown (normal mode) or, in highlight mode, as
its plain text with every token that came from an accepted MTP draft marked in the theme's ``$draft-token``
colours. Highlight mode works live while streaming and for replies reopened from the database, because each
reply stores its per-token text and source tags. (Markdown formatting and per-token marks do not mix: the
Markdown renderer re-flows text, so token boundaries are lost; showing the raw text keeps the mapping exact.)
"""

from __future__ import annotations

import asyncio
import time

from markdown_it import MarkdownIt
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content, Span
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownFence

from .live import LiveStatic
from .safe_text import terminal_safe
from .stats import stats_line
from .store import Message as StoredMessage

DRAFT_STYLE = "$draft-token-text on $draft-token"

# Message text never reaches the terminal raw (an escape sequence in a reply could retitle the terminal, write
# the clipboard, ...). C0 controls a model or a paste may put in, ESC and BEL included, are shown as their
# Unicode "control pictures" (newline and tab are kept), so "\x1b]0;x\x07" reads "␛]0;x␇"; what terminal_safe
# strips after that (C1 controls) is dropped. The stored text stays as it was written.
_VISIBLE = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"} | {0x7F: 0x2421}


def visible(text: str) -> str:
    """``text`` as it may be shown in a widget: no control character, no escape sequence."""
    return terminal_safe(text.translate(_VISIBLE))


def highlighted(pieces: list[str], sources: list[str]) -> Content:
    """Plain reply text with accepted-draft tokens styled (consecutive draft tokens form one span)."""
    text_parts: list[str] = []
    spans: list[Span] = []
    offset = 0
    run_start = None
    for piece, source in zip(pieces, sources):
        if source == "draft":
            if run_start is None:
                run_start = offset
        elif run_start is not None:
            spans.append(Span(run_start, offset, DRAFT_STYLE))
            run_start = None
        shown = visible(piece)  # piece by piece, so the offsets are those of the text shown
        text_parts.append(shown)
        offset += len(shown)
    if run_start is not None and offset > run_start:
        spans.append(Span(run_start, offset, DRAFT_STYLE))
    return Content("".join(text_parts), spans, strip_control_codes=False)


def code_blocks(markdown: str) -> list[str]:
    """The fenced and indented code blocks of a Markdown text, in order."""
    return [t.content for t in MarkdownIt("commonmark").parse(markdown) if t.type in ("fence", "code_block")]


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (click, or tab) to copy it (c) or its code blocks (k)."""

    BINDINGS = [
        Binding("c", "copy", "Copy message"),
        Binding("k", "copy_code", "Copy code"),
    ]

    def __init__(self, message: StoredMessage, *, highlight: bool = True, streaming: bool = False):
        super().__init__(classes=message.role)
        self.message = message
        self.highlight = highlight
        self.streaming = streaming
        self._code_index = 0
        self._timer: Timer | None = None
        self._render_s = 0.0  # how long the last streamed render took
        self._render_lock = asyncio.Lock()
        self._markdown_len = len(message.content)  # characters of the reply the Markdown widget holds

    # composition -------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        m = self.message
        yield Static(self._header(), classes="message-header", markup=False)
        if m.role == "user":
            yield Static(Content(visible(m.content), strip_control_codes=False), classes="message-body")
            return
        yield Markdown(visible(m.content), classes="message-body reply-markdown")
        yield LiveStatic(self._highlight_content(), classes="message-body reply-highlight")
        yield Static(self._footer(), classes="message-footer", markup=False)

    def on_mount(self) -> None:
        if self.message.role == "assistant":
            self._show_mode()

    def _header(self) -> str:
        m = self.message
        if m.role == "user":
            return "You"
        return f"Assistant · {terminal_safe(m.model)}" if m.model else "Assistant"

    def _footer(self) -> str:
        m = self.message
        notes = []
        if self.streaming:
            notes.append("generating…")
        line = stats_line(m.stats)
        if line:
            notes.append(line)
        if m.status == "stopped":
            notes.append("stopped")
        elif m.status == "interrupted":
            notes.append("interrupted (the app was closed while it was generating)")
        if m.error:
            notes.append(f"error: {m.error}")
        return terminal_safe(" · ".join(notes))  # an error may quote model text or a path

    def _highlight_content(self) -> Content:
        m = self.message
        if m.pieces and "".join(m.pieces).strip():
            return highlighted(m.pieces, m.sources)
        return Content(visible(m.content), strip_control_codes=False)  # no per-token data (e.g. nothing generated yet)

    def _show_mode(self) -> None:
        self.query_one(".reply-markdown").display = not self.highlight
        self.query_one(".reply-highlight").display = self.highlight
        self.set_class(self.highlight, "highlight")

    # updates -----------------------------------------------------------------------------------------
    # While a reply streams, the body is re-rendered on a timer: at most 10 times a second, and less often when
    # a render costs more (a long Markdown reply), so that rendering takes at most RENDER_SHARE of the UI
    # thread. Rendering holds the GIL, which the decode thread needs between its kernels: on CPU, with a small
    # model, every millisecond spent here is a millisecond of decoding lost.
    RENDER_SHARE = 0.1
    MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 1.0

    def grew(self) -> None:
        """The streaming reply (``self.message``) has more text: render it soon."""
        if self._timer is None:
            delay = min(max(self._render_s / self.RENDER_SHARE, self.MIN_INTERVAL_S), self.MAX_INTERVAL_S)
            self._timer = self.set_timer(delay, self._render_streamed)

    async def _render_streamed(self) -> None:
        self._timer = None
        started = time.perf_counter()
        async with self._render_lock:
            if self.highlight:
                self.query_one(".reply-highlight", LiveStatic).show(self._highlight_content())
            else:
                new = self.message.content[self._markdown_len :]
                if new:
                    self._markdown_len += len(new)
                    await self.query_one(".reply-markdown", Markdown).append(visible(new))
        self._render_s = time.perf_counter() - started

    async def refresh_body(self) -> None:
        """Render the whole body again in the current mode."""
        async with self._render_lock:
            if self.highlight:
                self.query_one(".reply-highlight", Static).update(self._highlight_content())
            else:
                self._markdown_len = len(self.message.content)
                await self.query_one(".reply-markdown", Markdown).update(visible(self.message.content))

    async def finish(self) -> None:
        """The reply is complete (or stopped or failed): render it fully and show its footer."""
        self.streaming = False
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if self.message.role == "assistant" and self.is_attached:
            await self.refresh_body()
            self.update_footer()

    def update_footer(self) -> None:
        if self.message.role == "assistant":
            self.query_one(".message-footer", Static).update(self._footer())

    async def set_highlight(self, on: bool) -> None:
        if self.message.role != "assistant" or on == self.highlight:
            return
        self.highlight = on
        await self.refresh_body()
        self._show_mode()

    # copy --------------------------------------------------------------------------------------------
    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.message.content)
        self.notify(f"Copied the message ({len(self.message.content)} characters) to the clipboard")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.message.content)
        if not blocks:
            self.notify("This message has no code block", severity="warning")
            return
        index = self._code_index % len(blocks)
        self._code_index = index + 1
        self._copy_code(blocks[index], f"code block {index + 1}/{len(blocks)}")

    def _copy_code(self, code: str, what: str) -> None:
        self.app.copy_to_clipboard(code)
        lines = code.count("\n") + (not code.endswith("\n"))
        self.notify(f"Copied {what} ({lines} lines) to the clipboard")

    def on_click(self, event: events.Click) -> None:
        widget = event.widget
        while widget is not None and widget is not self:
            if isinstance(widget, MarkdownFence):
                self._copy_code(widget.code, "the code block")
                return
            widget = widget.parent


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, ctrl+j (or shift+enter where the terminal reports it) adds a line."""

    class Submitted(Message):
        def __init__(self, prompt: "PromptInput", text: str):
            super().__init__()
            self.prompt = prompt
            self.text = text

        @property
        def control(self) -> "PromptInput":
            return self.prompt

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
