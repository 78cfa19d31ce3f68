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
        self.handed: tuple | None = None  # (event, phase): the current phase's time after event counts there

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            self.handed = None
            try:
                yield
            finally:
                end.record(self.stream)
                if self.handed is None:
                    self.pending.append((name, start, end))
                else:
                    (mid, later), self.handed = self.handed, None
                    self.pending += [(name, start, mid), (later, mid, end)]
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._add(self.recent, name, (time.perf_counter() - t0) * 1e3)

    def hand_over(self, event, name: str) -> None:
        """Inside phase(): from `event` on (recorded on the device, e.g. inside a CUDA graph that does two
        phases' work) the time counts as phase `name`. No-op without an event (the CPU: no split)."""
        if self.cuda and event is not None:
            self.handed = (event, name)

    def _add(self, into: dict, name: str, ms: float) -> None:
        into[name] = into.get(name, 0.0) + ms

    def start_cycle(self) -> None:
        self.recent = {}

    def collect(self, block: bool = False) -> dict[str, float]:
        """Phase times that are known now. On CUDA only finished events are read (block=True waits at the end)."""
        if self.cuda:
            keep = []
            for name, start, end in self.pending:
                if block or end.query():
                    end.synchronize()
                    self._add(self.recent, name, start.elapsed_time(end))
                else:
                    keep.append((name, start, end))
            self.pending = keep
        out, self.recent = self.recent, {}
        for k, v in out.items():
            self._add(self.totals, k, v)
        return out
