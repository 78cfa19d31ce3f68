"""--depth auto: the chooser as a pure decision on acceptance and cost, and auto decoding lossless."""

import math
import pytest

from engine import autodepth
from engine import AUTO, DecodeControl, GenerationSettings
from engine.autodepth import (HOLD_MAX, MIN_JUDGED, PROBE_EVERY, PROBE_MAX, PROBE_SHARE, PROBE_UNSURE, SPIKE, WEIGHT,
                              DepthChooser, best_depth, expected_tokens, rates, stop_floors)
from engine.events import Cycle, Tokens
from test_exactness import FAMILIES, assert_mtp_drafts_accepted_and_rejected, decode


def mid_reply(c: DepthChooser, acceptance: list[float]) -> DepthChooser:
    """c as if this reply's cycles had judged every position MIN_JUDGED times, to these estimates."""
    c.acceptance, c.judged = list(acceptance), [MIN_JUDGED] * 4
    return c


def test_expected_tokens_counts_the_accepted_prefix():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([1.0] * 4, 4) == 5.0


def test_best_depth_maximises_expected_tokens_per_second():
    flat = [1.0, 1.1, 1.2, 1.3, 1.4]  # cheap drafts, verify widths nearly free
    assert best_depth(rates([0.95] * 4, flat)) == 4  # easy text: draft deep
    assert best_depth(rates([0.0] * 4, flat)) == 0  # nothing accepted: plain decoding
    assert best_depth(rates([0.9, 0.05, 0.0, 0.0], flat)) == 1  # only the first position pays
    assert best_depth(rates([0.9] * 4, [1.0, 3.0, 5.0, 7.0, 9.0])) == 0  # drafting dearer than what it saves
    # a realistic profile: whichever depth has the highest expected rate
    real = [0.92, 0.84, 0.65, 0.54]
    by_depth = [expected_tokens(real, k) / c for k, c in enumerate(flat)]
    assert rates(real, flat) == pytest.approx(by_depth)
    assert best_depth(rates(real, flat)) == max(range(5), key=by_depth.__getitem__)


def test_the_chooser_falls_to_plain_decoding_and_recovers():
    c = DepthChooser(4)
    for _ in range(26):  # cycles whose drafts are all rejected (a draft step 3 ms: plain decoding faster even at
        depth = c.pick()  # FALL_DOUBT spreads of acceptance)
        c.observe(depth, [False] * depth, 10.0 + 3 * depth)
    assert c.pick() == 0 or "probing" in c.why
    picks = []
    for _ in range(4 * PROBE_EVERY):  # the text turns predictable: the probes see it, the depth comes back
        depth = c.pick()
        picks.append(depth)
        c.observe(depth, [True] * depth, 10.0 + depth)
    assert picks[-1] >= 2 and 0 in picks


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_is_lossless(name, engines, monkeypatch):
    """The chooser is shown a fixed cost per depth (a machine where drafting pays), not this machine's clock, so
    the depths it picks, and with them drafts accepted and rejected, are the same on every host: on the H200
    host's CPU the measured costs held q35's reply at plain decoding after its first drafts were rejected."""
    observe = DepthChooser.observe
    monkeypatch.setattr(DepthChooser, "observe", lambda self, depth, accepted, ms: observe(self, depth, accepted,
                                                                                           10.0 + depth))
    engine = engines(name)
    monkeypatch.setattr(engine, "auto_estimates", {})  # (not what earlier tests' replies measured)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain, _, _ = decode(engine, prompt, depth=0)
    tokens, _, fin = decode(engine, prompt, depth=AUTO)
    assert tokens == plain
    assert fin.stats["depth"] == AUTO and sum(fin.stats["auto_depths"].values()) == fin.stats["cycles"]
    assert_mtp_drafts_accepted_and_rejected(fin)


def test_switching_between_auto_and_a_fixed_depth_mid_reply_is_exact(engines):
    engine = engines("next")
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    control = DecodeControl(AUTO)
    tokens, whys, depths = [], [], []
    schedule = {3: 2, 6: AUTO, 9: 0, 12: AUTO}
    for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=40, depth=AUTO, ignore_eos=True), control):
        if isinstance(ev, Cycle):
            depths.append(control.depth)
            whys.append(ev.why)
            control.depth = schedule.get(ev.index, control.depth)
        elif isinstance(ev, Tokens):
            tokens += ev.token_ids
    assert tokens == plain
    assert {AUTO, 2, 0} <= set(depths)
    assert all(w.startswith("expected tok/s") for w, d in zip(whys, depths) if d == AUTO)


def test_a_bad_depth_is_refused(engines):
    from engine import EngineError

    engine = engines("next")
    with pytest.raises(EngineError, match="or auto"):
        list(engine.generate([1, 2, 3], GenerationSettings(depth="deep")))


def test_a_cycle_that_paid_a_one_time_cost_is_not_its_depths_cost():
    """A graph capture inside one cycle (here 40x the others) must not make its depth, nor the depths the cost
    line extrapolates past it, look dear: at full acceptance the chooser still goes deep."""
    for first in (True, False):  # the outlier as the reply's first cycle, or later
        c = DepthChooser(4, mean_first=True)
        for i in range(30):
            depth = c.pick()
            slow = (i == 0) if first else (depth == 4 and 4 not in c.cost)
            c.observe(depth, [True] * depth, 400.0 if slow else 10.0 + 0.1 * depth)
        assert c.pick() == 4, (first, c.cost, c.why)
        assert max(c.cost.values()) < 20.0


def test_a_stalled_cycle_moves_its_depths_cost_a_little_and_a_lasting_change_is_followed():
    """A shared CPU stalls a cycle now and then (4x here, under the one-time-cost cut): the estimate moves at most
    WEIGHT of the way to SPIKE times itself. A cost that really changes (a longer context) is followed within
    a few cycles all the same."""
    c = DepthChooser(4)
    for ms in (10.0, 10.0, 40.0, 40.0):
        c.observe(2, [True, True], ms)
    assert c.cost[2] == pytest.approx(10.0 * (1 + WEIGHT * (SPIKE - 1)) ** 2)  # (17.8 without the cut)
    for _ in range(12):
        c.observe(2, [True, True], 30.0)
    assert c.cost[2] > 27.0


def test_a_position_past_the_chosen_depth_is_measured_again():
    """A run of rejections at position 4 drops its estimate below what depth 4 needs, and no depth-3 cycle judges
    position 4: without a deeper probe, depth 3 held for the rest of the reply however good the drafts became
    (auto_sim: 7% of 1024-token runs at 0.92/0.84/0.65/0.54 below 0.97 of the best fixed depth)."""
    c, cost = DepthChooser(4), {3: 16.35, 4: 16.8}
    for _ in range(30):
        c.observe(3, [True] * 3, cost[3])
        c.observe(4, [True] * 3 + [False], cost[4])
    picks = []
    for _ in range(2 * PROBE_EVERY):  # every draft is accepted from here on
        depth = c.pick()
        picks.append(depth)
        c.observe(depth, [True] * depth, cost[depth])
    assert picks[: PROBE_EVERY - 1] == [3] * (PROBE_EVERY - 1)  # the stale estimate holds depth 3 ...
    assert picks[-PROBE_EVERY:] == [4] * PROBE_EVERY  # ... until a probe measures position 4 again


def test_probes_are_spaced_by_what_they_cost_over_the_chosen_depth():
    """A probe from plain decoding every PROBE_EVERY cycles where a depth-1 cycle costs 14.0 ms to a plain one's 8.2
    (the demo model on a 2-core CPU) cost 4% of a reply whose drafts were all rejected (auto_sim --costs cpu-demo,
    flat 0: auto 0.942 of plain). A probe is due once the cycles since the last one took 1 / PROBE_SHARE times its
    extra cost: every PROBE_EVERY cycles where it is cheap (the 27B on the H200), further apart where it is dear,
    PROBE_MAX cycles apart at the most: a rejected position is still measured again."""
    cpu = {0: 8.2, 1: 14.0, 2: 16.4, 3: 18.7, 4: 21.0}
    h200 = {0: 14.86, 1: 16.2, 2: 16.4, 3: 16.35, 4: 16.8}
    between = {0: 10.0, 1: 12.0, 2: 13.0, 3: 14.0, 4: 15.0}  # a probe 2 ms over 10: due after 200 ms, 20 cycles
    n = 4 * PROBE_MAX
    dear = (cpu, math.ceil(5.8 / (PROBE_SHARE * 8.2)))  # (a probe 5.8 ms over 8.2: due after 580 ms, 71 cycles)
    capped = ({0: 1.0, 1: 4.0, 2: 4.2, 3: 4.4, 4: 4.6}, PROBE_MAX)  # (3 ms over 1: after 300 ms, past the cap)
    for cost, every in (dear, capped, (h200, PROBE_EVERY), (between, round(2.0 / (PROBE_SHARE * 10.0)))):
        c = DepthChooser(4, cost=dict(cost))
        mid_reply(c, [0.0] * 4)  # every draft rejected so far
        picks = []
        for _ in range(n):
            depth = c.pick()
            picks.append(depth)
            c.observe(depth, [False] * depth, cost[depth])
        assert [i for i, d in enumerate(picks) if d] == list(range(every - 1, n, every)), (cost, picks)
        assert set(picks) == {0, 1} and c.judged[0] == MIN_JUDGED + n // every


def test_a_probe_near_the_break_even_is_cheap_and_comes_soon():
    """A probe's cost is its cycle less what the chosen depth would take for the tokens it is expected to commit.
    Plain decoding at 12.0 ms against depth 1's 16.4 (the demo model, oneDNN verify widths, 2-core CPU) breaks
    even at a first-position acceptance of 0.37: an estimate just under it (a few rejections in a row) probes
    every PROBE_EVERY cycles, not as if every draft were lost (PROBE_MAX here), and one just over it drafts."""
    cost = {0: 12.0, 1: 16.4, 2: 20.3, 3: 24.3, 4: 27.4}
    c = DepthChooser(4, cost=dict(cost))
    mid_reply(c, [0.33] + [0.0] * 3)
    assert c.probe_loss(0, c.costs()) == pytest.approx(16.4 - 12.0 * 1.33)  # 0.44 ms
    picks = [c.probe(0) for _ in range(2 * PROBE_EVERY)]
    assert [i for i, d in enumerate(picks) if d] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1], picks
    c.acceptance[0] = 0.0  # every draft rejected: the probe costs depth 1's extra 4.4 ms, spaced by it
    assert c.probe_loss(0, c.costs()) == pytest.approx(4.4)
    c.acceptance[0] = 0.40
    assert c.pick() == 1


def test_a_probe_from_plain_decoding_pays_the_switch_and_is_spaced_by_it():
    """A drafting cycle after plain ones also pays the drafter's catch-up over their tokens (the demo model on an
    H100: 0.33 ms on a 0.46 ms plain step). That is not its depth's cost (below) but the switch's, and every probe
    from plain decoding pays it: spaced as if it were free (every PROBE_EVERY cycles near the break-even), probes
    cost 3% of a reply (auto 0.96x plain, where plain decoding was 0.97 of the best depth)."""
    cost = {0: 0.46, 1: 0.80, 2: 0.95, 3: 1.07, 4: 1.19}
    c = DepthChooser(4, cost=dict(cost))
    c.observe(0, [], 0.46)
    c.observe(1, [False], 0.80 + 0.33)
    c.observe(0, [], 0.46)  # (a probe right after plain cycles pays the switch)
    assert c.cost == cost and c.switch_ms == pytest.approx(0.33)
    mid_reply(c, [0.6, 0.3, 0.6, 0.6])  # depth 1 breaks even at 0.74
    assert c.probe_loss(0, c.costs()) == pytest.approx(0.80 + 0.33 - 0.46 * 1.6)
    assert c.probe_loss(1, c.costs()) == pytest.approx(0.95 - 0.80 / 1.6 * (1.6 + 0.18))  # (no switch: drafting)
    for switch_ms, every in ((0.33, math.ceil((0.80 + 0.33 - 0.46 * 1.6) / (PROBE_SHARE * 0.46))), (None, PROBE_EVERY)):
        c.switch_ms, c.since_probe, c.since_probe_ms = switch_ms, 0, 0.0
        picks = [c.probe(0) for _ in range(2 * PROBE_MAX)]
        assert [i for i, d in enumerate(picks) if d] == list(range(every - 1, 2 * PROBE_MAX, every)), switch_ms


def test_the_next_reply_starts_from_the_costs_the_last_one_learned_not_its_acceptance():
    """The engine keeps a reply's estimates per drafter kind for the next (DepthChooser.estimates): the costs and
    the switch's are this model's on this device; the acceptance is the text's, and a reply of easy text after
    one of hard text would start from a confident 0 that probes rarely correct."""
    demo = {0: 0.46, 1: 0.80, 2: 0.95, 3: 1.07, 4: 1.19}  # the demo model on an H100
    last = DepthChooser(4, mean_first=True, cost=dict(demo))
    for _ in range(12):
        last.observe(3, [False], 1.07)
    last.observe(0, [], 0.46)
    last.observe(1, [False], 1.1)
    learned = last.estimates()
    assert learned == {"cost": demo, "switch_ms": pytest.approx(0.3)}
    resumed = DepthChooser(4, mean_first=True, **learned)
    assert (resumed.cost, resumed.switch_ms) == (last.cost, last.switch_ms) and resumed.cost is not last.cost
    assert resumed.acceptance == DepthChooser(4).acceptance and resumed.judged == [0] * 4  # (the prior)


def test_a_position_judged_a_few_times_is_probed_again_soon(monkeypatch):
    """Known costs at which the prior picks plain decoding (the demo model's CPU): the reply's first cycle drafts
    one token anyway (MIN_JUDGED), and it is rejected. Position 1's estimate, 0.3 on that one cycle, held plain
    decoding until the next probe, PROBE_MAX cycles away where probes are spaced by their cost. While judged fewer
    than MIN_JUDGED times a position is probed every PROBE_UNSURE cycles; here the drafts are good, and it climbs.
    (The probes alone: with FALL_DOUBT the one rejection does not make the fall, see
    test_a_fall_needs_plain_decoding_faster_beyond_the_estimates_spread.)"""
    monkeypatch.setattr(autodepth, "FALL_DOUBT", 0.0)
    cpu = {0: 8.2, 1: 14.0, 2: 16.4, 3: 18.7, 4: 21.0}
    c = DepthChooser(4, mean_first=True, cost=dict(cpu))
    picks = []
    for i in range(40):
        depth = c.pick()
        picks.append(depth)
        c.observe(depth, [i > 0] * depth, cpu[depth])  # the first cycle's draft rejected, every later one accepted
    assert picks[: PROBE_UNSURE + 1] == [1] + [0] * (PROBE_UNSURE - 1) + [1], picks
    assert picks[-10:] == [4] * 10, picks


def test_plain_decoding_not_measured_yet_is_guessed_a_step_below_the_drafting_depths():
    """Depths 1-4 measured, plain decoding not: on the line through them (11.7 ms at the demo model's 2-core CPU
    costs, where it takes 8.2) depth 0 never looked best, and auto drafted at depth 1 through replies that plain
    decoding ran faster. A step below the line it is tried, measured, and kept; where drafting costs little more
    than plain decoding (the 27B on the H200) it is not tried at acceptances that make drafting pay."""
    cpu = {0: 8.2, 1: 14.0, 2: 16.4, 3: 18.7, 4: 21.0}
    c = DepthChooser(4, cost={k: cpu[k] for k in range(1, 5)})
    mid_reply(c, [0.45] * 4)
    assert c.costs()[1:] == [cpu[k] for k in range(1, 5)] and c.costs()[0] == pytest.approx(14.0 - 2 * 7.0 / 3)
    assert c.pick() == 0, c.why  # (the line: depth 1 at 1.45 / 14.0 over plain's 1 / 11.7)
    c.observe(0, [], cpu[0])
    assert c.costs()[0] == cpu[0] and c.pick() == 0
    h200 = {1: 16.2, 2: 16.4, 3: 16.35, 4: 16.8}
    c = DepthChooser(4, cost=dict(h200))
    mid_reply(c, [0.3] * 4)
    assert c.costs()[0] == pytest.approx(15.8) and c.pick() > 0, c.why
    assert DepthChooser(4, cost={1: 10.0, 2: 14.0}).costs()[0] == 5.0  # (half the cheapest's at the least)


def test_a_position_never_judged_is_drafted_after_a_fully_accepted_cycle():
    """Where a draft step is dear (the demo model on a 2-core CPU) the prior alone picks plain decoding: the
    reply's first cycle drafts anyway, and each fully accepted cycle one position deeper, until every position
    has been judged a few times. Before, plain decoding held until the first probe, 16 cycles in (auto_sim at flat
    1.0: 0.88 of depth 4 over 128 tokens)."""
    cost = {0: 8.2, 1: 14.0, 2: 16.4, 3: 18.7, 4: 21.0}
    c = DepthChooser(4, mean_first=True, cost=dict(cost))
    picks = []
    for _ in range(12):  # every draft is accepted
        depth = c.pick()
        picks.append(depth)
        c.observe(depth, [True] * depth, cost[depth])
    assert picks[0] == 1 and picks.index(4) <= 3 and set(picks[picks.index(4) :]) == {4}, picks


def test_a_fall_needs_plain_decoding_faster_beyond_the_estimates_spread(monkeypatch):
    """Plain decoding judges nothing, so a fall on a dip of the estimates lasts until the next probe (PROBE_MAX
    cycles where a probe is dear: the demo model on an H100). A dip where plain decoding is faster at the estimates
    but not at FALL_DOUBT spreads above them keeps drafting, at the best drafting depth; hard text, where plain
    decoding is faster either way, falls."""
    gpu = {0: 0.30, 1: 0.62, 2: 0.72, 3: 0.82, 4: 0.92}
    c = DepthChooser(4, cost=dict(gpu), switch_ms=0.33)
    c.acceptance, c.judged, c.last_depth, c.all_accepted = [0.62, 0.85, 0.85, 0.85], [20] * 4, 4, False
    by_depth = rates(c.acceptance, c.costs())
    assert best_depth(by_depth) == 0  # (a dip)
    assert c.pick() == 4 and "kept" in c.why, c.why
    monkeypatch.setattr(autodepth, "FALL_DOUBT", 0.0)
    assert c.pick() == 0  # (the doubt is what kept it)
    monkeypatch.undo()
    c.acceptance = [0.3] * 4  # hard text
    assert c.pick() == 0 and "kept" not in c.why, c.why
    c.last_depth = 0
    c.acceptance = [0.62, 0.85, 0.85, 0.85]
    assert c.pick() == 0  # (from plain decoding the estimates decide alone: no probe is due)


def test_a_probe_from_plain_decoding_climbs_on_from_its_own_depth(monkeypatch):
    """The demo model on an H100 (a plain step 0.30 ms, a depth-1 cycle 0.62): the prior picks plain decoding,
    and so do the estimates while position 1 alone is known (1.75 tokens for 0.62 ms at 0.75 is slower than
    plain, and positions 2-4 sit at the prior). A fully accepted probe goes on one position deeper than its own
    depth, not than the pick's. Before, every probe from plain decoding drafted one token, positions 2-4 were never
    judged, and auto decoded plainly through replies that depth 3 ran 1.07x faster (245 of 252 cycles); here,
    position 1 accepted 3 times in 4 and every later one (depth 4: 1.3x plain), it stayed plain for 100 cycles.
    (The probes alone, without FALL_DOUBT, which keeps drafting after that rejection.)"""
    monkeypatch.setattr(autodepth, "FALL_DOUBT", 0.0)
    gpu = {0: 0.30, 1: 0.62, 2: 0.72, 3: 0.82, 4: 0.92}
    c = DepthChooser(4, mean_first=True, cost=dict(gpu))
    picks, drafted = [], 0
    for _ in range(100):
        depth = c.pick()
        picks.append(depth)
        drafted += depth > 0
        c.observe(depth, [drafted % 4 != 2] + [True] * (depth - 1) if depth else [], gpu[depth])
    assert picks[:3] == [1, 2, 0] and set(picks[-40:]) == {4}, picks


def test_a_reply_starts_from_the_costs_the_last_one_measured(ckpt):
    from engine import load_engine

    engine = load_engine(str(ckpt("next")), device="cpu")
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])

    def first_cycle_why() -> str:
        settings = GenerationSettings(max_new_tokens=12, depth=AUTO, ignore_eos=True)
        return [e for e in engine.generate(prompt, settings) if isinstance(e, Cycle)][0].why

    assert "by depth 0: 1000," in first_cycle_why()  # nothing measured yet: a plain cycle guessed at 1 ms
    costs = engine.auto_estimates["MTPDrafter"]["cost"]
    assert costs and all(ms > 0 for ms in costs.values())
    learned = engine.auto_estimates["MTPDrafter"]
    expected = DepthChooser(4, mean_first=True, **learned)
    expected.pick()
    why = first_cycle_why()
    assert "by depth 0: 1000," not in why  # the next reply starts from the measured costs
    assert why.split(";")[0] == expected.why.split(";")[0]  # and the acceptance the last reply learned


def test_a_drafting_cycle_after_plain_ones_is_not_its_depths_cost():
    """Such a cycle also pays for the switch (the drafter's catch-up, cold weights): its depth's cost is learned
    from drafting cycles in a row only, so probes from plain decoding do not pin a dear-looking depth."""
    c = DepthChooser(4)
    c.observe(1, [True], 12.0)
    for _ in range(6):
        c.observe(0, [], 10.0)
        c.observe(1, [False], 30.0)  # right after a plain cycle: not depth 1's cost
    assert c.cost == {0: 10.0, 1: 12.0}
    c.observe(1, [True], 14.0)  # after a drafting cycle: it is
    assert c.cost[1] == pytest.approx(12.0 + WEIGHT * 2.0)


def test_a_chain_stops_where_one_more_draft_costs_more_than_it_is_expected_to_give():
    # floor = rate * step / acceptance of the next position: 0.1 tokens a ms, a 4 ms step, 0.8 -> 0.5
    assert stop_floors([0.8] * 4, 0.1, 4.0, 4) == pytest.approx([0.5, 0.5, 0.5])
    assert max(stop_floors([0.8] * 4, 0.1, 0.1, 4)) < 0.02  # cheap steps (a 27B on a GPU): the chain runs on
    assert stop_floors([0.8, 0.05, 0.8, 0.8], 0.1, 4.0, 3)[0] == 1.0  # the next position is hardly accepted
    assert stop_floors([0.8] * 4, 0.1, 4.0, 1) == []  # one draft: nothing to stop


def test_the_chooser_offers_floors_from_its_estimates_but_not_to_a_probe():
    c = DepthChooser(4, cost={0: 13.0, 1: 18.0, 2: 23.0, 3: 27.0, 4: 26.0})
    # one more draft: the slope through the drafting depths' costs (27 -> 26 is noise, not a free draft)
    assert c.step_ms(c.costs()) == pytest.approx(2.8)
    floors = c.floors(3)
    rate = expected_tokens(c.acceptance, 3) / 27.0
    assert floors == pytest.approx([rate * 2.8 / a for a in c.acceptance[1:3]])
    assert "chain stops below p" in c.why
    assert c.floors(1) == []
    c.probing = True  # a probe judges the position past the depth: its chain runs to the end
    assert c.floors(3) == []
    for _ in range(200):  # and pick() says when it probes
        c.pick()
        assert c.probing == ("probing" in c.why)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_chain_stopped_on_a_doubtful_draft_is_exact(name, engines, monkeypatch):
    """Chains of up to 4 drafts that stop after a draft the head gives less than 0.5 (the floors, fixed here:
    stop_floors is tested above): they stop early after doubtful drafts and run on after confident ones, drafts
    are accepted and rejected, and the text is plain decoding's."""
    monkeypatch.setattr(DepthChooser, "pick", lambda self: 4)
    monkeypatch.setattr(DepthChooser, "floors", lambda self, k: [0.5] * (k - 1))
    engine = engines(name)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=48)
    events = list(engine.generate(prompt, GenerationSettings(max_new_tokens=48, depth=AUTO, ignore_eos=True)))
    assert [t for e in events if isinstance(e, Tokens) for t in e.token_ids] == plain
    cycles = [e for e in events if isinstance(e, Cycle)]
    stopped = [c for c in cycles if c.stopped]
    assert stopped and all("stopped after draft" in c.why for c in stopped)
    assert any(c.depth >= 2 for c in cycles if not c.stopped)  # and chains ran on past a confident draft
    assert_mtp_drafts_accepted_and_rejected(events[-1])


def test_a_held_plain_pick_decides_as_reading_the_estimates_every_cycle_would(monkeypatch):
    """A plain pick holds for the cycles before the next probe could be due (the pick's host time was a tenth of a
    plain step on the demo model on a GPU): at steady costs, the depths picked, probes included, are the ones a
    chooser reading its estimates every cycle picks, while most plain picks skip the reading."""
    import random

    import engine.autodepth as autodepth

    tables = {"cpu": {0: 8.2, 1: 14.0, 2: 16.4, 3: 18.7, 4: 21.0}, "h100-demo": {0: 0.18, 1: 0.37, 2: 0.42, 3: 0.51,
              4: 0.6}, "h200-27b": {0: 14.86, 1: 16.2, 2: 16.4, 3: 16.35, 4: 16.8}}

    def run(cost, p, hold_max):
        monkeypatch.setattr(autodepth, "HOLD_MAX", hold_max)
        rng, c, picks, read = random.Random(7), DepthChooser(4, mean_first=True, cost=dict(cost), switch_ms=0.3), [], 0
        for _ in range(400):
            before = c.held
            depth = c.pick()
            read += not (before and depth == 0 and c.held == before - 1)
            picks.append(depth)
            flags = []
            for _ in range(depth):
                flags.append(rng.random() < p)
                if not flags[-1]:
                    break
            c.observe(depth, flags, cost[depth] + (0.3 if depth and picks[-2:-1] == [0] else 0.0))
        return picks, read

    held_somewhere = False
    for name, cost in tables.items():
        for p in (0.0, 0.3, 0.6, 0.95):
            (held, read_held), (every, read_every) = run(cost, p, HOLD_MAX), run(cost, p, 0)
            assert held == every, (name, p)
            assert read_every == 400 and (read_held < 400) == (held.count(0) > 2 * PROBE_EVERY), (name, p)
            held_somewhere |= read_held < 400 // 4
    assert held_somewhere  # (at acceptance 0 fewer than one pick in four reads the estimates)


def test_a_plain_cycle_that_launched_a_drafting_one_is_not_a_plain_cost(ckpt, monkeypatch):
    """With graphs (here graphs.Rerun, the CPU's stand-in) the call that finishes a cycle launches the next one;
    where the depth rises from 0 that is the head's catch-up, draft and verify, launched by the host. That call's
    time is not plain decoding's cost: taken as one, each switch raised plain's running cost, and drafting looked
    cheaper next to it. The chooser gets no cost for it (None); every other cycle's time it gets."""
    from engine import load_engine

    engine = load_engine(str(ckpt("next")), device="cpu", dtype="float32", cuda_graphs=True)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    seen = []
    monkeypatch.setattr(DepthChooser, "observe_cost", lambda self, depth, ms: seen.append((depth, ms)))
    control = DecodeControl(0)
    for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=24, depth=0, ignore_eos=True), control):
        if isinstance(ev, Cycle) and ev.index == 4:
            control.depth = 2  # (the next call finishes a plain cycle and launches a depth-2 one)
    plain = [ms for depth, ms in seen if depth == 0]
    assert plain[:4] == [ms for ms in plain[:4] if ms is not None] and len(plain) == 5 and plain[4] is None, seen
    assert all(ms is not None for depth, ms in seen if depth == 2) and any(depth == 2 for depth, _ in seen)


def test_launching_a_drafting_cycle_from_plain_decoding_is_the_switchs_cost():
    """The call that finishes a plain cycle and launches the drafting one after it (engine: not a plain cost) took
    0.5 ms where plain cycles take 0.2: the 0.3 over is the switch's, added to what the drafting cycle itself took
    over its depth's cost (0.1), not to plain decoding's running cost."""
    c = DepthChooser(4, cost={0: 0.2, 1: 0.4})
    c.observe(0, [], 0.2)
    c.observe(0, [], None)
    c.owe(0.5)
    c.observe(1, [False], 0.5)
    assert c.cost == {0: 0.2, 1: 0.4} and c.switch_ms == pytest.approx(0.4) and c.owed_ms == 0.0
    c.observe(0, [], 0.2)
    c.observe(1, [True], 0.45)  # (a switch without a launch measured: its own extra alone)
    assert c.switch_ms == pytest.approx(0.4 + WEIGHT * (0.05 - 0.4))


def test_the_plain_cycle_after_a_drafting_one_is_the_round_trips_cost_not_plain_decodings():
    """With graphs a plain step runs ahead of the host, except the first after a drafting cycle: it is launched
    once that cycle was read (the demo model on an H100: 0.25 ms against 0.165). Taken as plain's cost, each fall
    raised plain's estimate, and an auto reply after one with many falls began drafting. What it took over plain's
    cost is owed by the round trip: the next switch from plain decoding pays it."""
    c = DepthChooser(4, cost={0: 0.2, 1: 0.4})
    c.observe(1, [True], 0.4)
    c.observe(0, [], 0.3)  # (the fall)
    assert c.cost == {0: 0.2, 1: 0.4} and c.owed_ms == pytest.approx(0.1)
    c.observe(0, [], 0.2)
    c.observe(0, [], None)
    c.owe(0.5)
    c.observe(1, [False], 0.45)
    assert c.switch_ms == pytest.approx(0.1 + 0.3 + 0.05) and c.owed_ms == 0.0 and c.cost == {0: 0.2, 1: 0.4}
