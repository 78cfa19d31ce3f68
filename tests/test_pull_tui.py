"""The model picker's Download tab (F5 → Download) under the Textual pilot, against the local stand-in Hub
(tests/hub_server.py) with the real huggingface_hub client in the download's child process: HF_ENDPOINT points
at the server, HF_HOME is a temporary folder.

What must hold: the tab lists the catalogue with what this machine fits and what the engine refuses; a
repository id downloads with a bar per file and ends switched to the new model; a cancelled download leaves no
model behind and the chat usable; an unreachable hub is one line.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from app_support import home  # noqa: F401 (a fixture)
from app_support import run_async, send, wait_loaded, wait_reply, wait_until
from hub_server import HubServer, Repo
from textual.widgets import DataTable, Input, Label, ProgressBar, TabbedContent

from app.screens import ModelPickerScreen
from app.tui import MtpChatApp

SIZE = (110, 40)
DEMO = Path(__file__).resolve().parents[1] / "engine" / "assets" / "demo"
SHA = Repo.__dataclass_fields__["sha"].default


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture
def hf_env(tmp_path, hub, monkeypatch):
    """The download child's environment: this server, a fresh cache, short timeouts; the user's own offline
    setting is none (the test session turns HF_HUB_OFFLINE on for everything else)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "5")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "MTPCHAT_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("app.cmd_pull.USER_HF_OFFLINE", None)
    return tmp_path / "hf"


def snapshot(hf_home: Path, repo: str = "org/model") -> Path:
    return hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / SHA


async def open_download_tab(pilot, app) -> ModelPickerScreen:
    await pilot.press("f5")
    await pilot.pause()
    picker = app.screen
    assert isinstance(picker, ModelPickerScreen)
    await pilot.click("#models-tabs Tab#--content-tab-tab-download")
    await pilot.pause()
    assert picker.query_one("#models-tabs", TabbedContent).active == "tab-download"
    assert picker.focused is picker.query_one("#catalogue-table")  # the keys work in the tab at once
    return picker


async def ask(pilot, picker, ref: str) -> None:
    field = picker.query_one("#download-ref", Input)
    field.focus()
    field.value = ref
    await pilot.press("enter")
    await pilot.pause()


def status(picker) -> str:
    return picker.query_one("#download-status", Label).visual.plain


@run_async
async def test_the_tab_lists_the_catalogue_and_a_download_switches_to_the_model(home, hub, hf_env, ckpt):
    from engine import catalogue

    hub.repos["org/model"] = Repo.from_folder(ckpt("next"))
    app = MtpChatApp(model=str(DEMO))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        assert "f5 → Download" in app.chat_screen.query_one("#empty-hint").visual.plain  # the demo points there
        picker = await open_download_tab(pilot, app)
        table = picker.query_one("#catalogue-table", DataTable)
        await wait_until(pilot, lambda: table.row_count == len(catalogue.entries()), 10, "the catalogue")
        rows = {str(table.get_row_at(i)[0]): [str(c) for c in table.get_row_at(i)] for i in range(table.row_count)}
        assert rows["qwen3.5-0.8b"][3] == "yes" and rows["qwen3.5-0.8b"][2] in ("yes", "no")
        assert "not yet" not in rows["qwen3.5-27b-fp8"][5]  # FP8 releases are pulled and run like bf16 ones

        seen_bars: set[str] = set()
        await ask(pilot, picker, "org/model")

        def progressed() -> bool:
            seen_bars.update(n for n, (bar, _) in picker._bars.items() if bar.total)
            return app.download.state != "checking" and not isinstance(app.screen, ModelPickerScreen)

        await wait_until(pilot, progressed, 20, "the download")
        job = app.download
        assert job.state == "done", (job.state, job.error)
        assert "model.safetensors" in seen_bars  # a bar per file, with the hub's total
        assert all(p.done == p.total for p in job.files.values()), job.files
        assert set(job.files) == {f.name for f in snapshot(hf_env).iterdir()}
        await wait_until(pilot, lambda: app.engine_state == "ready" and app.model_path == str(snapshot(hf_env)),
                         20, "the switch to the download")
        assert "f5 → Download" not in app.chat_screen.query_one("#empty-hint").visual.plain


@run_async
async def test_a_cancelled_download_leaves_no_model_and_the_chat_usable(home, hub, hf_env, ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "big"  # weights over the 1 MiB the server sends before holding the rest
    src.mkdir()
    for f in ckpt("next").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.padding"] = torch.zeros(1 << 20)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    repo = Repo.from_folder(src)
    repo.hold.add("model.safetensors")
    hub.repos["org/model"] = repo
    app = MtpChatApp(model=str(DEMO))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        picker = await open_download_tab(pilot, app)
        await ask(pilot, picker, "org/model")
        held = lambda: any(r.range is None for r in hub.file_requests("model.safetensors"))  # noqa: E731
        await wait_until(pilot, held, 20, "the weights in flight")
        await pilot.pause(0.3)
        assert app.download.state == "downloading"
        assert any(p.done == p.total for p in app.download.files.values())  # the small files came first
        await pilot.press("f8")
        await wait_until(pilot, lambda: app.download.state == "cancelled", 10, "the cancel")
        await pilot.pause(0.3)
        assert "cancelled org/model" in status(picker)
        assert not snapshot(hf_env).exists()  # nothing half-downloaded is listed

        from engine import discover

        assert "org/model" not in {c.name for c in discover(include_embedded=False, include_env=False)}
        await pilot.press("escape")
        await send(pilot, app, "Hello")
        assert (await wait_reply(pilot, app)).status == "complete"  # the chat goes on


@run_async
async def test_an_unreachable_hub_is_one_line(home, hf_env, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    app = MtpChatApp(model=str(DEMO))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        picker = await open_download_tab(pilot, app)
        await ask(pilot, picker, "org/model")
        await wait_until(pilot, lambda: not app.download.running, 20, "the failure")
        await pilot.pause(0.3)
        line = status(picker)
        assert app.download.state == "failed"
        assert line.startswith("download failed: cannot reach http://127.0.0.1:") and "\n" not in line, line
        assert "Traceback" not in (app.download.error or "")
        assert not any(isinstance(w, ProgressBar) for w in picker.query(ProgressBar))


@run_async
async def test_a_finding_is_accepted_by_asking_again(home, hub, hf_env, ckpt):
    """No MTP head: `pull` wants --yes; the tab says so in one line and the same request again downloads it."""
    hub.repos["org/model"] = Repo.from_folder(ckpt("next_nomtp"))
    app = MtpChatApp(model=str(DEMO))
    async with app.run_test(size=SIZE) as pilot:
        await wait_loaded(pilot, app)
        picker = await open_download_tab(pilot, app)
        await ask(pilot, picker, "org/model")
        await wait_until(pilot, lambda: not app.download.running, 20, "the check")
        await pilot.pause(0.3)
        assert app.download.needs_yes and "no mtp.* tensors" in status(picker), status(picker)
        assert status(picker).endswith("enter again downloads it anyway")
        assert not hub.full_downloads() - {"config.json"}
        await ask(pilot, picker, "org/model")
        await wait_until(pilot, lambda: not isinstance(app.screen, ModelPickerScreen), 20, "the download")
        assert app.download.state == "done" and app.download.yes
        await wait_until(pilot, lambda: app.engine_state == "ready" and app.model_path == str(snapshot(hf_env)),
                         20, "the switch to the download")
