"""Markdown with the accepted-draft marks inside it (app/markdown_spans.py): the alignment of rendered blocks onto
the reply's text, the blocks Textual's real Markdown widget builds (in a bare App under the pilot), streaming
token by token against rendering the same text whole, and the chat on the embedded demo model."""

from __future__ import annotations

import time
from pathlib import Path

from app_support import home  # noqa: F401 (a fixture)
from app_support import run_async, scripted, send, wait_loaded, wait_reply, write_settings
from textual.app import App
from textual.containers import VerticalScroll
from textual.content import Content, Span
from textual.widgets.markdown import MarkdownFence

from app.markdown_spans import DRAFT_STYLE, DraftMarkdown, align, block_contents, draft_mask, draft_spans
from app.store import Message
from app.transcript import MessageView, highlighted
from app.tui import MtpChatApp

DEMO = Path(__file__).resolve().parents[1] / "engine" / "assets" / "demo"


# the alignment, on its own ------------------------------------------------------------------------------------
def test_verbatim_text_maps_one_to_one():
    source = "xx def f():\n    return 1\n"
    assert align("def f():", source, 3, len(source)) == list(range(3, 11))
    mask = draft_mask(len(source), [highlighted_span(7, 9)])
    assert [(s.start, s.end) for s in draft_spans("def f():", source, 3, len(source), mask)] == [(4, 6)]


def test_markup_is_skipped_and_whitespace_matches_line_breaks():
    source = "a **bold** `co`\nnext"
    positions = align("a bold co next", source, 0, len(source))
    assert "".join(source[p] for p in positions) == "a bold co\nnext"


def test_link_destinations_are_never_matched():
    # the next text ("m...") would match inside the URL ("...com/m...") if the destination were searched
    source = "[site](http://example.com/more/mmm) more"
    positions = align("site more", source, 0, len(source))
    assert positions[:4] == [1, 2, 3, 4] and source[positions[5] :].startswith("more") and positions[5] > 30


def test_a_character_the_renderer_made_up_does_not_derail_the_rest():
    source = "&copy; 2024 **drafted**"
    mask = draft_mask(len(source), [highlighted_span(14, 21)])
    rendered = "© 2024 drafted"
    positions = align(rendered, source, 0, len(source))
    assert positions[0] == -1  # the entity's expansion is not in the source
    spans = draft_spans(rendered, source, 0, len(source), mask)
    assert [rendered[s.start : s.end] for s in spans] == ["drafted"]


def test_the_streaming_highlighter_equals_building_afresh():
    from app.transcript import Highlighter

    pieces, sources = tokens("a", "\x1b]0;", "b", "c", "d\u2028", "e")
    grower = Highlighter()
    for n in list(range(1, len(pieces) + 1)) + [2, 4]:  # growing, then shorter again (a new reply): rebuilt
        got, want = grower.content(pieces[:n], sources[:n]), highlighted(pieces[:n], sources[:n])
        assert (got.plain, got.spans) == (want.plain, want.spans)
    other = ["x"] + pieces[1:]  # a different first piece: rebuilt, not continued
    assert grower.content(other, sources).plain == highlighted(other, sources).plain == "x␛]0;bcd\ne"


def highlighted_span(start: int, end: int) -> Span:
    return Span(start, end, DRAFT_STYLE)


# blocks built by Textual's Markdown widget -----------------------------------------------------------------------
class MarkdownApp(App):
    def compose(self):
        yield DraftMarkdown()


async def render(pieces: list[str], sources: list[str]) -> list[tuple[str, list[str]]]:
    """Each leaf block's rendered text and its marked parts, the reply rendered whole."""
    app = MarkdownApp()
    async with app.run_test(size=(100, 60)) as pilot:
        md = app.query_one(DraftMarkdown)
        await md.show(highlighted(pieces, sources), whole=True)
        await pilot.pause()
        return blocks(md)


def blocks(md: DraftMarkdown) -> list[tuple[str, list[str]]]:
    return [(c.plain, [c.plain[s.start : s.end] for s in c.spans if s.style == DRAFT_STYLE])
            for c in block_contents(md)]


def tokens(*marked: str) -> tuple[list[str], list[str]]:
    """Pieces from alternating (target, draft, target, ...) strings."""
    return list(marked), ["draft" if i % 2 else "target" for i in range(len(marked))]


@run_async
async def test_nested_emphasis_keeps_the_marks_and_drops_the_stars():
    shown = await render(*tokens("Say ***very", " bold*** and *em **str", "ong** em* ", "end"))
    assert shown == [("Say very bold and em strong em end", [" bold and em str", "end"])]


@run_async
async def test_code_fence_marks_the_code_not_the_fence_lines():
    shown = await render(*tokens("Here:\n\n```python\ndef ", "add(a, b)", ":\n    return a ", "+ b", "\n```\n"))
    assert shown[0] == ("Here:", [])
    code, marked = shown[1]
    assert code == "def add(a, b):\n    return a + b" and marked == ["add(a, b)", "+ b"]


@run_async
async def test_inline_code_headings_lists_and_links():
    pieces, sources = tokens("# A ", "title", "\n\nUse `len", "(x)` to", " count.\n\n- one\n  - nested ",
                             "item", "\n1. [the ", "docs", "](https://docs.python.org/3/library/func.html) ",
                             "here", "\n")
    shown = await render(pieces, sources)
    assert shown == [("A title", ["title"]), ("Use len(x) to count.", ["(x) to"]),
                     ("one", []), ("nested item", ["item"]), ("the docs here", ["docs", "here"])]


@run_async
async def test_table_cells_and_blockquotes():
    shown = await render(*tokens("| a | b |\n|---|---|\n| ", "x", " | ", "y", " |\n\n> quoted ", "words", "\n"))
    assert ("quoted words", ["words"]) in shown
    assert ("x", ["x"]) in shown and ("b", []) in shown and ("y", ["y"]) in shown


@run_async
async def test_raw_html_and_tool_calls_are_text_and_controls_are_visible():
    pieces, sources = tokens("<b>hi</b> ", "<tool_call>", " \x1b]0;x\x07 ok")
    shown = await render(pieces, sources)
    assert shown == [("<b>hi</b> <tool_call> ␛]0;x␇ ok", ["<tool_call>"])]


@run_async
async def test_without_highlights_nothing_is_marked():
    pieces, sources = tokens("Some **", "bold", "** text")
    app = MarkdownApp()
    async with app.run_test() as pilot:
        md = app.query_one(DraftMarkdown)
        await md.show(Content(highlighted(pieces, sources).plain), whole=True)
        await pilot.pause()
        assert blocks(md) == [("Some bold text", [])]


STREAMED = ("Intro with **bold", " words** and `code`.", "\n\n## Steps\n\n1. First ", "step", "\n2. Second *it",
            "alic* step\n\n```py", "thon\nfor i in ", "range(3):\n", "    print(i)", "\n``", "`\n\nAfter ",
            "the", " fence, a [link](http://x.org/", "abc) and ", "more", ".\n")


async def stream(pieces: list[str], sources: list[str]) -> list[tuple[str, list[str]]]:
    """Show the reply piece by piece as the chat does (appending); after each piece, what is shown must equal
    rendering the same prefix whole. Returns the final blocks."""
    app = MarkdownApp()
    async with app.run_test(size=(100, 80)) as pilot:
        md = app.query_one(DraftMarkdown)
        for n in range(1, len(pieces) + 1):
            content = highlighted(pieces[:n], sources[:n])
            await md.show(content)
            await pilot.pause()
            streamed = blocks(md)
            await md.show(content, whole=True)
            await pilot.pause()
            assert streamed == blocks(md), f"after {n} pieces: {pieces[:n]}"
        return blocks(md)


@run_async
async def test_streaming_token_by_token_equals_rendering_whole():
    """Mid-stream (half-written emphasis, an unfinished fence) every step shows what rendering the same prefix
    whole shows, marks included: the incremental re-parse of the last block loses nothing."""
    final = await stream(*tokens(*STREAMED))
    assert final == [("Intro with bold words and code.", [" words and code."]), ("Steps", []),
                     ("First step", ["step"]), ("Second italic step", ["alic step"]),
                     ("for i in range(3):\n    print(i)", ["range(3):\n"]),
                     ("After the fence, a link and more.", ["the", " and ", "."])]


@run_async
async def test_unicode_line_separators_do_not_shift_the_lines():
    # Textual counts U+2028 as a line break and markdown-it does not: shown as a newline, both count alike
    final = await stream(*tokens("one\u2028two\n\n- a ", "list", "\n- b\u2029\n", "para", " end\n"))
    assert final == [("one two", []), ("a list", ["list"]), ("b", []), ("para end", ["para"])]


@run_async
async def test_an_unfinished_fence_streams_as_code():
    pieces, sources = tokens("Code:\n\n```\nx = ", "1")
    shown = await render(pieces, sources)
    assert shown == [("Code:", []), ("x = 1", ["1"])]


# cost while streaming ----------------------------------------------------------------------------------------
def long_reply(tokens: int = 2000) -> tuple[list[str], list[str]]:
    """Markdown of ``tokens`` pieces: paragraphs of ~40 tokens with bold words, a code fence every 200."""
    pieces = [f" w{i}" if i % 3 else f" **b{i}**" for i in range(tokens)]
    for i in range(0, tokens, 40):
        pieces[i] = f"\n\n```\ncode {i}\n```\n\n" if i % 200 == 0 else "\n\n" + pieces[i]
    return pieces, ["draft" if i % 2 else "target" for i in range(tokens)]


@run_async
async def test_streaming_a_long_reply_renders_only_its_last_block(home, capsys):
    """A 2,000-token reply in the chat's own MessageView, rendered after every token (the chat coalesces
    renders to at most 10 a second: this is the worst case), each render timed (CPU time) with the screen's
    refresh that follows it: a render late in the reply costs a fraction of rendering the whole reply, because
    only the last block is parsed, aligned and rebuilt."""
    pieces, sources = long_reply()
    app = MtpChatApp(loader=lambda *args: scripted(["x"], ["target"]))
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_loaded(pilot, app)
        message = Message(id=0, role="assistant", content="", status="streaming")
        view = MessageView(message, streaming=True)
        await app.query_one("#transcript", VerticalScroll).mount(view)
        times = []
        for piece, source in zip(pieces, sources):
            message.pieces.append(piece)
            message.sources.append(source)
            message.parts.append("answer")
            message.content += piece
            started = time.process_time()
            await view._render_streamed()
            await pilot.pause()
            times.append(time.process_time() - started)
        started = time.process_time()
        await view.finish()  # the whole reply rendered again, once
        await pilot.pause()
        whole = time.process_time() - started
        early, late = sum(times[100:300]) / 200, sum(times[1800:2000]) / 200
        with capsys.disabled():
            print(f"\nrender after a token: tokens 100-300 {early * 1e3:.1f} ms, 1800-2000 {late * 1e3:.1f} ms; "
                  f"the whole 2,000-token reply {whole * 1e3:.0f} ms")
        assert late < whole / 4
        shown = view.shown_answer()
        assert "**" not in shown.plain and "```" not in shown.plain
        assert len([s for s in shown.spans if s.style == DRAFT_STYLE]) > 500


# the chat, on the embedded demo model ---------------------------------------------------------------------------
@run_async
async def test_demo_reply_renders_markdown_with_highlights(home):
    write_settings(max_new_tokens=120, depth=2)
    app = MtpChatApp(model=str(DEMO))
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_loaded(pilot, app, timeout=60)
        await send(pilot, app, "How does the with statement look in code?")  # the demo model answers with a fence
        reply = await wait_reply(pilot, app, 90)
        view = app.query(MessageView).last()
        await pilot.pause()
        assert "```" in reply.content and "draft" in reply.sources
        shown = view.shown_answer()
        assert "```" not in shown.plain and shown.plain.strip()
        assert view.query(MarkdownFence)  # the code is a code block
        fence = view.query_one(MarkdownFence)
        assert fence.code.strip() and fence.code.strip() in reply.content
        marked = [s for s in shown.spans if s.style == DRAFT_STYLE]
        assert marked and all(shown.plain[s.start : s.end] for s in marked)
        assert not any(raw in app.export_screenshot() for raw in ("```", "\x1b]"))
        await pilot.press("f2")  # highlights off: still Markdown, no marks
        await pilot.pause()
        assert view.query_one(".reply-markdown").display and "```" not in view.shown_answer().plain
        assert not [s for s in view.shown_answer().spans if s.style == DRAFT_STYLE]
        await pilot.press("f2")
        await pilot.pause()
        assert [s for s in view.shown_answer().spans if s.style == DRAFT_STYLE]
        await view.set_markdown(False)  # the setting off: the plain text, marks on its raw characters
        assert view.query_one(".reply-text").display and "```" in view.shown_answer().plain
        assert [s for s in view.shown_answer().spans if s.style == DRAFT_STYLE]
