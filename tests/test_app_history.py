"""The chat's history under Textual's pilot with the real engine on a tiny checkpoint: retry keeps alternatives
(alt+left / alt+right, saved and exported), editing the last message, up-arrow recall, the conversations
screen (search, rename, delete), two app instances on one data folder, and the store's failures (a file for
MTPCHAT_HOME, a locked database) as notices while the chat goes on."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from app_support import home  # noqa: F401 (a fixture)
from app_support import run_async, scripted, send, wait_loaded, wait_reply, wait_until, write_settings
from textual.widgets import DataTable, Footer, Input

from app import paths
from app.conversations import ConversationsScreen
from app.export import export_conversation
from app.store import Store
from app.transcript import MessageView, PromptInput
from app.tui import MtpChatApp

SIZE = (110, 36)


@pytest.fixture
def model(ckpt) -> str:
    return str(ckpt("next"))


def shown(app) -> list[str]:
    return [v.message.content for v in app.query(MessageView)]


def notices(app) -> str:
    return "\n".join(n.message for n in app._notifications)


@run_async
async def test_retry_keeps_alternatives_that_persist_and_export(home, model, tmp_path):
    write_settings(max_new_tokens=6, depth=2, temperature=1.0, top_p=0.9, top_k=20, seed=None)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "Hello")
        first = await wait_reply(pilot, app)
        await pilot.press("ctrl+r")
        await pilot.pause()
        second = await wait_reply(pilot, app)
        assert second.id != first.id and len(app.conversation.messages) == 2
        assert [m.id for m in app.conversation.alternatives(second)] == [first.id, second.id]
        assert shown(app) == ["Hello", second.content]
        await pilot.press("alt+left")  # back to the first reply
        await pilot.pause()
        assert app.conversation.messages[-1].id == first.id and shown(app) == ["Hello", first.content]
        assert "Reply 1 of 2" in notices(app)
        await pilot.press("alt+right")
        await pilot.pause()
        assert app.conversation.messages[-1].id == second.id
        await pilot.press("alt+left")
        await pilot.pause()
        assert second.settings["temperature"] == 1.0 and second.settings["top_k"] == 20
        assert second.settings["depth"] == 2 and second.settings["model"] == app.model_name
    # after a restart: the chosen one shown, the other kept; the export has both and how each was made
    stored = Store()
    conv = stored.load_conversation(app.conversation.id)
    assert [m.id for m in conv.messages] == [conv.messages[0].id, first.id]
    assert [m.id for m in conv.alternatives(conv.messages[1])] == [first.id, second.id]
    written = {p.suffix: p for p in export_conversation(stored, conv.id, tmp_path, ["json", "md"])}
    data = json.loads(written[".json"].read_text())
    reply = data["messages"][1]
    assert reply["alternative"] == {"index": 0, "of": 2} and reply["alternatives"][0]["id"] == second.id
    assert reply["settings"]["top_p"] == 0.9 and reply["settings"]["engine_version"]
    assert "reply 1 of 2" in written[".md"].read_text()
    stored.close()


@run_async
async def test_edit_the_last_message_and_recall_earlier_prompts(home, model):
    write_settings(max_new_tokens=4, depth=1)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "first question")
        await wait_reply(pilot, app)
        await send(pilot, app, "second question")
        await wait_reply(pilot, app)
        prompt = app.query_one("#prompt", PromptInput)

        await pilot.press("alt+e")
        assert prompt.text == "second question" and app.editing is not None
        await pilot.press("escape")  # cancelled: the input as it was
        assert prompt.text == "" and app.editing is None

        await pilot.press("alt+e")
        await pilot.press(*" again")
        await pilot.press("enter")
        await pilot.pause()
        await wait_reply(pilot, app)
        assert [m.content for m in app.conversation.messages if m.role == "user"] == [
            "first question", "second question again"]
        assert len(app.conversation.messages) == 4 and len(list(app.query(MessageView))) == 4

        # up in the empty input: the earlier prompts, newest first; down comes back to the empty input
        await pilot.press("up")
        assert prompt.text == "second question again"
        await pilot.press("up")
        assert prompt.text == "first question"
        await pilot.press("down")
        assert prompt.text == "second question again"
        await pilot.press("down")
        assert prompt.text == ""
        await pilot.press(*"typed")
        await pilot.press("up")  # text typed: up is the cursor's again
        assert prompt.text == "typed"
    stored = Store()
    users = [m.content for m in stored.load_conversation(app.conversation.id).messages if m.role == "user"]
    assert users == ["first question", "second question again"]  # the edited one replaced, not added
    stored.close()


@run_async
async def test_conversations_screen_searches_renames_and_deletes(home, model):
    write_settings(max_new_tokens=3, depth=1)
    app = MtpChatApp(model=model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        await send(pilot, app, "recipe for pancakes")
        await wait_reply(pilot, app)
        pancakes = app.conversation.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        await pilot.press("ctrl+o")  # the new chat is empty: not listed
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, ConversationsScreen)
        table = screen.query_one(DataTable)
        assert table.row_count == 1
        footer = {b.binding.description for b in screen.active_bindings.values()}
        assert {"Rename", "Delete", "Search", "Open"} <= footer and screen.query(Footer)

        await pilot.press("slash")
        await pilot.press(*"pancak")  # a word's prefix, in a message
        await pilot.pause()
        assert table.row_count == 1
        await pilot.press("escape")  # clears the search
        screen.query_one("#conversations-search", Input).value = "zucchini"
        await pilot.pause()
        assert table.row_count == 0
        screen.query_one("#conversations-search", Input).value = ""
        await pilot.pause()
        table.focus()

        await pilot.press("r")
        rename = screen.query_one("#conversations-rename", Input)
        assert rename.display and rename.value == "recipe for pancakes"
        rename.value = "Pancakes"
        await pilot.press("enter")
        await pilot.pause()
        assert "Pancakes" in str(table.get_row_at(0)[0])
        await pilot.press("d")
        assert table.row_count == 1  # one d only asks
        await pilot.press("d")
        await pilot.pause()
        assert table.row_count == 0
        await pilot.press("escape")
    stored = Store()
    assert pancakes not in [c.id for c in stored.list_conversations(include_empty=True)]
    stored.close()


@run_async
async def test_two_app_instances_on_one_folder_keep_their_own_conversations(home, model):
    write_settings(max_new_tokens=3, depth=1)
    first = MtpChatApp(model=model)
    async with first.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, first)
        await send(pilot, first, "from the first window")
        await wait_reply(pilot, first)
        second = MtpChatApp(model=model)  # started while the first runs, on the same folder
        async with second.run_test(size=SIZE) as pilot2:
            await wait_loaded(pilot2, second)
            assert second.conversation.id != first.conversation.id and shown(second) == []
            await send(pilot2, second, "from the second window")
            await wait_reply(pilot2, second)
            await pilot2.press("ctrl+o")
            await pilot2.pause()
            table = second.screen.query_one(DataTable)
            assert table.row_count == 2  # both listed, the first's marked and not opened here
            table.move_cursor(row=1)
            await pilot2.press("enter")
            await pilot2.pause()
            assert isinstance(second.screen, ConversationsScreen)
            assert "open in another mtpchat window" in notices(second)
            await pilot2.press("escape")
        await send(pilot, first, "the first again")
        await wait_reply(pilot, first)
    stored = Store()
    conv = stored.load_conversation(first.conversation.id)
    assert [m.content for m in conv.messages if m.role == "user"] == ["from the first window", "the first again"]
    stored.close()


@run_async
async def test_mtpchat_home_being_a_file_is_a_notice_and_the_chat_works(tmp_path, monkeypatch):
    blocker = tmp_path / "home-file"
    blocker.write_text("")
    monkeypatch.setenv("MTPCHAT_HOME", str(blocker))
    app = MtpChatApp(loader=lambda *args: scripted(["Hi", "!"], ["target", "draft"]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert "will not be saved" in notices(app) and str(blocker) in notices(app)
        await send(pilot, app, "hello")
        reply = await wait_reply(pilot, app)
        assert reply.content == "Hi!" and app.store.memory


@run_async
async def test_a_locked_database_never_blocks_the_chat(home):
    app = MtpChatApp(loader=lambda *args: scripted(["Hi", " there"], ["target", "draft"]))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        app.store.flush(5)
        holder = sqlite3.connect(paths.database_path(), isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another program holds the database for a while
        started = time.monotonic()
        await send(pilot, app, "while locked")
        reply = await wait_reply(pilot, app)
        assert reply.content == "Hi there" and time.monotonic() - started < 2.0  # no 5 s wait per write
        await wait_until(pilot, lambda: "Saving the conversation is failing" in notices(app), 5, "the notice")
        assert app.store.pending_writes > 0
        holder.execute("ROLLBACK")
        await wait_until(pilot, lambda: "Saving works again" in notices(app), 5, "saving again")
        conv_id = app.conversation.id
    stored = Store()
    messages = stored.load_conversation(conv_id).messages
    assert [(m.content, m.status) for m in messages] == [("while locked", "complete"), ("Hi there", "complete")]
    stored.close()
