"""The TUI driven by Textual's Pilot, with the real engine on a real tiny checkpoint (tests/fixtures.py) or the
embedded demo model. No mocks: the decode thread loads and runs the engine as it does for a user."""

from __future__ import annotations

import csv
import json
import os
import sqlite3
import threading
from pathlib import Path

import pytest
from app_support import home  # noqa: F401 (a fixture)
from app_support import (ScriptedEngine, next_posted, run_async, scripted, send, wait_loaded, wait_reply,
                         wait_until, write_settings)
from fixtures import oom_on_the_second_verify
from textual.widgets import DataTable, Input, Label, Markdown, Select, Static

from app.screens import ExportScreen, ModelPickerScreen
from app.store import Store
from app.transcript import DRAFT_STYLE, MessageView, PromptInput, visible
from app.tui import MtpChatApp

SIZE = (130, 36)  # the side panel beside the chat (from 120 columns)
DEMO = Path(__file__).resolve().parents[1] / "engine" / "assets" / "demo"


@pytest.fixture
def model(ckpt) -> str:
    return str(ckpt("next"))


def draft_spans(view: MessageView) -> list:
    content = view.shown_answer()
    return [s for s in content.spans if s.style == DRAFT_STYLE]


def raw_controls(text: str) -> set[str]:
    """The control characters in ``text`` a terminal would act on (newline and tab aside)."""
    return {c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F}


@run_async
async def test_reply_streams_and_is_saved(home, model):
    write_settings(max_new_tokens=40, depth=2, highlight=False)  # Markdown mode
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert app.engine_state == "ready" and app.model_name == Path(model).name
        await send(pilot, app, "Hello, how are you today?")
        reply = await wait_reply(pilot, app)
        view = app.query(MessageView).last()
        assert view.query_one(".reply-markdown", Markdown).source == visible(reply.content)
        assert not app.query_one("#legend-draft").display
        assert reply.role == "assistant" and reply.status == "complete"
        assert len(reply.token_ids) == len(reply.sources) == len(reply.pieces) > 0
        assert "".join(reply.pieces) == reply.content
        assert reply.stats["depth"] == 2 and reply.stats["cycles"] >= 1
        # the timing pane shows the reply's numbers
        summary = str(app.query_one("#timing-summary", Static).visual)
        assert summary and app.query_one("#prompt", PromptInput).text == ""
        # the diagnostics pane is refreshed after the reply: the conversation is now the reusable history
        assert app.engine_diagnostics["reuse"]["history_tokens"] >= len(reply.token_ids)
    stored = Store().load_conversation(app.conversation.id).messages
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[1].token_ids == reply.token_ids and stored[1].sources == reply.sources
    assert len(Store().cycles(app.conversation.id)) == reply.stats["cycles"]
    chunks = Store().conn.execute("SELECT COUNT(*) FROM token_chunks WHERE message_id = ?", (reply.id,)).fetchone()[0]
    assert chunks >= 2  # streamed (and saved) in several coalesced chunks, not in one piece at the end


@run_async
async def test_accepted_drafts_are_highlighted_live_and_after_reopen(home):
    write_settings(max_new_tokens=60, depth=3)
    app = MtpChatApp(model=str(DEMO))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app, timeout=60)
        await send(pilot, app, "hi, how are you?")  # small talk: the demo model's MTP head drafts it well
        view = app.query(MessageView).last()
        await wait_until(pilot, lambda: draft_spans(view) or app.request is None, 30, "a highlighted draft")
        reply = await wait_reply(pilot, app, 60)
        assert "draft" in reply.sources and draft_spans(view)
        spans = [(s.start, s.end) for s in draft_spans(view)]
        assert app.query_one("#legend-draft").display
        await pilot.press("f2")  # off: still Markdown, no spans shown
        assert view.query_one(".reply-markdown").display and not draft_spans(view)
        await pilot.press("f2")
    app2 = MtpChatApp(model=str(DEMO))
    async with app2.run_test(size=SIZE) as pilot:
        view = app2.query(MessageView).last()
        assert view.message.sources == reply.sources
        assert [(s.start, s.end) for s in draft_spans(view)] == spans


@run_async
async def test_highlighting_uses_the_engines_token_pieces(home):
    # "世" is three bytes over two tokens: the first completes no character (piece ""), the second, an accepted
    # draft, carries it; the app shows the engine's pieces, it does not decode tokens again
    pieces, sources = ["Hi", " ", "", "世", "!"], ["target", "target", "target", "draft", "draft"]
    app = MtpChatApp(loader=lambda *args: scripted(pieces, sources))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "hello")
        reply = await wait_reply(pilot, app)
        assert reply.pieces == pieces and reply.content == "Hi 世!"
        view = app.query(MessageView).last()
        assert view.shown_answer().plain == "Hi 世!"
        assert [(s.start, s.end) for s in draft_spans(view)] == [(3, 5)]  # "世!"
    assert Store().load_conversation(app.conversation.id).messages[1].pieces == pieces


@run_async
async def test_escape_sequences_in_replies_titles_and_names_never_reach_the_terminal(home, tmp_path):
    osc = "\x1b]0;pwned\x07\x1b]52;c;aGk=\x07"  # retitle the terminal; write the clipboard
    pieces = ["Sure", " \x1b]0;", "pwned\x07", "\x1b]52;c;aGk=\x07", " done\x9b2J"]
    sources = ["target", "draft", "draft", "target", "target"]
    prompt = f"Hi {osc}there"
    app = MtpChatApp(loader=lambda *args: scripted(pieces, sources, name=f"evil{osc}model"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, prompt)
        reply = await wait_reply(pilot, app)
        view = app.query(MessageView).last()
        shown = view.shown_answer().plain
        assert shown == "Sure ␛]0;pwned␇␛]52;c;aGk=␇ done" and not raw_controls(shown)
        assert [shown[s.start : s.end] for s in draft_spans(view)] == [" ␛]0;pwned␇"]  # on the text shown
        await pilot.press("f2")  # highlights off: the Markdown holds the same text
        await pilot.pause()
        assert view.query_one(".reply-markdown", Markdown).source == shown
        assert app.sub_title == "evilmodel — Hi there" and not raw_controls(app.title)
        assert not raw_controls(app.export_screenshot())  # header, transcript, status line as drawn

        await pilot.press("ctrl+o")  # the list of past conversations
        await pilot.pause()
        assert not raw_controls(app.export_screenshot())
        await pilot.press("escape")
        await pilot.pause()
        candidate = type("Candidate", (), {"name": f"cand{osc}", "path": tmp_path / f"cand{osc}", "family": "x"})()
        app.push_screen(ModelPickerScreen(f"/models/{osc}", discover=lambda: [candidate]))
        await wait_until(pilot, lambda: app.screen.candidates, 10, "the scripted discovery")
        await pilot.pause()
        assert not raw_controls(app.export_screenshot())
    # the store keeps what was written and generated, as it was
    stored = Store().load_conversation(app.conversation.id)
    assert stored.messages[0].content == prompt
    assert stored.messages[1].content == "".join(pieces) == reply.content and stored.messages[1].pieces == pieces
    assert stored.title == "Hi there"


@run_async
async def test_depth_change_mid_reply_reaches_the_next_cycles(home, model):
    write_settings(max_new_tokens=5000, depth=2, ignore_eos=True)  # runs until stopped
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Tell me a story about a cat.")
        await wait_until(pilot, lambda: app.request is None or app.request.stats.cycles >= 1, 20, "a cycle")
        assert app.request is not None
        seen_before = app.request.stats.cycles
        await pilot.press("alt+3")  # priority binding: works while the prompt has focus
        assert app.depth == 3 and app.query_one("#prompt", PromptInput).text == ""
        assert "speculation depth  3" in str(app.query_one("#timing-depth", Static).visual)
        request = app.request
        await wait_until(pilot, lambda: request.stats.last_cycle.depth == 3 or app.request is None, 20, "depth 3")
        await pilot.pause(0.1)
        view = app.query(MessageView).last()
        assert app.request is not None and view.streaming
        assert view.shown_answer().plain  # rendered while streaming
        assert "(last cycle: 3)" in str(app.query_one("#timing-depth", Static).visual)
        await pilot.press("escape")
        reply = await wait_reply(pilot, app)
        rows = Store().cycles(app.conversation.id)
        assert all(r.depth == 2 for r in rows[:seen_before])
        assert any(r.depth == 3 for r in rows[seen_before:]), [r.depth for r in rows]
        # a finished reply's last cycle may be shorter than its depth (the token limit): not shown as its depth
        assert reply.stats["depth"] == 3 and "last cycle" not in str(app.query_one("#timing-depth", Static).visual)
        assert app.settings.depth == 3  # remembered


@run_async
async def test_the_timing_pane_says_why_auto_chose_the_last_cycles_depth(home, model):
    write_settings(max_new_tokens=5000, depth="auto", ignore_eos=True)  # the default, stated
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Tell me a story about a cat.")
        await wait_until(pilot, lambda: app.request is None or app.request.stats.cycles >= 2, 20, "two cycles")
        await pilot.pause(0.1)
        assert app.request is not None
        pane = str(app.query_one("#timing-depth", Static).visual)
        assert "speculation depth  auto" in pane and "expected tok/s by depth 0: " in pane
        await pilot.press("escape")
        await wait_reply(pilot, app)
        assert "expected tok/s" not in str(app.query_one("#timing-depth", Static).visual)  # (streaming only)


@run_async
async def test_escape_stops_and_the_app_stays_usable(home, model):
    write_settings(max_new_tokens=5000, depth=2, ignore_eos=True)  # runs until stopped
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Tell me a story about a cat.")
        await wait_until(pilot, lambda: app.request and app.request.stats.tokens >= 2, 20, "tokens")
        await pilot.press("escape")
        reply = await wait_reply(pilot, app)
        assert reply.status == "stopped" and reply.finish_reason == "stop"
        assert len(reply.token_ids) < 5000
        app.settings.max_new_tokens = 4
        await send(pilot, app, "Hello")
        again = await wait_reply(pilot, app)
        assert again.status == "complete" and again.finish_reason in ("length", "eos")
    statuses = [m.status for m in Store().load_conversation(app.conversation.id).messages]
    assert statuses == ["complete", "stopped", "complete", "complete"]


@run_async
async def test_export_dialog_writes_files_and_shows_errors(home, model, tmp_path):
    write_settings(max_new_tokens=10, depth="auto")
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Hello")
        reply = await wait_reply(pilot, app)

        await pilot.press("f7")
        await pilot.pause()
        assert isinstance(app.screen, ExportScreen)
        assert app.screen.query_one("#export-dir", Input).value.endswith(str(Path("data") / "exports"))
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("")
        app.screen.query_one("#export-dir", Input).value = str(blocker / "x")
        await pilot.click("#export")
        assert isinstance(app.screen, ExportScreen)  # stays open, says why
        assert "export failed" in str(app.screen.query_one("#export-error", Label).visual)

        out = tmp_path / "exports"
        directory = app.screen.query_one("#export-dir", Input)
        directory.value = str(out)
        directory.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ExportScreen)
    files = {p.suffix: p for p in out.iterdir()}
    assert set(files) == {".md", ".json", ".csv", ".jsonl"}
    assert "Hello" in files[".md"].read_text()
    tokens = json.loads(files[".json"].read_text())["messages"][1]["tokens"]
    assert [t["source"] for t in tokens] == reply.sources and [t["id"] for t in tokens] == reply.token_ids
    rows = list(csv.DictReader(files[".csv"].open()))
    assert len(rows) == reply.stats["cycles"] and "verify_ms" in rows[0]
    assert all(r["why"].startswith("expected tok/s by depth 0:") for r in rows)  # auto says why, cycle by cycle
    lines = [json.loads(line) for line in files[".jsonl"].read_text().splitlines()]
    assert len(lines) == reply.stats["cycles"] and [x["why"] for x in lines] == [r["why"] for r in rows]


@run_async
async def test_restart_reopens_the_conversation_and_the_draft(home, model):
    write_settings(max_new_tokens=8, depth=1, theme="mtp-paper")
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        assert app.theme == "mtp-paper"
        await wait_loaded(pilot, app)
        await send(pilot, app, "Hello there")
        reply = await wait_reply(pilot, app)
        await pilot.press(*"unsent")
        await pilot.press("ctrl+j")
        await pilot.press(*"draft")
        app.theme = "mtp-dusk"
        await pilot.pause()
    app2 = MtpChatApp(model=model)
    async with app2.run_test(size=SIZE) as pilot:
        views = list(app2.query(MessageView))
        assert [v.message.content for v in views] == ["Hello there", reply.content]
        assert views[1].message.sources == reply.sources
        assert app2.query_one("#prompt", PromptInput).text == "unsent\ndraft"
        assert app2.theme == "mtp-dusk"  # the theme is remembered
        await pilot.press("ctrl+n")
        assert list(app2.query(MessageView)) == []
        assert len(app2.store.list_conversations(include_empty=True)) == 2  # (the new, empty one is not listed)


@run_async
async def test_failed_load_is_a_notice_and_a_good_model_can_be_picked(home, model, tmp_path):
    write_settings(max_new_tokens=6)
    app = MtpChatApp(model=str(tmp_path / "no-such-model"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert app.engine_state == "failed"
        notices = [n.message for n in app._notifications]
        assert any("Could not load" in n and "no-such-model" in n for n in notices), notices
        await send(pilot, app, "keep me")
        assert app.query_one("#prompt", PromptInput).text == "keep me"  # nothing typed is lost
        assert app.conversation.messages == []

        await pilot.press("f5")
        await pilot.pause()
        assert isinstance(app.screen, ModelPickerScreen)
        app.screen.query_one("#models-path", Input).value = model
        await pilot.click("#load")
        await wait_until(pilot, lambda: app.engine_state == "ready", 20, "the picked model")
        assert app.model_name == Path(model).name
        await send(pilot, app, "keep me")
        reply = await wait_reply(pilot, app)
        assert reply.role == "assistant" and reply.status == "complete"
        assert app.conversation.messages[0].content == "keep me"


@run_async
async def test_a_fallback_during_a_reply_is_a_notice(home, model):
    """Out of memory mid-reply: the engine lowers the depth and goes on; the user is told, once."""
    write_settings(max_new_tokens=12, depth=4)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        trunk = app.worker.engine.trunk
        trunk.forward = oom_on_the_second_verify(trunk.forward)
        await send(pilot, app, "Hello")
        reply = await wait_reply(pilot, app)
        assert reply.status == "complete" and reply.content
        notices = [n.message for n in app._notifications if n.message.startswith("memory:")]
        assert len(notices) == 1 and "depth lowered to 2" in notices[0]


@run_async
async def test_an_engine_error_is_a_notice_and_the_next_request_works(home, model):
    # top-p 7 reaches the engine (the settings screen would refuse it), which raises EngineError
    write_settings(max_new_tokens=6, depth=2)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        app.settings.top_p = 7.0
        await send(pilot, app, "Hello")
        failed = await wait_reply(pilot, app)
        assert failed.status == "error" and "top-p" in failed.error
        assert any("Generation failed" in n.message for n in app._notifications)
        # what the user wrote is kept: shown, and in the store
        assert [v.message.content for v in app.query(MessageView)][0] == "Hello"
        assert [m.content for m in Store().load_conversation(app.conversation.id).messages] == ["Hello", ""]
        app.settings.top_p = 1.0
        await pilot.press("ctrl+r")  # retry the same turn
        retried = await wait_reply(pilot, app)
        assert retried.status == "complete" and retried.content
        assert [m.role for m in app.conversation.messages] == ["user", "assistant"]


@run_async
async def test_a_failed_save_of_the_reply_keeps_the_message_and_the_app(home):
    app = MtpChatApp(loader=lambda *args: scripted(["Hi"], ["target"]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        add_message = app.store.add_message

        def full_disk(conv, role, *args, **kwargs):
            if role == "assistant":
                raise sqlite3.OperationalError("database or disk is full")
            return add_message(conv, role, *args, **kwargs)

        app.store.add_message = full_disk
        await send(pilot, app, "keep me")
        assert any("Could not save the reply" in n.message for n in app._notifications)
        assert app.request is None and [m.content for m in app.conversation.messages] == ["keep me"]
        assert [m.content for m in Store().load_conversation(app.conversation.id).messages] == ["keep me"]
        app.store.add_message = add_message
        await pilot.press("ctrl+r")  # the disk has room again: ask again
        reply = await wait_reply(pilot, app)
        assert reply.content == "Hi" and [m.role for m in app.conversation.messages] == ["user", "assistant"]


@run_async
async def test_settings_screen_validates_and_saves(home, model):
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f6")
        screen = app.screen
        screen.query_one("#set-top-p", Input).value = "3"
        await pilot.press("ctrl+s")
        assert app.screen is screen and "top-p" in str(screen.query_one("#settings-error", Label).visual)
        screen.query_one("#set-top-p", Input).value = "0.9"
        screen.query_one("#set-max", Input).value = "77"
        screen.query_one("#set-system").load_text("You are terse.")
        await pilot.press("ctrl+s")
        assert app.screen is not screen
        assert (app.settings.top_p, app.settings.max_new_tokens) == (0.9, 77)
        assert app.conversation.system_prompt == "You are terse."
        assert app.history()[0] == {"role": "system", "content": "You are terse."}
        await pilot.press("f1")
        assert "ctrl+j" in str(app.screen.query_one("#help-keys", Static).visual)
        await pilot.press("escape")


@run_async
async def test_conversations_copy_and_command_palette(home, model):
    write_settings(max_new_tokens=4, depth=2)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "first chat")
        await wait_reply(pilot, app)
        first_id = app.conversation.id
        await pilot.press("ctrl+n")
        await send(pilot, app, "second chat")
        second = await wait_reply(pilot, app)

        # copy: a focused message (c), the last reply from anywhere (alt+c)
        view = app.query(MessageView).first()
        view.focus()
        await pilot.press("c")
        assert app.clipboard == "second chat"
        await pilot.press("alt+c")
        assert app.clipboard == second.content

        # reopen the first conversation
        await pilot.press("ctrl+o")
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert table.row_count == 2
        table.move_cursor(row=1)  # newest first: the first chat is the second row
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.conversation.id == first_id, 5, "the first chat")
        assert [v.message.content for v in app.query(MessageView)][0] == "first chat"

        # the command palette sets the depth
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Depth 4")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.depth == 4, 5, "depth 4 from the palette")


@run_async
async def test_switching_models_without_restarting(home, model, ckpt, monkeypatch, tmp_path):
    other = str(ckpt("q35"))  # a Qwen3.5 (wrapped) checkpoint
    monkeypatch.setenv("MTPCHAT_MODELS", os.pathsep.join([model, other]))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    write_settings(max_new_tokens=4)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await pilot.press("f5")
        picker = app.screen
        assert isinstance(picker, ModelPickerScreen)
        await wait_until(pilot, lambda: len(picker.candidates) >= 2, 20, "discovered models")
        table = picker.query_one(DataTable)
        row = next(i for i, c in enumerate(picker.candidates) if c.path == other)
        table.move_cursor(row=row)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.engine_state == "ready" and app.model_path == other, 20, "the switch")
        assert app.settings.model == other  # remembered for the next start
        await send(pilot, app, "Hello")
        assert (await wait_reply(pilot, app)).model == Path(other).name

        # a model that fails to load: the one that worked stays loaded
        await pilot.press("f5")
        await pilot.pause()
        app.screen.query_one("#models-path", Input).value = str(tmp_path / "broken")
        await pilot.click("#load")
        await wait_until(pilot, lambda: any("Still using" in n.message for n in app._notifications), 20, "notice")
        await wait_until(pilot, lambda: app.engine_state == "ready", 20, "the old model back")
        assert app.model_path == other
        assert app.settings.model == other  # the failed pick is not remembered


@run_async
async def test_the_transcript_follows_the_stream_only_from_the_bottom(home, model):
    write_settings(max_new_tokens=5000, depth=2, ignore_eos=True)
    app = MtpChatApp(model=model)
    async with app.run_test(size=(70, 20)) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Tell me a story about a cat.")
        transcript = app.query_one("#transcript")
        await wait_until(pilot, lambda: transcript.max_scroll_y > 3, 20, "an overflowing reply")
        at_bottom = lambda: transcript.scroll_y == transcript.max_scroll_y  # noqa: E731
        await wait_until(pilot, at_bottom, 5, "following the stream")
        transcript.scroll_to(y=0, animate=False)  # the reader scrolls up: stop following
        grown = transcript.max_scroll_y
        await wait_until(pilot, lambda: transcript.max_scroll_y > grown + 2, 20, "more text")
        assert transcript.scroll_y == 0
        transcript.scroll_end(animate=False)  # back at the bottom: follow again
        grown = transcript.max_scroll_y
        await wait_until(pilot, lambda: transcript.max_scroll_y > grown + 2, 20, "more text")
        await wait_until(pilot, at_bottom, 5, "following the stream again")
        await pilot.press("escape")
        await wait_reply(pilot, app)


class StatusRecorder(MtpChatApp):
    """The app, recording every status line it shows (a warm-up on the demo model takes a second or two on the
    CPU: polling could miss its steps)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.statuses: list[str] = []

    def _update_status(self) -> None:
        super()._update_status()
        self.statuses.append(str(self.ui("#status", Static).visual))


def fresh_reply(text: str, settings: dict) -> str:
    """The demo model's reply to `text` from a freshly loaded engine (no warm-up, no state)."""
    from engine import GenerationSettings, Tokens, load_engine

    engine = load_engine(str(DEMO), device="cpu")
    events = engine.chat([{"role": "user", "content": text}], GenerationSettings(**settings))
    return "".join(e.text for e in events if isinstance(e, Tokens))


@run_async
async def test_warm_up_shows_its_progress_and_leaves_no_state(home, monkeypatch):
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # the fresh MTPCHAT_HOME's: nothing compiled yet
        monkeypatch.delenv(var, raising=False)
    write_settings(max_new_tokens=24, depth=2)
    app = StatusRecorder(model=str(DEMO), warm_up=True)  # forced on: on the CPU the chat skips it
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine_state == "ready", 60, "the warm-up")
        steps = [s for s in app.statuses if "preparing kernels" in s]
        assert any("preparing kernels 1/7 · depth 0: long prompt" in s for s in steps)  # depths 0, 1, 2
        assert any("preparing kernels 7/7 · depth 2: turn prompt" in s for s in steps)
        # from the warm-up's start on (the line before it, at EngineLoaded, is a plain "preparing kernels…")
        assert all("(first run on this machine: compiling kernels once)" in s for s in steps[1:])
        assert "ready in " in app.statuses[-1] and "preparing" not in app.statuses[-1]
        assert app.engine_diagnostics["reuse"]["history_tokens"] == 0  # the snapshot taken after the warm-up
        await send(pilot, app, "hi, how are you?")
        reply = await wait_reply(pilot, app, 30)
        assert "ready in " not in app.statuses[-1]  # said once
    assert reply.status == "complete"
    assert reply.content == fresh_reply("hi, how are you?", dict(max_new_tokens=24, depth=2))


def test_a_message_sent_during_the_warm_up_is_answered_after_it(home):
    from app.worker import EngineLoaded, EngineWorker, Generate, ReplyFinished, WarmedUp, WarmupProgress

    posted, done = [], threading.Event()
    settings = dict(max_new_tokens=8, depth=1)

    def post(message) -> None:  # on the engine thread
        posted.append(message)
        if isinstance(message, WarmupProgress) and message.done == 1:  # mid-warm-up: the user sends a message
            worker.submit(Generate(1, [{"role": "user", "content": "hi"}], settings))
        if isinstance(message, ReplyFinished):
            done.set()

    worker = EngineWorker(post, str(DEMO), "cpu", depth=1, warm_up=True)
    worker.start()
    try:
        assert done.wait(120), "no reply"
    finally:
        worker.shutdown()
    kinds = [type(m) for m in posted]
    assert kinds.index(EngineLoaded) < kinds.index(WarmupProgress) < kinds.index(WarmedUp) < kinds.index(ReplyFinished)
    assert [m.done for m in posted if isinstance(m, WarmupProgress)] == [0, 1, 2, 3, 4, 5]  # depths 0 and 1
    warmed = next(m for m in posted if isinstance(m, WarmedUp))
    assert warmed.error is None and warmed.ready_s >= warmed.seconds > 0
    assert posted[-1].reason in ("eos", "length")


def test_a_load_freezes_the_heap_and_a_switch_frees_the_old_engine(ckpt):
    """settle_heap: after a load the collector no longer scans the model's objects (a full collection of them
    held the GIL for up to 0.4 s mid-reply); a switch unfreezes first, so the engine it replaces is freed even
    from a reference cycle (one is made here: frozen, it would keep the old model's memory for good)."""
    import gc
    import queue
    import weakref

    from app.worker import EngineLoaded, EngineWorker, SwitchModel

    posted = queue.Queue()
    worker = EngineWorker(posted.put, str(ckpt("q35")), "cpu", None)
    gc.unfreeze()
    worker.start()
    try:
        next_posted(posted, EngineLoaded)
        assert gc.get_freeze_count() > 1000
        worker.engine.itself = worker.engine
        old = weakref.ref(worker.engine)
        worker.submit(SwitchModel(str(ckpt("next"))))
        next_posted(posted, EngineLoaded)
        assert worker.engine is not None and old() is None
    finally:
        worker.shutdown(timeout=10)


class FailingWarmUp(ScriptedEngine):
    def warm_up(self, depths, progress):
        raise RuntimeError("ptxas failed\nwith a long log")


@run_async
async def test_a_failed_warm_up_is_a_notice_and_the_model_stays_usable(home):
    from engine import Finished, Started, Tokens

    engine = FailingWarmUp([Started(prompt_tokens=3), Tokens([5], ["target"], "ok", ["ok"]),
                            Finished(reason="eos", stats={})])
    app = MtpChatApp(loader=lambda *_: engine, warm_up=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine_state == "ready", 20, "the warm-up to end")
        notices = [n.message for n in app._notifications]
        assert notices == ["Preparing kernels failed: RuntimeError: ptxas failed (the first reply compiles them)"]
        await send(pilot, app, "hello")
        assert (await wait_reply(pilot, app)).content == "ok"


@run_async
async def test_a_narrow_terminal_hides_the_side_panel_until_asked(home, model):
    """At 60 columns the 46-column side panel would leave the chat a sliver: a one-line summary instead, f3 shows
    the panel in the chat's place (not saved as a choice), and a wide terminal shows it beside the chat again
    unless the user closed it there."""
    app = MtpChatApp(model=model)
    async with app.run_test(size=(60, 20)) as pilot:
        await wait_loaded(pilot, app)
        side, chat = app.query_one("#side"), app.query_one("#chat")
        assert not side.display and app.query_one("#transcript").size.width > 40
        assert app.query_one("#side-summary").display
        await pilot.press("f3")
        assert side.display and not chat.display
        await pilot.press("f3")
        assert chat.display and not side.display
        await pilot.resize_terminal(140, 40)
        await pilot.pause()
        assert side.display and chat.display
        await pilot.press("f3")  # closed by the user where it fits: stays closed
        await pilot.resize_terminal(60, 20)
        await pilot.pause()
        await pilot.resize_terminal(140, 40)
        await pilot.pause()
        assert not side.display and app.settings.side_panel is False
        await pilot.press("f3")
        assert side.display


@run_async
async def test_finish_reasons_show_and_ctrl_q_mid_reply_saves_the_stats(home, model):
    write_settings(max_new_tokens=6, depth=2, ignore_eos=True)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Hello")
        cut = await wait_reply(pilot, app)
        footer = str(app.query(MessageView).last().query_one(".message-footer", Static).visual)
        assert cut.finish_reason == "length" and "cut off at the token limit" in footer, footer
        app.settings.max_new_tokens = 5000  # runs until stopped
        await send(pilot, app, "Tell me a story about a cat.")
        await wait_until(pilot, lambda: app.request and app.request.stats.cycles >= 2, 20, "cycles")
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: app.request is None, 5, "the reply to be stopped")
        assert "stopped by you" in str(app.query(MessageView).last().query_one(".message-footer", Static).visual)
    assert app.return_code == 0
    saved = Store().load_conversation(app.conversation.id).messages[-1]
    assert saved.status == "stopped" and saved.finish_reason == "stop"
    assert saved.stats["cycles"] >= 2 and saved.stats["depth"] == 2 and saved.stats["tokens_per_s"] > 0


@run_async
async def test_small_terminals_and_resizes_mid_reply(home, model):
    """Below 120 columns the side panel gives way to a one-line summary (f3 / f4 show it in the chat's place);
    down to 20x8, and resized while a reply streams, nothing breaks (at 50 columns the prompt's placeholder was
    once wrapped at width 0: a ValueError)."""
    write_settings(max_new_tokens=5000, depth=2, ignore_eos=True)  # runs until stopped
    app = MtpChatApp(model=model)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_loaded(pilot, app)
        side, chat, summary = app.query_one("#side"), app.query_one("#chat"), app.query_one("#side-summary")
        assert side.display and not summary.display
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert not side.display and summary.display and "no reply yet" in str(summary.visual)
        await send(pilot, app, "Tell me a story about a cat.")
        await wait_until(pilot, lambda: app.request and app.request.stats.cycles >= 1, 20, "a cycle")
        for size in [(50, 20), (20, 8), (120, 30), (45, 15)]:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.1)
            assert side.display == (size[0] >= 120) and summary.display == (size[0] < 120), size
        assert app.request is not None  # still streaming, at every size
        await pilot.press("f3")  # narrow: the panel in the chat's place
        await pilot.pause()
        assert side.display and not chat.display and side.active == "timing"
        await pilot.press("f3")
        await pilot.pause()
        assert chat.display and not side.display and app.focused is app.query_one("#prompt")
        await pilot.press("escape")
        await wait_reply(pilot, app)
        await wait_until(pilot, lambda: "last reply" in str(summary.visual), 5, "the summary")
        assert "tok/s" in str(summary.visual) and "accepted" in str(summary.visual)
        await pilot.resize_terminal(20, 8)
        for key in ("f1", "f6", "f5"):  # the dialogs fit too
            await pilot.press(key)
            await pilot.pause(0.3)
            assert app.screen is not app.chat_screen, key
            await pilot.press("escape")
            await pilot.pause(0.1)
        await pilot.resize_terminal(160, 48)
        await pilot.pause()
        assert side.display and chat.display and not summary.display


@run_async
async def test_quit_while_a_model_switch_loads(home, model, ckpt):
    """The worker's messages of a load that outlives the chat screen are dropped (once a NoMatches
    ('#diagnostics-pane') at teardown)."""
    from app.worker import SwitchModel

    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        app.worker.submit(SwitchModel(str(ckpt("q35"))))
        # the worker has taken the switch (a tiny model's load can end before the UI sees it start, when a
        # loaded machine runs the UI thread late: the state was never seen 'loading' in a CI run)
        await wait_until(pilot, lambda: app.engine_state == "loading" or app.worker.commands.empty(), 10,
                         "the switch to start")
        await pilot.press("ctrl+q")
    assert app.return_code == 0


@run_async
async def test_the_pickers_download_tab_is_reachable_by_keyboard(home, model):
    from textual.widgets import TabbedContent

    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await pilot.press("f5")
        await pilot.pause()
        picker = app.screen
        tabs = picker.query_one("#models-tabs", TabbedContent)
        assert isinstance(picker, ModelPickerScreen) and tabs.active == "tab-installed"
        await pilot.press("f9")
        await pilot.pause()
        assert tabs.active == "tab-download" and picker.focused is picker.query_one("#catalogue-table")
        await pilot.press("ctrl+pageup")
        await pilot.pause()
        assert tabs.active == "tab-installed" and picker.focused is picker.query_one("#models-table")
        assert "f9 switches" in str(picker.query_one("#models-keys", Label).visual)


def pane_text(app) -> str:
    """The diagnostics pane as plain text (what a terminal shows)."""
    from rich.console import Console

    console = Console(width=100, record=True, file=open(os.devnull, "w"))
    console.print(app.query_one("#diag-body", Static).content)
    return console.export_text()


@run_async
async def test_the_picker_loads_a_draft_model_for_the_chosen_model(home, monkeypatch, tmp_path):
    """F5 → the highlighted model's draft models (discovery's pairs) or none: a draft reloads the engine with it,
    and the diagnostics pane names the drafter; none reloads without it."""
    from draft_fixtures import write_qwen3

    root = tmp_path / "models"
    target = write_qwen3(root / "target", seed=4)
    small = write_qwen3(root / "small", seed=5, layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8)
    monkeypatch.setenv("MTPCHAT_MODELS", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    monkeypatch.setenv("MTPCHAT_DRAFT_MODEL", "")  # (the picker sets it for the engine thread; restored after)
    write_settings(max_new_tokens=4)
    app = MtpChatApp(model=str(target))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert "draft:" not in pane_text(app)
        loaded = "none"
        for pick, drafter in ((str(small), "draft:small"), (None, None)):
            await pilot.press("f5")
            picker = app.screen
            assert isinstance(picker, ModelPickerScreen)
            await wait_until(pilot, lambda: len(picker.candidates) >= 2, 20, "discovered models")
            picker.query_one("#models-table", DataTable).move_cursor(
                row=next(i for i, c in enumerate(picker.candidates) if c.path == str(target)))
            select = picker.query_one("#models-draft", Select)
            await wait_until(pilot, lambda: (str(small), str(small)) in [(v, v) for _, v in select._options], 5,
                             "the target's drafts offered")
            assert select.value == loaded  # (the second time: the loaded draft preselected)
            select.value = "none" if pick is None else pick
            await pilot.pause()
            assert picker.draft == pick
            await pilot.click("#load")
            await wait_until(pilot, lambda: app.engine_state == "ready" and app.engine_diagnostics.get(
                "drafter", {}).get("name") == (drafter or None), 30, f"the reload with {drafter}")
            assert app.model_path == str(target)
            text = pane_text(app)
            assert (drafter in text) if drafter else ("draft:" not in text), text
            await send(pilot, app, "Hello")
            reply = await wait_reply(pilot, app)
            assert (reply.stats or {}).get("drafter") == drafter, reply.stats  # the reply drafted with it
            loaded = pick


@run_async
async def test_the_status_line_takes_the_bar_s_width_as_its_text_grows(home):
    """The status line is redrawn without a new layout unless its height changes (LiveStatic): with an auto width
    it kept its first text's width and cut the context meter off ("context 40 /") once the text grew."""
    app = MtpChatApp(loader=lambda *args: scripted(["Hi", "!"], ["target", "draft"]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        status = app.query_one("#status")
        assert str(status.styles.width) == "1fr"
        await send(pilot, app, "Hello")
        await wait_reply(pilot, app)
        await pilot.pause()
        assert status.size.width >= len(status.content.plain) + 20  # (the bar's rest: the chat column's width)
