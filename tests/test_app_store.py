"""The conversation store against real SQLite: two instances on one folder, start-up on a bad folder or file, a
locked database and a full one (the writer thread), search, rename, delete, alternatives, file modes, exports."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import sqlite3
import stat
import tempfile
import time
from pathlib import Path
import pytest
from app_support import home  # noqa: F401 (fixture)

from app import paths
from app.export import export_conversation, reply_settings, settings_line
from app.settings import Settings, save_settings
from app.store import MIGRATIONS, SCHEMA_VERSION, Store, StoreError
from engine import Cycle

def reply(store: Store, conv: int, text: str = "Hello there", user: str = "Say hello") -> int:
    store.add_message(conv, "user", user)
    message = store.add_message(conv, "assistant", status="streaming", model="tiny")
    store.append_reply(message, text, [1, 2], ["target", "draft"], [text[:3], text[3:]],
                       [(Cycle(0, 2, 2, 1, [True, False], {"verify": 1.0}, 2), 3.0)])
    store.finish_message(message, "complete", finish_reason="eos", stats={"depth": 2})
    return message


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# two instances on one folder -------------------------------------------------------------------------------
def test_two_instances_on_one_folder_each_own_their_conversation(home):
    first = Store()
    a = first.startup_conversation()
    reply(first, a, user="from the first window")
    second = Store()  # a second mtpchat on the same data folder
    b = second.startup_conversation()
    assert b != a  # not the first one's latest conversation: one of its own
    reply(second, b, user="from the second window")
    reply(first, a, text="more", user="the first again")

    first.flush(5), second.flush(5)
    for store in (first, second):  # each lists both
        assert {c.id for c in store.list_conversations()} == {a, b}
    assert [c.open_elsewhere for c in second.list_conversations() if c.id == a] == [True]
    assert [c.open_elsewhere for c in first.list_conversations() if c.id == a] == [False]
    assert not second.claim(a)  # owned by the first: not opened there
    with pytest.raises(StoreError, match="another mtpchat window"):
        second.delete_conversation(a)
    # no interleaving: each conversation holds its own instance's turns only
    assert [m.content for m in second.load_conversation(a).messages if m.role == "user"] == [
        "from the first window", "the first again"]
    assert [m.content for m in first.load_conversation(b).messages if m.role == "user"] == ["from the second window"]

    first.close()  # the first quits: its conversation is free again
    assert not second.open_elsewhere(a) and second.claim(a)
    third = Store()
    assert third.startup_conversation() not in (a, b)  # both are the second's now
    third.close()
    second.close()


def test_a_streaming_reply_of_another_instance_is_not_marked_interrupted(home):
    first = Store()
    conv = first.startup_conversation()
    first.add_message(conv, "user", "hi")
    streaming = first.add_message(conv, "assistant", status="streaming")
    first.flush(5)
    second = Store()  # starts while the first is generating
    second.flush(5)
    assert second.load_conversation(conv).messages[1].status == "streaming"
    first.append_reply(streaming, "done", [1], ["target"], ["done"])
    first.finish_message(streaming, "complete")
    first.close()
    assert second.load_conversation(conv).messages[1].status == "complete"
    second.close()


# start-up on a bad folder / file ---------------------------------------------------------------------------
def test_mtpchat_home_being_a_file_is_a_store_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("MTPCHAT_HOME", str(blocker))
    with pytest.raises(StoreError, match="cannot open the conversation database"):
        Store()
    memory = Store(":memory:")  # what the app falls back to
    conv = memory.startup_conversation()
    reply(memory, conv)
    assert [m.role for m in memory.load_conversation(conv).messages] == ["user", "assistant"]
    memory.close()


def test_a_read_only_database_is_a_store_error(tmp_path_factory):
    """As an ordinary user (root writes anything): a database file and folder it may read, not write."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the check as another user")
    folder = Path(tempfile.mkdtemp(prefix="mtpchat-ro-"))  # (pytest's folders are root's alone)
    os.chmod(folder, 0o755)
    store = Store(folder / "c.sqlite3")
    reply(store, store.startup_conversation())
    store.close()
    os.chmod(folder / "c.sqlite3", 0o644)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child drops to nobody and opens the store as the app would
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                Store(folder / "c.sqlite3")
                said = "opened"
            except StoreError as exc:
                said = f"StoreError: {exc}"
        except BaseException as exc:  # anything else is the bug this test is for
            said = f"{type(exc).__name__}: {exc}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    said = os.read(read, 4096).decode()
    shutil.rmtree(folder)
    assert said.startswith("StoreError:") and "read-only" in said, said


def test_a_database_locked_at_start_past_the_timeout_is_a_store_error(tmp_path):
    path = tmp_path / "c.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)  # a new database, locked before its first open
    holder.execute("BEGIN EXCLUSIVE")
    started = time.monotonic()
    with pytest.raises(StoreError, match="locked"):
        Store(path)  # the default 5 s wait
    assert 4.5 < time.monotonic() - started < 10
    holder.execute("ROLLBACK")
    Store(path).close()  # free again: opens


# the writer thread: a locked database never blocks the caller ------------------------------------------------
def test_writes_under_a_lock_return_at_once_and_land_after_it(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = Store(path)
    conv = store.startup_conversation()
    store.flush(5)
    statuses = []
    store.on_write_status = statuses.append
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program holds the database
    started = time.monotonic()
    store.add_message(conv, "user", "while locked")
    message = store.add_message(conv, "assistant", status="streaming")
    for i in range(20):
        store.append_reply(message, f"w{i} ", [i], ["target"], [f"w{i} "])
    store.finish_message(message, "complete", finish_reason="eos")
    store.set_draft(conv, "typing")
    assert time.monotonic() - started < 0.2  # the caller (the UI thread) never waited for the lock
    assert not store.flush(1.5) and store.pending_writes > 0
    assert statuses and "locked" in statuses[0]  # said after a second of failing
    holder.execute("ROLLBACK")
    assert store.flush(5)
    assert statuses[-1] is None  # and said again when it works
    loaded = store.load_conversation(conv)
    assert loaded.messages[1].content == "".join(f"w{i} " for i in range(20))
    assert loaded.messages[1].status == "complete" and loaded.draft == "typing"
    store.close()


def test_a_full_disk_never_saves_a_short_reply_as_complete(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = Store(path)
    conv = store.startup_conversation()
    store.add_message(conv, "user", "hi")
    message = store.add_message(conv, "assistant", status="streaming")
    store.append_reply(message, "saved ", [1], ["target"], ["saved "])
    assert store.flush(5)
    pages = store.writer.conn.execute("PRAGMA page_count").fetchone()[0]
    store.writer.conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here on
    big = "x" * 200_000
    store.append_reply(message, big, [2], ["target"], [big])
    store.finish_message(message, "complete", finish_reason="eos")
    assert not store.flush(1.0) and "full" in (store.write_error or "")
    assert not store.close(timeout=0.5)  # quitting while it is still full: the rest is lost, said so
    reopened = Store(path)
    saved = reopened.load_conversation(conv).messages[1]
    assert saved.content == "saved " and saved.status == "interrupted"  # shorter, and not 'complete'
    reopened.close()


def test_a_dropped_chunk_makes_the_reply_incomplete(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = Store(path)
    conv = store.startup_conversation()
    store.add_message(conv, "user", "hi")
    message = store.add_message(conv, "assistant", status="streaming")
    store.flush(5)
    other = sqlite3.connect(path, isolation_level=None)  # a chunk SQLite refuses for good
    other.execute("""CREATE TRIGGER refuse BEFORE UPDATE OF content ON messages WHEN NEW.content LIKE '%boom%'
                     BEGIN SELECT RAISE(ABORT, 'refused'); END""")
    store.append_reply(message, "fine ", [1], ["target"], ["fine "])
    store.append_reply(message, "boom", [2], ["target"], ["boom"])
    store.append_reply(message, "", [], [], [])
    store.finish_message(message, "complete", finish_reason="eos")
    assert store.flush(5)
    saved = store.load_conversation(conv).messages[1]
    assert saved.content == "fine " and saved.status == "incomplete"
    store.close()



def test_a_reply_holding_a_nul_character_is_saved_complete(tmp_path):
    # SQLite's length() stops at a NUL: a random-weights model's text held one, and its whole reply was saved
    # 'incomplete' (the check compared a short count with what was shown)
    store = Store(tmp_path / "c.sqlite3")
    conv = store.startup_conversation()
    message = store.add_message(conv, "assistant", status="streaming")
    store.append_reply(message, "a\x00b", [1, 2, 3], ["target"] * 3, ["a", "\x00", "b"])
    store.finish_message(message, "stopped", finish_reason="stop")
    assert store.flush(5)
    saved = store.load_conversation(conv).messages[0]
    assert saved.content == "a\x00b" and saved.status == "stopped"
    store.close()

# history: search, rename, delete, empty chats -------------------------------------------------------------
@pytest.mark.parametrize("fts", [True, False], ids=["fts5", "like"])
def test_search_rename_delete_and_empty_chats(home, fts):
    store = Store()
    store.fts = store.fts and fts
    pasta = store.startup_conversation()
    reply(store, pasta, text="Boil the spaghetti for nine minutes", user="How long do I cook pasta?")
    moon = store.create_conversation()
    reply(store, moon, text="About 384,400 km", user="How far is the moon?")
    empty = store.create_conversation()
    store.flush(5)
    assert [c.id for c in store.list_conversations()] == [moon, pasta]  # newest first, the empty one left out
    assert empty in [c.id for c in store.list_conversations(include_empty=True)]

    found = store.search("spaghet")  # a prefix of a word of a reply
    assert [c.id for c in found] == [pasta] and "spaghetti" in found[0].snippet
    assert [c.id for c in store.search("how far")] == [moon]
    assert {c.id for c in store.search("how")} == {moon, pasta}
    assert store.search('moon" OR "pasta') == [] and store.search("NEAR(") == []  # typed text, not syntax
    assert store.search("   ") == store.list_conversations()

    assert store.rename_conversation(moon, "  Lunar\n\x1b[31mdistance ") == "Lunar distance"
    assert [c.id for c in store.search("lunar")] == [moon]  # titles are searched too
    store.delete_conversation(pasta)
    assert [c.id for c in store.list_conversations()] == [moon] and store.search("spaghetti") == []
    store.close()
    again = Store()  # an empty chat nobody has open is gone at the next start
    again.flush(5)
    assert empty not in [c.id for c in again.list_conversations(include_empty=True)]
    again.close()


# alternatives ---------------------------------------------------------------------------------------------
def test_alternatives_persist_and_export(home, tmp_path):
    store = Store()
    conv = store.startup_conversation()
    first = reply(store, conv, text="First answer")
    store.hide_message(first)  # retried: the first answer kept, not shown
    settings = reply_settings("tiny", {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3, "depth": 2})
    second = store.add_message(conv, "assistant", status="streaming", model="tiny", settings=settings)
    store.append_reply(second, "Second answer", [5], ["draft"], ["Second answer"])
    store.finish_message(second, "complete", finish_reason="length")
    loaded = store.load_conversation(conv)
    assert [m.content for m in loaded.messages] == ["Say hello", "Second answer"]
    assert [m.id for m in loaded.alternatives(loaded.messages[1])] == [first, second]
    assert loaded.messages[1].settings == settings and settings["engine_version"]

    store.show_alternative(first, [first, second])  # navigated back to the first
    loaded = store.load_conversation(conv)
    assert [m.content for m in loaded.messages] == ["Say hello", "First answer"]

    written = {p.suffix: p for p in export_conversation(store, conv, tmp_path / "out", ["md", "json", "csv"])}
    md = written[".md"].read_text()
    assert "reply 1 of 2" in md and "Alternative reply 2 of 2" in md and "Second answer" in md
    assert settings_line(settings) in md and "temperature 0.7 · top-p 0.9 · top-k 20 · seed 3 · depth 2" in md
    data = json.loads(written[".json"].read_text())
    shown = data["messages"][1]
    assert shown["content"] == "First answer" and shown["alternative"] == {"index": 0, "of": 2}
    assert [(a["content"], a["index"], a["settings"]["top_k"]) for a in shown["alternatives"]] == [
        ("Second answer", 1, 20)]
    assert data["exported_by"]["mtpchat"] == settings["engine_version"]
    rows = list(csv.DictReader(io.StringIO(written[".csv"].read_text())))
    assert rows[0]["accepted_per_position"] == "AR"  # letters: a spreadsheet keeps them as text
    for path in written.values():
        assert mode(path) == 0o600
    assert mode(tmp_path / "out") == 0o700
    store.close()


def database_at(path, version: int) -> sqlite3.Connection:
    """A database as an mtpchat of schema `version` left it (empty)."""
    conn = sqlite3.connect(path)
    for target, script in enumerate(MIGRATIONS[:version], 1):
        conn.executescript(script + f"\nPRAGMA user_version = {target};")
    return conn


def test_a_v3_database_migrates_to_alternatives(tmp_path):
    path = tmp_path / "v3.sqlite3"
    conn = database_at(path, 3)
    conn.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (3, 'old', 1, 1)")
    conn.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (3, 'user', 'q', 1)")
    conn.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (3, 'assistant', 'a', 1)")
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    conv = store.load_conversation(3)
    assert [m.content for m in conv.messages] == ["q", "a"] and not conv.messages[1].hidden
    assert [c.id for c in store.search("q")] == [3]  # the full-text index is built from the old messages
    store.close()


def test_a_v4_timing_log_migrates_and_its_old_cycles_have_no_reason(tmp_path):
    path = tmp_path / "v4.sqlite3"
    conn = database_at(path, 4)
    conn.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (4, 'old', 1, 1)")
    conn.execute("INSERT INTO messages (id, conversation_id, role, content, created_at) "
                 "VALUES (9, 4, 'assistant', 'a', 1)")
    conn.execute("INSERT INTO cycles (message_id, idx, depth, drafted, accepted, accepted_mask, committed, phase_ms, "
                 "t_ms) VALUES (9, 0, 2, 2, 1, '10', 2, '{}', 1.0)")
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    (row,) = store.cycles(4)
    assert row.depth == 2 and row.accepted_per_position == [True, False] and row.why == ""
    store.close()


# file modes -----------------------------------------------------------------------------------------------
def test_the_database_and_its_folders_are_private(home):
    store = Store()
    reply(store, store.startup_conversation())
    store.flush(5)
    db = paths.database_path()
    assert mode(db) == 0o600 and mode(db.parent) == 0o700 and mode(home) == 0o700
    assert all(mode(p) == 0o600 for p in db.parent.glob("conversations.sqlite3*"))  # -wal, -shm too
    store.close()
    log = paths.private_file(paths.log_path())
    assert mode(log) == 0o600
    save_settings(Settings())
    assert mode(paths.config_dir()) == 0o700 and mode(paths.settings_path()) == 0o600


def test_a_reply_whose_alternatives_are_all_hidden_still_shows_one(home):
    store = Store()  # the app died between hiding the retried reply and saving the new one
    conv = store.startup_conversation()
    hidden = reply(store, conv, text="kept")
    store.hide_message(hidden)
    assert [m.content for m in store.load_conversation(conv).messages] == ["Say hello", "kept"]
    store.close()
