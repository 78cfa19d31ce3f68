"""The mtpchat Textual application.

One background thread (``EngineWorker``) owns the engine; this module only sends it commands and renders the
messages it posts. Conversations are saved to SQLite as they happen (``Store``), settings to JSON
(``settings``), and both are reopened on start.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import signal
import sqlite3
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

import themes

from engine import format_tokens

from . import terminal_keys
from .chat_history import HISTORY_BINDINGS, ChatHistory
from .clipboard import Clipboard
from .dialogs import Dialogs
from .downloads import DownloadJob
from .keys import APP_BINDINGS, DepthKeys
from .live import LiveStatic
from .palette import Palette
from .panes import DiagnosticsPane, TimingPane
from .persistence import Persistence, conversation_tokens
from .reply_parts import REASONING
from .safe_text import first_line, terminal_safe
from .settings import Settings, load_settings
from .side_pane import SidePane
from .stats import ReplyStats
from .status import StatusLine, warmup_text
from .store import Conversation, Message, Store, StoreError, title_for
from .thinking_control import ThinkingControl
from .transcript import MessageView, PromptInput
from .welcome import DEMO_HINT, EMPTY_HINT, is_demo
from .worker import (
    EngineLoaded,
    EngineLoadFailed,
    EngineLoading,
    EngineWorker,
    Generate,
    HistoryTrimmed,
    ReplyFailed,
    ReplyFinished,
    ReplyProgress,
    ReplyStarted,
    Stop,
    WarmedUp,
    WarmupProgress,
    default_loader,
)

log = logging.getLogger("mtpchat")

def while_open(handler):
    """A handler of the worker's messages that does nothing once the app is exiting: a load or a reply that
    outlives a quit posts into a chat whose widgets are being removed (once NoMatches('#diagnostics-pane'))."""
    if inspect.iscoroutinefunction(handler):
        async def handle(app: "MtpChatApp", message) -> None:
            if not app.exiting:
                await handler(app, message)
    else:
        def handle(app: "MtpChatApp", message) -> None:
            if not app.exiting:
                handler(app, message)
    return functools.wraps(handler)(handle)


@dataclass
class StreamingReply:
    """The reply being generated: its stored message, its view and its live numbers."""

    message: Message
    view: MessageView | None  # None once its conversation is no longer shown
    stats: ReplyStats = field(default_factory=ReplyStats)


class MtpChatApp(DepthKeys, ThinkingControl, ChatHistory, Persistence, StatusLine, SidePane, Dialogs, Clipboard,
                 Palette, App):
    """The chat: the App, its layout and the handlers of the worker's messages. What the keys, dialogs, status
    line, side pane, clipboard, palette and store glue do lives in the mixins, one file each."""

    TITLE = "mtpchat"
    CSS_PATH = [Path(__file__).with_name("app.tcss"), themes.CSS_PATH]
    COMMAND_PALETTE_BINDING = "ctrl+p"

    BINDINGS = APP_BINDINGS + HISTORY_BINDINGS

    def __init__(
        self,
        model: str | None = None,
        depth: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        *,
        loader=default_loader,
        warm_up: bool | None = None,  # after a load: None on CUDA only (worker.should_warm_up)
        think: bool | None = None,  # --think / --no-think: this session's, over the saved setting
    ):
        super().__init__()
        terminal_keys.install()  # alt+4 and friends from terminals that send ESC + key
        self.settings: Settings = load_settings()
        self.depth = depth if depth is not None else self.settings.depth
        self.think = think if think is not None else self.settings.think  # None: the chat template's default
        self.thinking = None  # the loaded engine's `thinking` (its template's switch, default and variables)
        if model is None and self.settings.model and Path(self.settings.model).exists():
            model = self.settings.model
        self.worker = EngineWorker(self.post_message, model, device, dtype, loader=loader, depth=self.depth,
                                   warm_up=warm_up)
        self.device = device  # what a download is sized for (F5 → Download)
        self.download: DownloadJob | None = None  # the model download, while and after it runs
        self.engine_state = "loading"  # loading | warming (kernels, graphs) | ready | failed
        self.warmup_status = ""  # while warming: "preparing kernels 3/9 · depth 1: first prompt"
        self.ready_note = ""  # "ready in 12.3 s" after a warm-up, until the first reply starts
        self.model_name: str | None = None
        self.model_path: str | None = None
        self.store: Store | None = None
        self.conversation: Conversation | None = None
        self.request: StreamingReply | None = None
        self.last_stats = ReplyStats()
        self._stats_dirty = False
        self._save_error_shown = False
        self._picked_model: str | None = None
        self._quit_code: int | None = None  # a quit waits for the reply in progress to be saved
        self._fallbacks_noticed: set[tuple[str, str]] = set()
        self.engine_info, self.engine_diagnostics = None, {}  # the loaded model's, refreshed after every reply
        # the context meter: tokens of the open conversation as last sent (None: not known until the next reply),
        # and how many of its oldest messages no longer fit the context
        self.context_used: int | None = 0
        self.context_dropped = 0
        for theme in themes.load_themes():
            self.register_theme(theme)

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Notices quote errors, paths and model names: always shown terminal-safe; the app's own notices are
        not read as markup (widgets' ``notify`` asks for markup unless told otherwise)."""
        super().notify(terminal_safe(message), title=terminal_safe(title), severity=severity, timeout=timeout,
                       markup=markup)

    # theme -----------------------------------------------------------------------------------------------
    def get_theme_variable_defaults(self) -> dict[str, str]:
        return themes.variable_defaults(self.current_theme)

    def _theme_changed(self, theme) -> None:
        # highlight spans name theme variables ($draft-token), so they follow the theme without a redraw here
        if self.settings.theme != theme.name:
            self.settings.theme = theme.name
            self._save_settings()

    # layout ----------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="transcript")
                yield LiveStatic("", id="side-summary")  # the timing pane in one line, when it has no room
                with Horizontal(id="statusbar"):
                    yield Static(" accepted draft ", classes="legend-draft", id="legend-draft")
                    yield Static(" target ", classes="legend-target", id="legend-target")
                    yield LiveStatic("", id="status")
                yield PromptInput(
                    id="prompt",
                    placeholder="Message  (enter sends · ctrl+j new line · esc stops · f1 help)",
                    soft_wrap=True,
                    show_line_numbers=False,
                )
            with TabbedContent(id="side", initial="timing"):
                with TabPane("Timing", id="timing"):
                    yield TimingPane(id="timing-pane")
                with TabPane("Diagnostics", id="diagnostics"):
                    yield DiagnosticsPane(id="diagnostics-pane")
        yield Footer()

    def ui(self, selector: str, expect_type: type[Widget] = Widget) -> Widget:
        """A widget of the chat screen, also while a dialog is on top of it."""
        return self.chat_screen.query_one(selector, expect_type)

    async def on_mount(self) -> None:
        self.chat_screen = self.screen
        self._exit_on_signals()
        if self.get_theme(self.settings.theme) is None:
            self.settings.theme = themes.DEFAULT_THEME
        self.theme = self.settings.theme
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        if self.settings.keymap:
            self.set_keymap(self.settings.keymap)
        self._fit_side()
        self.ui("#legend-draft").display = self.settings.highlight
        self.ui("#legend-target").display = self.settings.highlight
        for warning in self.settings.warnings:
            self.notify(warning, severity="warning", timeout=8)
        try:
            self.store = Store()
        except StoreError as exc:
            self.notify(f"{exc}\nConversations will not be saved this session.", severity="error", timeout=15)
            self.store = Store(":memory:")
        self.watch_store_writes()
        # the latest conversation, unless another mtpchat on this folder has it open (then a new one)
        conv_id = self.store.startup_conversation(self.settings.system_prompt)
        await self.open_conversation(conv_id)
        self.ui("#timing-pane", TimingPane).show(self.last_stats, self.depth)
        self.ui("#prompt", PromptInput).focus()
        self._update_status()
        self.set_interval(self.STATS_REFRESH_S, self._refresh_stats)
        self.call_after_refresh(self.worker.start)  # the first frame before torch is imported

    def _exit_on_signals(self) -> None:
        """SIGTERM (kill, a closing session manager), SIGHUP (the terminal or the ssh link went) and an external
        SIGINT end the app the way ctrl+q does: a reply in progress is saved with its stats, and Textual puts
        the terminal back (alternate screen and mouse reporting off, cursor shown) instead of the process dying
        with the terminal left in application mode. The exit status is the shell's 128 + signal number."""
        if self.is_headless:  # the pilot: the test process keeps its own signals
            return
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, partial(self.quit_when_idle, 128 + signum))
            except (NotImplementedError, RuntimeError, ValueError):  # Windows, or not the main thread
                pass

    QUIT_WAIT_S = 2.0  # how long a quit mid-reply waits for the engine's final numbers

    exiting = False  # set when the app starts to exit: the worker's late messages are dropped (while_open)

    def exit(self, *args, **kwargs) -> None:
        self.exiting = True
        super().exit(*args, **kwargs)

    async def action_quit(self) -> None:
        self.quit_when_idle()

    def quit_when_idle(self, return_code: int = 0) -> None:
        """Quit (ctrl+q, a signal); a reply in progress is stopped first, so it is saved with the engine's own
        stats and finish reason. The app ends when the engine says it finished (_end_request), or after
        QUIT_WAIT_S whatever it says."""
        if self.request is None:
            self.exit(return_code=return_code)
            return
        self._quit_code = return_code
        self.worker.submit(Stop())
        self.set_timer(self.QUIT_WAIT_S, partial(self.exit, return_code=return_code))

    def on_unmount(self) -> None:
        if self.request is not None and self.store is not None:  # the engine did not answer: what came is kept
            self._saved(self.store.finish_message, self.request.message.id, "stopped", finish_reason="stop",
                        stats=self.request.stats.summary())
        if self.download is not None:  # quitting mid-download: the child goes too (the pull resumes later)
            self.download.cancel()
        self.worker.shutdown()
        if self.store is not None:
            self.store.close()

    # the header shows these: a conversation title (one saved before titles were made terminal-safe) or a model
    # folder's name must not reach the terminal as escape sequences (an OSC 0 would retitle the terminal)
    def validate_title(self, title: str) -> str:
        return terminal_safe(title)

    def validate_sub_title(self, sub_title: str) -> str:
        return terminal_safe(sub_title)

    @on(PromptInput.Changed, "#prompt")
    def _draft_changed(self, event: PromptInput.Changed) -> None:
        if self.store and self.conversation and event.text_area.text != self.conversation.draft:
            self.conversation.draft = event.text_area.text
            self._saved(self.store.set_draft, self.conversation.id, self.conversation.draft)

    @on(PromptInput.Submitted, "#prompt")
    async def _submit(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if not text.strip():
            return
        if self.request is not None:
            self.notify("Still generating — esc stops it", severity="warning")
            return
        if self.engine_state == "failed":
            self.notify("No model is loaded — pick one with f5. Your message is kept.", severity="error")
            return
        prompt = self.ui("#prompt", PromptInput)
        conv = self.conversation
        await self.drop_edited()  # alt+e: the message it replaces goes first, with its reply
        try:
            user = self._add_message("user", text)
        except sqlite3.Error as exc:
            self.notify(f"Could not save the message: {exc}. It is kept in the input.", severity="error")
            return
        prompt.clear()  # fires Changed -> the stored draft is cleared
        conv.title = conv.title or title_for(text)
        self.sub_title = self._subtitle()
        await self._mount_message(user)
        await self.generate()

    async def _mount_message(self, message: Message, streaming: bool = False) -> MessageView:
        view = MessageView(message, highlight=self.settings.highlight, markdown=self.settings.markdown,
                           streaming=streaming)
        transcript = self.ui("#transcript", VerticalScroll)
        for hint in transcript.query("#empty-hint"):
            await hint.remove()
        await transcript.mount(view)
        return view


    async def generate(self) -> None:
        """Ask for the next assistant reply of the open conversation."""
        s = self.settings
        generation = dict(max_new_tokens=s.max_new_tokens, depth=self.depth, temperature=s.temperature,
                          top_p=s.top_p, top_k=s.top_k, seed=s.seed, ignore_eos=s.ignore_eos,
                          **self.thinking_settings())
        try:
            reply = self._add_message("assistant", status="streaming", model=self.model_name,
                                      settings=self.reply_settings(generation))
        except sqlite3.Error as exc:  # the user's message is saved and shown: ctrl+r asks again
            self.notify(f"Could not save the reply: {exc}. Your message is kept; ctrl+r retries.", severity="error")
            return
        view = await self._mount_message(reply, streaming=True)
        self.request = StreamingReply(reply, view)
        self.request.stats.depth = self.depth
        self.ui("#transcript", VerticalScroll).anchor()
        self.worker.submit(Generate(reply.id, self.history(), generation))
        self._show_stats()
        self._update_status()

    # engine messages -------------------------------------------------------------------------------------
    @while_open
    def on_engine_loading(self, message: EngineLoading) -> None:
        self.engine_state = "loading"
        self.ui("#diagnostics-pane", DiagnosticsPane).show_loading(message.model)
        self.sub_title = self._subtitle()
        self._update_status()

    @while_open
    def on_engine_loaded(self, message: EngineLoaded) -> None:
        self.engine_state = "warming" if message.warming_up else "ready"
        self.warmup_status, self.ready_note = "preparing kernels…", ""
        self.engine_info, self.engine_diagnostics = message.info, message.diagnostics
        self.thinking = message.thinking
        # the load's own fallbacks (no CUDA, no FLA, ...) are in the diagnostics pane, not notices; plain decoding
        # gets its notice at the first reply
        self._fallbacks_noticed = {(f["feature"], f["reason"]) for f in message.diagnostics.get("fallbacks", [])
                                   if f["feature"] != "speculation"}
        self.model_name = getattr(message.info, "name", None) or "model"
        self.model_path = str(getattr(message.info, "path", "") or "") or None
        self.ui("#diagnostics-pane", DiagnosticsPane).show(message.info, message.diagnostics)
        picked, self._picked_model = self._picked_model, None
        if picked and self.model_path and os.path.realpath(picked) == os.path.realpath(self.model_path):
            self.settings.model = picked
            self._save_settings()
        self.sub_title = self._subtitle()
        self._update_status()
        self._show_welcome()

    def _show_welcome(self) -> None:
        """The empty conversation's welcome, with the pointer to F5 → Download while the demo model is loaded."""
        demo = self.model_path is not None and is_demo(self.model_path)
        for hint in self.chat_screen.query("#empty-hint"):
            hint.update(Content.assemble(EMPTY_HINT, DEMO_HINT) if demo else EMPTY_HINT)

    @while_open
    def on_warmup_progress(self, message: WarmupProgress) -> None:
        if self.engine_state == "warming":
            self.warmup_status = warmup_text(message.done, message.total, message.what, message.first_run)
            self._update_status()

    @while_open
    def on_warmed_up(self, message: WarmedUp) -> None:
        if self.engine_state != "warming":
            return
        self.engine_state = "ready"
        self.ready_note = f"ready in {message.ready_s:.1f} s"
        if message.error:
            self.notify(f"Preparing kernels failed: {first_line(message.error)} (the first reply compiles them)",
                        severity="warning", timeout=10)
        if message.diagnostics is not None:  # the CUDA graphs the warm-up captured
            self.engine_diagnostics = message.diagnostics
            self.ui("#diagnostics-pane", DiagnosticsPane).show(self.engine_info, message.diagnostics)
        self._update_status()

    @while_open
    def on_engine_load_failed(self, message: EngineLoadFailed) -> None:
        what = message.model or "the default model"
        self._picked_model = None
        if message.model is not None and message.model == self.settings.model:
            self.settings.model = None  # do not try it again at the next start
            self._save_settings()
        if message.kept:
            self.notify(f"Could not load {what}: {message.error}\nStill using {message.kept}.",
                        severity="error", timeout=15)
            return
        self.engine_state = "failed"
        self.model_name = None
        self.ui("#diagnostics-pane", DiagnosticsPane).show_failed(message.error)
        self.notify(f"Could not load {what}: {message.error}\nPick another model with f5.",
                    severity="error", timeout=15)
        self.sub_title = self._subtitle()
        self._update_status()

    def _current(self, request_id: int) -> StreamingReply | None:
        request = self.request
        return request if request is not None and request.message.id == request_id else None

    def _notice_fallbacks(self, fallbacks: list[dict], features: tuple[str, ...] | None = None) -> None:
        """One notice per (feature, reason) while a model is loaded; the load's own fallbacks (no CUDA, ...) are
        in the diagnostics pane instead (on_engine_loaded marks them noticed)."""
        for fallback in fallbacks:
            key = (fallback["feature"], fallback["reason"])
            if (features is None or key[0] in features) and key not in self._fallbacks_noticed:
                self._fallbacks_noticed.add(key)
                what = "Plain decoding" if key[0] == "speculation" else key[0]
                self.notify(f"{what}: {key[1]}", severity="warning", timeout=8)

    @while_open
    def on_reply_started(self, message: ReplyStarted) -> None:
        self.ready_note = ""  # the load-to-ready time is said once
        self._notice_fallbacks(message.fallbacks, ("speculation",))  # before the reply: it will not speculate
        request = self._current(message.request_id)
        if request is not None:
            self.context_used = message.prompt_tokens
            if message.reasoning and request.view is not None:
                request.view.open_reasoning()
            self._update_status()

    @while_open
    def on_history_trimmed(self, message: HistoryTrimmed) -> None:
        """The oldest turns no longer fit the context: say so when more of them are dropped than before."""
        if self._current(message.request_id) is None:
            return
        if message.dropped > self.context_dropped:
            limit = f" ({format_tokens(message.limit)} tokens)" if message.limit else ""
            self.notify(f"This chat is longer than the model's context{limit}: its {message.dropped} oldest "
                        f"message{'s' * (message.dropped > 1)} are no longer sent to the model (the system prompt "
                        f"is kept).", severity="warning", timeout=10)
        self.context_dropped = message.dropped
        self._update_status()

    @while_open
    def on_reply_progress(self, message: ReplyProgress) -> None:
        request = self._current(message.request_id)
        if request is None:
            return
        self._saved(self.store.append_reply, message.request_id, message.text, message.token_ids, message.sources,
                    message.pieces, message.cycles, reasoning=message.reasoning, parts=message.parts,
                    cycle_parts=message.cycle_parts)
        stats = request.stats
        stats.add_tokens(len(message.token_ids), message.t_ms)
        stats.add_parts(message.parts, message.t_ms)
        for (cycle, t_ms), part in zip(message.cycles, message.cycle_parts or ["answer"] * len(message.cycles)):
            stats.add_cycle(cycle, t_ms)
            stats.add_part_cycle(cycle, part)
        reply = request.message
        reply.content += message.text
        reply.reasoning += message.reasoning
        reply.token_ids += message.token_ids
        reply.sources += message.sources
        reply.pieces += message.pieces
        reply.parts += message.parts
        if self.context_used is not None:
            self.context_used += len(message.token_ids)
        if request.view is not None:
            if REASONING in message.parts:  # the thinking block's time so far
                request.view.reasoning_ms = message.t_ms
            request.view.grew()
        self._stats_dirty = True  # shown by _refresh_stats at a few Hz

    @while_open
    async def on_reply_finished(self, message: ReplyFinished) -> None:
        request = self._current(message.request_id)
        if request is None:
            return
        status = "stopped" if message.reason == "stop" else "complete"
        reply = request.message
        reply.status, reply.finish_reason, reply.stats, reply.fallbacks = (
            status, message.reason, message.stats, message.fallbacks)
        self._saved(self.store.finish_message, reply.id, status, finish_reason=message.reason,
                    stats=message.stats, fallbacks=message.fallbacks)
        request.stats.final = message.stats
        self.context_used = conversation_tokens([reply]) or self.context_used
        if message.diagnostics is not None:  # replay counters, reuse and memory as they are now
            self.engine_diagnostics = message.diagnostics
            self.ui("#diagnostics-pane", DiagnosticsPane).show(self.engine_info, message.diagnostics)
        self._notice_fallbacks(message.fallbacks)  # and what happened during the reply (out of memory: depth lowered)
        await self._end_request(request)

    @while_open
    async def on_reply_failed(self, message: ReplyFailed) -> None:
        request = self._current(message.request_id)
        if request is None:
            return
        reply = request.message
        reply.status, reply.error = "error", message.error
        self._saved(self.store.finish_message, reply.id, "error", error=message.error)
        self.notify(f"Generation failed: {message.error}\nThe conversation is kept; ctrl+r retries.",
                    severity="error", timeout=15)
        await self._end_request(request)

    async def _end_request(self, request: StreamingReply) -> None:
        try:
            if request.view is not None:
                await request.view.finish()
        finally:
            self.request = None
            self.last_stats = request.stats
            self._show_stats()
            self._update_status()
            if self._quit_code is not None:
                self.exit(return_code=self._quit_code)

    # actions ---------------------------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.request is not None:
            self.worker.submit(Stop())
            self.notify("Stopping…", timeout=2)
        else:
            self.cancel_edit()  # esc while editing the last message (alt+e)

    async def action_toggle_highlight(self) -> None:
        on = not self.settings.highlight
        self.settings.highlight = on
        self._save_settings()
        self.ui("#legend-draft").display = on
        self.ui("#legend-target").display = on
        for view in self.chat_screen.query(MessageView):
            await view.set_highlight(on)
        self.notify("Acceptance highlights on" if on else "Acceptance highlights off", timeout=2)

    async def action_toggle_markdown(self) -> None:
        self.settings.markdown = not self.settings.markdown
        self._save_settings()
        await self.show_markdown()
        self.notify("Replies rendered as Markdown" if self.settings.markdown else "Replies shown as plain text",
                    timeout=2)

    async def show_markdown(self) -> None:
        """Every reply rendered as the markdown setting says (Markdown, or the plain text)."""
        for view in self.chat_screen.query(MessageView):
            await view.set_markdown(self.settings.markdown)

    def on_resize(self, event) -> None:
        self._fit_side(event.size.width)  # (the app's own size follows a moment later)

    @on(TabbedContent.TabActivated, "#side")
    def _tab_activated(self) -> None:
        self._show_stats()

