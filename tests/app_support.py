"""Helpers shared by the app tests (tests/test_app_*.py)."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from app.settings import Settings, save_settings


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh MTPCHAT_HOME (settings, conversations, exports), and torch threads as the TUI sets them
    (one core left to the UI thread), restored afterwards."""
    import torch

    from app.tui import reserve_ui_core

    monkeypatch.setenv("MTPCHAT_HOME", str(tmp_path / "home"))
    threads = torch.get_num_threads()
    reserve_ui_core()
    yield tmp_path / "home"
    torch.set_num_threads(threads)


def run_async(test):
    """Run an async test function with asyncio (no pytest async plugin needed)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


async def wait_until(pilot, predicate, timeout: float = 15.0, what: str = "condition") -> None:
    """Let the app run until predicate() is true (the engine works on its own thread meanwhile)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def wait_loaded(pilot, app, timeout: float = 20.0) -> None:
    await wait_until(pilot, lambda: app.engine_state != "loading", timeout, "the model to load")


async def send(pilot, app, text: str) -> None:
    prompt = app.query_one("#prompt")
    prompt.focus()
    prompt.load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def wait_reply(pilot, app, timeout: float = 20.0):
    await wait_until(pilot, lambda: app.request is None, timeout, "the reply to finish")
    return app.conversation.messages[-1]


def write_settings(**values) -> Settings:
    settings = Settings(**values)
    save_settings(settings)
    return settings
