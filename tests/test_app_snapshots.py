"""Snapshot tests (pytest-textual-snapshot) of the main screen, the timing and diagnostics panes and the model
picker, with the real engine on the tiny fixture checkpoint. Volatile values (timings, versions, paths, thread
counts) are blanked before the picture is taken; counts of a greedy reply are deterministic and stay.

Update after an intended change: pytest tests/test_app_snapshots.py --snapshot-update (and look at the SVGs)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
from app_support import home  # noqa: F401 (a fixture)
from app_support import send, wait_loaded, wait_reply, write_settings

from app.panes import DiagnosticsPane, TimingPane
from app.screens import ModelPickerScreen
from app.stats import ReplyStats
from app.transcript import PromptInput
from app.tui import MtpChatApp

SIZE = (120, 36)


@pytest.fixture
def model(ckpt) -> str:
    return str(ckpt("next"))


async def settle(pilot, app) -> None:
    await wait_loaded(pilot, app)
    app.ui("#prompt", PromptInput).cursor_blink = False
    await pilot.pause()


def redacted(diagnostics: dict) -> dict:
    """Diagnostics without what differs between machines and runs, and without the engine's wording of its
    reasons (it changes as the engine does; the pane's layout of them is what this snapshot checks)."""

    def scrub(value, key=""):
        if key in ("reason", "path", "name", "threads") and isinstance(value, (str, int)):
            return "…"
        if isinstance(value, dict):
            return {k: scrub(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    return scrub({k: v for k, v in diagnostics.items() if k != "versions"})


def timeless(stats: ReplyStats) -> ReplyStats:
    """The reply's counts and acceptance (deterministic under greedy decoding) without its times."""
    final = {k: v for k, v in (stats.final or {}).items() if k not in ("tokens_per_s", "ttft_ms", "total_s")}
    final["phase_ms"] = {phase: 0.0 for phase in stats.phase_ms}
    last = stats.last_cycle
    if last is not None:
        last.phase_ms = {phase: 0.0 for phase in last.phase_ms}
    return ReplyStats(
        depth=stats.depth, tokens=stats.tokens, cycles=stats.cycles, drafted=stats.drafted,
        accepted=stats.accepted, last_cycle=last, acceptance_series=stats.acceptance_series, final=final,
    )


def test_main_screen(home, model, snap_compare):
    write_settings()
    app = MtpChatApp(model=model)

    async def run_before(pilot):
        await settle(pilot, app)
        app.ui("#prompt", PromptInput).load_text("What is a Gated DeltaNet?")
        app.ui("#diagnostics-pane", DiagnosticsPane).display = False  # holds machine details; own snapshot

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_timing_pane_after_a_reply(home, model, snap_compare):
    write_settings(max_new_tokens=16, depth=2)
    app = MtpChatApp(model=model)

    async def run_before(pilot):
        await settle(pilot, app)
        await send(pilot, app, "Hello, how are you today?")
        await wait_reply(pilot, app)
        await pilot.press("ctrl+n")  # an empty transcript: the reply's footer holds its tokens/s
        app.ui("#timing-pane", TimingPane).show(timeless(app.last_stats), app.depth)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_diagnostics_pane(home, model, snap_compare, monkeypatch):
    monkeypatch.setenv("MTPCHAT_CPU_LINEAR", "mkl")  # (else the backend shown is what this CPU's timing chose)
    write_settings()
    app = MtpChatApp(model=model)

    async def run_before(pilot):
        await settle(pilot, app)
        await pilot.press("f4")
        engine = app.worker.engine
        info = dataclasses.replace(engine.info, path="…")
        app.ui("#diagnostics-pane", DiagnosticsPane).show(info, redacted(engine.diagnostics()))
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_model_picker(home, model, snap_compare):
    from engine.discovery import discover

    write_settings()
    app = MtpChatApp(model=model)
    only_the_fixture = partial(discover, [model], include_hf_cache=False, include_embedded=False, include_env=False)

    async def run_before(pilot):
        await settle(pilot, app)
        screen = ModelPickerScreen("tiny", discover=only_the_fixture)
        await app.push_screen(screen)
        await pilot.pause()
        await pilot.wait_for_scheduled_animations()
        while screen.query_one("#models-status").visual.plain == "searching…":
            await pilot.pause(0.05)
        # (the header once kept the empty table's widths: screens.fill_table gives the columns their widths)
        await pilot.pause(0.1)
        await pilot.wait_for_scheduled_animations()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
