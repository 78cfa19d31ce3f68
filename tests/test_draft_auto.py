"""--drafter auto: the MTP head and a draft model, one of them drafting each cycle, chosen from running estimates
of each one's acceptance per position and cost per cycle (autodepth.DrafterChooser over AutoDrafter). Lossless
(plain greedy equals transformers equals auto, eager and through the graph runner, across turns that reuse the
state); both drafters draft in one request, with drafts accepted and rejected; a draft that is cheap but never
accepted loses to the MTP head; the decision on its own picks the faster drafter either way and probes the loser."""

import pytest
import torch
import transformers as tf
from draft_fixtures import write_qwen3, write_qwen35_pair
from test_exactness import PROMPTS, decode

from engine import GenerationSettings, load_engine
from engine.autodepth import PROBE_EVERY, AutoDrafter, DrafterChooser
from engine.events import Cycle

NOISE = 0.1  # (test_draft_model's: depth-1 acceptance about 0.65-0.8)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A wrapped Qwen3.5 target with its MTP head, its perturbed text-only draft, and a tiny random Qwen3 draft
    of the same tokenizer (cheap, its drafts almost never accepted)."""
    root = tmp_path_factory.mktemp("auto")
    target, draft = write_qwen35_pair(root, NOISE)
    junk = write_qwen3(root / "junk", seed=7, layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8)
    return target, draft, junk


def run(engine, prompt, **kw):
    events = list(engine.generate(prompt, GenerationSettings(ignore_eos=True, **kw)))
    tokens = [t for e in events if hasattr(e, "token_ids") for t in e.token_ids]
    return tokens, [e for e in events if isinstance(e, Cycle)], events[-1]


def test_the_chooser_picks_the_faster_drafter_and_probes_the_loser():
    c = DrafterChooser(["mtp", "draft:x"])
    assert [c.pick(2), c.pick(2)] == ["mtp", "mtp"]  # no cost yet: each drafter in turn
    c.observe("mtp", 2, [True, True], 500.0)  # a first cycle's cost is not counted (one-time costs)
    assert c.pick(2) == "mtp"
    c.observe("mtp", 2, [True, True], 10.0)
    assert c.pick(2) == "draft:x"
    c.observe("draft:x", 2, [True, True], 10.0)
    for _ in range(30):  # the draft always accepted, the head never, at the same cost: the draft is faster
        c.observe("draft:x", 2, [True, True], 10.0)
        c.observe("mtp", 2, [False], 10.0)
    picks = [c.pick(2) for _ in range(2 * PROBE_EVERY)]
    assert picks.count("mtp") == 2 and picks[PROBE_EVERY - 1] == "mtp"
    assert picks[-1] == "mtp" and c.why.startswith("drafter mtp (probing the slower): expected tok/s at depth 2")
    assert c.pick(2) == "draft:x" and c.why.startswith("drafter draft:x: expected tok/s at depth 2 mtp")
    c.since_probe = PROBE_EVERY - 1
    assert c.pick(2) == "mtp" and c.why.startswith("drafter mtp (probing the slower)")
    for _ in range(30):  # the head as good, at a fifth of the cost: the head wins
        c.observe("mtp", 2, [True, True], 2.0)
    assert c.pick(2) == "mtp" and "expected tok/s at depth 2" in c.why


def test_auto_is_lossless_and_both_drafters_draft(hybrid):
    target, draft, _ = hybrid
    engine = load_engine(str(target), draft_model=str(draft))  # both: auto is the default
    assert isinstance(engine.default_drafter(), AutoDrafter) and engine.drafter_choice is None
    hf = tf.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    graphs = load_engine(str(target), cuda_graphs=True, draft_model=str(draft), drafter="auto")
    assert graphs.graph_runner is not None and isinstance(graphs.default_drafter(), AutoDrafter)
    for messages in PROMPTS[:2]:
        prompt = engine.encode_chat(messages)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
        assert plain == ref[0, len(prompt):].tolist()
        for e in (engine, graphs):
            for depth in (1, 3, 2, "auto"):  # (a second turn over the same prompt restores its snapshot)
                spec, cycles, fin = run(e, prompt, depth=depth, max_new_tokens=40)
                assert spec == plain, (depth, e is graphs)
                s = fin.stats
                assert s["drafter"] == f"auto(mtp, draft:{draft.name})" and 0 < s["drafted"], s
                if depth != "auto":  # (auto may find plain decoding cheaper on a busy CPU and draft only its probes,
                    assert 0 < s["accepted"] < s["drafted"], s  # all of which can be accepted: CI saw 5 of 5)
                drafted = [c for c in cycles if c.drafted]
                assert sum(s["drafter_cycles"].values()) == len(drafted) > 0
                # each cycle names its drafter
                bad = [c.why for c in drafted if not c.why.startswith(("drafter mtp", f"drafter draft:{draft.name}"))]
                assert not bad, bad
    first = engine.auto_drafter.chooser.estimates
    assert set(first) == {"mtp", f"draft:{draft.name}"} and all(est.cost for est in first.values())
    # one request in which both drafted (the first tries each; later ones probe the loser)
    _, _, fin = run(load_engine(str(target), draft_model=str(draft)), engine.encode_chat(PROMPTS[0]), depth=2,
                    max_new_tokens=40)
    assert set(fin.stats["drafter_cycles"]) == {"mtp", f"draft:{draft.name}"}, fin.stats["drafter_cycles"]


def test_a_cheap_draft_that_is_never_accepted_loses_to_the_mtp_head(hybrid):
    target, _, junk = hybrid
    engine = load_engine(str(target), draft_model=str(junk))
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=96)
    spec, cycles, fin = run(engine, prompt, depth=2, max_new_tokens=96)
    assert spec == plain
    counts = fin.stats["drafter_cycles"]
    # tried, then mostly probed (the CPU's wall times are noisy: a probe at a slow moment can win a cycle or two)
    assert counts["draft:junk"] >= 1 and counts["mtp"] > 2 * counts["draft:junk"], counts
    est = engine.auto_drafter.chooser.estimates
    # (a plain mean of its cycles with the prior counted once: 0.6 / 3 after its first two, all rejected)
    assert est["draft:junk"].acceptance[0] <= 0.2 and est["draft:junk"].acceptance[0] < est["mtp"].acceptance[0]
    # and it stays there: a second request starts from the estimates so far
    _, _, fin = run(engine, prompt, depth=2, max_new_tokens=48, reuse=False)
    counts = fin.stats["drafter_cycles"]
    assert counts["mtp"] > 2 * counts.get("draft:junk", 0), counts


def test_cli_run_with_drafter_auto(hybrid, capsys):
    import json

    from app.cli import main

    target, draft, _ = hybrid
    assert main(["run", "--model", str(target), "--draft-model", str(draft), "--drafter", "auto", "--prompt",
                 "Tell me a story", "--depth", "2", "--max-new-tokens", "24", "--ignore-eos", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["drafter"] == f"auto(mtp, draft:{draft.name})"
    assert set(stats["drafter_cycles"]) == {"mtp", f"draft:{draft.name}"}
    assert main(["run", "--model", str(target), "--drafter", "auto", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--drafter auto: no draft model" in err, err


def test_a_draft_that_holds_the_whole_sequence_restarts_instead_of_feeding_nothing(hybrid):
    """A restored turn can leave the draft's caches holding exactly the committed sequence (seen once in a clean
    CI run of the auto test: a 0-token forward). Drafting must feed the last token, so the draft restarts."""
    from engine.timing import PhaseTimer

    target, draft, _ = hybrid
    engine = load_engine(str(target), draft_model=str(draft), drafter="draft")
    prompt = engine.encode_chat(PROMPTS[0])
    decode(engine, prompt, depth=2, max_new_tokens=8)
    d = engine.draft_drafter
    seq = d.seen[: d.caches.processed].clone()  # all it processed, and nothing more
    with torch.inference_mode():  # (as the engine drives it)
        d.prime(seq, seq.shape[0] - 1)
        drafts, _ = d.propose(seq, 2, PhaseTimer(torch.device("cpu")))
    assert drafts.shape[0] == 2 and d.caches.processed == seq.shape[0] - 1
