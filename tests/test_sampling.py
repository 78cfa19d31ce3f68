"""Speculative sampling keeps the target distribution: goodness-of-fit tests of the first generated tokens
against their exact distribution under plain sampling, with deliberately wrong acceptance rules as negative
controls (one of them wrong only at chained draft positions, 2 and up).

The setup keeps the outcome space enumerable: top-k 2 (and a top-p that sometimes leaves one token) at a high
temperature, 6 new tokens: at most 2^6 sequences, whose exact probabilities come from the trunk alone (one
forward per prefix). At depth d the first cycle drafts min(d, 4) tokens and draws a bonus, so drafts at
positions 1-4, chained from the head's own hidden states and sampled tokens, all decide what comes out.

False alarms: each test compares N_SAMPLES seeded generations with the exact distribution by Pearson's
chi-square (cells expected below 5 pooled) and fails below ALPHA = 1e-4, so a correct engine fails one of the
five tests that expect a match with probability about 5e-4 over the choice of seeds (the chi-square tail is
asymptotic). The seeds are fixed: a given engine passes or fails every time; a change in how the engine draws its
random numbers re-draws the seeds in effect.
"""

import pytest
import torch

from engine import AUTO, GenerationSettings, sampling
from engine.drafters import OracleDrafter
from engine.autodepth import DepthChooser
from engine.events import Cycle, Tokens
from engine.sampling import SamplingParams, probabilities

PARAMS = SamplingParams(temperature=3.0, top_k=2, top_p=0.9)
NEW = 6
N_SAMPLES = 400
ALPHA = 1e-4


def exact_distribution(engine, prompt, n=NEW):
    """P(t_1..t_n) under plain sampling, by enumerating every path the top-k / top-p support allows."""
    trunk = engine.trunk

    def probs_after(seq):
        caches = trunk.new_caches()
        caches.kv.reserve(len(seq))
        with torch.inference_mode():
            h = trunk.forward(torch.tensor([seq]), 0, caches, verify=False)
            return probabilities(trunk.logits(h[0, -1:]), PARAMS)[0]

    paths = {(): 1.0}
    for _ in range(n):
        longer = {}
        for path, prob in paths.items():
            p = probs_after(prompt + list(path))
            for t in torch.nonzero(p).flatten().tolist():
                longer[path + (t,)] = prob * float(p[t])
        paths = longer
    return paths


def samples(engine, prompt, depth, drafter_factory=None):
    """Counts of the N_SAMPLES seeded generations, the drafts [drafted, accepted] per draft position, and the
    cycles whose chain stopped short of its depth (--depth auto's floors)."""
    counts, per_position, stopped = {}, [], 0
    settings = GenerationSettings(max_new_tokens=NEW, depth=depth, temperature=PARAMS.temperature,
                                  top_k=PARAMS.top_k, top_p=PARAMS.top_p, ignore_eos=True)
    for i in range(N_SAMPLES):
        settings.seed = 1000 + i
        events = list(engine.generate(prompt, settings, drafter=drafter_factory() if drafter_factory else None))
        key = tuple(t for e in events if isinstance(e, Tokens) for t in e.token_ids)
        counts[key] = counts.get(key, 0) + 1
        stopped += sum(isinstance(e, Cycle) and e.stopped for e in events)
        for j, (d, a) in enumerate(events[-1].stats["per_position_counts"]):
            if j == len(per_position):
                per_position.append([0, 0])
            per_position[j][0] += d
            per_position[j][1] += a
    return counts, per_position, stopped


def chi_square_p_value(counts, exact):
    """Pearson goodness of fit; outcomes expected fewer than 5 times are pooled, with any outcome the exact
    distribution gives probability 0. Returns the upper-tail p-value (the regularized incomplete gamma)."""
    n = sum(counts.values())
    cells, pooled_e, pooled_o = [], 0.0, 0
    for key, p in exact.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
        else:
            cells.append((o, e))
    outside = sum(v for k, v in counts.items() if k not in exact)
    cells.append((pooled_o + outside, max(pooled_e, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def setup(engines):
    engine = engines("next")
    prompt = engine.encode_chat([{"role": "user", "content": "Hello"}])
    exact = exact_distribution(engine, prompt)
    assert abs(sum(exact.values()) - 1) < 1e-4 and len(exact) > 16
    assert sum(p * N_SAMPLES >= 5 for p in exact.values()) >= 16  # cells enough for the test to have power
    return engine, prompt, exact


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_mtp_speculative_sampling_matches_target_distribution(depth, setup):
    """Every draft position, chained ones included, both accepts and rejects sampled drafts, and the tokens
    that come out are distributed as plain sampling's."""
    engine, prompt, exact = setup
    counts, per_position, _ = samples(engine, prompt, depth)
    for j, (drafted, accepted) in enumerate(per_position):
        assert 0 < accepted < drafted, f"draft position {j + 1}: {accepted} of {drafted} accepted"
    assert chi_square_p_value(counts, exact) > ALPHA


def test_oracle_proposing_target_samples_is_accepted_and_exact(setup):
    """The oracle replays the most likely path as point-mass drafts: often accepted, the distribution exact."""
    engine, prompt, exact = setup
    reference = max(exact, key=exact.get)
    vocab = engine.trunk.config.vocab_size
    counts, per_position, _ = samples(engine, prompt, 3, lambda: OracleDrafter(list(reference), len(prompt), 0.0,
                                                                             vocab))
    assert all(0 < a < d for d, a in per_position)
    assert chi_square_p_value(counts, exact) > ALPHA


def test_chains_stopped_on_doubtful_sampled_drafts_keep_the_distribution(setup, monkeypatch):
    """--depth auto's floors on the CPU: a chain of up to 4 sampled drafts stops after one whose q is below 0.55.
    Where it stops depends on the drafts alone, before the target sees them, so the text stays exact in
    distribution; chains stop early and run to the end, every position accepts and rejects."""
    engine, prompt, exact = setup
    monkeypatch.setattr(DepthChooser, "pick", lambda self: 4)
    monkeypatch.setattr(DepthChooser, "floors", lambda self, k: [0.55] * (k - 1))
    counts, per_position, stopped = samples(engine, prompt, AUTO)
    assert len(per_position) == 4 and all(0 < a < d for d, a in per_position), per_position
    assert 0 < stopped and per_position[3][0] > 0
    assert chi_square_p_value(counts, exact) > ALPHA


def wrong_rule(monkeypatch, wrong):
    real = sampling.verify_sampled
    monkeypatch.setattr(sampling, "verify_sampled", lambda logits, drafts, q, params, generator:
                        wrong(real, logits, drafts, q, params, generator))


def test_wrong_acceptance_rule_fails_the_same_test(setup, monkeypatch):
    """Negative control: always accepting the drafts must be detected."""
    engine, prompt, exact = setup

    def always_accept(real, logits, drafts, q, params, generator):
        _, tokens = real(logits, drafts, q, params, generator)
        return torch.tensor([drafts.shape[0]]), tokens

    wrong_rule(monkeypatch, always_accept)
    counts, per_position, _ = samples(engine, prompt, 3)
    assert per_position[0][0] > 0
    assert chi_square_p_value(counts, exact) < ALPHA


def test_chained_drafts_judged_by_the_first_drafts_distribution_fail_the_same_test(setup, monkeypatch):
    """Negative control for chained drafting alone: drafts 2 and up judged with the first draft's q (as if the
    drafter kept one distribution for its whole chain) must be detected. Draft 1 is judged correctly."""
    engine, prompt, exact = setup

    def first_q_for_all(real, logits, drafts, q, params, generator):
        if q is not None:  # (None: a cycle with no drafts, at the end of the reply)
            q = q[:1].expand_as(q).contiguous()
        return real(logits, drafts, q, params, generator)

    wrong_rule(monkeypatch, first_q_for_all)
    counts, per_position, _ = samples(engine, prompt, 3)
    assert per_position[1][0] > 0
    assert chi_square_p_value(counts, exact) < ALPHA


def test_greedy_is_bit_exact_at_temperature_zero(engines):
    engine = engines("next")
    prompt = engine.encode_chat([{"role": "user", "content": "Hello"}])
    runs = {}
    for depth in (0, 2):
        s = GenerationSettings(max_new_tokens=16, depth=depth, temperature=0.0, seed=3, ignore_eos=True)
        runs[depth] = [t for e in engine.generate(prompt, s) if isinstance(e, Tokens) for t in e.token_ids]
    assert runs[0] == runs[2]


def test_probabilities_respect_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (p[0, 3:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the top token alone already has >= 0.5 of the mass
