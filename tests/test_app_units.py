"""The app's parts that need no terminal: SQLite store and its migrations, settings, export, themes, highlight
spans, terminal-safe display text."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3

import pytest
from app_support import home  # noqa: F401 (fixture)

from app import paths
from app.export import ExportError, export_conversation, timing_csv
from app.settings import Settings, load_settings, save_settings
from app.store import MIGRATIONS, SCHEMA_VERSION, CycleRow, Store, StoreError, title_for
from app.transcript import DRAFT_STYLE, code_blocks, highlighted, visible
from app.tui import warmup_text
from app.worker import should_warm_up
from engine import Cycle


def make_reply(store: Store) -> tuple[int, int]:
    conv = store.create_conversation("Be brief.")
    store.add_message(conv, "user", "Say hello\nplease")
    reply = store.add_message(conv, "assistant", status="streaming", model="tiny")
    store.append_reply(reply, "Hel", [10, 11], ["target", "draft"], ["He", "l"],
                       [(Cycle(0, 2, 2, 1, [True, False], {"draft": 0.5, "verify": 1.5}, 2), 3.0)])
    store.append_reply(reply, "lo", [12], ["target"], ["lo"],
                       [(Cycle(1, 2, 2, 0, [False, False], {"draft": 0.4, "verify": 1.2, "x": 1}, 1,
                               why="expected tok/s by depth 0: 50, 1: 60, 2: 61"), 5.0)])
    return conv, reply


def test_paths_follow_mtpchat_home(home):
    assert paths.config_dir() == home / "config"
    assert paths.database_path().parent == home / "data"
    assert paths.exports_dir() == home / "data" / "exports"


def test_kernel_caches_go_to_the_cache_folder_unless_the_user_set_them(home, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/triton")
    assert paths.cache_dir() == home / "cache"  # MTPCHAT_HOME is honoured
    paths.use_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/triton"  # the user's setting wins
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(home / "cache" / "kernels" / "inductor")


def test_an_empty_kernel_cache_is_the_first_run(home, monkeypatch):
    for var in paths.KERNEL_CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert paths.kernel_cache_empty()  # no folder yet
    triton = paths.kernels_dir() / "triton"
    triton.mkdir(parents=True)
    assert paths.kernel_cache_empty()  # a folder, nothing compiled into it
    (triton / "a-kernel").mkdir()
    assert not paths.kernel_cache_empty()


def test_warm_up_on_cuda_only_unless_forced():
    assert should_warm_up("cuda:0") and should_warm_up("cuda")
    assert not should_warm_up("cpu") and not should_warm_up("")
    assert should_warm_up("cpu", forced=True) and not should_warm_up("cuda:0", forced=False)


def test_warm_up_status_text():
    assert warmup_text(0, None, "", False) == "preparing kernels…"
    assert warmup_text(3, 9, "depth 1: first prompt", False) == "preparing kernels 3/9 · depth 1: first prompt"
    assert warmup_text(3, 9, "depth 1: first prompt", True).endswith(
        "(first run on this machine: compiling kernels once)")


def test_store_saves_every_chunk_and_reopens(home):
    store = Store()
    conv, reply = make_reply(store)
    store.set_draft(conv, "half-typed")
    store.close()  # as if killed mid-reply: the row is still 'streaming'

    store = Store()
    loaded = store.load_conversation(conv)
    assert loaded.title == "Say hello please" and loaded.system_prompt == "Be brief."
    assert loaded.draft == "half-typed"
    user, assistant = loaded.messages
    assert user.content == "Say hello\nplease"
    assert assistant.content == "Hello" and assistant.status == "interrupted"
    assert assistant.token_ids == [10, 11, 12]
    assert assistant.sources == ["target", "draft", "target"]
    assert assistant.pieces == ["He", "l", "lo"]
    rows = store.cycles(conv)
    assert rows[0] == CycleRow(reply, 0, 2, 2, 1, [True, False], 2, {"draft": 0.5, "verify": 1.5}, 3.0)
    assert [r.index for r in rows] == [0, 1] and rows[1].t_ms == 5.0
    assert rows[1].why == "expected tok/s by depth 0: 50, 1: 60, 2: 61"  # the timing log keeps auto's reason
    assert store.latest_conversation_id() == conv
    store.finish_message(reply, "complete", finish_reason="eos", stats={"depth": 2})
    assert store.load_conversation(conv).messages[1].stats == {"depth": 2}
    store.delete_conversation(conv)
    assert store.list_conversations() == [] and store.cycles(conv) == []


def test_store_migrates_v1_database(tmp_path):
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0] + "\nPRAGMA user_version = 1;")
    conn.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (7, 'old', 1, 1)")
    conn.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (7, 'user', 'hi', 1)")
    conn.commit()
    conn.close()

    store = Store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conv = store.load_conversation(7)
    assert [m.content for m in conv.messages] == ["hi"]
    reply = store.add_message(7, "assistant")
    store.append_reply(reply, "yo", [1], ["draft"], ["yo"])
    assert store.load_conversation(7).messages[1].sources == ["draft"]


def test_store_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "new.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_settings_roundtrip_and_bad_values(home):
    assert load_settings() == Settings()  # no file yet
    save_settings(Settings(theme="mtp-paper", depth=3, seed=5, keymap={"export": "ctrl+e"}))
    again = load_settings()
    assert (again.theme, again.depth, again.seed, again.keymap) == ("mtp-paper", 3, 5, {"export": "ctrl+e"})

    paths.settings_path().write_text(json.dumps({"depth": "deep", "top_p": 7, "temperature": 0.5, "extra": 1}))
    bad = load_settings()
    assert bad.depth == Settings().depth and bad.top_p == 1.0 and bad.temperature == 0.5
    assert len(bad.warnings) == 2

    paths.settings_path().write_text("{not json")
    assert "not valid JSON" in load_settings().warnings[0]


def test_export_writes_all_formats(home, tmp_path):
    store = Store()
    conv, reply = make_reply(store)
    store.finish_message(reply, "complete", finish_reason="eos",
                         stats={"tokens_per_s": 12.5, "depth": 2, "acceptance_rate": 0.25, "mean_accepted_length": 1.5})
    written = export_conversation(store, conv, tmp_path / "out", ["md", "json", "csv", "jsonl"])
    by_ext = {p.name.split(".", 1)[1]: p for p in written}
    assert set(by_ext) == {"md", "json", "csv", "jsonl"}

    md = by_ext["md"].read_text()
    assert "## User" in md and "Say hello" in md and "## Assistant (tiny)" in md and "Hello" in md
    assert "12.5 tok/s" in md and "## System" in md

    data = json.loads(by_ext["json"].read_text())
    tokens = data["messages"][1]["tokens"]
    assert [(t["id"], t["text"], t["source"]) for t in tokens] == [
        (10, "He", "target"), (11, "l", "draft"), (12, "lo", "target")]

    rows = list(csv.DictReader(io.StringIO(by_ext["csv"].read_text())))
    assert [r["cycle"] for r in rows] == ["0", "1"]
    assert rows[0]["accepted_per_position"] == "AR" and float(rows[0]["verify_ms"]) == 1.5
    assert rows[0]["x_ms"] == "" and rows[1]["x_ms"] == "1.0000"  # extra phases get their own column
    assert [r["why"] for r in rows] == ["", "expected tok/s by depth 0: 50, 1: 60, 2: 61"]

    lines = [json.loads(line) for line in by_ext["jsonl"].read_text().splitlines()]
    assert lines[1]["phase_ms"]["verify"] == 1.2 and lines[0]["accepted_per_position"] == [True, False]


def test_export_to_an_unwritable_path_is_an_error(home, tmp_path):
    store = Store()
    conv, _ = make_reply(store)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ExportError, match="cannot write"):
        export_conversation(store, conv, blocker / "sub", ["md"])
    with pytest.raises(ExportError):
        export_conversation(store, conv, tmp_path, [])
    assert timing_csv([]).startswith("message_id,cycle,depth")


def test_themes_load_and_fill_missing_variables():
    from textual.theme import BUILTIN_THEMES

    import themes

    loaded = {t.name: t for t in themes.load_themes()}
    assert {"mtp-dusk", "mtp-paper"} <= set(loaded)
    for theme in loaded.values():
        assert {"draft-token", "draft-token-text"} <= set(theme.variables)
    defaults = themes.variable_defaults(BUILTIN_THEMES["nord"])
    assert defaults["draft-token"].startswith("#") and set(defaults) >= {"draft-token", "target-token-text"}


def test_highlight_spans_cover_draft_runs():
    content = highlighted(["A", "b", "c", "\x06", "d"], ["target", "draft", "draft", "target", "draft"])
    assert content.plain == "Abc␆d"  # control characters made visible, one for one
    assert [(s.start, s.end, s.style) for s in content.spans] == [(1, 3, DRAFT_STYLE), (4, 5, DRAFT_STYLE)]
    assert visible("a\tb\nc\x1b") == "a\tb\nc␛"
    # C1 controls are dropped piece by piece: the spans stay on the text shown
    content = highlighted(["A", "\x85b", "c\x9b"], ["target", "draft", "target"])
    assert content.plain == "Abc" and [(s.start, s.end) for s in content.spans] == [(1, 2)]
    assert code_blocks("x\n```py\nprint(1)\n```\n\n    indented\n") == ["print(1)\n", "indented\n"]


def test_titles_are_terminal_safe_and_messages_stored_as_written(home):
    evil = "\x1b]0;pwned\x07\x1b]52;c;aGk=\x07"
    assert title_for(f"Hi {evil}there\x9d0;x\x9c") == "Hi there"
    store = Store()
    conv = store.create_conversation()
    store.add_message(conv, "user", f"Hi {evil}there")
    assert store.load_conversation(conv).title == "Hi there"
    assert store.load_conversation(conv).messages[0].content == f"Hi {evil}there"


def test_timing_grid_aligns_columns():
    from app.panes import grid, human_count

    content = grid([["verify", "12.50", "3%"], ["commit", "0.20", "45%"]], right={1, 2})
    assert content.plain.splitlines() == ["verify 12.50  3%", "commit  0.20 45%"]
    assert (human_count(270504), human_count(80e9), human_count(None)) == ("270.5K", "80.0B", "—")


def test_copy_goes_to_the_first_clipboard_tool_that_takes_it(tmp_path, monkeypatch):
    """A real child process per tool, fed on stdin (here small scripts stand in for wl-copy / xclip: neither runs
    without a display); none present or none working: None, and the app says the text went to OSC 52 only."""
    from app.clipboard import copy_with_tool

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    monkeypatch.setenv("DISPLAY", ":0")
    assert copy_with_tool("nothing here") is None
    wl = bin_dir / "wl-copy"
    wl.write_text("#!/bin/sh\nexit 1\n")  # present but failing (no compositor): the next tool is tried
    xclip = bin_dir / "xclip"
    xclip.write_text(f"#!/bin/sh\n[ \"$1 $2\" = '-selection clipboard' ] && /bin/cat > '{tmp_path}/xclip.out'\n")
    for tool in (wl, xclip):
        tool.chmod(0o755)
    assert copy_with_tool("héllo\nworld") == "xclip"
    assert (tmp_path / "xclip.out").read_text() == "héllo\nworld"
    monkeypatch.delenv("DISPLAY")  # over ssh: no X display, so no X tool
    assert copy_with_tool("x") is None


def test_the_demo_model_has_one_name_and_one_parameter_count():
    """The status line (the engine's info), the picker and `models` (discovery) and the README say the same."""
    from pathlib import Path

    from app.panes import human_count
    from engine import EMBEDDED_DIR, discover, load_engine

    found = discover([], include_hf_cache=False, include_embedded=True, include_env=False)
    demo = next(c for c in found if c.source == "embedded")
    info = load_engine(str(EMBEDDED_DIR)).info
    assert info.name == demo.name == "mtpchat-demo"
    assert info.params == demo.params
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"a {human_count(demo.params)}-parameter" in readme, human_count(demo.params)


def test_the_diagnostics_say_whose_threads_they_count():
    from app.panes import threads_text

    assert threads_text(1, 2) == "1 of 2 CPUs (one left to the UI)"
    assert threads_text(4, 4) == "4 of 4 CPUs" and threads_text(3, None) == "3"


def test_a_reply_s_footer_names_a_draft_model_that_drafted():
    from app.stats import stats_line

    base = {"tokens_per_s": 52.1, "depth": 2, "drafted": 10, "acceptance_rate": 0.7, "mean_accepted_length": 2.4}
    assert stats_line({**base, "drafter": "mtp"}) == "52.1 tok/s · depth 2 · 70% accepted · 2.40 tok/cycle"
    assert "· draft:small ·" in stats_line({**base, "drafter": "draft:small"})
    assert "\x1b" not in stats_line({**base, "drafter": "draft:evil\x1b]0;x\x07"})  # a folder name is untrusted
    assert "draft:" not in stats_line({**base, "drafted": 0, "drafter": "draft:small"})  # (it drafted nothing)
