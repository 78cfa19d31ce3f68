"""The decode thread: it alone owns the engine.

The UI puts commands on a queue (Generate, Stop, SetDepth, SwitchModel, Shutdown); the thread posts Textual
messages back (thread-safe ``App.post_message``). Token chunks and cycle stats are coalesced: the thread sends
at most one ``ReplyProgress`` per ``FLUSH_INTERVAL_S`` however fast the engine commits tokens, so the UI stays
responsive at hundreds of tokens per second. Widgets never touch the engine and the engine never touches widgets.

Stop and SetDepth are also applied to the running request's ``DecodeControl`` at once (it is thread-safe), so
they take effect at the next cycle even when a cycle is slow; everything else waits its turn in the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from textual.message import Message

if TYPE_CHECKING:  # the engine (and torch) are imported on the decode thread, after the first frame
    from engine import Cycle

log = logging.getLogger("mtpchat.worker")

FLUSH_INTERVAL_S = 0.04  # ~25 UI updates per second at most
_NOTHING = object()


# commands (UI -> thread) -----------------------------------------------------------------------------
@dataclass
class Generate:
    request_id: int
    messages: list[dict]
    settings: dict  # GenerationSettings keyword arguments


@dataclass
class Stop:
    pass


@dataclass
class SetDepth:
    depth: int


@dataclass
class SwitchModel:
    model: str | None


@dataclass
class Shutdown:
    pass


Command = Generate | Stop | SetDepth | SwitchModel | Shutdown


# messages (thread -> UI) -----------------------------------------------------------------------------
@dataclass
class EngineLoading(Message):
    model: str | None


@dataclass
class EngineLoaded(Message):
    info: Any  # engine.info
    diagnostics: dict


@dataclass
class EngineLoadFailed(Message):
    model: str | None
    error: str
    kept: str | None = None  # the model still loaded, when a switch failed


@dataclass
class ReplyStarted(Message):
    request_id: int
    prompt_tokens: int
    reused_tokens: int
    fallbacks: list[dict]


@dataclass
class ReplyProgress(Message):
    """Everything committed since the previous progress message."""

    request_id: int
    text: str
    token_ids: list[int]
    sources: list[str]
    pieces: list[str]  # the text of each token (the engine's Tokens.pieces; for highlighting)
    cycles: list[tuple[Cycle, float]]  # the engine's cycles, each with when the thread received it (ms after start)
    t_ms: float


@dataclass
class ReplyFinished(Message):
    request_id: int
    reason: str
    stats: dict
    fallbacks: list[dict]
    diagnostics: dict | None = None  # engine.diagnostics() after the reply (graph replays, reuse, memory)


@dataclass
class ReplyFailed(Message):
    request_id: int
    error: str
    out_of_memory: bool = False


# helpers ---------------------------------------------------------------------------------------------
def describe_error(exc: BaseException) -> tuple[str, bool]:
    """One clear line for a failure, and whether it was an out-of-memory error."""
    name = type(exc).__name__
    oom = "OutOfMemory" in name or "out of memory" in str(exc).lower()
    if oom:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else name
        return f"out of memory: {first} — try a smaller model, a lower depth or fewer max tokens", True
    try:
        from engine import EngineError
    except Exception:  # engine not importable: report what we have
        EngineError = ()  # type: ignore[assignment]
    if isinstance(exc, EngineError):
        return str(exc), False
    return f"{name}: {exc}", False


def _fallbacks(items) -> list[dict]:
    return [{"feature": f.feature, "reason": f.reason} for f in items or []]


def default_loader(model: str | None, device: str | None, dtype: str | None):
    from engine import load_engine

    return load_engine(model, device=device, dtype=dtype)


class EngineWorker:
    def __init__(
        self,
        post: Callable[[Message], Any],
        model: str | None,
        device: str | None = None,
        dtype: str | None = None,
        loader: Callable = default_loader,
    ):
        self.post = post
        self.model = model
        self.device = device
        self.dtype = dtype
        self.loader = loader
        self.commands: queue.Queue[Command] = queue.Queue()
        self.engine = None
        self._control = None
        self._lock = threading.Lock()  # guards _control between the UI thread and this one
        self._shutdown = False
        self.thread = threading.Thread(target=self._run, name="mtpchat-engine", daemon=True)

    # UI side -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, command: Command) -> None:
        with self._lock:
            control = self._control
        if control is not None:
            self._apply(control, command)
        self.commands.put(command)

    def shutdown(self, timeout: float = 3.0) -> None:
        self.submit(Shutdown())
        if self.thread.is_alive():
            self.thread.join(timeout)

    # thread side -------------------------------------------------------------------------------------
    @staticmethod
    def _apply(control, command: Command) -> None:
        if isinstance(command, (Stop, Shutdown)):
            control.stop()
        elif isinstance(command, SetDepth):
            control.depth = command.depth

    def _run(self) -> None:
        self._load(self.model)
        deferred: list[Command] = []
        while not self._shutdown:
            command = deferred.pop(0) if deferred else self.commands.get()
            if isinstance(command, Shutdown):
                break
            if isinstance(command, Generate):
                deferred += self._generate(command)
            elif isinstance(command, SwitchModel):
                self._switch(command.model)
            # Stop / SetDepth while idle: nothing to do (the next Generate carries the depth)
        self._close()

    def _close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # closing must not keep the app from exiting
                log.exception("engine.close failed")
            self.engine = None

    def _load(self, model: str | None, previous: Any = _NOTHING) -> None:
        """Load ``model``; if that fails and ``previous`` names the model that was loaded, reload it."""
        self.post(EngineLoading(model))
        try:
            self.engine = self.loader(model, self.device, self.dtype)
            diagnostics = self.engine.diagnostics()
        except Exception as exc:  # a failed load leaves the app usable
            log.warning("loading %s failed", model or "the default model", exc_info=True)
            message, _ = describe_error(exc)
            self.engine = None
            kept = None
            if previous is not _NOTHING:
                try:  # go back to the model that worked
                    self.engine = self.loader(previous, self.device, self.dtype)
                    kept = self.engine.info.name
                    self.post(EngineLoadFailed(model, message, kept=kept))
                    self.post(EngineLoaded(self.engine.info, self.engine.diagnostics()))
                    return
                except Exception:
                    self.engine = None
            self.post(EngineLoadFailed(model, message))
            return
        self.model = model
        self.post(EngineLoaded(self.engine.info, diagnostics))

    def _diagnostics(self) -> dict | None:
        try:
            return self.engine.diagnostics()
        except Exception:  # a snapshot is never worth failing a reply over
            log.warning("engine.diagnostics failed", exc_info=True)
            return None

    def _switch(self, model: str | None) -> None:
        previous = self.model if self.engine is not None else _NOTHING
        self._close()  # free its memory before loading the next one
        self._load(model, previous)

    def _drain(self, control=None) -> list[Command]:
        """Take the queued commands: Stop / SetDepth go to the running request (dropped when there is none),
        Shutdown is noted, Generate / SwitchModel are returned to run next, in order."""
        later = []
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return later
            if control is not None:
                self._apply(control, command)
            if isinstance(command, Shutdown):
                self._shutdown = True
            elif isinstance(command, (Generate, SwitchModel)):
                later.append(command)

    def _generate(self, command: Generate) -> list[Command]:
        rid = command.request_id
        if self.engine is None:
            self.post(ReplyFailed(rid, "no model is loaded — pick one with the model picker (F5)"))
            return self._drain()
        from engine import Cycle, DecodeControl, Finished, GenerationSettings, Started, Tokens

        control = DecodeControl(depth=command.settings.get("depth", 0))
        with self._lock:
            self._control = control
        later: list[Command] = []
        start = time.perf_counter()
        pending = dict(text=[], token_ids=[], sources=[], pieces=[], cycles=[])
        last_flush = 0.0

        def flush(now: float) -> None:
            nonlocal last_flush
            if pending["token_ids"] or pending["cycles"] or pending["text"]:
                self.post(ReplyProgress(
                    rid, "".join(pending["text"]), pending["token_ids"], pending["sources"], pending["pieces"],
                    pending["cycles"], (now - start) * 1000,
                ))
                pending.update(text=[], token_ids=[], sources=[], pieces=[], cycles=[])
            last_flush = now

        try:
            settings = GenerationSettings(**command.settings)
            for event in self.engine.chat(command.messages, settings, control):
                later += self._drain(control)
                now = time.perf_counter()
                if isinstance(event, Tokens):
                    pending["text"].append(event.text)
                    pending["token_ids"] += event.token_ids
                    pending["sources"] += event.sources
                    pending["pieces"] += event.pieces  # decoded once, by the engine
                elif isinstance(event, Cycle):
                    pending["cycles"].append((event, (now - start) * 1000))
                elif isinstance(event, Started):
                    self.post(ReplyStarted(rid, event.prompt_tokens, event.reused_tokens,
                                           _fallbacks(event.fallbacks)))
                    last_flush = now
                    continue
                elif isinstance(event, Finished):
                    flush(now)
                    self.post(ReplyFinished(rid, event.reason, dict(event.stats), _fallbacks(event.fallbacks),
                                            self._diagnostics()))
                    continue
                if now - last_flush >= FLUSH_INTERVAL_S:
                    flush(now)
        except Exception as exc:  # engine errors, OOM: report, keep the thread and the engine
            log.warning("generation failed", exc_info=True)
            flush(time.perf_counter())
            message, oom = describe_error(exc)
            self.post(ReplyFailed(rid, message, out_of_memory=oom))
        finally:
            with self._lock:
                self._control = None
        return later + self._drain()
