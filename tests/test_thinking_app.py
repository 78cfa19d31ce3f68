"""Thinking models in the app (issue #24): the reasoning as its own collapsible part of a reply, the
enable_thinking switch (key, palette, settings; disabled with the reason on a model without it), the history
sent back, tool-call blocks, the exports, and `run`'s reasoning / answer split.

The TUI tests script the engine's events (tests/app_support.py ThinkingEngine: a reply that crosses `</think>`
deterministically, which the random-weight checkpoints cannot be made to produce); what a prompt becomes is
checked on the real q35_think checkpoint against transformers' apply_chat_template, token for token."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

from app_support import home  # noqa: F401 (a fixture)
from app_support import (ThinkingEngine, run_async, send, thinking_model, thinking_reply, wait_loaded, wait_reply,
                         wait_until, write_settings)
from textual.widgets import Collapsible, Input, Label, Markdown, Select, Static

from app.export import timing_csv, timing_jsonl, transcript_json, transcript_markdown
from app.reply_parts import history_content, split_tool_calls, tool_call_text
from app.store import Store
from app.transcript import DRAFT_STYLE, MessageView
from app.tui import MtpChatApp

SIZE = (130, 40)  # the side panel (timing) beside the chat: from 120 columns
REASONING = ["The user", " greets", " me", ".\n"]
ANSWER = ["\n\n", "Hello", " there", "!"]


def thinking_block(view: MessageView) -> Collapsible:
    return view.query_one(".thinking", Collapsible)


def title_of(block: Collapsible) -> str:
    return block.title.plain if hasattr(block.title, "plain") else str(block.title)


def reasoning_shown(view: MessageView) -> Static:
    return view.query_one(".reasoning-body", Static)


@run_async
async def test_the_thinking_block_streams_expanded_then_collapses_with_its_numbers(home):
    write_settings(highlight=True)
    gate = {"answer": threading.Event()}
    sources = ["target", "draft", "draft", "target", "target", "draft", "target", "target"]
    engine = ThinkingEngine(thinking_reply(REASONING, ANSWER, sources, gate))
    app = MtpChatApp(loader=lambda *_: engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "hi")
        view = app.query(MessageView).last()
        # the reasoning streams into an expanded block, its drafts highlighted
        await wait_until(pilot, lambda: "greets me." in reasoning_shown(view).visual.plain, 10, "the reasoning")
        block = thinking_block(view)
        assert block.display and not block.collapsed
        assert title_of(block).startswith("thinking… · 4 tokens")
        shown = reasoning_shown(view).visual
        assert [shown.plain[s.start : s.end] for s in shown.spans if s.style == DRAFT_STYLE] == [" greets me"]
        assert "<think>" not in app.export_screenshot()
        gate["answer"].set()
        reply = await wait_reply(pilot, app)
        # the answer started: the block collapsed; the engine's numbers in its title
        assert block.collapsed and title_of(block) == "thinking · 5 tokens · 4.1 s"
        assert reply.content == "".join(ANSWER) and reply.reasoning == "".join(REASONING)
        assert view.shown_answer().plain == "Hello there!"
        # the timing pane: tokens/s and acceptance of each part
        parts = str(app.query_one("#timing-parts", Static).visual)
        assert "reasoning" in parts and "30.0" in parts and "answer" in parts and "60.0" in parts
        assert app.query_one("#timing-parts").display
        await pilot.press("f2")  # highlights off: the answer alone in the Markdown, the reasoning plain text
        await pilot.pause()
        assert view.query_one(".reply-markdown", Markdown).source == "Hello there!"
        assert reasoning_shown(view).visual.plain == "The user greets me."
    # saved in two parts, each token labelled: reopened collapsed with the same title
    stored = Store().load_conversation(app.conversation.id).messages[1]
    assert (stored.content, stored.reasoning) == (reply.content, reply.reasoning)
    assert stored.parts == ["reasoning"] * 5 + ["answer"] * 4 and stored.sources == reply.sources
    assert [row.part for row in Store().cycles(app.conversation.id)] == ["reasoning"] * 4 + ["answer"] * 4
    app2 = MtpChatApp(loader=lambda *_: engine)
    async with app2.run_test(size=SIZE) as pilot:
        block = thinking_block(app2.query(MessageView).last())
        assert block.display and block.collapsed and title_of(block) == "thinking · 5 tokens · 4.1 s"


@run_async
async def test_a_reply_without_reasoning_shows_no_thinking_block(home):
    from app_support import scripted

    app = MtpChatApp(loader=lambda *_: scripted(["Hi", "!"], ["target", "target"]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "hi")
        await wait_reply(pilot, app)
        assert not thinking_block(app.query(MessageView).last()).display
        assert not app.query_one("#timing-parts").display


@run_async
async def test_the_toggle_changes_what_is_sent_and_the_history_carries_the_reasoning(home):
    engine = ThinkingEngine(thinking_reply(REASONING, ANSWER))
    app = MtpChatApp(loader=lambda *_: engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert "thinking on" in str(app.query_one("#status", Static).visual)  # the template's default
        await send(pilot, app, "hi")
        await wait_reply(pilot, app)
        assert engine.requests[-1][1].think is None  # unset: the template's default
        await pilot.press("alt+t")
        assert app.settings.think is False and "thinking off" in str(app.query_one("#status", Static).visual)
        await send(pilot, app, "again")
        await wait_reply(pilot, app)
        messages, settings = engine.requests[-1]
        assert settings.think is False
        # the first reply goes back in the model's own form (the template drops it from earlier turns)
        assert messages[1] == {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello there!"}
        # the palette and the settings screen switch it too
        app.action_toggle_thinking()
        assert app.settings.think is True
        await pilot.press("f6")
        screen = app.screen
        assert not screen.query_one("#set-think", Select).disabled
        screen.query_one("#set-think", Select).value = "off"
        screen.query_one("#set-think-budget", Input).value = "64"
        screen.query_one("#set-template-vars", Input).value = "preserve_thinking=true, unknown=1"
        await pilot.press("ctrl+s")
        assert app.screen is not screen
        assert (app.settings.think, app.settings.think_budget) == (False, 64)
        assert app.settings.template_vars == {"preserve_thinking": True, "unknown": 1}
        await send(pilot, app, "third")
        await wait_reply(pilot, app)
        settings = engine.requests[-1][1]
        # only the variables the template reads are passed
        assert (settings.think, settings.think_budget) == (False, 64)
        assert settings.template_vars == {"preserve_thinking": True}


@run_async
async def test_a_model_without_the_switch_disables_the_toggle_with_the_reason(home):
    engine = ThinkingEngine(thinking_reply([], ["Hi"]), thinking=thinking_model(switch=False))
    app = MtpChatApp(loader=lambda *_: engine, think=False)  # --no-think: no effect, nothing sent
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await pilot.press("alt+t")
        await pilot.pause()
        assert any("no enable_thinking switch" in n.message for n in app._notifications)
        assert "thinking" not in str(app.query_one("#status", Static).visual)
        await send(pilot, app, "hi")
        await wait_reply(pilot, app)
        assert engine.requests[-1][1].think is None
        await pilot.press("f6")
        screen = app.screen
        assert screen.query_one("#set-think", Select).disabled
        assert "no enable_thinking switch" in str(screen.query_one("#think-reason", Label).visual)
        await pilot.press("escape")


@run_async
async def test_the_toggle_renders_the_templates_empty_block_on_the_real_checkpoint(home, ckpt):
    """think=False through the chat on q35_think: the prompt is apply_chat_template(enable_thinking=False),
    token for token (and the default opens <think>)."""
    from transformers import AutoTokenizer

    from app.worker import default_loader

    path = str(ckpt("q35_think"))
    prompts = []

    def recording_loader(*args):
        engine = default_loader(path, None, None)
        generate = engine.generate

        def recorded(prompt_ids, settings, control=None, **kw):
            prompts.append(list(prompt_ids))
            return generate(prompt_ids, settings, control, **kw)

        engine.generate = recorded
        return engine

    write_settings(max_new_tokens=3, depth=1)
    app = MtpChatApp(loader=recording_loader)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert app.thinking.switch and app.thinking.default is True
        await send(pilot, app, "Hello")
        await wait_reply(pilot, app)
        await pilot.press("alt+t")
        await send(pilot, app, "Hello again")
        await wait_reply(pilot, app)
        history = app.history()
    tok = AutoTokenizer.from_pretrained(path)
    first = [{"role": "user", "content": "Hello"}]
    second = history[: [m["content"] for m in history].index("Hello again") + 1]
    assert prompts[0] == template_ids(tok, first)
    assert prompts[1] == template_ids(tok, second, enable_thinking=False)
    assert prompts[1] != template_ids(tok, second)  # the empty block: the generation prompt closed it


def template_ids(tok, messages, **variables) -> list[int]:
    """transformers' own rendering and tokenization of a chat, the oracle of the prompts."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **variables)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@run_async
async def test_tool_calls_render_as_collapsed_blocks_and_are_not_run(home):
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    engine = ThinkingEngine(thinking_reply(["Weather", " asked.\n"], ["\n\n", "Let me check.\n", call]))
    app = MtpChatApp(loader=lambda *_: engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "weather in Paris?")
        reply = await wait_reply(pilot, app)
        view = app.query(MessageView).last()
        await pilot.pause()
        blocks = view.query(".tool-call").results(Collapsible)
        blocks = list(blocks)
        assert len(blocks) == 1 and blocks[0].collapsed
        assert title_of(blocks[0]) == "tool call · get_weather · not run"
        assert str(blocks[0].query_one(".tool-call-body", Static).visual) == "city: Paris\ndays: 3"
        assert view.shown_answer().plain == "Let me check."
        assert call in reply.content  # stored as written


def test_tool_calls_in_qwens_forms():
    xml = split_tool_calls("a<tool_call>\n<function=f>\n<parameter=x>\nline 1\nline 2\n</parameter>\n</function>"
                           "\n</tool_call>b")
    assert xml[0] == "a" and xml[2] == "b" and xml[1].name == "f" and xml[1].complete
    assert tool_call_text(xml[1]) == "x: line 1\n    line 2"
    js = split_tool_calls('<tool_call>\n{"name": "g", "arguments": {"q": "cats", "n": 2}}\n</tool_call>')[0]
    assert (js.name, js.arguments) == ("g", [("q", "cats"), ("n", "2")])
    cut = split_tool_calls("<tool_call>\n<function=h>\n<parameter=y>\n1")[0]  # a reply stopped mid-call
    assert cut.name == "h" and not cut.complete and cut.arguments == [("y", "1")]


def test_history_content_is_the_models_own_form():
    assert history_content("Think.\n", "\n\nAnswer") == "<think>\nThink.\n</think>\n\nAnswer"
    assert history_content("", "Answer") == "Answer"  # no reasoning (thinking off, or a model without it)


def _thinking_conversation(store: Store) -> int:
    conv = store.create_conversation()
    store.add_message(conv, "user", "hi")
    reply = store.add_message(conv, "assistant", status="streaming")
    from engine import Cycle

    cycles = [(Cycle(0, 1, 1, 1, [True], {"verify": 1.0}, 2), 5.0),
              (Cycle(1, 1, 1, 0, [False], {"verify": 2.0}, 1), 9.0)]
    store.append_reply(reply, "\n\nHello", [100, 101, 4, 200, 201], ["target", "draft", "forced", "target", "target"],
                       ["Think", "ing.\n", "", "\n\n", "Hello"], cycles, reasoning="Thinking.\n",
                       parts=["reasoning"] * 3 + ["answer"] * 2, cycle_parts=["reasoning", "answer"])
    store.finish_message(reply, "complete", finish_reason="eos", stats={"parts": {"reasoning": {"tokens": 3}}})
    return conv


def test_exports_keep_reasoning_apart(home):
    store = Store()
    conv = store.load_conversation(_thinking_conversation(store))
    md = transcript_markdown(conv)
    assert "<details><summary>thinking · 3 tokens</summary>\n\nThinking.\n\n</details>\n\nHello" in md
    data = transcript_json(conv)["messages"][1]
    assert data["content"] == data["answer"]["text"] == "\n\nHello"
    assert data["reasoning"]["text"] == "Thinking.\n"
    assert [t["source"] for t in data["reasoning"]["tokens"]] == ["target", "draft", "forced"]
    assert [t["id"] for t in data["answer"]["tokens"]] == [200, 201]
    rows = store.cycles(conv.id)
    assert [r.part for r in rows] == ["reasoning", "answer"]
    assert "part" in timing_csv(rows).splitlines()[0] and ",reasoning," in timing_csv(rows)
    assert [json.loads(line)["part"] for line in timing_jsonl(rows).splitlines()] == ["reasoning", "answer"]


# run -------------------------------------------------------------------------------------------------------
class ThinkingRunEngine:
    """What cmd_run needs of an engine: a reply whose reasoning crosses `</think>` (scripted events)."""

    def __init__(self):
        from engine import ModelInfo

        self.info = ModelInfo("fake", "/fake", "qwen3_5", "qwen3_5", 1, 1, "cpu", "float32")
        self.thinking = thinking_model()
        self.encoded = []

    def encode_chat(self, messages, think=None, template_vars=None):
        self.encoded.append(think)
        return [1, 2, 3]

    def check_context(self, prompt_tokens, max_new_tokens=None):
        pass

    def generate(self, prompt, settings, control=None):
        yield from thinking_reply(["Hmm", " \x1b]0;x\x07ok.\n"], ["\n\n", "Hi", "!"])()

    def diagnostics(self):
        return {}


def _run_args(**kw):
    base = dict(prompt="hi", system=None, raw=False, max_new_tokens=8, depth=0, temperature=0.0, top_p=1.0, top_k=0,
                seed=None, ignore_eos=True, json=False, think=None, think_budget=None, show_thinking=False)
    return argparse.Namespace(**{**base, **kw})


def test_run_prints_the_answer_and_the_reasoning_only_when_asked(capsys):
    from app.cmd_run import _run

    assert _run(_run_args(), ThinkingRunEngine()) == 0
    out, err = capsys.readouterr()
    assert out == "Hi!\n" and "Hmm" not in err
    assert _run(_run_args(show_thinking=True), ThinkingRunEngine()) == 0
    out, err = capsys.readouterr()
    assert out == "Hi!\n" and err.startswith("Hmm ok.\n[") and "\x1b" not in err  # terminal-safe


def test_run_json_splits_reasoning_and_answer(capsys):
    from app.cmd_run import _run

    engine = ThinkingRunEngine()
    assert _run(_run_args(json=True, think=True), engine) == 0
    out = json.loads(capsys.readouterr().out)
    assert engine.encoded == [True]
    assert out["text"] == "\n\nHi!" and out["reasoning"] == "Hmm \x1b]0;x\x07ok.\n"  # lossless
    assert out["parts"] == ["reasoning"] * 3 + ["answer"] * 3 and len(out["parts"]) == len(out["token_ids"])
    assert set(out["stats"]["parts"]) == {"reasoning", "answer"}


def test_run_json_no_think_on_the_real_checkpoint(ckpt, capsys):
    from transformers import AutoTokenizer

    from app.cli import main

    path = str(ckpt("q35_think"))
    assert main(["run", "--model", path, "--prompt", "Hello", "--max-new-tokens", "4", "--no-think", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(path)
    expected = template_ids(tok, [{"role": "user", "content": "Hello"}], enable_thinking=False)
    assert out["prompt_token_ids"] == expected
    assert out["reasoning"] == "" and out["parts"] == ["answer"] * len(out["token_ids"])  # the block came closed
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)


def test_thinking_settings_are_tri_state_and_checked(home):
    from app.settings import Settings, format_template_vars, parse_template_vars

    s = Settings.from_dict({"think": False, "think_budget": 128, "template_vars": {"preserve_thinking": True}})
    assert (s.think, s.think_budget, s.template_vars, s.warnings) == (False, 128, {"preserve_thinking": True}, [])
    bad = Settings.from_dict({"think": "yes", "think_budget": 0, "template_vars": {"x": [1]}})
    assert (bad.think, bad.think_budget, bad.template_vars) == (None, None, {}) and len(bad.warnings) == 3
    values = parse_template_vars("preserve_thinking=true, depth=2, style = short")
    assert values == {"preserve_thinking": True, "depth": 2, "style": "short"}
    assert parse_template_vars(format_template_vars(values)) == values
    with pytest.raises(ValueError):
        parse_template_vars("not a pair")


def test_a_reply_saved_before_parts_existed_is_all_answer(tmp_path):
    import sqlite3

    from app.store import MIGRATIONS

    path = tmp_path / "v2.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0] + MIGRATIONS[1] + "\nPRAGMA user_version = 2;")
    conn.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', 1, 1)")
    conn.execute("INSERT INTO messages (id, conversation_id, role, content, created_at) "
                 "VALUES (5, 1, 'assistant', 'yo', 1)")
    conn.execute("INSERT INTO token_chunks (message_id, token_ids, sources, pieces) VALUES (5, '[1]', 't', '[\"yo\"]')")
    conn.commit()
    conn.close()
    reply = Store(path).load_conversation(1).messages[0]
    assert (reply.content, reply.reasoning, reply.parts) == ("yo", "", ["answer"])
