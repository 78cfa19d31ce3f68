"""Live statistics of one reply, built from the engine's cycles the decode thread reports. When the reply finishes,
the engine's own ``Finished.stats`` replace the live estimates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .reply_parts import ANSWER, REASONING
from .safe_text import terminal_safe

if TYPE_CHECKING:
    from engine import Cycle

SERIES_LENGTH = 120  # points kept for the sparklines


@dataclass
class ReplyStats:
    depth: int = 0  # the depth requested now (may change mid-reply)
    tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    first_token_ms: float | None = None  # time to first token, measured by the app's decode thread
    last_token_ms: float | None = None
    last_cycle: Cycle | None = None
    last_cycle_ms: float | None = None  # when the decode thread received last_cycle, ms after the reply started
    phase_total_ms: dict[str, float] = field(default_factory=dict)
    position_tries: list[int] = field(default_factory=list)
    position_hits: list[int] = field(default_factory=list)
    tps_series: list[float] = field(default_factory=list)
    acceptance_series: list[float] = field(default_factory=list)
    final: dict | None = None  # the engine's Finished.stats
    # a thinking model's reply, part by part ("reasoning", "answer"): tokens, drafts judged and accepted, and the
    # span of time the part's tokens arrived in
    part_tokens: dict[str, int] = field(default_factory=dict)
    part_drafted: dict[str, int] = field(default_factory=dict)
    part_accepted: dict[str, int] = field(default_factory=dict)
    part_span_ms: dict[str, list[float]] = field(default_factory=dict)  # part -> [first, last] arrival

    def add_parts(self, parts: list[str], t_ms: float) -> None:
        """Tokens of a chunk, by part, received ``t_ms`` after the reply started."""
        for part in dict.fromkeys(parts):
            self.part_tokens[part] = self.part_tokens.get(part, 0) + parts.count(part)
            span = self.part_span_ms.setdefault(part, [t_ms, t_ms])
            span[1] = t_ms

    def add_part_cycle(self, cycle: Cycle, part: str) -> None:
        self.part_drafted[part] = self.part_drafted.get(part, 0) + cycle.drafted
        self.part_accepted[part] = self.part_accepted.get(part, 0) + cycle.accepted

    def parts(self) -> dict[str, dict]:
        """Per part {tokens, acceptance_rate, tokens_per_s} (None where not known yet); empty for a reply without
        reasoning. The engine's final numbers win once the reply is finished."""
        if not self.part_tokens.get(REASONING):
            return {}
        final = (self.final or {}).get("parts") or {}
        out = {}
        for part in (REASONING, ANSWER):
            if part in final:
                f = final[part]
                out[part] = {"tokens": f.get("tokens"), "tokens_per_s": f.get("tokens_per_s"),
                             "acceptance_rate": f.get("acceptance_rate") if f.get("drafted") else None}
                continue
            tokens, drafted = self.part_tokens.get(part, 0), self.part_drafted.get(part, 0)
            first, last = self.part_span_ms.get(part, (0.0, 0.0))
            out[part] = {"tokens": tokens,
                         "tokens_per_s": (tokens - 1) / ((last - first) / 1000) if tokens > 1 and last > first
                         else None,
                         "acceptance_rate": self.part_accepted.get(part, 0) / drafted if drafted else None}
        return out

    def add_tokens(self, count: int, t_ms: float) -> None:
        if count and self.first_token_ms is None:
            self.first_token_ms = t_ms
        if count:
            self.last_token_ms = t_ms
        self.tokens += count

    def add_cycle(self, cycle: Cycle, t_ms: float) -> None:
        """One of the engine's cycles, received by the decode thread ``t_ms`` after the reply started."""
        previous_ms = self.last_cycle_ms
        self.cycles += 1
        self.drafted += cycle.drafted
        self.accepted += cycle.accepted
        for phase, ms in cycle.phase_ms.items():
            self.phase_total_ms[phase] = self.phase_total_ms.get(phase, 0.0) + ms
        for pos, hit in enumerate(cycle.accepted_per_position):
            if pos >= len(self.position_tries):
                self.position_tries.append(0)
                self.position_hits.append(0)
            self.position_tries[pos] += 1
            self.position_hits[pos] += bool(hit)
        # throughput of this cycle: wall time since the previous one, or its phase times for the first
        if previous_ms is not None and t_ms > previous_ms:
            seconds = (t_ms - previous_ms) / 1000
        else:
            seconds = sum(cycle.phase_ms.values()) / 1000
        if seconds > 0:
            self._push(self.tps_series, cycle.committed / seconds)
        if cycle.drafted:
            self._push(self.acceptance_series, cycle.accepted / cycle.drafted)
        self.last_cycle, self.last_cycle_ms = cycle, t_ms

    @staticmethod
    def _push(series: list[float], value: float) -> None:
        series.append(value)
        del series[:-SERIES_LENGTH]

    # derived values (the engine's final numbers win once the reply is finished) ------------------------
    def _final(self, key: str):
        return self.final.get(key) if self.final else None

    @property
    def tokens_per_s(self) -> float | None:
        final = self._final("tokens_per_s")
        if final is not None:
            return final
        if self.first_token_ms is None or self.last_token_ms is None or self.tokens < 2:
            return None
        span = (self.last_token_ms - self.first_token_ms) / 1000
        return (self.tokens - 1) / span if span > 0 else None

    @property
    def ttft_ms(self) -> float | None:
        final = self._final("ttft_ms")
        return final if final is not None else self.first_token_ms

    @property
    def acceptance_rate(self) -> float | None:
        final = self._final("acceptance_rate")
        if final is not None:
            return final
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens committed per verify cycle (accepted drafts + the target's token)."""
        final = self._final("mean_accepted_length")
        if final is not None:
            return final
        return (self.accepted + self.cycles) / self.cycles if self.cycles else None

    @property
    def per_position(self) -> list[float]:
        final = self._final("per_position_acceptance")
        if final is not None:
            return list(final)
        return [h / t if t else 0.0 for h, t in zip(self.position_hits, self.position_tries)]

    @property
    def phase_ms(self) -> dict[str, float]:
        final = self._final("phase_ms")
        return dict(final) if final else dict(self.phase_total_ms)

    def summary(self) -> dict:
        """The numbers so far under the engine's stats keys: what a reply cut off by the app's exit keeps."""
        if self.final:
            return dict(self.final)
        return {"depth": self.depth, "cycles": self.cycles, "drafted": self.drafted, "accepted": self.accepted,
                "generated_tokens": self.tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "tokens_per_s": self.tokens_per_s,
                "ttft_ms": self.ttft_ms, "per_position_acceptance": self.per_position, "phase_ms": self.phase_ms}


def stats_line(stats: dict | None) -> str:
    """A finished reply's numbers on one line: '52.1 tok/s · depth 2 · 71% accepted · 2.42 tok/cycle', the drafter
    named when it is not the MTP head ('· draft:Qwen3-0.6B ·'): the transcript's footers and the Markdown export."""
    if not stats:
        return ""
    parts = []
    if stats.get("tokens_per_s") is not None:
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("depth") is not None:
        parts.append(f"depth {stats['depth']}")
    if stats.get("drafted"):
        if stats.get("drafter") not in (None, "mtp"):  # a draft model, or --drafter auto: which drafted
            parts.append(terminal_safe(str(stats["drafter"])))
        if stats.get("acceptance_rate") is not None:
            parts.append(f"{100 * stats['acceptance_rate']:.0f}% accepted")
        if stats.get("mean_accepted_length") is not None:
            parts.append(f"{stats['mean_accepted_length']:.2f} tok/cycle")
    return " · ".join(parts)
