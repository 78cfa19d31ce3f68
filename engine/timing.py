"""Phase timers: CUDA events on the GPU (read back without extra host syncs), perf_counter on the CPU."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASES = ("prefill", "priming", "draft", "verify", "accept", "commit", "refresh", "sampling", "detokenize")


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # the stream the events are recorded on, looked up once: Event.record() looks it up on every call, which
        # was the larger part of the timer's host time per cycle (H200 host, cProfile), time the GPU may wait for
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.pending: list[tuple[str, object, object]] = []  # CUDA: (phase, start event, end event)
        self.totals: dict[str, float] = {}
        self.recent: dict[str, float] = {}
        self.handed: list = []  # (event, phase): the current phase's time after each event counts there

    @contextmanager
    def phase(self, name: str):
        start, end = self.mark(), self.mark()
        start.record(self.stream)
        self.handed = []
        try:
            yield
        finally:
            end.record(self.stream)
            marks = [start] + [e for e, _ in self.handed] + [end]
            names = [name] + [later for _, later in self.handed]
            self.handed = []
            for phase, a, b in zip(names, marks, marks[1:]):
                if self.cuda:  # (read later, without a host sync: collect)
                    self.pending.append((phase, a, b))
                else:
                    self._add(self.recent, phase, (b.t - a.t) * 1e3)

    def mark(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else HostMark()

    def hand_over(self, event, name: str) -> None:
        """Inside phase(): from `event` on (a CUDA event, or a HostMark on the CPU, recorded inside a graph that
        does several phases' work; in order) the time counts as phase `name`. No-op without an event."""
        if event is not None:
            self.handed.append((event, name))

    def _add(self, into: dict, name: str, ms: float) -> None:
        into[name] = into.get(name, 0.0) + ms

    def start_cycle(self) -> None:
        self.recent = {}

    def collect(self, block: bool = False) -> dict[str, float]:
        """Phase times that are known now. On CUDA only finished events are read (block=True waits at the end)."""
        if self.cuda:
            keep = []
            for name, start, end in self.pending:
                if block or (end.query() and start.query()):  # (a graph's events: both, in any order)
                    end.synchronize()
                    self._add(self.recent, name, start.elapsed_time(end))
                else:
                    keep.append((name, start, end))
            self.pending = keep
        out, self.recent = self.recent, {}
        for k, v in out.items():
            self._add(self.totals, k, v)
        return out


class HostMark:
    """The CPU's stand-in for a CUDA event recorded inside a graph (graphs.Rerun runs the step on the host)."""

    t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()
