"""The mtpchat Textual application.

One background thread (``EngineWorker``) owns the engine; this module only sends it commands and renders the
messages it posts. Conversations are saved to SQLite as they happen (``Store``), settings to JSON
(``settings``), and both are reopened on start.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

import themes

from engine import format_tokens

from . import paths
from .downloads import DownloadJob
from .export import export_conversation
from .live import LiveStatic
from .panes import DiagnosticsPane, TimingPane
from .reply_parts import REASONING, history_content
from .safe_text import first_line, terminal_safe
from .screens import ConversationsScreen, ExportScreen, HelpScreen, ModelPickerScreen, SettingsScreen
from .settings import AUTO, DEPTH_KEYS, DEPTH_ORDER, MAX_DEPTH, Settings, load_settings, save_settings
from .stats import ReplyStats
from .store import Conversation, Message, Store, StoreError, title_for
from .transcript import DRAFT_STYLE, MessageView, PromptInput
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
    SetDepth,
    Stop,
    SwitchModel,
    WarmedUp,
    WarmupProgress,
    default_loader,
)

log = logging.getLogger("mtpchat")

EMPTY_HINT = Content.assemble(
    ("Ask anything.\n\n", "bold"),
    "The model's MTP head drafts tokens ahead and the model checks them; tokens it accepted are shown ",
    ("like this", DRAFT_STYLE),
    " (f2 toggles). alt+0…alt+4 sets how many tokens are drafted per cycle, even mid-reply; "
    "f3 shows where the time goes. f1 lists every key.",
)
# Added to the welcome while the embedded demo model is loaded: it only babbles, a real one is a download away.
DEMO_HINT = ("\n\nThis is the tiny built-in demo model (it writes nonsense): f5 → Download fetches a real one "
             "sized for this machine.")


@dataclass
class StreamingReply:
    """The reply being generated: its stored message, its view and its live numbers."""

    message: Message
    view: MessageView | None  # None once its conversation is no longer shown
    stats: ReplyStats = field(default_factory=ReplyStats)


NARROW_COLUMNS = 100  # below this the side panel is hidden unless asked for


class MtpChatApp(App):
    TITLE = "mtpchat"
    CSS_PATH = [Path(__file__).with_name("app.tcss"), themes.CSS_PATH]
    COMMAND_PALETTE_BINDING = "ctrl+p"

    BINDINGS = [
        # priority: the prompt (a TextArea) has its own uses for some of these keys (f6, f7)
        Binding("f1", "help", "Help", priority=True, id="help"),
        Binding("question_mark", "help", "Help", show=False, id="help-question"),
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("f2", "toggle_highlight", "Highlights", priority=True, id="highlight"),
        Binding("f3", "pane('timing')", "Timing", priority=True, id="timing"),
        Binding("f4", "pane('diagnostics')", "Diagnostics", show=False, priority=True, id="diagnostics"),
        Binding("f5", "models", "Models", priority=True, id="models"),
        Binding("f6", "settings", "Settings", priority=True, id="settings"),
        Binding("f7", "export", "Export", priority=True, id="export"),
        Binding("ctrl+n", "new_chat", "New chat", id="new-chat"),
        Binding("ctrl+o", "conversations", "Open", show=False, id="conversations"),
        Binding("ctrl+r", "retry", "Retry", show=False, id="retry"),
        Binding("alt+c", "copy_last", "Copy reply", show=False, priority=True, id="copy-last"),
        Binding("alt+k", "copy_code", "Copy code block", show=False, priority=True, id="copy-code"),
        Binding("alt+t", "toggle_thinking", "Thinking", show=False, priority=True, id="thinking"),
        *[
            Binding(f"alt+{d}", f"depth({d})", f"Depth {d}", show=False, priority=True, id=f"depth-{d}")
            for d in range(DEPTH_KEYS + 1)
        ],
        Binding("alt+a", "depth('auto')", "Depth auto", show=False, priority=True, id="depth-auto"),
        Binding("alt+minus", "depth_step(-1)", "Depth -", show=False, priority=True, id="depth-down"),
        Binding("alt+equals_sign,alt+plus", "depth_step(1)", "Depth +", show=False, priority=True, id="depth-up"),
        # plain keys work when the prompt is not focused (the prompt types them)
        *[Binding(str(d), f"depth({d})", show=False) for d in range(DEPTH_KEYS + 1)],
        Binding("minus", "depth_step(-1)", show=False),
        Binding("plus,equals_sign", "depth_step(1)", show=False),
    ]

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
        conv_id = self.store.latest_conversation_id()
        if conv_id is None:
            conv_id = self.store.create_conversation(self.settings.system_prompt)
        await self.open_conversation(conv_id)
        self.ui("#timing-pane", TimingPane).show(self.last_stats, self.depth)
        self.ui("#prompt", PromptInput).focus()
        self._update_status()
        self.set_interval(self.STATS_REFRESH_S, self._refresh_stats)
        self.call_after_refresh(self.worker.start)  # the first frame before torch is imported

    def on_unmount(self) -> None:
        if self.request is not None and self.store is not None:  # quit mid-reply: what came is kept
            self._saved(self.store.finish_message, self.request.message.id, "stopped", finish_reason="stop")
        if self.download is not None:  # quitting mid-download: the child goes too (the pull resumes later)
            self.download.cancel()
        self.worker.shutdown()
        if self.store is not None:
            self.store.close()

    # conversation ----------------------------------------------------------------------------------------
    async def open_conversation(self, conv_id: int) -> None:
        assert self.store is not None
        if self.request is not None:
            self.request.view = None  # keeps saving, no longer shown
        self.conversation = self.store.load_conversation(conv_id)
        transcript = self.ui("#transcript", VerticalScroll)
        await transcript.remove_children()
        views = [MessageView(m, highlight=self.settings.highlight) for m in self.conversation.messages]
        await transcript.mount_all(views or [Static(EMPTY_HINT, id="empty-hint")])
        self._show_welcome()
        prompt = self.ui("#prompt", PromptInput)
        with prompt.prevent(PromptInput.Changed):
            prompt.load_text(self.conversation.draft)
        prompt.move_cursor(prompt.document.end)
        self.sub_title = self._subtitle()
        self.context_used, self.context_dropped = conversation_tokens(self.conversation.messages), 0
        self._update_status()
        transcript.anchor()

    def _subtitle(self) -> str:
        title = self.conversation.title if self.conversation else ""
        model = self.model_name or ("loading…" if self.engine_state == "loading" else "no model")
        return f"{model} — {title}" if title else model

    # the header shows these: a conversation title (one saved before titles were made terminal-safe) or a model
    # folder's name must not reach the terminal as escape sequences (an OSC 0 would retitle the terminal)
    def validate_title(self, title: str) -> str:
        return terminal_safe(title)

    def validate_sub_title(self, sub_title: str) -> str:
        return terminal_safe(sub_title)

    def history(self) -> list[dict]:
        """What the model sees: the system prompt, then the turns (failed or empty replies left out)."""
        conv = self.conversation
        messages = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt.strip() else []
        markers = (getattr(self.thinking, "open_marker", None), getattr(self.thinking, "close_marker", None))
        for m in conv.messages:
            if m.role == "assistant" and (m.status in ("streaming", "error") or not m.content.strip()):
                continue
            # a reply's reasoning goes back in the model's own form; the template drops it from earlier turns
            content = history_content(m.reasoning, m.content, *markers) if m.role == "assistant" else m.content
            messages.append({"role": m.role, "content": content})
        return messages

    # thinking --------------------------------------------------------------------------------------------
    def thinking_switch(self) -> tuple[bool, str | None]:
        """Can thinking be switched for the loaded model, and if not, why not."""
        info = self.thinking
        if info is None:
            return False, "no model is loaded yet"
        return bool(info.switch), None if info.switch else (info.reason or "the model has no thinking switch")

    def thinking_on(self) -> bool | None:
        """Whether the next reply thinks: the user's choice, else the template's default (None: not known)."""
        if not self.thinking_switch()[0]:
            return None
        return self.think if self.think is not None else self.thinking.default

    def thinking_settings(self) -> dict:
        """The GenerationSettings of thinking: enable_thinking only where the template has the switch (and the
        user chose), the budget, the template variables the user set that the template reads."""
        out = {}
        if self.thinking_switch()[0] and self.think is not None:
            out["think"] = self.think
        if self.settings.think_budget is not None:
            out["think_budget"] = self.settings.think_budget
        known = set(getattr(self.thinking, "variables", None) or [])
        variables = {k: v for k, v in self.settings.template_vars.items() if k in known}
        if variables:
            out["template_vars"] = variables
        return out

    def _saved(self, write, *args, **kwargs) -> bool:
        """Run a store write; a failure (disk full, file removed) is reported once and the app keeps going."""
        try:
            write(*args, **kwargs)
            return True
        except sqlite3.Error as exc:
            if not self._save_error_shown:
                self._save_error_shown = True
                self.notify(f"Could not save the conversation: {exc}", severity="error", timeout=15)
            return False

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
        view = MessageView(message, highlight=self.settings.highlight, streaming=streaming)
        transcript = self.ui("#transcript", VerticalScroll)
        for hint in transcript.query("#empty-hint"):
            await hint.remove()
        await transcript.mount(view)
        return view

    def _add_message(self, role: str, content: str = "", **kwargs) -> Message:
        message_id = self.store.add_message(self.conversation.id, role, content, **kwargs)
        message = Message(id=message_id, role=role, content=content, status=kwargs.get("status", "complete"),
                          model=kwargs.get("model"))
        self.conversation.messages.append(message)
        return message

    async def generate(self) -> None:
        """Ask for the next assistant reply of the open conversation."""
        try:
            reply = self._add_message("assistant", status="streaming", model=self.model_name)
        except sqlite3.Error as exc:  # the user's message is saved and shown: ctrl+r asks again
            self.notify(f"Could not save the reply: {exc}. Your message is kept; ctrl+r retries.", severity="error")
            return
        view = await self._mount_message(reply, streaming=True)
        self.request = StreamingReply(reply, view)
        self.request.stats.depth = self.depth
        self.ui("#transcript", VerticalScroll).anchor()
        s = self.settings
        self.worker.submit(Generate(
            reply.id,
            self.history(),
            dict(max_new_tokens=s.max_new_tokens, depth=self.depth, temperature=s.temperature, top_p=s.top_p,
                 top_k=s.top_k, seed=s.seed, ignore_eos=s.ignore_eos, **self.thinking_settings()),
        ))
        self._show_stats()
        self._update_status()

    # engine messages -------------------------------------------------------------------------------------
    def on_engine_loading(self, message: EngineLoading) -> None:
        self.engine_state = "loading"
        self.ui("#diagnostics-pane", DiagnosticsPane).show_loading(message.model)
        self.sub_title = self._subtitle()
        self._update_status()

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

    def on_warmup_progress(self, message: WarmupProgress) -> None:
        if self.engine_state == "warming":
            self.warmup_status = warmup_text(message.done, message.total, message.what, message.first_run)
            self._update_status()

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

    def on_reply_started(self, message: ReplyStarted) -> None:
        self.ready_note = ""  # the load-to-ready time is said once
        self._notice_fallbacks(message.fallbacks, ("speculation",))  # before the reply: it will not speculate
        request = self._current(message.request_id)
        if request is not None:
            self.context_used = message.prompt_tokens
            if message.reasoning and request.view is not None:
                request.view.open_reasoning()
            self._update_status()

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

    # display ---------------------------------------------------------------------------------------------
    STATS_REFRESH_S = 0.5  # the timing pane and status line follow a streaming reply at 2 Hz

    def _refresh_stats(self) -> None:
        if self._stats_dirty and self.chat_screen.is_attached:
            self._show_stats()
            self._update_status()

    def _show_stats(self) -> None:
        side = self.ui("#side", TabbedContent)
        if not (side.display and side.active == "timing"):
            return  # hidden: shown when the pane opens (action_pane)
        self._stats_dirty = False
        stats = self.request.stats if self.request else self.last_stats
        self.ui("#timing-pane", TimingPane).show(stats, self.depth)

    def _update_status(self) -> None:
        parts = []
        if self.engine_state == "loading":
            parts.append("loading model…")
        elif self.engine_state == "failed":
            parts.append("no model (f5 picks one)")
        else:
            parts.append(terminal_safe(self.model_name or ""))
        parts.append(f"depth {self.depth}")
        thinking = self.thinking_on()
        if thinking is not None:  # a model with the switch: what the next reply does (alt+t switches)
            parts.append("thinking on" if thinking else "thinking off")
        if self.engine_state == "warming":  # a message sent meanwhile waits in the worker's queue
            parts.append(self.warmup_status + (" · your message is next" if self.request is not None else ""))
        elif self.request is not None:
            tps = self.request.stats.tokens_per_s
            parts.append("generating…" + (f" {tps:.0f} tok/s" if tps else "") + " (esc stops)")
        elif self.engine_state == "ready":
            parts.append(self.ready_note or "ready")
        parts.append(self._context_meter())
        self.ui("#status", LiveStatic).show(" · ".join(p for p in parts if p))

    def _context_meter(self) -> str:
        """'context 12.3k / 262k': the open conversation's tokens (prompt and reply, as last sent) of the loaded
        model's context; with how many of its oldest messages no longer fit."""
        limit = (self.engine_diagnostics.get("context") or {}).get("limit") if self.engine_state == "ready" else None
        if not limit:
            return ""
        used = "?" if self.context_used is None else format_tokens(self.context_used)
        meter = f"context {used} / {format_tokens(limit)}"
        if self.context_dropped:
            meter += f" ({self.context_dropped} oldest not sent)"
        return meter

    def _save_settings(self) -> None:
        try:
            save_settings(self.settings)
        except OSError as exc:
            self.notify(f"Could not save settings: {exc}", severity="error")

    # actions ---------------------------------------------------------------------------------------------
    MAIN_SCREEN_ACTIONS = {"help", "models", "settings", "export", "new_chat", "conversations", "retry", "pane"}

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # dialogs open from the chat screen only (the keys pass through to an open dialog instead)
        if action in self.MAIN_SCREEN_ACTIONS and isinstance(self.screen, ModalScreen):
            return False
        return True

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_stop(self) -> None:
        if self.request is not None:
            self.worker.submit(Stop())
            self.notify("Stopping…", timeout=2)

    def action_depth(self, depth: int | str) -> None:
        depth = depth if depth == AUTO else max(0, min(MAX_DEPTH, depth))
        self.depth = depth
        self.worker.submit(SetDepth(depth))  # applies to the running reply from its next cycle
        if self.request is not None:
            self.request.stats.depth = depth
        self.settings.depth = depth
        self._save_settings()
        self._show_stats()
        self._update_status()

    def action_depth_step(self, step: int) -> None:
        """Along auto, 0, 1, .. MAX_DEPTH."""
        at = DEPTH_ORDER.index(self.depth) if self.depth in DEPTH_ORDER else 0
        self.action_depth(DEPTH_ORDER[max(0, min(len(DEPTH_ORDER) - 1, at + step))])

    async def action_toggle_highlight(self) -> None:
        on = not self.settings.highlight
        self.settings.highlight = on
        self._save_settings()
        self.ui("#legend-draft").display = on
        self.ui("#legend-target").display = on
        for view in self.chat_screen.query(MessageView):
            await view.set_highlight(on)
        self.notify("Acceptance highlights on" if on else "Acceptance highlights off", timeout=2)

    def action_toggle_thinking(self) -> None:
        """Thinking on / off from the next reply (the template's enable_thinking); a model without the switch
        says why it has none."""
        switch, reason = self.thinking_switch()
        if not switch:
            self.notify(f"Thinking cannot be switched: {reason}", severity="warning", timeout=5)
            return
        self.think = self.settings.think = not self.thinking_on()
        self._save_settings()
        self._update_status()
        self.notify(f"Thinking {'on' if self.think else 'off'} from the next reply", timeout=2)

    def on_resize(self, event) -> None:
        self._fit_side(event.size.width)  # (the app's own size follows a moment later)

    def _fit_side(self, width: int | None = None) -> None:
        """The side panel is 46 columns wide: in a narrow terminal it would leave the chat a sliver, so there it
        stays hidden until asked for (f3 / f4), and comes back when the terminal is wide again."""
        if getattr(self, "chat_screen", None) is not None:
            width = self.size.width if width is None else width
            self.ui("#side").display = self.settings.side_panel and width >= NARROW_COLUMNS

    def action_pane(self, tab: str) -> None:
        side = self.ui("#side", TabbedContent)
        if side.display and side.active == tab:
            side.display = False
        else:
            side.display = True
            side.active = tab
        self.settings.side_panel = bool(side.display)
        self._save_settings()
        self._show_stats()

    @on(TabbedContent.TabActivated, "#side")
    def _tab_activated(self) -> None:
        self._show_stats()

    def action_models(self) -> None:
        def chosen(path: str | None) -> None:
            if path is None:
                return
            if self.request is not None:
                self.worker.submit(Stop())
            self._picked_model = path  # remembered in the settings once it has loaded
            self.worker.submit(SwitchModel(path))

        self.push_screen(ModelPickerScreen(self.model_path or self.model_name, device=self.device), chosen)

    def start_download(self, ref: str, yes: bool = False) -> DownloadJob | None:
        """A model download (F5 → Download) in a child process: the chat, and a reply in progress, go on."""
        if self.download is not None and self.download.running:
            self.notify(f"Already downloading {self.download.ref}", severity="warning")
            return None
        self.download = DownloadJob(ref, yes=yes, device=self.device)
        try:
            self.download.start(self._download_ended, self.call_from_thread)
        except OSError as e:
            self.download.state, self.download.error = "failed", f"could not start the download: {e.strerror}"
        return self.download

    def _download_ended(self, job: DownloadJob) -> None:
        """Done: switched to, when the picker is open (the user is choosing a model); else offered."""
        if job.state == "done" and job.path:
            if isinstance(self.screen, ModelPickerScreen):
                self.screen.dismiss(job.path)  # the picker's own path: SwitchModel
            else:
                self.notify(f"Downloaded {job.ref}: f5 switches to it")
        elif job.state == "failed" and not isinstance(self.screen, ModelPickerScreen):
            self.notify(f"Download of {job.ref} failed: {job.error}", severity="error")

    def action_settings(self) -> None:
        def chosen(new: Settings | None) -> None:
            if new is None:
                return
            depth_changed = new.depth != self.settings.depth
            if new.think != self.settings.think:
                self.think = new.think
            self.settings = new
            if depth_changed:
                self.action_depth(new.depth)
            self._update_status()
            self._save_settings()
            if new.system_prompt != self.conversation.system_prompt:
                self.conversation.system_prompt = new.system_prompt
                self.store.set_system_prompt(self.conversation.id, new.system_prompt)
            self.notify("Settings saved", timeout=2)

        self.push_screen(SettingsScreen(self.settings, self.conversation.system_prompt, self.thinking), chosen)

    def action_export(self) -> None:
        conv_id = self.conversation.id

        def do_export(directory: Path, formats: list[str]) -> list[Path]:
            return export_conversation(self.store, conv_id, directory, formats)

        def done(written: list[Path] | None) -> None:
            if written:
                names = "\n".join(str(p) for p in written)
                self.notify(f"Exported:\n{names}", timeout=8)

        self.push_screen(ExportScreen(paths.exports_dir(), do_export), done)

    async def action_new_chat(self) -> None:
        if self.request is not None:
            self.worker.submit(Stop())
        if self.conversation is not None and not self.conversation.messages:
            self.notify("This chat is already empty", timeout=2)
            return
        conv_id = self.store.create_conversation(self.settings.system_prompt, self.model_name)
        await self.open_conversation(conv_id)
        self._show_stats()

    def action_conversations(self) -> None:
        async def chosen(conv_id: int | None) -> None:
            if conv_id is None or conv_id == self.conversation.id:
                return
            if self.request is not None:
                self.worker.submit(Stop())
            await self.open_conversation(conv_id)

        self.push_screen(
            ConversationsScreen(self.store.list_conversations, self.store.delete_conversation,
                                self.conversation.id),
            chosen,
        )

    async def action_retry(self) -> None:
        if self.request is not None:
            self.notify("Still generating — esc stops it", severity="warning")
            return
        if self.engine_state == "failed":
            self.notify("No model is loaded — pick one with f5", severity="error")
            return
        messages = self.conversation.messages
        if not messages:
            return
        if messages[-1].role == "assistant":
            last = messages.pop()
            self._saved(self.store.delete_message, last.id)
            views = self.chat_screen.query(MessageView)
            if views and views.last().message.id == last.id:
                await views.last().remove()
        if messages and messages[-1].role == "user":
            await self.generate()

    def action_copy_last(self) -> None:
        for message in reversed(self.conversation.messages):
            if message.role == "assistant" and message.content:
                self.copy_to_clipboard(message.content)
                self.notify(f"Copied the last reply ({len(message.content)} characters)", timeout=3)
                return
        self.notify("No reply to copy yet", severity="warning")

    def action_copy_code(self) -> None:
        """Copy the last fenced code block of the conversation (what people usually want from a reply)."""
        import re

        for message in reversed(self.conversation.messages):
            blocks = re.findall(r"```[^\n]*\n(.*?)```", message.content or "", flags=re.S)
            if message.role == "assistant" and blocks:
                self.copy_to_clipboard(blocks[-1])
                self.notify(f"Copied a code block ({len(blocks[-1])} characters)", timeout=3)
                return
        self.notify("No code block to copy", severity="warning")

    # command palette -------------------------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Depth auto", "Speculation depth chosen per cycle (expected tokens per second)",
                            lambda: self.action_depth(AUTO))
        for depth in range(DEPTH_KEYS + 1):
            label = "plain decoding" if depth == 0 else f"{depth} MTP draft token{'s' * (depth > 1)} per cycle"
            yield SystemCommand(f"Depth {depth}", f"Speculation depth {depth}: {label}",
                                lambda d=depth: self.action_depth(d))
        switch, reason = self.thinking_switch()
        yield SystemCommand("Toggle thinking", "Reasoning on / off from the next reply (alt+t)" if switch
                            else f"Unavailable: {reason}", self.action_toggle_thinking)
        yield SystemCommand("Toggle acceptance highlights", "Mark tokens that came from accepted MTP drafts",
                            self.action_toggle_highlight)
        yield SystemCommand("Timing pane", "Per-phase times, tokens/s, acceptance",
                            lambda: self.action_pane("timing"))
        yield SystemCommand("Diagnostics pane", "Device, dtype, backends, fallbacks",
                            lambda: self.action_pane("diagnostics"))
        yield SystemCommand("Models", "Pick and load another model", self.action_models)
        yield SystemCommand("Settings", "System prompt, sampling, max tokens", self.action_settings)
        yield SystemCommand("Export", "Transcript (Markdown, JSON) and timing log (CSV, JSONL)",
                            self.action_export)
        yield SystemCommand("New chat", "Start a new conversation", self.action_new_chat)
        yield SystemCommand("Open conversation", "Reopen a past conversation", self.action_conversations)
        yield SystemCommand("Retry", "Generate the last reply again", self.action_retry)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard", self.action_copy_last)
        yield SystemCommand("Copy last code block", "Copy the last fenced code block", self.action_copy_code)
        yield SystemCommand("Stop", "Stop generating", self.action_stop)
        yield SystemCommand("Help", "Keys and what they do", self.action_help)


def is_demo(path: str) -> bool:
    from engine import EMBEDDED_DIR

    return os.path.realpath(path) == os.path.realpath(EMBEDDED_DIR)


def warmup_text(done: int, total: int | None, what: str, first_run: bool) -> str:
    """The status line during a warm-up: 'preparing kernels 3/9 · depth 1: first prompt', and on the first run
    on a machine why it takes long."""
    text = f"preparing kernels {done}/{total}" if total else "preparing kernels…"
    if what:
        text += f" · {what}"
    if first_run:
        text += " (first run on this machine: compiling kernels once)"
    return text


def conversation_tokens(messages) -> int | None:
    """The tokens a conversation took when its last reply was made (its prompt and the reply, from the reply's
    stats): 0 for an empty one, None when no finished reply says."""
    if not messages:
        return 0
    for m in reversed(messages):
        if m.role == "assistant" and m.stats:
            prompt, generated = m.stats.get("prompt_tokens"), m.stats.get("generated_tokens")
            if isinstance(prompt, int) and isinstance(generated, int):
                return prompt + generated
    return None


def reserve_ui_core() -> None:
    """Leave one CPU core to the UI thread: torch's intra-op threads busy-wait, and when they take every core
    the UI thread and they slow each other down badly (measured on 2 cores: the tiny test model decoded at
    ~10 tok/s with 2 torch threads under load, ~190 tok/s with 1). Respects an explicit OMP_NUM_THREADS."""
    cores = os.cpu_count() or 1
    if cores < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    torch = sys.modules.get("torch")  # already imported by the caller: adjust it; else set the env var early
    if torch is not None:
        if torch.get_num_threads() >= cores:
            torch.set_num_threads(cores - 1)
    else:
        os.environ["OMP_NUM_THREADS"] = str(cores - 1)


def run_tui(model: str | None = None, depth: int | None = None, device: str | None = None,
            dtype: str | None = None, tp: int = 1, max_context: int | None = None, think: bool | None = None) -> int:
    """Run the TUI until the user quits; returns the exit status."""
    reserve_ui_core()
    try:  # tracebacks of failed loads and requests go to a file (the terminal belongs to the UI)
        paths.data_dir().mkdir(parents=True, exist_ok=True)
        logging.basicConfig(filename=paths.log_path(), level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    except OSError:
        pass
    loader = partial(default_loader, max_context=max_context)  # --max-context: every model the chat loads
    if tp > 1:  # rank 0 (this process) owns the UI; tp - 1 follower processes run the same cycles
        from multiprocessing import resource_tracker

        from engine import tp_loader

        # start multiprocessing's helper while the real stdio is still ours: spawning it from inside the
        # running app fails (Textual has replaced stderr)
        resource_tracker.ensure_running()
        loader = tp_loader(tp, max_context)
    # no warm-up under --tp: Engine.warm_up would run on rank 0 alone, and its collectives would wait for the
    # followers forever (the chat's requests reach them through TPLeader.chat)
    app = MtpChatApp(model=model, depth=depth, device=device, dtype=dtype, loader=loader,
                     warm_up=False if tp > 1 else None, think=think)
    app.run()
    return app.return_code or 0
