"""Phase timers: CUDA events on the GPU (read back without extra host syncs), perf_counter on the CPU."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

PHASES = ("prefill", "priming", "draft", "verify", "accept", "commit", "refresh", "sampling", "detokenize")
# phases that are the host's work alone, timed on its clock: CUDA events around them measured how far the GPU's
# queue moved meanwhile, and cost two events a token on the demo model's host-bound plain steps
HOST_PHASES = ("detokenize",)


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
        # this timer's own marks, read and free to record again (a CUDA event each phase's start and end, created
        # once: not per cycle), and the ids of all of them (not the graphs' events that hand_over brings)
        self.free: list = []
        self.own: set[int] = set()

    @contextmanager
    def phase(self, name: str):
        if name in HOST_PHASES:
            t = time.perf_counter()
            try:
                yield
            finally:
                self._add(self.recent, name, (time.perf_counter() - t) * 1e3)
            return
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
                    self.release(a, b)

    def mark(self):
        if self.free:
            return self.free.pop()
        m = torch.cuda.Event(enable_timing=True) if self.cuda else HostMark()
        self.own.add(id(m))
        return m

    def release(self, *marks) -> None:
        """Marks whose times were read: this timer's own are recorded again by later phases."""
        self.free.extend(m for m in marks if id(m) in self.own)

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
                    self.release(start, end)
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
