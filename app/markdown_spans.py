"""A reply rendered as Markdown with its accepted-draft tokens still marked.

Textual's Markdown widget turns the reply's text into blocks (paragraphs, headings, lists, tables, code fences),
and in doing so drops the markup (`**`, backquotes, fence lines, list markers) and re-flows whitespace: the
rendered text of a block is no longer the reply's text, so the token boundaries are lost. markdown-it gives
each block its source lines (``Token.map``) but no character offsets inside them, so each rendered block is
aligned back onto its source lines: its characters appear there in order (markup aside), and each takes the
draft mark of the source character it came from. Code is written verbatim, so a fence's code maps one to one.

The alignment is greedy and local (a character is looked for within a few characters of the previous one; a
link's destination, which is never shown, is left out of the search), so a character the renderer made up (an
entity's expansion, a bullet) is left unmarked and cannot throw the rest of the block off.

Streaming: Textual's ``Markdown.append`` parses again only from the start of the last top-level block and
rebuilds only that block, so this alignment also runs only over the last block: the cost per update follows the
size of the block being written, not of the whole reply; a paragraph or code block that keeps its size is
redrawn without a screen-wide layout pass.

This builds on Textual's Markdown internals (8.x: ``_parse_markdown``, a block's ``_inline_token`` /
``_content`` / ``_blocks``, a fence's ``_highlighted_code``, ``_last_parsed_line``); tests/test_markdown_spans.py
renders through the real widget, so a Textual that changes them fails there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextlib import suppress

from markdown_it import MarkdownIt
from markdown_it.token import Token
from textual.await_complete import AwaitComplete
from textual.content import Content, Span
from textual.css.query import NoMatches
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownBlock, MarkdownFence

from .live import redraw

DRAFT_STYLE = "$draft-token-text on $draft-token"

WINDOW = 24  # how far past the previous character the next rendered one is looked for (markup in between)
_SPACE = re.compile(r"\s")
_DRAFT_RUN = re.compile(rb"\x01+")
# What a link writes after its text and never shows: ](destination "title") or ][label]
_LINK_TAIL = re.compile(r"\]\((?:[^()\s]|\([^()\s]*\))*(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)|\]\[[^\]]*\]")


def parser() -> MarkdownIt:
    """Textual's default ("gfm-like": tables, strikethrough, autolinks) without raw HTML: a model's HTML, or
    its `<tool_call>` block while it streams, is shown as the text it is, never dropped or interpreted."""
    return MarkdownIt("gfm-like", {"html": False})


def draft_mask(length: int, spans: Iterable[Span]) -> bytearray:
    """One byte per character of the shown text: 1 where an accepted-draft token wrote it."""
    mask = bytearray(length)
    for span in spans:
        if span.style == DRAFT_STYLE:
            start, end = max(0, span.start), min(length, span.end)
            if end > start:
                mask[start:end] = b"\x01" * (end - start)
    return mask


def searchable(source: str, start: int, end: int) -> tuple[str, list[int] | None]:
    """``source[start:end]`` without its links' destinations, and where each kept character is in ``source``
    (None when nothing was left out: then the offset is ``start`` plus the index)."""
    region = source[start:end]
    cuts = [(m.start() + 1, m.end()) for m in _LINK_TAIL.finditer(region)]  # the "]" stays: it is never shown
    if not cuts:
        return region, None
    kept, index, at = [], [], 0
    for a, b in cuts:
        kept.append(region[at:a])
        index.extend(range(start + at, start + a))
        at = b
    kept.append(region[at:])
    index.extend(range(start + at, end))
    return "".join(kept), index


def align(rendered: str, source: str, start: int, end: int) -> list[int]:
    """For each character of ``rendered``, the offset in ``source`` (within [start, end)) it was written at, or
    -1 when it is not there (a character the renderer added). Whitespace matches any whitespace (the renderer
    turns line breaks into spaces and runs of spaces into one)."""
    if source.startswith(rendered, start) and start + len(rendered) <= end:  # verbatim (code, plain text)
        return list(range(start, start + len(rendered)))
    region, index = searchable(source, start, end)
    out: list[int] = []
    at, limit = 0, len(region)
    for ch in rendered:
        stop = min(limit, at + WINDOW)
        if ch.isspace():
            m = _SPACE.search(region, at, stop)
            j = m.start() if m else -1
        else:
            j = region.find(ch, at, stop)
        if j < 0:
            out.append(-1)
            continue
        out.append(j + start if index is None else index[j])
        at = j + 1
    return out


def draft_spans(rendered: str, source: str, start: int, end: int, mask: bytearray) -> list[Span]:
    """Spans of ``rendered`` (a block's text) over the characters that came from accepted drafts."""
    if not rendered or not mask.count(1, start, end):
        return []
    if source.startswith(rendered, start) and start + len(rendered) <= end:  # verbatim: runs of the mask
        return [Span(m.start() - start, m.end() - start, DRAFT_STYLE)
                for m in _DRAFT_RUN.finditer(mask, start, start + len(rendered))]
    spans, run = [], None
    for i, at in enumerate(align(rendered, source, start, end)):
        marked = 0 <= at < len(mask) and mask[at]
        if marked and run is None:
            run = i
        elif not marked and run is not None:
            spans.append(Span(run, i, DRAFT_STYLE))
            run = None
    if run is not None:
        spans.append(Span(run, len(rendered), DRAFT_STYLE))
    return spans


def with_spans(content: Content, spans: list[Span]) -> Content:
    """``content`` with ``spans`` on top of its own styles (so a draft mark shows inside code and links too)."""
    if not spans:
        return content
    return Content(content.plain, [*content.spans, *spans], strip_control_codes=False)


class LineOffsets:
    """Character offset of each line start of a text (lines as ``str.splitlines`` counts them, which is how
    Textual's Markdown counts the lines it parses from)."""

    def __init__(self, text: str):
        self.starts = [0]
        for line in text.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int) -> int:
        return self.starts[min(max(line, 0), len(self.starts) - 1)]


class DraftParagraph(Markdown.BLOCKS["paragraph_open"]):
    """A paragraph, the block a streaming reply grows most often: redrawn without laying the screen out again
    while its height stays the same."""

    _lines: int | None = None

    def set_content(self, content: Content) -> None:
        self._content = content
        self._lines = redraw(self, content, self._lines)


class DraftFence(MarkdownFence):
    """A code block whose highlighted code also carries the draft marks (kept when the theme re-highlights);
    redrawn without a layout pass while its size stays the same."""

    _draft_spans: list[Span] = []
    _code_size: tuple[int, int] | None = None

    def set_content(self, content: Content) -> None:
        self._content = content
        lines = content.plain.split("\n")
        size = (len(lines), max(map(len, lines)))  # the code scrolls sideways: its width counts too
        with suppress(NoMatches):
            self.query_one("#code-content", Label).update(content, layout=size != self._code_size)
            self._code_size = size

    def mark(self, spans: list[Span]) -> None:
        self._draft_spans = spans
        self._highlighted_code = with_spans(self._highlighted_code, spans)

    def notify_style_update(self) -> None:
        super().notify_style_update()  # highlights the code again for the new theme
        if self._draft_spans:
            self._highlighted_code = with_spans(self._highlighted_code, self._draft_spans)
            self.set_content(self._highlighted_code)


class DraftMarkdown(Markdown):
    """Textual's Markdown, its blocks' text marked where accepted drafts wrote it.

    ``show(content)``: ``content`` is the text to render with its draft spans (app/transcript.highlighted); the
    spans are mapped onto every block built from it (paragraphs, headings, list items, table cells, code)."""

    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": DraftParagraph, "fence": DraftFence, "code_block": DraftFence}

    def __init__(self, content: Content | None = None, **kwargs):
        content = content or Content("")
        self._mask = draft_mask(len(content.plain), content.spans)
        self._first_line = 0  # the source line the tokens being built start at (append parses from a line on)
        self._offsets: LineOffsets | None = None
        self._last_block_line = 0  # the source line the last top-level block starts at
        super().__init__(content.plain, parser_factory=parser, **kwargs)

    def show(self, content: Content, whole: bool = False) -> AwaitComplete:
        """Render ``content``: appended when it extends what is shown (streaming), else (or when ``whole``)
        rendered again from the start."""
        text, shown = content.plain, self.source
        self._mask = draft_mask(len(text), content.spans)
        if not whole and shown and len(text) >= len(shown) and text.startswith(shown):
            if len(text) == len(shown):
                return AwaitComplete.nothing()
            return self.append(text[len(shown) :])
        return self.update(text)

    def update(self, markdown: str) -> AwaitComplete:
        self._first_line = 0
        self._offsets = None
        rendered = super().update(markdown)

        async def then() -> None:
            await rendered
            # Textual's update leaves the next append parsing from the last line only, which splits a last
            # block of several lines (a list, a fence) when a reply re-rendered mid-stream (f2) grows: parse
            # again from the start of the last block, as append itself does
            self._last_parsed_line = self._last_block_line

        return AwaitComplete(then())

    def append(self, markdown: str) -> AwaitComplete:
        # Textual parses again from its last top-level block's line: the tokens' lines count from there
        self._first_line = self._last_parsed_line
        self._offsets = None
        return super().append(markdown)

    def _parse_markdown(self, tokens: Iterable[Token]) -> Iterable[MarkdownBlock]:
        tokens = list(tokens)
        last = next((t.map[0] for t in reversed(tokens) if t.map is not None and t.level == 0), 0)
        self._last_block_line = self._first_line + last
        marks = bool(self._mask) and self._mask.count(1) > 0
        for block in super()._parse_markdown(tokens):
            if marks:
                self._mark(block, {})
            yield block

    def _mark(self, block: MarkdownBlock, line_cursor: dict[int, int]) -> None:
        """Add the draft spans to ``block`` and the blocks inside it (not composed yet)."""
        if isinstance(block, DraftFence):
            first, last = self._lines(block._token)
            code_from = first if block._token.type == "code_block" else first + 1  # after the ``` line
            source, start, end = self.source, self._offset(code_from), self._offset(last)
            rendered = block._highlighted_code.plain
            block.mark(draft_spans(rendered, source, start, end, self._mask))
        elif block._inline_token is not None:
            token = block._inline_token
            first, last = self._lines(token)
            source, start, end = self.source, self._offset(first), self._offset(last)
            start = max(start, line_cursor.get(first, start))  # table cells share their row's line
            lead = token.content.split("\n", 1)[0]
            found = source.find(lead, start, end) if lead else -1
            if found >= 0:  # skip the block's own markers on its first line ("#", "-", "1.", ">")
                start = found
            rendered = block._content.plain
            spans = draft_spans(rendered, source, start, end, self._mask)
            if spans:
                block.set_content(with_spans(block._content, spans))
            line_cursor[first] = found + len(lead) if found >= 0 else start
        for child in block._blocks:
            self._mark(child, line_cursor)

    def _lines(self, token: Token) -> tuple[int, int]:
        first, last = token.map if token.map else (0, 0)
        return first + self._first_line, last + self._first_line

    def _offset(self, line: int) -> int:
        if self._offsets is None:
            self._offsets = LineOffsets(self.source)
        return self._offsets.at(line)

    def shown(self) -> Content:
        """The rendered text of all blocks with their styles, one block a line (what the tests read)."""
        return Content("\n").join(block_contents(self))


def block_contents(widget) -> list[Content]:
    """The Contents of the leaf blocks under ``widget``, in order (a fence's highlighted code included)."""
    out: list[Content] = []
    for block in widget.query(MarkdownBlock):
        if isinstance(block, MarkdownFence):
            out.append(block._highlighted_code)
        elif isinstance(block, Markdown.BLOCKS["table_open"]):  # a table widget draws its cells, not blocks
            out.extend(getattr(block, "_headers", []))
            out.extend(cell for row in getattr(block, "_rows", []) for cell in row)
        elif block._inline_token is not None:
            out.append(block._content)
    return out

