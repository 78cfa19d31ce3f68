"""Helpers shared by the app tests (tests/test_app_*.py)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from app.settings import Settings, save_settings


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh MTPCHAT_HOME (settings, conversations, exports), and torch threads as the TUI sets them
    (one core left to the UI thread), restored afterwards."""
    import torch

    from app.launch import reserve_ui_core

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


def next_posted(posted, kind, timeout: float = 60.0):
    """The next message of `kind` an EngineWorker put into the queue `posted` (the ones before it skipped)."""
    while not isinstance(message := posted.get(timeout=timeout), kind):
        pass
    return message


def write_settings(**values) -> Settings:
    settings = Settings(**values)
    save_settings(settings)
    return settings


class ScriptedEngine:
    """Stands in for the engine on the decode thread and yields the events it is given, for what the real one
    cannot be made to produce on demand (a character split over tokens, escape sequences in a reply, a reasoning
    block crossing `</think>`). It has no tokenizer: the app can take a token's text only from the engine's
    ``Tokens.pieces``. It records what each request sent (``requests``: (messages, settings)); ``thinking`` is
    what a model's template says about reasoning (no switch by default)."""

    def __init__(self, events: list, name: str = "scripted", thinking=None):
        from engine.reasoning import ThinkingInfo

        self.events = events
        self.info = type("Info", (), {"name": name, "path": f"/models/{name}"})()
        self.thinking = thinking or ThinkingInfo(False, "the chat template has no enable_thinking switch", None)
        self.requests: list = []

    def diagnostics(self) -> dict:
        return {}

    def fit_messages(self, messages, reply_tokens, think=None, template_vars=None):
        from engine.context import Fitted

        return Fitted(list(messages), 0, None)  # no context limit to fit

    def chat(self, messages, settings, control):
        self.requests.append((messages, settings))
        yield from self.events

    def close(self) -> None:
        pass


def scripted(pieces: list[str], sources: list[str], name: str = "scripted") -> ScriptedEngine:
    """An engine whose every reply is ``pieces`` (two Tokens events, then one cycle)."""
    from engine import Cycle, Finished, Started, Tokens

    half = len(pieces) // 2
    chunks = [(pieces[:half], sources[:half]), (pieces[half:], sources[half:])]
    events = [Started(prompt_tokens=3)]
    for i, (p, s) in enumerate(chunks):
        ids = list(range(10 * i, 10 * i + len(p)))
        events.append(Tokens(token_ids=ids, sources=s, text="".join(p), pieces=p))
    drafted = sources.count("draft")
    events += [Cycle(0, drafted, drafted, drafted, [True] * drafted, {"verify": 1.0}, len(pieces)),
               Finished(reason="eos", stats={})]
    return ScriptedEngine(events, name)


def thinking_model(switch: bool = True, default: bool | None = True, variables=("preserve_thinking",)):
    """What a Qwen3.5-style template says (the engine's ThinkingInfo), or one without the switch."""
    from engine.reasoning import ThinkingInfo

    if not switch:
        return ThinkingInfo(False, "the chat template has no enable_thinking switch", None)
    return ThinkingInfo(True, None, default, list(variables), "<think>", "</think>", 3, 4)


def thinking_reply(reasoning: list[str], answer: list[str], sources=None, gate=None, reasoning_ms: float = 4100.0):
    """The events of a reply that opens inside a reasoning block (the generation prompt opened `<think>`): each
    reasoning piece one cycle, then the closing marker (piece "", part reasoning), then the answer; the engine's
    per-part stats at the end. ``gate`` (a threading.Event per stage: "answer", "finish") holds the stream
    before that stage, so a test can look at the chat in between. ``sources``: one per reasoning + answer piece
    ("draft" marks an accepted draft)."""
    from engine import Cycle, Finished, Started, Tokens

    sources = list(sources or ["target"] * (len(reasoning) + len(answer)))
    r_sources, a_sources = sources[: len(reasoning)], sources[len(reasoning) :]
    gate = gate or {}

    def held(event: threading.Event):
        # the decode thread posts what it has when the next event comes after its flush interval: an empty
        # Tokens event then, so that everything before the gate is shown while the stream waits
        time.sleep(0.1)
        yield Tokens([], [], "", [], [])
        event.wait(10)

    def events():
        yield Started(prompt_tokens=3, reasoning=True)
        for i, (piece, source) in enumerate(zip(reasoning, r_sources)):
            yield Cycle(i, 1, int(source == "draft"), int(source == "draft"), [source == "draft"], {"verify": 1.0}, 1)
            yield Tokens([100 + i], [source], piece, [piece], ["reasoning"])
        if "answer" in gate:
            yield from held(gate["answer"])
        yield Tokens([4], ["target"], "", [""], ["reasoning"])  # </think>: never shown
        for i, (piece, source) in enumerate(zip(answer, a_sources)):
            yield Cycle(100 + i, 1, int(source == "draft"), int(source == "draft"), [source == "draft"],
                        {"verify": 1.0}, 1)
            yield Tokens([200 + i], [source], piece, [piece], ["answer"])
        if "finish" in gate:
            yield from held(gate["finish"])
        n_reasoning = len(reasoning) + 1
        yield Finished(reason="eos", stats={
            "depth": 1, "tokens_per_s": 50.0, "acceptance_rate": 0.5, "drafted": 2, "parts": {
                "reasoning": {"tokens": n_reasoning, "drafted": len(reasoning), "accepted": r_sources.count("draft"),
                              "acceptance_rate": r_sources.count("draft") / max(len(reasoning), 1),
                              "ms": reasoning_ms, "tokens_per_s": 30.0},
                "answer": {"tokens": len(answer), "drafted": len(answer), "accepted": a_sources.count("draft"),
                           "acceptance_rate": a_sources.count("draft") / max(len(answer), 1), "ms": 500.0,
                           "tokens_per_s": 60.0}}})

    return events


class ThinkingEngine(ScriptedEngine):
    """A scripted engine whose every reply is ``thinking_reply(...)`` (its events made afresh per request)."""

    def __init__(self, reply, thinking=None, name: str = "thinker"):
        super().__init__([], name, thinking or thinking_model())
        self.reply = reply

    def chat(self, messages, settings, control):
        self.requests.append((messages, settings))
        yield from self.reply()
