"""The status line and the timing pane's refresh: model, depth, thinking, what the engine is doing, the context
meter."""

from __future__ import annotations

from textual.widgets import TabbedContent

from engine import format_tokens

from .live import LiveStatic
from .panes import TimingPane
from .safe_text import terminal_safe
from .stats import ReplyStats


class StatusLine:
    """The status line under the transcript and the timing pane, refreshed while a reply streams."""

    STATS_REFRESH_S = 0.5  # the timing pane and status line follow a streaming reply at 2 Hz

    def _refresh_stats(self) -> None:
        if self._stats_dirty and self.chat_screen.is_attached:
            self._show_stats()
            self._update_status()

    def _show_stats(self) -> None:
        stats = self.request.stats if self.request else self.last_stats
        summary = self.ui("#side-summary", LiveStatic)
        if summary.display:
            self._stats_dirty = False
            summary.show(summary_line(stats, self.request is not None))
        side = self.ui("#side", TabbedContent)
        if not (side.display and side.active == "timing"):
            return  # hidden: shown when the pane opens (action_pane)
        self._stats_dirty = False
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


def summary_line(stats: ReplyStats, streaming: bool) -> str:
    """The timing pane in one line, for a terminal too narrow for it: 'last reply 52.1 tok/s · 71% accepted ·
    2.42 tok/cycle · first token 120 ms · f3 more'."""
    if not stats.tokens and not streaming:
        return "no reply yet · f3 timing · f4 diagnostics"
    parts = ["this reply" if streaming else "last reply"]
    if stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if stats.acceptance_rate is not None:
        parts.append(f"{100 * stats.acceptance_rate:.0f}% accepted")
    if stats.mean_accepted_length is not None:
        parts.append(f"{stats.mean_accepted_length:.2f} tok/cycle")
    if stats.ttft_ms is not None:
        parts.append(f"first token {stats.ttft_ms:.0f} ms")
    return " · ".join(parts) + " · f3 more"


def warmup_text(done: int, total: int | None, what: str, first_run: bool) -> str:
    """The status line during a warm-up: 'preparing kernels 3/9 · depth 1: first prompt', and on the first run
    on a machine why it takes long."""
    text = f"preparing kernels {done}/{total}" if total else "preparing kernels…"
    if what:
        text += f" · {what}"
    if first_run:
        text += " (first run on this machine: compiling kernels once)"
    return text
