"""Speculative sampling keeps the target distribution: a goodness-of-fit test against the exact distribution of
the first generated tokens, with a deliberately wrong acceptance rule as the negative control."""

import math

import pytest
import torch

from engine import GenerationSettings, sampling
from engine.drafters import OracleDrafter
from engine.events import Tokens
from engine.sampling import SamplingParams, probabilities

PARAMS = SamplingParams(temperature=1.5, top_k=3, top_p=0.95)
N_SAMPLES = 600
NEW = 3  # the first token (from the prompt) and two from the first cycle


def exact_distribution(engine, prompt):
    """P(t1, t2, t3) by enumerating every path the top-k / top-p support allows, with the trunk alone."""
    trunk = engine.trunk
    out = {}

    def probs_after(seq):
        caches = trunk.new_caches()
        caches.kv.reserve(len(seq))
        with torch.inference_mode():
            h = trunk.forward(torch.tensor([seq]), 0, caches, verify=False)
            return probabilities(trunk.logits(h[0, -1:]), PARAMS)[0]

    p1 = probs_after(prompt)
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = probs_after(prompt + [a])
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = probs_after(prompt + [a, b])
            for c in torch.nonzero(p3).flatten().tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def samples(engine, prompt, depth, drafter_factory=None):
    counts, drafted, accepted = {}, 0, 0
    settings = GenerationSettings(max_new_tokens=NEW, depth=depth, temperature=PARAMS.temperature,
                                  top_k=PARAMS.top_k, top_p=PARAMS.top_p, ignore_eos=True)
    for i in range(N_SAMPLES):
        settings.seed = 1000 + i
        events = list(engine.generate(prompt, settings, drafter=drafter_factory() if drafter_factory else None))
        key = tuple(t for e in events if isinstance(e, Tokens) for t in e.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += events[-1].stats["drafted"]
        accepted += events[-1].stats["accepted"]
    return counts, drafted, accepted


def chi_square_p_value(counts, exact):
    """Pearson goodness of fit; outcomes with small expectation are pooled. Returns the upper-tail p-value."""
    cells, pooled_e, pooled_o = [], 0.0, 0
    for key, p in exact.items():
        e, o = p * N_SAMPLES, counts.get(key, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
        else:
            cells.append((o, e))
    outside = sum(v for k, v in counts.items() if k not in exact)
    cells.append((pooled_o + outside, max(pooled_e, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def setup(engines):
    engine = engines("next")
    prompt = engine.encode_chat([{"role": "user", "content": "Hello"}])
    return engine, prompt, exact_distribution(engine, prompt)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mtp_speculative_sampling_matches_target_distribution(depth, setup):
    engine, prompt, exact = setup
    assert abs(sum(exact.values()) - 1) < 1e-4 and len(exact) > 4
    counts, drafted, _ = samples(engine, prompt, depth)
    assert drafted > 0
    assert chi_square_p_value(counts, exact) > 1e-3


def test_oracle_proposing_target_samples_is_accepted_and_exact(setup):
    """The oracle replays one of the target's own samples: acceptance is non-zero, the distribution exact."""
    engine, prompt, exact = setup
    reference = max(exact, key=exact.get)  # the most likely path: often accepted
    vocab = engine.trunk.config.vocab_size
    counts, drafted, accepted = samples(engine, prompt, 2, lambda: OracleDrafter(list(reference), len(prompt), 0.0,
                                                                                  vocab))
    assert drafted > 0 and accepted > 0
    assert chi_square_p_value(counts, exact) > 1e-3


def test_wrong_acceptance_rule_fails_the_same_test(setup, monkeypatch):
    """Negative control: always accepting the drafts must be detected."""
    engine, prompt, exact = setup

    def always_accept(logits, drafts, q, params, generator):
        m, tokens = sampling.__dict__["_real_verify"](logits, drafts, q, params, generator)
        return torch.tensor([drafts.shape[0]]), tokens

    monkeypatch.setitem(sampling.__dict__, "_real_verify", sampling.verify_sampled)
    monkeypatch.setattr(sampling, "verify_sampled", always_accept)
    counts, drafted, _ = samples(engine, prompt, 2)
    assert drafted > 0
    assert chi_square_p_value(counts, exact) < 1e-3


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
