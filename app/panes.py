"""Side panes: timing (per-phase times, throughput, acceptance, sparklines) and diagnostics."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Sparkline, Static

from .export import PHASES
from .stats import ReplyStats

DASH = "—"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return DASH if value is None else f"{value:{spec}}{suffix}"


def _bar(fraction: float, width: int = 14) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


class TimingPane(VerticalScroll):
    """Where the time of the current (or last) reply goes, updated live."""

    def compose(self) -> ComposeResult:
        yield Static(id="timing-depth")
        yield Static(id="timing-summary")
        yield Label("acceptance by draft position", classes="pane-title")
        yield Static(id="timing-positions")
        yield Label("phases (ms)", classes="pane-title")
        yield Static(id="timing-phases")
        yield Label("tokens/s over the reply", classes="pane-title")
        yield Sparkline([], id="spark-tps")
        yield Label("acceptance over the reply", classes="pane-title")
        yield Sparkline([], id="spark-acceptance")

    def on_mount(self) -> None:
        self.show(ReplyStats(), depth=None)

    def show_depth(self, depth: int | None, cycle_depth: int | None = None) -> None:
        text = Text()
        text.append("speculation depth ", style="bold")
        text.append(DASH if depth is None else str(depth), style="bold reverse")
        if depth == 0:
            text.append("  (plain decoding)")
        if cycle_depth is not None and cycle_depth != depth:
            text.append(f"  last cycle ran at {cycle_depth}")
        self.query_one("#timing-depth", Static).update(text)

    def show(self, stats: ReplyStats, depth: int | None) -> None:
        last = stats.last_cycle
        self.show_depth(depth, last.depth if last else None)

        summary = Table.grid(padding=(0, 1))
        summary.add_column(style="dim")
        summary.add_column(justify="right")
        summary.add_row("tokens/s", _fmt(stats.tokens_per_s, ".1f"))
        summary.add_row("first token", _fmt(stats.ttft_ms, ".0f", " ms"))
        rate = stats.acceptance_rate
        summary.add_row("acceptance", DASH if rate is None else f"{100 * rate:.1f}%")
        summary.add_row("tokens/cycle", _fmt(stats.mean_accepted_length, ".2f"))
        summary.add_row("cycles", str(stats.cycles) if stats.cycles else DASH)
        summary.add_row("drafted / accepted", f"{stats.drafted} / {stats.accepted}" if stats.cycles else DASH)
        summary.add_row("tokens", str(stats.tokens) if stats.tokens else DASH)
        self.query_one("#timing-summary", Static).update(summary)

        positions = Table.grid(padding=(0, 1))
        for index, fraction in enumerate(stats.per_position, start=1):
            positions.add_row(f"d{index}", _bar(fraction), f"{100 * fraction:3.0f}%")
        self.query_one("#timing-positions", Static).update(positions if stats.per_position else DASH)

        totals = stats.phase_ms
        last_phases = last.phase_ms if last else {}
        names = [p for p in PHASES if p in totals or p in last_phases]
        names += [p for p in list(totals) + list(last_phases) if p not in names]
        grand = sum(totals.values()) or 1.0
        phases = Table(box=None, padding=(0, 1), show_edge=False, header_style="dim")
        phases.add_column("phase")
        phases.add_column("last", justify="right")
        phases.add_column("total", justify="right")
        phases.add_column("%", justify="right")
        for name in names:
            phases.add_row(
                name,
                f"{last_phases[name]:.2f}" if name in last_phases else DASH,
                f"{totals[name]:.1f}" if name in totals else DASH,
                f"{100 * totals.get(name, 0.0) / grand:.0f}",
            )
        self.query_one("#timing-phases", Static).update(phases if names else DASH)

        self.query_one("#spark-tps", Sparkline).data = list(stats.tps_series)
        self.query_one("#spark-acceptance", Sparkline).data = list(stats.acceptance_series)


def _rows(value, prefix: str = "") -> list[tuple[str, str]]:
    """Flatten nested diagnostics into (key, value) rows."""
    if isinstance(value, dict):
        rows = []
        for key, item in value.items():
            name = f"{prefix}{key}"
            if isinstance(item, (dict, list)) and item:
                rows.append((name, ""))
                rows += _rows(item, prefix + "  ")
            else:
                rows.append((name, _scalar(item)))
        return rows
    if isinstance(value, list):
        rows = []
        for item in value:
            if isinstance(item, dict):
                first = True
                for key, sub in item.items():
                    rows.append((f"{prefix}{'- ' if first else '  '}{key}", _scalar(sub)))
                    first = False
            else:
                rows.append((f"{prefix}-", _scalar(item)))
        return rows
    return [(prefix.strip() or "value", _scalar(value))]


def _scalar(value) -> str:
    if value is None:
        return DASH
    if isinstance(value, (dict, list)):
        return DASH if not value else str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class DiagnosticsPane(VerticalScroll):
    """The loaded model (``engine.info``) and ``engine.diagnostics()``: device, dtype, backends and why,
    versions, fallbacks."""

    def compose(self) -> ComposeResult:
        yield Label("model", classes="pane-title")
        yield Static(DASH, id="diag-model")
        yield Label("engine", classes="pane-title")
        yield Static("loading…", id="diag-engine")

    def show_loading(self, model: str | None) -> None:
        self.query_one("#diag-model", Static).update(Text(f"loading {model or 'the default model'}…"))
        self.query_one("#diag-engine", Static).update(DASH)

    def show_failed(self, error: str) -> None:
        self.query_one("#diag-model", Static).update(Text("no model loaded", style="bold"))
        self.query_one("#diag-engine", Static).update(Text(error, style="red"))

    def show(self, info, diagnostics: dict) -> None:
        model = {}
        for key in ("name", "family", "params", "mtp_layers", "device", "dtype", "path"):
            if hasattr(info, key):
                model[key] = getattr(info, key)
        self.query_one("#diag-model", Static).update(self._table(_rows(model)))
        self.query_one("#diag-engine", Static).update(self._table(_rows(diagnostics)))

    @staticmethod
    def _table(rows: list[tuple[str, str]]) -> Table:
        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(key, value)
        return table
