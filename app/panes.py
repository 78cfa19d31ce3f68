"""Side panes: timing (per-phase times, throughput, acceptance, sparklines) and diagnostics."""

from __future__ import annotations

import os

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Label, Sparkline, Static

from .live import LiveStatic
from .safe_text import terminal_safe
from .stats import ReplyStats

DASH = "—"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return DASH if value is None else f"{value:{spec}}{suffix}"


def _bar(fraction: float, width: int = 14) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


Cell = str | tuple[str, str]  # text, or (text, style)


def grid(rows: list[list[Cell]], right: set[int] = frozenset(), gap: int = 1) -> Content:
    """Rows of cells as aligned columns (Content, not a Rich table: it is cheap to measure and draw, and the
    timing pane is redrawn while replies stream)."""
    def text(cell: Cell) -> str:
        return cell if isinstance(cell, str) else cell[0]

    widths = [max(len(text(row[i])) for row in rows if i < len(row)) for i in range(max(map(len, rows)))]
    parts: list[Cell] = []
    for r, row in enumerate(rows):
        for i, cell in enumerate(row):
            body = text(cell)
            padded = body.rjust(widths[i]) if i in right else body.ljust(widths[i])
            if i < len(row) - 1:
                padded += " " * gap
            parts.append(padded if isinstance(cell, str) else (padded, cell[1]))
        if r < len(rows) - 1:
            parts.append("\n")
    return Content.assemble(*parts)


class TimingPane(VerticalScroll):
    """Where the time of the current (or last) reply goes, updated live."""

    def compose(self) -> ComposeResult:
        yield LiveStatic(id="timing-depth")
        yield LiveStatic(id="timing-summary")
        yield Label("reasoning and answer", classes="pane-title", id="timing-parts-title")
        yield LiveStatic(id="timing-parts")
        yield Label("acceptance by draft position", classes="pane-title")
        yield LiveStatic(id="timing-positions")
        yield Label("phases, ms", classes="pane-title")
        yield LiveStatic(id="timing-phases")
        yield Label("tokens/s over the reply", classes="pane-title")
        yield Sparkline([], id="spark-tps")
        yield Label("acceptance over the reply", classes="pane-title")
        yield Sparkline([], id="spark-acceptance")

    def on_mount(self) -> None:
        self.show(ReplyStats(), depth=None)

    def show_depth(self, depth: int | None, cycle_depth: int | None = None, why: str = "") -> None:
        parts: list[Cell] = [("speculation depth ", "bold"), (DASH if depth is None else f" {depth} ", "bold reverse")]
        if depth == 0:
            parts.append("  plain decoding")
        if cycle_depth is not None:  # while a reply streams (its last cycle may be short: the token limit)
            parts.append((f"  (last cycle: {cycle_depth})", "dim"))
        if why:  # --depth auto: why the last cycle ran at its depth (the engine's words, not the model's text)
            parts.append((f"\n{why}", "dim"))
        self.query_one("#timing-depth", LiveStatic).show(Content.assemble(*parts))

    def show_parts(self, parts: dict[str, dict]) -> None:
        """Tokens, tokens/s and acceptance of the reasoning and of the answer (MTP acceptance usually differs
        between them); shown for replies with reasoning only."""
        for widget in (self.query_one("#timing-parts-title"), self.query_one("#timing-parts")):
            widget.display = bool(parts)
        if not parts:
            return
        rows: list[list[Cell]] = [["", ("tokens", "dim"), ("tok/s", "dim"), ("acceptance", "dim")]]
        for name, part in parts.items():
            rate = part.get("acceptance_rate")
            rows.append([name, _fmt(part.get("tokens"), "d"), _fmt(part.get("tokens_per_s"), ".1f"),
                         DASH if rate is None else f"{100 * rate:.1f}%"])
        self.query_one("#timing-parts", LiveStatic).show(grid(rows, right={1, 2, 3}, gap=2))

    def show(self, stats: ReplyStats, depth: int | None) -> None:
        last = stats.last_cycle
        if last is not None and stats.final is None:
            self.show_depth(depth, last.depth, last.why)
        else:
            self.show_depth(depth)

        rate = stats.acceptance_rate
        counted = bool(stats.cycles)
        summary = grid([
            [("tokens/s", "dim"), _fmt(stats.tokens_per_s, ".1f"), ("first token", "dim"),
             _fmt(stats.ttft_ms, ".0f", " ms")],
            [("acceptance", "dim"), DASH if rate is None else f"{100 * rate:.1f}%", ("tokens/cycle", "dim"),
             _fmt(stats.mean_accepted_length, ".2f")],
            [("cycles", "dim"), str(stats.cycles) if counted else DASH, ("tokens", "dim"),
             str(stats.tokens) if stats.tokens else DASH],
            [("drafted", "dim"), str(stats.drafted) if counted else DASH, ("accepted", "dim"),
             str(stats.accepted) if counted else DASH],
            # multi-turn reuse: prompt tokens whose state was kept from the previous turn vs newly prefilled
            [("prompt reused", "dim"), _fmt((stats.final or {}).get("reused_tokens"), "d"),
             ("prefilled", "dim"), _fmt((stats.final or {}).get("prefilled_tokens"), "d")],
        ])
        self.query_one("#timing-summary", LiveStatic).show(summary)
        self.show_parts(stats.parts())

        positions = [[f"d{i}", _bar(f), f"{100 * f:.0f}%"] for i, f in enumerate(stats.per_position, start=1)]
        self.query_one("#timing-positions", LiveStatic).show(grid(positions, right={2}) if positions else DASH)

        totals = stats.phase_ms
        last_phases = last.phase_ms if last else {}
        names = []
        if totals or last_phases:  # the engine's phase order (there are phases only once it has run)
            from engine import PHASES

            names = [p for p in PHASES if p in totals or p in last_phases]
            names += [p for p in list(totals) + list(last_phases) if p not in names]
        grand = sum(totals.values()) or 1.0
        rows: list[list[Cell]] = [["", ("last cycle", "dim"), ("reply", "dim"), ("share", "dim")]]
        for name in names:
            rows.append([
                name,
                f"{last_phases[name]:.2f}" if name in last_phases else DASH,
                f"{totals[name]:.1f}" if name in totals else DASH,
                f"{100 * totals.get(name, 0.0) / grand:.0f}%",
            ])
        self.query_one("#timing-phases", LiveStatic).show(grid(rows, right={1, 2, 3}, gap=2) if names else DASH)

        self.query_one("#spark-tps", Sparkline).data = list(stats.tps_series)
        self.query_one("#spark-acceptance", Sparkline).data = list(stats.acceptance_series)


def human_count(value) -> str:
    """270504 -> '270.5K', 80e9 -> '80.0B'."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        return DASH if value in (None, 0) else str(value)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return str(int(value))


def _scalar(value) -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_scalar(v) for v in value) if value else DASH
    return terminal_safe(str(value))  # paths, model names, error texts: never raw to the terminal


def threads_text(threads: int, cpus: int | None) -> str:
    """'1 of 2 CPUs (one left to the UI)': doctor counts the CPUs, the chat's torch uses one less."""
    if not cpus:
        return str(threads)
    return f"{threads} of {cpus} CPUs" + (" (one left to the UI)" if threads == cpus - 1 else "")


def _section(value) -> Table | Text:
    """One diagnostics section: key/value rows; a nested dict shows as 'name  first value' with the rest dim
    below (e.g. a backend and why it was chosen); a list of dicts as one line each."""
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict) and item:
                (first_key, first), *rest = item.items()
                cell = Text(_scalar(first) if first_key == "backend" else f"{first_key}: {_scalar(first)}")
                for sub_key, sub in rest:
                    line = _scalar(sub) if sub_key == "reason" else f"{sub_key}: {_scalar(sub)}"
                    cell.append(f"\n{line}", style="dim")
                table.add_row(_scalar(key), cell)
            elif key == "threads" and isinstance(item, int):
                table.add_row("torch threads", threads_text(item, os.cpu_count()))
            else:
                table.add_row(_scalar(key), _scalar(item if key != "params" else human_count(item)))
        return table
    if isinstance(value, list):
        if not value:
            return Text(DASH)
        for item in value:
            if isinstance(item, dict):
                values = list(item.values())
                table.add_row(_scalar(values[0]) if values else "", " · ".join(_scalar(v) for v in values[1:]))
            else:
                table.add_row("-", _scalar(item))
        return table
    return Text(_scalar(value))


class DiagnosticsPane(VerticalScroll):
    """The loaded model (``engine.info``) and ``engine.diagnostics()``: device, dtype, backends and why,
    versions, fallbacks, one section per top-level key."""

    def compose(self) -> ComposeResult:
        yield Static("loading…", id="diag-body")

    def show_loading(self, model: str | None) -> None:
        self.query_one("#diag-body", Static).update(Text(terminal_safe(f"loading {model or 'the default model'}…")))

    def show_failed(self, error: str) -> None:
        text = Text("no model loaded\n", style="bold")
        text.append(terminal_safe(error), style="red")
        self.query_one("#diag-body", Static).update(text)

    def show(self, info, diagnostics: dict) -> None:
        sections = dict(diagnostics)
        model = {key: getattr(info, key) for key in ("name", "family", "params", "mtp_layers", "path")
                 if hasattr(info, key)}
        sections["model"] = {**model, **{k: v for k, v in sections.get("model", {}).items() if k not in model}}
        sections = {"model": sections.pop("model"), **sections}
        parts = []
        for title, value in sections.items():
            parts.append(Text(_scalar(title), style="bold"))
            parts.append(_section(value))
            parts.append(Text(""))
        self.query_one("#diag-body", Static).update(Group(*parts))
