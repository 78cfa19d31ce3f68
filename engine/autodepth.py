"""`--depth auto`: the speculation depth chosen per cycle to maximise expected tokens per second.

A cycle at depth k commits 1 + a_1 + a_1 a_2 + ... + a_1..a_k tokens on average, where a_i is the acceptance of
draft position i given that position i - 1 was accepted (how MTP heads behave: a rejection ends the cycle), and
costs c_k: one verify pass of k + 1 tokens plus k draft steps. Both are measured on the running reply: acceptance
per position as a running mean of the cycles' flags, the cost per depth as a running mean of the cycles' wall time
(a depth not tried yet is extrapolated from those that were: verify widths cost nearly alike, each draft step
adds). Depth 0 (plain decoding) wins when acceptance is low or drafting dear. A position past the chosen depth is
judged by no cycle, so now and then a cycle below the deepest depth drafts a token deeper (a probe): from depth 0, a
reply whose text becomes predictable again gets speculation back; from depth k, a low estimate at position k + 1
that a few rejections made is measured again instead of holding the depth below it for the rest of the reply.
Probes come every PROBE_EVERY cycles where a deeper cycle costs little more, further apart where it is dear, so
that what they cost over the chosen depth stays about PROBE_SHARE of the time (PROBE_MAX cycles apart at most;
every PROBE_UNSURE cycles while the position's estimate rests on fewer than MIN_JUDGED cycles).

`--drafter auto` (AutoDrafter, DrafterChooser) reuses these estimates, one DepthChooser per drafter: each cycle the
MTP head or the draft model, whichever has the higher expected tokens per second at the cycle's depth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .limits import MAX_DEPTH

PRIOR_ACCEPTANCE = 0.6  # before any cycle: what released MTP heads reach at the first position, roughly
WEIGHT = 0.15  # running means of the costs: the weight of the newest cycle (about the last 7 cycles count)
# of the acceptance: about the last 10 cycles. At 0.15 the estimate of a first position accepted half the time
# strayed below a break-even at 0.37 often enough that auto spent a quarter of a reply decoding plainly (auto_sim
# --costs cpu-demo-onednn --known-costs, flat 0.5: 0.929 of depth 1; with this and probe_loss 0.948; the demo
# head's profile 0.962 -> 0.976, flat 0 0.973 -> 0.970); a reply whose text turns hard is followed a few cycles
# later ('changing': 1.066 -> 1.041 of the best fixed depth); the 27B H200 costs: within 0.003 either way
ACCEPTANCE_WEIGHT = 0.1
# a fall from drafting to plain decoding needs plain decoding to be faster even at every position's acceptance
# estimate plus FALL_DOUBT standard errors (spread): on estimates a few cycles deep a fall is often a dip of the
# running mean, and plain cycles judge nothing, so that it held for PROBE_MAX cycles (the demo model on an H100:
# auto 0.93 of depth 3 over 24 rounds, bimodal, 1,633 of its 3,494 cycles plain, auto_ab_stop68_h100.json). Drafting
# on instead judges the positions again. auto_sim, 200 seeds of 256 tokens, --known-costs, auto / best fixed depth
# in expectation (0 -> 2): --costs h100-demo-68 --switch-ms 0.37: demo-gpu-65 0.945 -> 0.989, demo-gpu 0.936 ->
# 0.980, flat 0.5 0.976 -> 0.982, flat 0 0.956 -> 0.970, hard-easy x4 0.935 -> 0.954, changing 1.181 -> 1.123,
# hard then easy 1.152 -> 1.120; cpu-demo-onednn --switch-ms 3.8: flat 0.5 0.936 -> 0.977, hard-easy x4 0.908 ->
# 0.952, demo-gpu-65 0.969 -> 0.983, hard then easy 1.023 -> 0.992; h200-27b: flat 0 0.990 -> 0.982, the rest
# within 0.005 or higher
FALL_DOUBT = 2.0
PROBE_EVERY = 16
# a probe is due once the cycles since the last one have spent 1 / PROBE_SHARE times its cost (probe_loss: what a
# cycle one position deeper costs over the chosen depth's time for the tokens it is expected to commit; with every
# draft rejected, its extra cost), PROBE_EVERY cycles at the least, PROBE_MAX at the most. The
# 27B on the H200 (14.9 ms plain, 16.2 depth 1, 16.4-16.8 deeper): every 16 cycles as before. The demo model on a
# 2-core CPU (8.2 ms plain, 14.0 depth 1): every 16 cycles a probe from plain decoding cost 4% of a reply whose
# drafts were all rejected (auto_sim --costs cpu-demo, flat 0: auto 0.942 of plain); now every ~70 once the
# position has been judged MIN_JUDGED times (0.964; every PROBE_UNSURE cycles before that, below). The demo model
# on an H100 (0.165 ms plain, 0.35 depth 1, 0.37 of switch): a probe from plain decoding costs over 3 plain steps,
# and at PROBE_MAX = 64 the cap, not the share, spaced them: 5% of a reply whose drafts were all rejected (auto_sim
# --costs h100-demo-67 --switch-ms 0.37 --known-costs, 256 tokens, 500 seeds: flat 0 0.923 -> 0.946 of plain at
# 128; flat 0.5 0.935 -> 0.958; the demo head's profile 0.959 -> 0.972; hard text turning easy every 32 tokens
# 0.931 -> 0.955; the realistic profile 0.973 -> 0.971; the 27B's H200 and the demo's CPU costs unchanged)
PROBE_SHARE = 0.01
PROBE_MAX = 8 * PROBE_EVERY
# a position judged fewer than MIN_JUDGED times is probed every PROBE_UNSURE cycles, whatever it costs: its
# estimate rests on a cycle or two (one rejection at a reply's start put position 1 at 0.3 and held plain decoding
# at the demo's CPU costs for PROBE_MAX cycles: auto_sim --costs cpu-demo --known-costs at 0.92/0.84/0.65/0.54 fell
# from 0.954 of depth 3 to 0.938 with the probes spaced by cost alone; now 0.962)
PROBE_UNSURE = 4
# a position judged fewer times than this is drafted at a reply's first cycle and after a cycle that accepted every
# draft before it: where a draft step is dear (the demo model on a 2-core CPU: plain 8.2 ms, depth 1 14.0, depth 3
# 18.7 ms a cycle) the prior picks plain decoding, and with a probe every PROBE_EVERY cycles adding one position at a
# time auto reached depth 4 at flat acceptance 1.0 after some 20 cycles (auto_sim: 0.88 of depth 4 over 128 tokens)
MIN_JUDGED = 4
# a pick of plain decoding (not a probe) holds for the cycles before the next probe could be due, PROBE_EVERY - 1
# at most: plain cycles learn nothing but plain decoding's own cost, and the pick's host time was a tenth of a plain
# step on the demo model on a GPU (about 17 us on this 2-core CPU against a 0.18 ms step on an H100: auto 0.92x
# plain where it decoded 245 of 252 cycles plainly, stop 65)
HOLD_MAX = PROBE_EVERY - 1
# a cycle this many times the cheapest depth's running cost paid for something once (a CUDA-graph capture, a first
# kernel call, the allocator growing): not its depth's cost. One such 400 ms cycle taken as depth 4's cost made
# every deep depth look dear for the rest of a 27B reply (auto 2.54x plain where depth 4 gave 3.27x, H200)
OUTLIER = 5.0
# a cycle slower than this many times its depth's running cost counts as this many: a shared CPU's stall (another
# process, a GC pass) moves the estimate at most WEIGHT of the way to double, where a 4x cycle at WEIGHT 0.15 had
# moved it 45% and two such handed a never-accepted draft model the cycles for a stretch (test_draft_auto, CI)
SPIKE = 2.0


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens a depth-k cycle commits on average: the target's one plus each accepted draft."""
    return expected_by_depth(acceptance, k)[-1]


def expected_by_depth(acceptance: list[float], k: int) -> list[float]:
    """expected_tokens at every depth 0 .. k, in one pass (the chooser picks every cycle: its host time is a plain
    step's on a small model)."""
    out, run = [1.0], 1.0
    for a in acceptance[:k]:
        run *= a
        out.append(out[-1] + run)
    return out


def rates(acceptance: list[float], cost_ms: list[float]) -> list[float]:
    """Expected tokens a ms at every depth k = 0 .. len(cost_ms) - 1."""
    return [e / max(c, 1e-6) for e, c in zip(expected_by_depth(acceptance, len(cost_ms) - 1), cost_ms)]


def best_depth(rate_by_depth: list[float]) -> int:
    """argmax over k of rates(acceptance, cost_ms)[k] (the pure decision, tested on its own)."""
    return max(range(len(rate_by_depth)), key=lambda k: (rate_by_depth[k], -k))  # (ties: the shallower)


def stop_floors(acceptance: list[float], rate: float, step_ms: float, k: int) -> list[float]:
    """Per draft j of a depth-k chain (j = 1 .. k - 1): the drafter's probability of draft j below which the chain
    stops after it. Drafting j + 1 costs step_ms (a draft step and a verify row) and gains a token when draft j
    and then j + 1 are accepted: about p_j * acceptance[j], with the drafter's own probability p_j for the first.
    Worth it when that gain per ms is at least the cycle's expected rate (tokens a ms), so the floor is
    rate * step_ms / acceptance[j]. Where a draft step is dear (the demo model on a 2-core CPU: about 13 ms a plain
    cycle, 3-4 ms more a draft) floors of 0.3-0.7; where it is cheap (the 27B on the H200: the head is one layer
    of 64) next to 0, and the chain runs to k."""
    return [min(rate * step_ms / max(acceptance[j], 1e-6), 1.0) for j in range(1, k)]


@dataclass
class DepthChooser:
    max_depth: int
    acceptance: list[float] = field(default_factory=list)  # conditional acceptance per position
    cost: dict[int, float] = field(default_factory=dict)  # depth -> running mean of a cycle's wall ms
    since_probe: int = 0
    since_probe_ms: float = 0.0  # the expected cost of the cycles since the last probe (the running estimates)
    why: str = ""
    # the first cycles as a plain mean with the prior counted once (weight 1 / (n + 1), down to WEIGHT): one
    # drafter's estimate moves only while it drafts, so a loser's first cycles must count fully (--drafter auto)
    mean_first: bool = False
    judged: list[int] = field(default_factory=list)  # cycles that judged each position
    # the last cycle drafted and every draft was accepted; before any cycle True: nothing judged, the first drafts
    all_accepted: bool = True
    last_depth: int | None = None  # the depth of the last cycle observed
    probing: bool = False  # the last pick was a probe
    # what a drafting cycle right after plain ones took over its depth's cost (None: not seen yet): the drafter's
    # catch-up over the plain cycles' tokens, cold weights. A probe from plain decoding pays it (probe_loss); the
    # demo model on an H100: 0.33 ms of catch-up on a 0.46 ms plain step, which probes spaced as if it were free
    # (every ~50 cycles) made 3% of a reply (auto 0.96x plain where plain was 0.97 of the best depth)
    switch_ms: float | None = None
    held: int = 0  # plain picks left to hand out without reading the estimates (hold)
    # what the next switch owes from calls outside its own cycle: the fall's plain cycle before it (observe) and
    # the launch of the drafting cycle (the engine's owe)
    owed_ms: float = 0.0

    def __post_init__(self):
        self.acceptance = [PRIOR_ACCEPTANCE] * self.max_depth
        self.judged = [0] * self.max_depth
        self.cost = dict(self.cost)  # (a copy of what the last reply measured: estimates())

    def estimates(self) -> dict:
        """What the next reply's chooser starts from (DepthChooser(max_depth, **estimates)): this model's costs on
        this device, the switch's included; not the acceptance, which is the text's. Tried in stop 59 (the
        acceptance per position resumed, counted as 5 cycles, climbing on the new reply's first judgments): on the
        demo model (H100, H200) it probed about as often as a reply from the prior does once the switch is costed,
        and auto_sim put a reply after one of hard text far behind (the 27B's costs, flat 0.5 after flat 0: 0.936
        of the best fixed depth resumed, 0.998 from the prior): a confident 0 is probed rarely."""
        return {"cost": dict(self.cost), "switch_ms": self.switch_ms}

    def costs(self) -> list[float]:
        """c_k for every k: measured, or a line through the measured ones (two points), or the one measured
        plus a draft step guessed at a tenth of it. Plain decoding not measured yet: a step below that line
        (not below half the cheapest measured): a drafting cycle also runs the drafter over what the last one
        accepted, a plain one runs no drafter. On the line, depth 0 looked dearer than it is and was never
        tried: the demo model on a 2-core CPU, depths 1-4 measured at 14.0-21.0 ms, put plain decoding at 11.7
        ms where it takes 8.2, and auto drafted at depths 1-2 through replies that plain decoding ran 10% faster
        (auto_sim --costs cpu-demo, flat 0.5); the 27B on the H200: 16.0 (now 15.8) where it takes 14.9."""
        known = sorted(self.cost.items())
        if not known:
            return [1.0 + 0.1 * k for k in range(self.max_depth + 1)]
        if len(known) == 1:
            (k0, c0), step = known[0], known[0][1] * 0.1
        else:
            (k0, c0), (k1, c1) = known[0], known[-1]
            step = max((c1 - c0) / (k1 - k0), 0.0)
        line = [self.cost.get(k, c0 + step * (k - k0)) for k in range(self.max_depth + 1)]
        if k0 > 0 and len(known) > 1:
            line[0] = max(line[0] - step, min(line[0], c0 / 2))
        return line

    def rate(self, k: int, costs: list[float] | None = None) -> float:
        """Expected tokens per second of a depth-k cycle (the running estimates)."""
        return rates(self.acceptance, costs or self.costs())[k] * 1e3

    def pick(self) -> int:
        if self.held and self.last_depth == 0:  # (what probe does at depth 0 when it is not due)
            self.held -= 1
            self.since_probe += 1
            self.since_probe_ms += self.cost.get(0, 0.0)
            self.probing = False
            return 0
        costs = self.costs()
        by_depth = rates(self.acceptance, costs)
        self.why = "expected tok/s by depth " + ", ".join(f"{j}: {r * 1e3:.0f}" for j, r in enumerate(by_depth))
        k = self.probe(self.worth_falling(best_depth(by_depth), by_depth, costs), costs)
        self.held = self.hold(costs) if k == 0 and not self.probing and 0 in self.cost else 0
        if self.held:
            self.why += f"; held {self.held} cycles"
        return k

    def hold(self, costs: list[float]) -> int:
        """After a plain pick that is not a probe: how many of the next picks are plain decoding whatever depth 0's
        cost does meanwhile (HOLD_MAX at most), the picks before the next probe could be due (probe_due, counted
        at today's costs; the pick after them reads the estimates again and probes when due). A drafting cycle
        observed in between (a depth imposed from outside) ends the hold (observe)."""
        s, c0 = self.since_probe, max(costs[0], 1e-6)
        if self.judged[0] < MIN_JUDGED:
            due = PROBE_UNSURE - s
        else:
            extra = self.probe_loss(0, costs)
            due = min(PROBE_MAX - s, max(PROBE_EVERY - s, int((extra / PROBE_SHARE - self.since_probe_ms) / c0)))
        return max(0, min(due - 2, HOLD_MAX))  # (a pick early rather than a probe late: the sums round)

    def worth_falling(self, k: int, by_depth: list[float], costs: list[float]) -> int:
        """k, or the best drafting depth where k = 0 comes from drafting but is not sure: plain decoding is not
        faster at every position's acceptance estimate plus FALL_DOUBT spreads. A fall on a dip of the estimates
        holds plain decoding, which judges nothing, until a probe: PROBE_MAX cycles where a probe is dear. (It
        replaces a rule that kept drafting where the plain cycles before the next probe would save less than the
        switch back costs, switch_ms: stop 62's demo-gpu-62 0.903 -> 0.917 of depth 4 on the demo's H100 costs;
        with this rule that one changes no auto_sim result.)"""
        if k > 0 or not self.last_depth:
            return k
        j = best_depth([0.0] + by_depth[1:])
        hopeful = rates([min(a + FALL_DOUBT * self.spread(i), 1.0) for i, a in enumerate(self.acceptance)], costs)
        if max(hopeful[1:]) <= by_depth[0]:
            return k
        self.why += f"; depth {j} kept: plain decoding is faster only within {FALL_DOUBT:g} spreads of acceptance"
        return j

    def spread(self, i: int) -> float:
        """The standard error of position i's acceptance estimate, taken at the estimate: a running mean's at
        ACCEPTANCE_WEIGHT, a(1 - a) w / (2 - w). (Not the plain mean's of a reply's first cycles, mean_first: with
        its spread a reply whose text starts hard drafted on through its first cycles, auto_sim's hard then easy
        1.120 -> 1.025 of the best fixed depth on the demo's H100 costs.)"""
        a, w = self.acceptance[i], ACCEPTANCE_WEIGHT
        return (a * (1.0 - a) * w / (2.0 - w)) ** 0.5

    def floors(self, k: int) -> list[float]:
        """stop_floors for this cycle's depth k from the running estimates, added to why (its chain stops early
        on a doubtful draft: drafters.stops_after, on the CPU). Empty for a probe: it is there to judge position
        k and what depth k costs, which a chain stopped before it would not."""
        if self.probing or k < 2:
            return []
        costs = self.costs()
        floors = stop_floors(self.acceptance, expected_tokens(self.acceptance, k) / max(costs[k], 1e-6),
                             self.step_ms(costs), k)
        self.why += "; chain stops below p " + " ".join(f"{f:.2f}" for f in floors)
        return floors

    def step_ms(self, costs: list[float]) -> float:
        """What one more draft adds to a cycle: the slope of a least-squares line through the drafting depths'
        running costs (two neighbours' difference was noise: on the 2-core CPU each cost moves by a tenth, and
        depth 4 was measured cheaper than depth 3), or the line costs() extrapolates."""
        known = sorted((d, c) for d, c in self.cost.items() if d > 0)
        if len(known) < 2:
            return max(costs[-1] - costs[-2], 0.0)
        mean_d = sum(d for d, _ in known) / len(known)
        mean_c = sum(c for _, c in known) / len(known)
        slope = sum((d - mean_d) * (c - mean_c) for d, c in known) / sum((d - mean_d) ** 2 for d, _ in known)
        return max(slope, 0.0)

    def probe(self, k: int, costs: list[float] | None = None) -> int:
        """k, or k + 1 now and then below the deepest depth (probe_due): no cycle at depth k judges position
        k + 1, so its estimate stays what it was when the depth fell below it (a run of rejections there pinned
        depth 3 for the rest of a 1024-token reply whose 4th position is accepted half the time; from depth 0:
        has the text become predictable again?). While position k + 1 has been judged fewer than MIN_JUDGED
        times: every PROBE_UNSURE cycles. After a cycle whose drafts were all accepted (or before any cycle), one
        position past that cycle's depth while that position has been judged fewer times: a reply climbs from the
        prior a position a cycle, not one per probe, and a probe from plain decoding goes on past depth 1."""
        self.probing = False
        if k >= self.max_depth:
            self.since_probe, self.since_probe_ms = 0, 0.0
            return k
        costs = costs or self.costs()
        self.since_probe += 1
        self.since_probe_ms += costs[k]
        few = self.judged[k] < MIN_JUDGED
        due = self.since_probe >= PROBE_UNSURE if few else self.probe_due(self.probe_loss(k, costs))
        # (from the last cycle's depth, a probe's included: from the pick's, a climb from plain decoding went no
        # further than depth 1 and positions 2-4 kept the prior all reply; the demo model on an H100: 245 of 252
        # cycles plain where depth 3 ran 1.07x faster. auto_sim --costs h100-demo-62 --switch-ms 0.33
        # --known-costs: profile demo-gpu-62 0.876 -> 0.903 of depth 4, the realistic one 0.904 -> 0.941)
        climb = max(k, self.last_depth or 0)
        if self.all_accepted and climb < self.max_depth and self.judged[climb] < MIN_JUDGED:
            k, due = climb, True
        if due:
            self.since_probe, self.since_probe_ms, k, self.probing = 0, 0.0, k + 1, True
            self.why += f"; probing depth {k}"
        return k

    def probe_loss(self, k: int, costs: list[float]) -> float:
        """What a probe one position deeper than k is expected to cost: its cycle's time less what depth k's
        cycles would take for the tokens it is expected to commit. Near the estimates' break-even the probe costs
        next to nothing, and it is the probe that tells which side of it the reply is on."""
        per_token = costs[k] / expected_tokens(self.acceptance, k)
        # (right after plain cycles it also pays the switch)
        switch = (self.switch_ms or 0.0) if k == 0 and self.last_depth == 0 else 0.0
        return max(costs[k + 1] + switch - per_token * expected_tokens(self.acceptance, k + 1), 0.0)

    def probe_due(self, extra_ms: float) -> bool:
        """Whether this cycle probes, a probe costing extra_ms (probe_loss): once the cycles
        since the last probe (this one included) took 1 / PROBE_SHARE times that, and PROBE_EVERY of them at
        the least; PROBE_MAX at the most."""
        if self.since_probe >= PROBE_MAX:
            return True
        return self.since_probe >= PROBE_EVERY and PROBE_SHARE * self.since_probe_ms >= extra_ms

    def observe(self, depth: int, accepted: list[bool], ms: float | None) -> None:
        """One cycle: its depth, its per-position flags (Cycle.accepted_per_position) and its wall time (None:
        not a cost to go by). A drafting cycle after a plain one is not its depth's cost: it also pays for the
        switch (the drafter catching up on the plain cycles' tokens; on a CPU the verify widths' weights, cold in
        the caches after one-row steps). The demo model on the 2-core CPU: depth 1's cost learned from such
        cycles was 20.9 ms where its cycles in a row took 17.1, so auto held plain decoding (12.0 ms) through
        replies that depth 1 ran 1.2x faster; each probe from plain decoding only confirmed it. Nor is the plain
        cycle right after a drafting one plain decoding's cost: its step was launched once the drafting cycle was
        read, not ahead of the host (with graphs), and what it took over plain's cost is owed by the round trip,
        to the next switch (owe). The demo model on an H100: 0.25 ms against 0.165, and after some auto replies
        plain's estimate had risen to 0.19-0.23 ms, so that the next reply began drafting (stop 67)."""
        switched, fell = self.last_depth == 0 and depth > 0, bool(self.last_depth) and depth == 0
        self.last_depth = depth
        if depth:
            self.held = 0
        if switched:
            self.observe_switch(depth, ms)
        elif fell and 0 in self.cost:  # (with no plain cost yet, the fall's is the best there is)
            self.owe(ms)
        else:
            self.observe_cost(depth, ms)
        self.all_accepted = depth > 0 and len(accepted) == depth and all(accepted)
        for i, flag in enumerate(accepted):  # position i was judged: i == 0 or i - 1 was accepted
            if i < self.max_depth:
                self.judged[i] += 1
                w = max(ACCEPTANCE_WEIGHT, 1.0 / (self.judged[i] + 1)) if self.mean_first else ACCEPTANCE_WEIGHT
                self.acceptance[i] += w * (float(flag) - self.acceptance[i])
            if not flag:
                break

    def usable(self, ms: float | None) -> float | None:
        """ms, or None where it paid for something once (OUTLIER times the cheapest depth's cost)."""
        return None if ms is None or self.cost and ms > OUTLIER * min(self.cost.values()) else ms

    def owe(self, ms: float | None) -> None:
        """A plain cycle's call that was not plain decoding alone: the fall's (observe), or one that also launched
        the drafting cycle after it (the engine: with graphs the next cycle is launched before the call returns,
        the head's catch-up, draft and verify on the host; observed without a cost). What it took over plain's
        cost goes to the next switch (observe_switch)."""
        ms = self.usable(ms)
        self.owed_ms += max(ms - self.cost[0], 0.0) if ms is not None and 0 in self.cost else 0.0

    def observe_switch(self, depth: int, ms: float | None) -> None:
        """A drafting cycle after plain ones: what it took over its depth's cost is the switch's (switch_ms), with
        what the calls before it owe (owe: the launch, the fall before)."""
        ms, owed, self.owed_ms = self.usable(ms), self.owed_ms, 0.0
        if ms is None or not self.cost:  # (no cost measured yet to take it over)
            return
        extra = max(ms - self.costs()[depth], 0.0) + owed
        self.switch_ms = extra if self.switch_ms is None else self.switch_ms + WEIGHT * (extra - self.switch_ms)

    def observe_cost(self, depth: int, ms: float | None) -> None:
        """A cycle's wall time at `depth` (a fixed depth's cycles too: they cost what auto's would)."""
        old, ms = self.cost.get(depth), self.usable(ms)
        if ms is not None:
            self.cost[depth] = ms if old is None else old + WEIGHT * (min(ms, SPIKE * old) - old)
            cheapest = min(self.cost.values())  # (and a first cycle that was one: forgotten, measured again later)
            self.cost = {d: c for d, c in self.cost.items() if c <= OUTLIER * cheapest}


# --- --drafter auto: the MTP head or the draft model, whichever is expected to be faster --------------------------


class DrafterChooser:
    """One DepthChooser per drafter (its acceptance per position, its cost per depth: the same estimates as
    --depth auto's), and per cycle the drafter with the higher expected tokens per second at the cycle's depth.
    A drafter with no cost yet drafts first (each gets estimates); then the loser drafts one cycle in every
    PROBE_EVERY, so that one whose drafts become acceptable again (another kind of text) gets the cycles back."""

    def __init__(self, names: list[str], max_depth: int = MAX_DEPTH):
        self.estimates = {n: DepthChooser(max_depth, mean_first=True) for n in names}
        self.since_probe = 0
        self.why = ""
        self.warm: set = set()  # (drafter, depth) pairs past their first cycle

    def observe(self, name: str, depth: int, accepted: list[bool], ms: float) -> None:
        """A drafter's cycle. The first at each depth counts for acceptance only: it pays one-time costs
        (allocations, kernels' first calls, graph captures) that would stick to a drafter not drafting again."""
        first = (name, depth) not in self.warm
        self.warm.add((name, depth))
        self.estimates[name].observe(depth, accepted, None if first else ms)

    def pick(self, k: int) -> str:
        untried = [n for n, e in self.estimates.items() if not e.cost]
        if untried:
            self.why = f"drafter {untried[0]}: no estimate yet"
            return untried[0]
        rates = {n: e.rate(k) for n, e in self.estimates.items()}
        name, probe = max(rates, key=rates.get), ""
        self.since_probe += 1
        if self.since_probe >= PROBE_EVERY:  # has the loser's text become predictable again?
            self.since_probe, name, probe = 0, min(rates, key=rates.get), " (probing the slower)"
        self.why = (f"drafter {name}{probe}: expected tok/s at depth {k} "
                    + ", ".join(f"{n} {r:.0f}" for n, r in rates.items()))
        return name


class AutoDrafter:
    """--drafter auto: the MTP head and a draft model behind the one drafter interface, chosen per cycle by
    DrafterChooser. Per cycle, not per request: a probe costs one cycle, not a reply, and a reply whose text turns
    easier for the other drafter switches within it; the engine keeps one drafter (the turn cache's snapshots,
    the reuse across turns stay valid).

    Both stay in step with the committed sequence: each sees every prefill and commit (the head keeps the
    trunk's hiddens to run over, the draft settles only a chain of its own); the one that did not draft catches
    up when it next drafts, off the clock (a switch's catch-up is not what a cycle of it costs). A cycle's cost
    is its wall time from the proposal to its commit. The head's refresh inside greedy verify graphs
    (MTPDrafter.refresh_verified) is not used here: with CUDA graphs its refresh is a launch of its own."""

    def __init__(self, mtp, draft):
        self.mtp, self.draft = mtp, draft
        self.members = {mtp.name: mtp, draft.name: draft}
        self.name = f"auto({mtp.name}, {draft.name})"
        self.chooser = DrafterChooser(list(self.members))
        self.proposed = None  # (name, k, start time, why) of the proposal not committed yet
        self.judging = None  # the same, between a commit's keep and its observe_kept
        self.previous = None  # the drafter of the last proposal
        self.note = None  # the drafter of the last committed cycle that drafted, and why
        self.req, self.tally = None, {}  # the request drafted for, and its cycles per drafter

    # the turn cache snapshots and restores the head's position (reuse.py): the draft re-checks its own state
    # against the committed sequence at each request (DraftModelDrafter._check)
    cache = property(lambda self: self.mtp.cache)
    covered = property(lambda self: self.mtp.covered, lambda self, v: setattr(self.mtp, "covered", v))
    pending = property(lambda self: self.mtp.pending, lambda self, v: setattr(self.mtp, "pending", v))
    ready = property(lambda self: self.mtp.ready, lambda self, v: setattr(self.mtp, "ready", v))
    # (api.Engine.start_from reserves a request's room up front when a drafter replays graphs)
    graphs = property(lambda self: self.mtp.graphs if self.mtp.graphs is not None else self.draft.graphs)

    def reserve(self, n: int) -> None:
        """Room up to the head's position + n in both (api.Engine.start_from)."""
        end = self.mtp.covered + n
        self.mtp.reserve(n)
        self.draft.reserve(max(end - self.draft.covered, 0))

    def reset(self) -> None:
        self.mtp.reset()
        self.draft.reset()
        self.proposed = self.judging = self.previous = None

    def observe(self, hidden: torch.Tensor) -> None:
        self.mtp.observe(hidden)
        self.draft.observe(hidden)

    def prime(self, seq_tokens: torch.Tensor, upto: int) -> None:
        self.mtp.prime(seq_tokens, upto)
        self.draft.prime(seq_tokens, upto)

    def keep(self, hidden: torch.Tensor):
        self.judging, self.proposed = self.proposed, None
        return self.mtp.keep(hidden), self.draft.keep(hidden), hidden.shape[1]

    def observe_kept(self, kept) -> None:
        head, draft, rows = kept
        self.mtp.observe_kept(head)
        self.draft.observe_kept(draft)
        judged, self.judging = self.judging, None
        if judged is None:  # (a plain step; it may run ahead of the drafted cycle before it: note stays that one's)
            return
        name, k, t0, why = judged
        m = rows - 1  # drafts accepted
        self.chooser.observe(name, k, [True] * m + [False] * (m < k), (time.perf_counter() - t0) * 1e3)
        self.tally[name] = self.tally.get(name, 0) + 1
        self.note = why

    def rollback(self) -> None:
        self.mtp.rollback()
        self.draft.rollback()
        if self.judging is None:  # a dropped cycle (not a commit's rollback between keep and observe_kept)
            self.proposed = None

    def propose(self, seq_tokens: torch.Tensor, k: int, timer, req=None):
        if req is not self.req:
            self.req, self.tally = req, {}
        name = self.chooser.pick(k)
        d = self.members[name]
        if name != self.previous:  # a switch: catch up on what the other drafted, off the clock
            L = seq_tokens.shape[0]
            if d is self.draft:
                with timer.phase("draft"):
                    d.prime(seq_tokens, L - 1)
            else:
                with timer.phase("refresh"):
                    d.catch_up(seq_tokens)
            if seq_tokens.is_cuda:
                torch.cuda.synchronize(seq_tokens.device)
        self.previous = name
        t0 = time.perf_counter()
        out = d.propose(seq_tokens, k, timer, req)
        self.proposed = (name, out[0].shape[0], t0, self.chooser.why)  # (fewer than k: a chain stopped early)
        return out


def drafter_cycles(req, drafter) -> dict:
    """Finished.stats' drafter_cycles: how many of the request's cycles each drafter drafted."""
    if isinstance(drafter, AutoDrafter):
        return dict(drafter.tally) if drafter.req is req else {}
    n = req.per_position[0][0] if req.per_position else 0  # (cycles that drafted judge position 0)
    return {drafter.name: n} if drafter is not None and n else {}
