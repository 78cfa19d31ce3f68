"""The decode thread: it alone owns the engine.

The UI puts commands on a queue (Generate, Stop, SetDepth, SwitchModel, Shutdown); the thread posts Textual
messages back (thread-safe ``App.post_message``). Token chunks and cycle stats are coalesced: the thread sends
at most one ``ReplyProgress`` per ``FLUSH_INTERVAL_S`` however fast the engine commits tokens, so the UI stays
responsive at hundreds of tokens per second. Widgets never touch the engine and the engine never touches widgets.

Stop and SetDepth are also applied to the running request's ``DecodeControl`` at once (it is thread-safe), so
they take effect at the next cycle even when a cycle is slow; everything else waits its turn in the queue.

On CUDA a load is followed by a warm-up (``Engine.warm_up``: kernel compilation and autotuning, the CUDA graphs of
the depths the chat uses), so that the first reply is not the one that pays for them: EngineLoaded says a warm-up
follows, WarmupProgress reports each step and WarmedUp ends it. A Generate submitted meanwhile waits in the queue.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from textual.message import Message

from . import paths
from .reply_parts import ANSWER, parts_or_answer, split_pieces

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


DRAFT_ENV = "MTPCHAT_DRAFT_MODEL"  # load_engine's default draft model (`mtpchat chat --draft-model` sets it)


@dataclass
class SwitchModel:
    model: str | None
    draft: str | None = None  # its draft model's path, "" for none (the model picker); None: as it was


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
    load_s: float = 0.0  # from the start of the load to this message
    warming_up: bool = False  # a warm-up follows (WarmupProgress ..., WarmedUp): not ready before it ends
    thinking: Any = None  # engine.thinking: the template's enable_thinking switch, its default, its variables


@dataclass
class WarmupProgress(Message):
    """A step of the warm-up is done (done = 0: it starts; total is None until the engine says)."""

    done: int
    total: int | None
    what: str  # the step just done, e.g. "depth 1: first prompt"
    first_run: bool  # nothing was compiled on this machine before: the warm-up compiles every kernel


@dataclass
class WarmedUp(Message):
    seconds: float  # the warm-up's own time
    ready_s: float  # from the start of the load to ready: what the user waited
    error: str | None = None  # the warm-up failed (the model is still usable: its first reply compiles instead)
    diagnostics: dict | None = None  # after the warm-up (the CUDA graphs it captured)


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
    reasoning: bool = False  # the reply opens inside a reasoning block (the generation prompt opened it)


@dataclass
class HistoryTrimmed(Message):
    """The conversation did not fit the model's context: its `dropped` oldest messages were left out of this
    request (the system prompt kept); `tokens` is what the kept ones encode to, `limit` the context."""

    request_id: int
    dropped: int
    tokens: int | None
    limit: int | None


@dataclass
class ReplyProgress(Message):
    """Everything committed since the previous progress message."""

    request_id: int
    text: str  # the answer's new text
    token_ids: list[int]
    sources: list[str]
    pieces: list[str]  # the text of each token (the engine's Tokens.pieces; for highlighting)
    cycles: list[tuple[Cycle, float]]  # the engine's cycles, each with when the thread received it (ms after start)
    t_ms: float
    reasoning: str = ""  # the reasoning's new text
    parts: list[str] = field(default_factory=list)  # "reasoning" | "answer" per token
    cycle_parts: list[str] = field(default_factory=list)  # the part each of ``cycles`` decoded


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


class _WarmupCancelled(Exception):
    """The app is quitting: the warm-up stops after its current step."""


def should_warm_up(device: str, forced: bool | None = None) -> bool:
    """Warm up after a load? On CUDA, where the first reply would otherwise compile kernels and capture graphs;
    not on the CPU, where there is nothing to compile and a warm-up would only delay the first reply.
    ``forced`` (True / False) overrides the device: tests, and tensor-parallel chats (rank 0 alone would run it)."""
    if forced is not None:
        return forced
    return str(device).startswith("cuda")


def _fallbacks(items) -> list[dict]:
    return [{"feature": f.feature, "reason": f.reason} for f in items or []]


def default_loader(model: str | None, device: str | None, dtype: str | None, max_context: int | None = None):
    from engine import load_engine

    return load_engine(model, device=device, dtype=dtype, max_context=max_context)


def warm_depths(depth) -> tuple[int, ...]:
    """The depths a warm-up covers: 0 .. the chat's depth (auto: every depth it may pick)."""
    from engine import AUTO, AUTO_MAX_DEPTH

    return tuple(range((AUTO_MAX_DEPTH if depth == AUTO else int(depth)) + 1))


def settle_heap() -> None:
    """After a load: collect, then freeze what is left (the model's modules, torch's and transformers' own
    objects) out of the cyclic collector's reach. A loaded process tracks about half a million objects, and
    every full collection scanned them all while it held the GIL: in the chat on the demo model, three
    600-token replies paid 5 full collections of 1.77 s in all (up to 391 ms each: a frozen screen and a
    stalled engine), and 0.29 s (at most 57 ms) with the heap frozen. Frozen objects are still freed when
    their last reference goes; a model switch unfreezes first, so the old engine's cycles are collected too."""
    gc.collect()
    gc.freeze()


class EngineWorker:
    def __init__(
        self,
        post: Callable[[Message], Any],
        model: str | None,
        device: str | None = None,
        dtype: str | None = None,
        loader: Callable = default_loader,
        depth: int | str = 3,
        warm_up: bool | None = None,
    ):
        self.post = post
        self.model = model
        self.device = device
        self.dtype = dtype
        self.loader = loader
        self.depth = depth  # the chat's depth, kept current by SetDepth: a warm-up covers depths 0 .. depth
        self.warm_up = warm_up  # None: on CUDA only (should_warm_up)
        self._quitting = False  # set from the UI thread: a running warm-up stops after its step
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
        if isinstance(command, SetDepth):
            self.depth = command.depth
        elif isinstance(command, Shutdown):
            self._quitting = True
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
                self._switch(command.model, command.draft)
            # Stop / SetDepth while idle: nothing to do (the next Generate carries the depth)
        self._close()

    def _close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # closing must not keep the app from exiting
                log.exception("engine.close failed")
            self.engine = None

    def _load(self, model: str | None, previous: Any = _NOTHING, previous_draft: str | None = None) -> None:
        """Load ``model``; if that fails and ``previous`` names the model that was loaded, reload it, with the
        draft model it had (``previous_draft``: a draft that failed to load must not fail the way back). Either
        way a loaded model is then warmed up (on CUDA) before it is ready."""
        started = time.perf_counter()
        first_run = paths.kernel_cache_empty()  # before the load: it may compile kernels itself
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
                if previous_draft is not None:
                    os.environ[DRAFT_ENV] = previous_draft
                try:  # go back to the model that worked
                    self.engine = self.loader(previous, self.device, self.dtype)
                    kept = self.engine.info.name
                    diagnostics = self.engine.diagnostics()
                    self.post(EngineLoadFailed(model, message, kept=kept))
                    self._ready(diagnostics, started, first_run)
                    return
                except Exception:
                    self.engine = None
            self.post(EngineLoadFailed(model, message))
            return
        self.model = model
        self._ready(diagnostics, started, first_run)

    def _ready(self, diagnostics: dict, started: float, first_run: bool) -> None:
        """Announce the loaded engine, then warm it up when that is wanted (WarmedUp: ready)."""
        warm = should_warm_up(getattr(self.engine.info, "device", ""), self.warm_up)
        load_s = time.perf_counter() - started
        settle_heap()
        self.post(EngineLoaded(self.engine.info, diagnostics, load_s=load_s, warming_up=warm,
                               thinking=getattr(self.engine, "thinking", None)))
        if not warm:
            log.info("%s ready in %.1f s", self.engine.info.name, load_s)
            return
        self._warm_up(started, first_run)

    def _warm_up(self, started: float, first_run: bool) -> None:
        """Engine.warm_up for depths 0 .. the chat's depth, each step reported. A failure is not a failed load:
        it is logged and said (WarmedUp.error), and the first reply pays what the warm-up did not."""
        def progress(done: int, total: int, what: str) -> None:
            if self._quitting:
                raise _WarmupCancelled
            self.post(WarmupProgress(done, total, what, first_run))

        self.post(WarmupProgress(0, None, "", first_run))
        begun, error = time.perf_counter(), None
        try:
            self.engine.warm_up(depths=warm_depths(self.depth), progress=progress)
        except _WarmupCancelled:
            return  # quitting: nobody waits for a WarmedUp
        except Exception as exc:
            log.warning("warm-up failed", exc_info=True)
            error, _ = describe_error(exc)
        now = time.perf_counter()
        log.info("%s ready in %.1f s (warm-up %.1f s%s)", self.engine.info.name, now - started, now - begun,
                 ", first run on this machine" if first_run else "")
        settle_heap()  # (the warm-up's objects: graphs, compiled code)
        self.post(WarmedUp(now - begun, now - started, error, self._diagnostics()))

    def _diagnostics(self) -> dict | None:
        try:
            return self.engine.diagnostics()
        except Exception:  # a snapshot is never worth failing a reply over
            log.warning("engine.diagnostics failed", exc_info=True)
            return None

    def _switch(self, model: str | None, draft: str | None = None) -> None:
        previous = self.model if self.engine is not None else _NOTHING
        previous_draft = os.environ.get(DRAFT_ENV, "")
        gc.unfreeze()  # (settle_heap froze the old engine's objects: its reference cycles must be collectable)
        self._close()  # free its memory before loading the next one
        if draft is not None:  # (the loaders read it, as they read `chat --draft-model`'s)
            os.environ[DRAFT_ENV] = draft
        self._load(model, previous, previous_draft)

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
        def fresh() -> dict:
            return dict(text=[], reasoning=[], token_ids=[], sources=[], pieces=[], parts=[], cycles=[],
                        cycle_parts=[])

        pending = fresh()
        # the engine yields a cycle's stats just before its tokens: a cycle waits for them to learn its part
        unlabelled: list[tuple[Cycle, float]] = []
        last_flush = 0.0

        def flush(now: float) -> None:
            nonlocal last_flush, pending
            if pending["token_ids"] or pending["cycles"] or pending["text"] or pending["reasoning"]:
                self.post(ReplyProgress(
                    rid, "".join(pending["text"]), pending["token_ids"], pending["sources"], pending["pieces"],
                    pending["cycles"], (now - start) * 1000, reasoning="".join(pending["reasoning"]),
                    parts=pending["parts"], cycle_parts=pending["cycle_parts"],
                ))
                pending = fresh()
            last_flush = now

        def label_cycles(part: str) -> None:
            pending["cycles"] += unlabelled
            pending["cycle_parts"] += [part] * len(unlabelled)
            unlabelled.clear()

        try:
            settings = GenerationSettings(**command.settings)
            # a conversation past the context loses its oldest turns (the engine's reuse then restarts from a
            # snapshot on the kept prefix, or from zero: never from state of the dropped turns)
            fitted = self.engine.fit_messages(command.messages, settings.max_new_tokens, settings.think,
                                              settings.template_vars)
            if fitted.dropped:
                self.post(HistoryTrimmed(rid, fitted.dropped, fitted.tokens, self.engine.context_limit))
            for event in self.engine.chat(fitted.messages, settings, control):
                later += self._drain(control)
                now = time.perf_counter()
                if isinstance(event, Tokens):
                    parts = parts_or_answer(getattr(event, "parts", None), len(event.token_ids))
                    pieces = event.pieces if len(event.pieces) == len(event.token_ids) else None
                    reasoning, answer = split_pieces(pieces, parts) if pieces is not None else ("", event.text)
                    label_cycles(parts[0] if parts else ANSWER)
                    pending["text"].append(answer)
                    pending["reasoning"].append(reasoning)
                    pending["token_ids"] += event.token_ids
                    pending["sources"] += event.sources
                    pending["pieces"] += event.pieces  # decoded once, by the engine
                    pending["parts"] += parts
                elif isinstance(event, Cycle):
                    unlabelled.append((event, (now - start) * 1000))
                    continue  # flushed with its tokens
                elif isinstance(event, Started):
                    self.post(ReplyStarted(rid, event.prompt_tokens, event.reused_tokens,
                                           _fallbacks(event.fallbacks), getattr(event, "reasoning", False)))
                    last_flush = now
                    continue
                elif isinstance(event, Finished):
                    label_cycles(ANSWER)
                    flush(now)
                    self.post(ReplyFinished(rid, event.reason, dict(event.stats), _fallbacks(event.fallbacks),
                                            self._diagnostics()))
                    continue
                if now - last_flush >= FLUSH_INTERVAL_S:
                    flush(now)
        except Exception as exc:  # engine errors, OOM: report, keep the thread and the engine
            log.warning("generation failed", exc_info=True)
            label_cycles(ANSWER)
            flush(time.perf_counter())
            message, oom = describe_error(exc)
            self.post(ReplyFailed(rid, message, out_of_memory=oom))
        finally:
            with self._lock:
                self._control = None
        return later + self._drain()
