"""Fault injection for the decode loop: raise at the N-th tensor operation of a request.

A TorchDispatchMode sees every aten op the engine runs (on the CPU, graph replays included: graphs.Rerun runs the
step again), so counting ops places a fault anywhere in a cycle: the draft, the verify, the acceptance, the
commit's replay, the refresh, the launch ahead, the in-place plain step, the host reads.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODES = {"oom": lambda n: torch.OutOfMemoryError(f"injected out of memory at op {n}"),
         "error": lambda n: RuntimeError(f"injected failure at op {n}")}


class FaultAt(TorchDispatchMode):
    """Counts ops; raises MODES[mode] once, at op number `at` (None: count only)."""

    def __init__(self, at: int | None = None, mode: str = "oom"):
        super().__init__()
        self.at, self.mode, self.count, self.fired = at, mode, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if self.count == self.at:
            self.fired = str(func)
            raise MODES[self.mode](self.count)
        return func(*args, **(kwargs or {}))


def handed_out(engine, prompt, settings, fault: FaultAt | None = None):
    """(tokens handed out, the exception that ended the request or None, how many tokens were out when the engine
    recovered from an out-of-memory error or None), under `fault` when given."""
    from contextlib import nullcontext

    from engine.events import Fallback, Tokens

    tokens: list[int] = []
    recovered = None
    try:
        with fault if fault is not None else nullcontext():
            for ev in engine.generate(prompt, settings):
                if isinstance(ev, Tokens):
                    tokens += ev.token_ids
                elif isinstance(ev, Fallback) and ev.feature == "memory" and recovered is None:
                    recovered = len(tokens)
    except Exception as e:  # the request failed: what it handed out before must still be right
        return tokens, e, recovered
    return tokens, None, recovered
