"""Committed-state reuse across turns.

Attention KV trims back to any prefix; GDN state cannot be rewound. So the engine keeps the state it has (the
processed history) and, at the end of each prompt, a snapshot of the GDN state, the MTP drafter's position and
the prompt's last logits. A new prompt that extends the history continues from it; one that diverges (an edit,
a regenerate, a template that rewrites earlier turns) restarts from the latest snapshot still on its prefix, or
from zero. Snapshots past a restore point are dropped: their KV and MTP entries may be overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SNAPSHOTS = 4


@dataclass
class Snapshot:
    n: int  # prompt tokens processed when it was taken
    conv: torch.Tensor
    recurrent: torch.Tensor
    logits: torch.Tensor  # the prompt's last-position logits [1, V]
    mtp_covered: int
    mtp_pending: list
    window: tuple | None = None  # sliding-window rings (rotating_cache.RotatingKV.snapshot): they cannot trim back

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent, self.logits)) + sum(
            t.numel() * t.element_size() for t in self.mtp_pending + list(self.window or ()))


class TurnCache:
    def __init__(self):
        self.history: list[int] = []  # tokens the trunk caches hold, in order
        self.snapshots: list[Snapshot] = []
        self.drafter = None  # the drafter that observed the history (another one's state would be stale)

    def reset(self) -> None:
        self.history, self.snapshots, self.drafter = [], [], None

    def plan(self, prompt: list[int], drafter) -> tuple[int, Snapshot | None]:
        """(tokens to reuse, snapshot to restore or None to continue from the live state)."""
        if drafter is not self.drafter:
            return 0, None
        common = 0
        for a, b in zip(self.history, prompt):
            if a != b:
                break
            common += 1
        if common == len(self.history) and common < len(prompt):
            return common, None  # the prompt extends what the caches hold
        usable = [s for s in self.snapshots if s.n <= common]
        if usable:
            return usable[-1].n, usable[-1]
        return 0, None

    def restore(self, snap: Snapshot, caches, drafter) -> None:
        caches.gdn.conv.copy_(snap.conv)
        caches.gdn.recurrent.copy_(snap.recurrent)
        caches.processed = snap.n
        caches.abort()  # trims KV to n
        if snap.window is not None:
            caches.window.restore(snap.window)
        if drafter is not None and hasattr(drafter, "cache"):
            drafter.covered = snap.mtp_covered
            drafter.cache.trim(snap.mtp_covered)
            drafter.pending = list(snap.mtp_pending)
            drafter.ready = None
        self.history = self.history[: snap.n]
        self.snapshots = [s for s in self.snapshots if s.n <= snap.n]

    def take(self, n: int, logits: torch.Tensor, caches, drafter) -> None:
        if any(s.n == n for s in self.snapshots):
            return
        covered = getattr(drafter, "covered", 0)
        pending = list(getattr(drafter, "pending", []))
        window = caches.window.snapshot() if caches.window is not None else None
        self.snapshots.append(Snapshot(n, caches.gdn.conv.clone(), caches.gdn.recurrent.clone(), logits.clone(),
                                       covered, pending, window))
        self.snapshots = self.snapshots[-MAX_SNAPSHOTS:]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)
