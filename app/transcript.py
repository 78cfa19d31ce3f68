"""The chat transcript: one ``MessageView`` per message, and the prompt input.

An assistant reply is shown as Markdown (the `markdown` setting; off: its plain text) and, in highlight mode (f2),
with every token that came from an accepted MTP draft marked in the theme's ``$draft-token`` colours, inside the
Markdown too: app/markdown_spans.py maps the per-token marks onto the rendered blocks (code, emphasis, headings,
lists, tables). Both work live while streaming and for replies reopened from the database, because each reply
stores its per-token text and source tags.

A thinking model's reply has two parts (app/reply_parts.py): its reasoning is a collapsible "thinking" block
above the answer, expanded and streaming while the reasoning runs, collapsed when the answer starts, titled with
its token count and time; the reasoning is always plain text (with the draft highlights in highlight mode). Tool
calls in an answer (Qwen's `<tool_call>` blocks) are shown below it, formatted and collapsed: never run.
"""

from __future__ import annotations

import asyncio
import time

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content, Span
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Collapsible, Static, TextArea
from textual.widgets.markdown import MarkdownFence

from .live import LiveStatic
from .markdown_spans import DRAFT_STYLE, DraftMarkdown, parser
from .reply_parts import (ANSWER, REASONING, ToolCall, reasoning_ms, select, shown_answer, split_tool_calls,
                          thinking_title, tool_call_text, tool_call_title)
from .safe_text import terminal_safe
from .stats import stats_line
from .store import Message as StoredMessage

# Message text never reaches the terminal raw (an escape sequence in a reply could retitle the terminal, write
# the clipboard, ...). C0 controls a model or a paste may put in, ESC and BEL included, are shown as their
# Unicode "control pictures" (newline and tab are kept), so "\x1b]0;x\x07" reads "␛]0;x␇"; what terminal_safe
# strips after that (C1 controls) is dropped. The stored text stays as it was written. The Unicode line and
# paragraph separators become newlines: Textual counts them as line breaks and markdown-it does not, and the
# Markdown's incremental re-parse (app/markdown_spans.py) needs both to count the same lines.
_VISIBLE = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"} | {0x7F: 0x2421, 0x2028: 0x0A, 0x2029: 0x0A}


def visible(text: str) -> str:
    """``text`` as it may be shown in a widget: no control character, no escape sequence."""
    return terminal_safe(text.translate(_VISIBLE))


def highlighted(pieces: list[str], sources: list[str]) -> Content:
    """Plain reply text with accepted-draft tokens styled (consecutive draft tokens form one span)."""
    return Highlighter().content(pieces, sources)


class Highlighter:
    """``highlighted`` for a reply that grows while it streams: only the pieces added since the last call are
    made visible (each call over a 2,000-token reply would otherwise cost milliseconds of the UI thread)."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._pieces: list[str] = []  # the pieces seen, as given
        self._shown: list[str] = []
        self._spans: list[Span] = []
        self._offset, self._run_start = 0, None

    def content(self, pieces: list[str], sources: list[str]) -> Content:
        seen = len(self._pieces)
        if len(pieces) < seen or pieces[:1] != self._pieces[:1] or (seen and pieces[seen - 1] != self._pieces[-1]):
            self._reset()  # not a continuation of what was seen: start again
            seen = 0
        for piece, source in zip(pieces[seen:], sources[seen:]):
            if source == "draft":
                if self._run_start is None:
                    self._run_start = self._offset
            elif self._run_start is not None:
                self._spans.append(Span(self._run_start, self._offset, DRAFT_STYLE))
                self._run_start = None
            shown = visible(piece)  # piece by piece, so the offsets are those of the text shown
            self._pieces.append(piece)
            self._shown.append(shown)
            self._offset += len(shown)
        spans = list(self._spans)
        if self._run_start is not None and self._offset > self._run_start:
            spans.append(Span(self._run_start, self._offset, DRAFT_STYLE))
        return Content("".join(self._shown), spans, strip_control_codes=False)


def without_leading_blank(pieces: list[str], sources: list[str]) -> tuple[list[str], list[str]]:
    """Pieces without the newlines that open them (the blank line after `</think>` is layout)."""
    for i, piece in enumerate(pieces):
        if piece.strip("\n"):
            return [piece.lstrip("\n")] + pieces[i + 1 :], sources[i:]
    return [], []


def without_tool_calls(content: Content) -> Content:
    """Shown text with its tool-call blocks cut out (they are shown apart, formatted)."""
    kept, at = [], 0
    for segment in split_tool_calls(content.plain):
        length = len(segment.raw if isinstance(segment, ToolCall) else segment)
        if not isinstance(segment, ToolCall):
            kept.append(content[at : at + length])
        at += length
    return Content("").join(kept).rstrip() if kept else Content("")


def code_blocks(markdown: str) -> list[str]:
    """The fenced and indented code blocks of a Markdown text, in order."""
    return [t.content for t in parser().parse(markdown) if t.type in ("fence", "code_block")]


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (click, or tab) to copy it (c) or its code blocks (k)."""

    BINDINGS = [
        Binding("c", "copy", "Copy message"),
        Binding("k", "copy_code", "Copy code"),
    ]

    def __init__(self, message: StoredMessage, *, highlight: bool = True, markdown: bool = True,
                 streaming: bool = False):
        super().__init__(classes=message.role)
        self.message = message
        self.highlight = highlight
        self.markdown = markdown  # render the answer as Markdown (else its plain text)
        self.streaming = streaming
        self._code_index = 0
        self._timer: Timer | None = None
        self._render_s = 0.0  # how long the last streamed render took
        self._render_lock = asyncio.Lock()
        self._highlighter = Highlighter()  # the answer's shown text, built as its pieces come
        self._reasoning_highlighter = Highlighter()
        self.reasoning_ms: float | None = None  # while the reasoning streams: its time so far (the app sets it)
        self._reasoning_running = streaming and REASONING in message.parts[-1:]
        self._auto_collapsed = not streaming  # the thinking block collapses once, when the answer starts

    # composition -------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        m = self.message
        yield Static(self._header(), classes="message-header", markup=False)
        if m.role == "user":
            yield Static(Content(visible(m.content), strip_control_codes=False), classes="message-body")
            return
        thinking = Collapsible(LiveStatic(self._reasoning_content(), classes="reasoning-body"),
                               title=self._thinking_title(), collapsed=not self._reasoning_running,
                               classes="thinking")
        thinking.display = self._has_reasoning()
        yield thinking
        answer = self._answer_content()  # only the view in use holds it
        yield DraftMarkdown(answer if self.markdown else None, classes="message-body reply-markdown")
        yield LiveStatic(Content("") if self.markdown else answer, classes="message-body reply-text")
        yield Vertical(*self._tool_call_blocks(), classes="tool-calls")
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
        if m.finish_reason == "length" and m.status != "stopped":  # else it just ends mid-sentence
            notes.append("cut off at the token limit (max tokens: f6; or the model's context)")
        if m.status == "stopped":
            notes.append("stopped by you")
        elif m.status == "interrupted":
            notes.append("interrupted (the app was closed while it was generating)")
        elif m.status == "incomplete":
            notes.append("incomplete (part of it could not be saved)")
        if m.error:
            notes.append(f"error: {m.error}")
        return terminal_safe(" · ".join(notes))  # an error may quote model text or a path

    def _answer_content(self) -> Content:
        """The answer as shown (tool calls cut out once complete), its accepted drafts marked in highlight mode.
        Built from the engine's pieces, made visible piece by piece, so the marks' offsets are the shown text's."""
        m = self.message
        pieces, sources = self._part(ANSWER)
        if pieces and "".join(pieces).strip():
            content = self._highlighter.content(*without_leading_blank(pieces, sources))
        else:  # no per-token data (e.g. nothing generated yet)
            content = Content(visible(shown_answer(m.content)), strip_control_codes=False)
        if not self.streaming:
            content = without_tool_calls(content)
        return content if self.highlight else Content(content.plain, strip_control_codes=False)

    def shown_answer(self) -> Content:
        """The answer's text as rendered, with its styles (one Markdown block a line)."""
        if self.markdown:
            return self.query_one(".reply-markdown", DraftMarkdown).shown()
        return self.query_one(".reply-text", LiveStatic).visual

    def _part(self, part: str) -> tuple[list[str], list[str]]:
        """The pieces and sources of the reply's tokens in ``part`` (a reply without parts is all answer)."""
        m = self.message
        if len(m.parts) != len(m.pieces):
            return (list(m.pieces), list(m.sources)) if part == ANSWER else ([], [])
        pieces, sources = select(part, m.parts, m.pieces, m.sources)
        return pieces, sources

    # the reasoning ---------------------------------------------------------------------------------------
    def _has_reasoning(self) -> bool:
        return self._reasoning_running or bool(self.message.reasoning.strip())

    def _reasoning_content(self) -> Content:
        """The reasoning as plain text; in highlight mode with its accepted drafts marked."""
        pieces, sources = self._part(REASONING)
        if not self.highlight:
            return Content(visible(self.message.reasoning.strip("\n")), strip_control_codes=False)
        while pieces and not pieces[-1].strip("\n"):  # the newline before `</think>` (and the marker's "")
            pieces, sources = pieces[:-1], sources[:-1]
        return self._reasoning_highlighter.content(*without_leading_blank(pieces, sources))

    def _thinking_title(self) -> Content:
        tokens = self.message.parts.count(REASONING)
        ms = reasoning_ms(self.message.stats) if not self.streaming else None
        return Content(thinking_title(tokens, ms if ms is not None else self.reasoning_ms, self._reasoning_running))

    def open_reasoning(self) -> None:
        """The reply starts inside a reasoning block (the generation prompt opened it): show it, streaming."""
        self._reasoning_running, self._auto_collapsed = True, False
        if self.is_mounted:
            thinking = self.query_one(".thinking", Collapsible)
            thinking.display, thinking.collapsed = True, False

    def _update_reasoning(self) -> None:
        """Follow the stream: the block's text and title; collapse it once the answer starts."""
        parts = self.message.parts
        self._reasoning_running = self.streaming and bool(parts) and parts[-1] == REASONING
        thinking = self.query_one(".thinking", Collapsible)
        if not self._has_reasoning():
            return
        thinking.display = True
        if self._reasoning_running and not self._auto_collapsed:
            thinking.collapsed = False
        if not self._reasoning_running and not self._auto_collapsed and ANSWER in parts:
            thinking.collapsed, self._auto_collapsed = True, True
        thinking.title = self._thinking_title()
        self.query_one(".reasoning-body", LiveStatic).show(self._reasoning_content())

    # tool calls ------------------------------------------------------------------------------------------
    def _tool_call_blocks(self) -> list[Collapsible]:
        if self.streaming:  # formatted once the reply is complete (a half-written call streams as text)
            return []
        calls = [s for s in split_tool_calls(self.message.content) if isinstance(s, ToolCall)]
        return [Collapsible(Static(Content(visible(tool_call_text(c)), strip_control_codes=False),
                                   classes="tool-call-body"),
                            title=Content(visible(tool_call_title(c))), collapsed=True, classes="tool-call")
                for c in calls]

    async def _refresh_tool_calls(self) -> None:
        box = self.query_one(".tool-calls", Vertical)
        await box.remove_children()
        await box.mount_all(self._tool_call_blocks())

    def _show_mode(self) -> None:
        self.query_one(".reply-markdown").display = self.markdown
        self.query_one(".reply-text").display = not self.markdown
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
            self._update_reasoning()
            if self.markdown:  # Markdown re-parses and rebuilds only its last block (app/markdown_spans.py)
                await self.query_one(".reply-markdown", DraftMarkdown).show(self._answer_content())
            else:
                self.query_one(".reply-text", LiveStatic).show(self._answer_content())
        self._render_s = time.perf_counter() - started

    async def refresh_body(self) -> None:
        """Render the whole body again in the current mode."""
        async with self._render_lock:
            self._update_reasoning()
            if self.markdown:
                await self.query_one(".reply-markdown", DraftMarkdown).show(self._answer_content(), whole=True)
            else:
                self.query_one(".reply-text", LiveStatic).update(self._answer_content())
            if not self.streaming:
                await self._refresh_tool_calls()

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

    async def set_markdown(self, on: bool) -> None:
        if self.message.role != "assistant" or on == self.markdown:
            return
        self.markdown = on
        await self.refresh_body()
        self._show_mode()
        if not on:  # the view not in use holds nothing
            await self.query_one(".reply-markdown", DraftMarkdown).show(Content(""), whole=True)
        else:
            self.query_one(".reply-text", LiveStatic).update("")

    # copy --------------------------------------------------------------------------------------------
    def action_copy(self) -> None:
        self.app.copy_text(self.message.content, f"the message ({len(self.message.content)} characters)")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.message.content)
        if not blocks:
            self.notify("This message has no code block", severity="warning")
            return
        index = self._code_index % len(blocks)
        self._code_index = index + 1
        self._copy_code(blocks[index], f"code block {index + 1}/{len(blocks)}")

    def _copy_code(self, code: str, what: str) -> None:
        lines = code.count("\n") + (not code.endswith("\n"))
        self.app.copy_text(code, f"{what} ({lines} lines)")

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
