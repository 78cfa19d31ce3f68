"""`--depth auto`: the speculation depth chosen per cycle to maximise expected tokens per second.

A cycle at depth k commits 1 + a_1 + a_1 a_2 + ... + a_1..a_k tokens on average, where a_i is the acceptance of
draft position i given that position i - 1 was accepted (how MTP heads behave: a rejection ends the cycle), and
costs c_k: one verify pass of k + 1 tokens plus k draft steps. Both are measured on the running reply: acceptance
per position as a running mean of the cycles' flags, the cost per depth as a running mean of the cycles' wall time
(a depth not tried yet is extrapolated from those that were: verify widths cost nearly alike, each draft step
adds). Depth 0 (plain decoding) wins when acceptance is low or drafting dear; every PROBE_EVERY cycles at depth 0
one cycle drafts a single token, so a reply whose text becomes predictable again gets speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6  # before any cycle: what released MTP heads reach at the first position, roughly
WEIGHT = 0.15  # running means: the weight of the newest cycle (about the last 7 cycles count)
PROBE_EVERY = 16


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens a depth-k cycle commits on average: the target's one plus each accepted draft."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def best_depth(acceptance: list[float], cost_ms: list[float]) -> int:
    """argmax over k of expected_tokens(acceptance, k) / cost_ms[k] (the pure decision, tested on its own)."""
    rates = [expected_tokens(acceptance, k) / max(c, 1e-6) for k, c in enumerate(cost_ms)]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))  # (ties: the shallower)


@dataclass
class DepthChooser:
    max_depth: int
    acceptance: list[float] = field(default_factory=list)  # conditional acceptance per position
    cost: dict[int, float] = field(default_factory=dict)  # depth -> running mean of a cycle's wall ms
    since_probe: int = 0
    why: str = ""

    def __post_init__(self):
        self.acceptance = [PRIOR_ACCEPTANCE] * self.max_depth

    def costs(self) -> list[float]:
        """c_k for every k: measured, or a line through the measured ones (two points), or the one measured
        plus a draft step guessed at a tenth of it."""
        known = sorted(self.cost.items())
        if not known:
            return [1.0 + 0.1 * k for k in range(self.max_depth + 1)]
        if len(known) == 1:
            (k0, c0), step = known[0], known[0][1] * 0.1
        else:
            (k0, c0), (k1, c1) = known[0], known[-1]
            step = max((c1 - c0) / (k1 - k0), 0.0)
        return [self.cost.get(k, c0 + step * (k - k0)) for k in range(self.max_depth + 1)]

    def pick(self) -> int:
        costs = self.costs()
        k = best_depth(self.acceptance, costs)
        self.since_probe = self.since_probe + 1 if k == 0 else 0
        rates = ", ".join(f"{j}: {expected_tokens(self.acceptance, j) / costs[j] * 1e3:.0f}"
                          for j in range(len(costs)))
        self.why = f"expected tok/s by depth {rates}"
        if k == 0 and self.since_probe >= PROBE_EVERY:  # has the text become predictable again?
            self.since_probe, k = 0, 1
            self.why += "; probing depth 1"
        return k

    def observe(self, depth: int, accepted: list[bool], ms: float) -> None:
        """One cycle: its depth, its per-position flags (Cycle.accepted_per_position) and its wall time."""
        old = self.cost.get(depth)
        self.cost[depth] = ms if old is None else old + WEIGHT * (ms - old)
        for i, flag in enumerate(accepted):  # position i was judged: i == 0 or i - 1 was accepted
            if i < self.max_depth:
                self.acceptance[i] += WEIGHT * (float(flag) - self.acceptance[i])
            if not flag:
                break
