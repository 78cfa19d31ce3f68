"""A separate draft model (--draft-model): speculation equals plain decoding equals transformers, with drafts
accepted and rejected, for a dense draft on a sliding-window Qwen3 target whose window wraps inside verify passes
and for a text-only Qwen3.5 (hybrid GDN) draft on a wrapped Qwen3.5 target; the draft's own caches commit and
roll back exactly (an identical draft is always accepted, its state equals a fresh prefill, a fault anywhere
leaves both models' committed states); sampling keeps the target distribution; mismatched drafts are refused."""

import itertools
import json
import math
import os

import pytest
import torch
import transformers as tf
from app_support import next_posted
from draft_fixtures import write_perturbed_draft, write_qwen3, write_qwen35_pair, write_tokenizer
from fixtures import greedy_reference
from faults import FaultAt, handed_out
from test_exactness import PROMPTS, decode

from engine import AUTO, GenerationSettings, load_engine
from engine.autodepth import DepthChooser
from engine.errors import EngineError
from engine.events import Cycle, Tokens

NOISE = 0.1  # the draft is the target perturbed by this much: depth-1 acceptance about 0.65-0.8
WINDOW = 8


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (target path, draft path): "sliding" (a dense Qwen3 target with sliding-window layers and its
    perturbed copy), "hybrid" (a wrapped Qwen3.5 target and a text-only Qwen3.5 draft), and "same" (the sliding
    target drafting for itself: every draft must be accepted)."""
    root = tmp_path_factory.mktemp("pairs")
    target = write_qwen3(root / "sliding_target", seed=4, window=WINDOW)
    made = {"sliding": (target, write_perturbed_draft(target, root / "sliding_draft", NOISE)),
            "same": (target, write_perturbed_draft(target, root / "same_draft", 0.0)),
            "hybrid": write_qwen35_pair(root, NOISE)}
    return made


@pytest.fixture(scope="module")
def engines_with_draft(pairs):
    made = {}

    def get(name):
        if name not in made:
            target, draft = pairs[name]
            # (the draft model drafts: with the hybrid's MTP head the default would be both, --drafter auto)
            made[name] = load_engine(str(target), draft_model=str(draft), drafter="draft")
        return made[name]

    return get


def assert_drafts_accepted_and_rejected(fin, draft_name):
    stats = fin.stats
    assert stats["drafter"] == f"draft:{draft_name}" and stats["drafted"] > 0, stats
    assert 0 < stats["accepted"] < stats["drafted"], stats


@pytest.mark.parametrize("name", ["sliding", "hybrid"])
def test_speculation_equals_plain_equals_transformers(name, pairs, engines_with_draft):
    engine = engines_with_draft(name)
    target, draft = pairs[name]
    hf = tf.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompt = engine.encode_chat(PROMPTS[0])
    ref = greedy_reference(hf, prompt, 40)
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    assert plain == ref
    for depth in (1, 2, 3, 4):
        spec, sources, fin = decode(engine, prompt, depth=depth, max_new_tokens=40)
        assert spec == plain, depth
        assert_drafts_accepted_and_rejected(fin, draft.name)
        assert sources.count("draft") == fin.stats["accepted"]
        assert len(fin.stats["per_position_acceptance"]) == depth


@pytest.mark.parametrize("name", ["same"])
def test_an_identical_draft_is_always_accepted(name, engines_with_draft):
    """The draft's state after every commit and rollback is the committed sequence's: a draft with the target's
    weights then proposes the target's tokens, every one (a draft state off by a token, or a ring or a GDN state
    not rewound, proposes others)."""
    engine = engines_with_draft(name)
    for messages in PROMPTS:
        prompt = engine.encode_chat(messages)
        plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
        for depth in (1, 3, 4):
            spec, sources, fin = decode(engine, prompt, depth=depth, max_new_tokens=40)
            assert spec == plain and fin.stats["acceptance_rate"] == 1.0, (depth, fin.stats)
            assert fin.stats["cycles"] < len(plain) // depth + 2
            # the chain's accepted rows were kept, not recomputed: the draft is behind by the last cycle's last
            # draft and the reply's closing plain step (k = 0 when one token is left) at most
            assert 0 <= engine.caches.processed - engine.draft_drafter.caches.processed <= 2


@pytest.mark.parametrize("name", ["sliding", "hybrid", "same"])
def test_a_chain_stopped_on_a_doubtful_draft_is_exact_and_keeps_the_drafts_state(name, engines_with_draft,
                                                                                 monkeypatch):
    """--depth auto's floors, fixed here so that chains of up to 4 drafts stop after draft 1, 2, 3 and run to 4
    in turn (an infinite floor stops the chain after that draft): the text is plain decoding's, and the draft
    settles what a stopped chain processed (the identical draft: every draft accepted, its state at most two
    tokens behind the target's)."""
    turn = itertools.count()

    def floors(self, k):
        stop = next(turn) % k
        return [math.inf if j == stop else 0.0 for j in range(k - 1)]

    monkeypatch.setattr(DepthChooser, "pick", lambda self: 4)
    monkeypatch.setattr(DepthChooser, "floors", floors)
    engine = engines_with_draft(name)
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    events = list(engine.generate(prompt, GenerationSettings(max_new_tokens=40, depth=AUTO, ignore_eos=True)))
    assert [t for e in events if isinstance(e, Tokens) for t in e.token_ids] == plain
    cycles = [e for e in events if isinstance(e, Cycle)]
    assert {(1, True), (2, True), (3, True), (4, False)} <= {(c.depth, c.stopped) for c in cycles}
    fin = events[-1]
    if name == "same":
        assert fin.stats["acceptance_rate"] == 1.0
        assert 0 <= engine.caches.processed - engine.draft_drafter.caches.processed <= 2
    else:
        assert_drafts_accepted_and_rejected(fin, engine.draft_drafter.loaded.name)


@pytest.mark.parametrize("name", ["sliding", "hybrid"])
def test_every_proposal_is_a_fresh_drafts_continuation_of_the_committed_sequence(name, engines_with_draft,
                                                                                 monkeypatch):
    """With drafts rejected in most cycles, each chain of proposals equals what the draft model computes from
    scratch over the committed sequence (one prefill, then greedy single steps): rejected rows never stay in the
    draft's KV, GDN state or ring, and accepted ones are never lost."""
    engine = engines_with_draft(name)
    d = engine.draft_drafter
    calls, real = [], d.propose

    def recording(seq, k, timer, req=None):
        drafts, q = real(seq, k, timer, req)
        calls.append((seq.clone(), drafts.clone()))
        return drafts, q

    monkeypatch.setattr(d, "propose", recording)
    prompt = engine.encode_chat(PROMPTS[1])
    _, _, fin = decode(engine, prompt, depth=3, max_new_tokens=30)
    assert 0 < fin.stats["accepted"] < fin.stats["drafted"] and len(calls) > 5
    t = d.trunk
    with torch.inference_mode():
        for seq, drafts in calls:
            caches = t.new_caches()
            caches.kv.reserve(seq.shape[0] + len(drafts))
            h = t.forward(seq.unsqueeze(0), 0, caches, verify=False)
            caches.advance(seq.shape[0])
            fresh = [int(t.logits(h[0, -1]).argmax())]
            while len(fresh) < len(drafts):
                h = t.forward(torch.tensor([fresh[-1:]]), caches.processed, caches, verify=False)
                caches.advance(1)
                fresh.append(int(t.logits(h[0, -1]).argmax()))
            assert drafts.tolist() == fresh


def test_the_hybrid_drafts_state_equals_a_fresh_prefill(engines_with_draft):
    """After a speculative reply the draft's committed GDN state (conv and recurrent) and KV equal those of one
    prefill over the tokens it holds: its chains were replayed to their accepted prefixes, never to more."""
    engine = engines_with_draft("hybrid")
    prompt = engine.encode_chat(PROMPTS[1])
    tokens, _, _ = decode(engine, prompt, depth=3, max_new_tokens=30)
    d = engine.draft_drafter
    n = d.caches.processed
    assert len(prompt) < n and d.seen[:n].tolist() == (prompt + tokens)[:n]
    fresh = d.trunk.new_caches()
    fresh.kv.reserve(n)
    with torch.inference_mode():
        d.trunk.forward(d.seen[:n].unsqueeze(0), 0, fresh, verify=False)
    fresh.advance(n)
    c = d.caches
    assert torch.allclose(c.gdn.recurrent, fresh.gdn.recurrent, atol=1e-4)
    assert torch.allclose(c.gdn.conv, fresh.gdn.conv, atol=1e-5)
    assert torch.allclose(c.kv.k[:, :, :n], fresh.kv.k[:, :, :n], atol=1e-4)


def test_sampled_speculation_with_a_draft_reproduces_and_keeps_the_distribution(engines_with_draft):
    """Seeded sampling reproduces at a given depth (each cycle draws its random numbers whatever is accepted);
    speculation does not reproduce plain sampling's draws, it keeps its distribution: the chi-square test of
    tests/test_sampling.py, with the draft's own q at every chained position."""
    from test_sampling import N_SAMPLES, PARAMS, chi_square_p_value, exact_distribution, samples

    engine = engines_with_draft("sliding")
    prompt = engine.encode_chat(PROMPTS[0])
    a, _, fin = decode(engine, prompt, depth=3, temperature=0.8, top_p=0.9, seed=1, max_new_tokens=30)
    b, _, _ = decode(engine, prompt, depth=3, temperature=0.8, top_p=0.9, seed=1, max_new_tokens=30)
    assert a == b
    assert_drafts_accepted_and_rejected(fin, engine.draft_drafter.loaded.name)

    prompt = engine.encode_chat([{"role": "user", "content": "Hello"}])
    exact = exact_distribution(engine, prompt)
    assert sum(p * N_SAMPLES >= 5 for p in exact.values()) >= 16
    counts, per_position, _ = samples(engine, prompt, 3)
    for j, (drafted, accepted) in enumerate(per_position):
        assert 0 < accepted < drafted, f"draft position {j + 1}: {accepted} of {drafted} accepted ({PARAMS})"
    assert chi_square_p_value(counts, exact) > 1e-4


def test_sampled_chains_of_a_draft_stopped_on_doubtful_drafts_keep_the_distribution(engines_with_draft,
                                                                                    monkeypatch):
    """--depth auto's floors with a draft model, sampled: a chain of up to 4 drafts stops after one whose q is
    below 0.5 (the less likely of its top 2; the draft settles the rows it processed); the chi-square test of
    tests/test_sampling.py."""
    from test_sampling import ALPHA, chi_square_p_value, exact_distribution, samples

    monkeypatch.setattr(DepthChooser, "pick", lambda self: 4)
    monkeypatch.setattr(DepthChooser, "floors", lambda self, k: [0.5] * (k - 1))
    engine = engines_with_draft("sliding")
    prompt = engine.encode_chat([{"role": "user", "content": "Hello"}])
    counts, per_position, stopped = samples(engine, prompt, AUTO)
    assert len(per_position) == 4 and all(0 < a < d for d, a in per_position), per_position
    assert 0 < stopped and per_position[3][0] > 0
    assert chi_square_p_value(counts, exact_distribution(engine, prompt)) > ALPHA


def test_a_fault_anywhere_in_a_draft_cycle_leaves_both_committed_states(engines_with_draft):
    """Faults at ops spread over a speculative request (the draft's chain, the verify, the commit, both models'
    settling): what was handed out is plain decoding's and the next request is exact, with every draft of the
    identical draft accepted (its state was left committed too)."""
    engine = engines_with_draft("same")
    prompt = engine.encode_chat(PROMPTS[0])
    s = GenerationSettings(max_new_tokens=12, depth=3, ignore_eos=True)
    plain, err, _ = handed_out(engine, prompt, GenerationSettings(max_new_tokens=12, depth=0, ignore_eos=True))
    count = FaultAt()
    assert handed_out(engine, prompt, s, count)[:2] == (plain, None)
    failed = 0
    for mode in ("oom", "error"):
        for at in range(7, count.count, max(1, count.count // 9) | 1):
            fault = FaultAt(at, mode)
            tokens, err, _ = handed_out(engine, prompt, s, fault)
            assert fault.fired and tokens == plain[: len(tokens)], (mode, at, fault.fired)
            failed += err is not None
            again, _, fin = decode(engine, prompt, depth=3, max_new_tokens=12)
            assert again == plain and fin.stats["acceptance_rate"] == 1.0, (mode, at, fault.fired)
    assert failed > 0


def test_drafter_choice_between_the_mtp_head_and_the_draft(pairs, engines_with_draft):
    engine = engines_with_draft("hybrid")
    prompt = engine.encode_chat(PROMPTS[0])
    assert engine.mtp_drafter is not None and engine.default_drafter() is engine.draft_drafter
    assert load_engine(str(pairs["hybrid"][0]), draft_model=str(pairs["hybrid"][1])).default_drafter().name == (
        f"auto(mtp, draft:{pairs['hybrid'][1].name})")  # both: auto by default
    plain, _, _ = decode(engine, prompt, depth=0)
    try:
        engine.attach_draft(None, "mtp")
        spec, _, fin = decode(engine, prompt, depth=2)
        assert spec == plain and fin.stats["drafter"] == "mtp"
    finally:
        engine.attach_draft(None, "draft")
    spec, _, fin = decode(engine, prompt, depth=2)
    assert spec == plain and fin.stats["drafter"].startswith("draft:")
    with pytest.raises(EngineError, match="--drafter draft: no draft model"):
        load_engine(str(pairs["sliding"][0]), drafter="draft")
    with pytest.raises(EngineError, match="--drafter auto: .* has no MTP head"):
        load_engine(str(pairs["sliding"][0]), draft_model=str(pairs["sliding"][1]), drafter="auto")


def test_mismatched_drafts_are_refused_in_one_line(pairs, tmp_path):
    target = str(pairs["sliding"][0])
    other_ids = write_qwen3(tmp_path / "other_ids", seed=9, layers=2, tokenizer=False)
    write_tokenizer(other_ids, vocab_shift=True)
    bigger_vocab = write_qwen3(tmp_path / "bigger_vocab", seed=9, layers=2, vocab_size=400)
    larger = write_qwen3(tmp_path / "larger", seed=9, layers=6)
    cases = [(other_ids, "maps tokens to other ids"), (bigger_vocab, "400 entries, the target's 384"),
             (larger, "larger than the target"), (tmp_path / "missing", "missing")]
    for draft, why in cases:
        with pytest.raises(EngineError, match=why) as e:
            load_engine(target, draft_model=str(draft))
        assert "\n" not in str(e.value) and "--draft-model" in str(e.value)


def test_cli_run_with_a_draft_model(pairs, capsys):
    from app.cli import main

    target, draft = pairs["sliding"]
    assert main(["run", "--model", str(target), "--draft-model", str(draft), "--prompt", "Tell me a story",
                 "--depth", "3", "--max-new-tokens", "16", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["drafter"] == f"draft:{draft.name}" and out["stats"]["drafted"] > 0
    assert main(["run", "--model", str(target), "--draft-model", str(target.parent / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--draft-model" in err


def test_discovery_pairs_drafts_with_targets_of_their_tokenizer(pairs, tmp_path, capsys):
    """A small model of the target's tokenizer is listed as its draft (by `models` and `doctor` too); one of
    another tokenizer, or not small enough (a same-size copy), is not."""
    import shutil

    from app.cli import main
    from engine.discovery import discover

    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(pairs["sliding"][0], root / "target")
    shutil.copytree(pairs["sliding"][1], root / "same_size")
    small = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    write_qwen3(root / "small", seed=5, layers=1, **small)
    other = write_qwen3(root / "small_other_ids", seed=5, layers=1, tokenizer=False, **small)
    write_tokenizer(other, vocab_shift=True)
    found = {c.name: c for c in discover([root], include_hf_cache=False, include_embedded=False,
                                         include_env=False)}
    assert all(c.supported for c in found.values()), {n: c.reason for n, c in found.items()}
    assert found["target"].drafts == [found["small"].path]
    assert found["same_size"].drafts == [found["small"].path] and found["small"].drafts == []
    assert found["small"].vocabulary != found["small_other_ids"].vocabulary
    assert main(["models", str(root)]) == 0
    assert "draft models (--draft-model): small" in capsys.readouterr().out
    engine = load_engine(str(root / "target"), draft_model=found["target"].drafts[0])
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0)
    spec, _, fin = decode(engine, prompt, depth=2)
    assert spec == plain and fin.stats["drafter"] == "draft:small"


def test_with_the_graph_runner_the_target_replays_its_steps_and_stays_exact(pairs, tmp_path):
    """The target's verify / decode / commit steps through the graph runner (graphs.Rerun on the CPU stands in
    for each CUDA graph) with a draft model drafting eagerly: a hybrid Qwen3.5 target, and a dense Qwen3 target
    (its ungated attention in graph mode); a sliding-window target too, its draft's chains eagerly."""
    dense = write_qwen3(tmp_path / "dense", seed=4)
    cases = [pairs["hybrid"], (dense, write_perturbed_draft(dense, tmp_path / "dense_draft", NOISE))]
    for target, draft in cases:
        eager = load_engine(str(target), cuda_graphs=False)
        graphs = load_engine(str(target), cuda_graphs=True, draft_model=str(draft), drafter="draft")
        prompt = eager.encode_chat(PROMPTS[0])
        plain, _, _ = decode(eager, prompt, depth=0, max_new_tokens=30)
        assert decode(graphs, prompt, depth=0, max_new_tokens=30)[0] == plain
        for depth in (1, 3):
            spec, _, fin = decode(graphs, prompt, depth=depth, max_new_tokens=30)
            assert spec == plain
            assert_drafts_accepted_and_rejected(fin, draft.name)
        report = graphs.diagnostics()["compile"]["cuda_graphs"]
        assert report["failure"] is None and sum(int(n) for n in report["replays"].values()) > 10
        chains = graphs.draft_drafter.graphs.report()  # greedy chains: one graph per (first width, k)
        assert chains["failure"] is None and sum(int(n) for n in chains["replays"].values()) > 10
    # a sliding-window target replays its graphs too (its ring's graph-mode record, rotating_cache.py); its draft's
    # chains stay eager (a chain's later steps would read what a graph-mode pass leaves in the record)
    target, draft = pairs["sliding"]
    sliding = load_engine(str(target), cuda_graphs=True, draft_model=str(draft), drafter="draft")
    eager = load_engine(str(target), cuda_graphs=False)
    prompt = eager.encode_chat(PROMPTS[0])
    plain = decode(eager, prompt, depth=0, max_new_tokens=30)[0]
    spec, _, fin = decode(sliding, prompt, depth=3, max_new_tokens=30)
    assert spec == plain
    assert_drafts_accepted_and_rejected(fin, draft.name)
    report = sliding.graph_runner.report()
    assert report["failure"] is None and sum(int(n) for n in report["replays"].values()) > 5
    assert sliding.draft_drafter.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["sliding", "hybrid"])
def test_on_cuda_with_graphs_a_draft_model_is_lossless(name, pairs):
    """float32 on CUDA (FLA kernels, the target's CUDA graphs; the draft eager): the CPU's plain tokens at every
    depth; bf16 runs the same loop."""
    target, draft = pairs[name]
    cpu = load_engine(str(target), device="cpu")
    gpu = load_engine(str(target), device="cuda", dtype="float32", draft_model=str(draft), drafter="draft")
    prompt = cpu.encode_chat(PROMPTS[0])
    plain, _, _ = decode(cpu, prompt, depth=0, max_new_tokens=32)
    for depth in (0, 1, 3):
        spec, _, fin = decode(gpu, prompt, depth=depth, max_new_tokens=32)
        assert spec == plain, depth
    assert_drafts_accepted_and_rejected(fin, draft.name)
    bf16 = load_engine(str(target), device="cuda", dtype="bfloat16", draft_model=str(draft))
    assert len(decode(bf16, prompt, depth=3, max_new_tokens=32)[0]) == 32


def test_bench_rows_for_the_draft_model(pairs, capsys):
    from app.cli import main

    target, draft = pairs["hybrid"]
    assert main(["bench", "--model", str(target), "--draft-model", str(draft), "--drafter", "mtp,auto", "--depths",
                 "0,2", "--max-new-tokens", "8", "--repeat", "1", "--no-hf", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    by = {(r["depth"], r["drafter"]): r for r in rows}
    auto = f"auto(mtp, draft:{draft.name})"
    assert set(by) >= {(0, "none"), (2, "mtp"), (2, f"draft:{draft.name}"), (2, auto)}
    assert by[(2, auto)]["identical_to_plain"] and "draft_cost" not in by[(2, auto)]
    mine = by[(2, f"draft:{draft.name}")]
    assert mine["identical_to_plain"] and mine["phase_ms"]["draft"] > 0
    assert main(["bench", "--model", str(target), "--drafter", "draft"]) == 2
    assert "no draft model" in capsys.readouterr().err


def test_bench_random_draft_presets_report_the_drafts_cost_and_break_even(capsys):
    """--draft-model random:PRESET: the preset's shape (hidden, heads, tied embeddings; the hybrid's GDN layers)
    with the target's vocabulary, cut by --draft-layers; every draft row says what the draft costs and the
    acceptance it would need to beat plain decoding."""
    from app.cli import main
    from app.cmd_bench import break_even_acceptance

    for preset in ("qwen3-0.6b", "qwen3.5-0.8b"):
        assert main(["bench", "--random-weights", "tiny", "--layers", "2", "--draft-model", f"random:{preset}",
                     "--draft-layers", "4", "--drafter", "draft", "--depths", "0,1,3", "--max-new-tokens", "8",
                     "--repeat", "1", "--no-hf", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["results"]
        by = {(r["depth"], r["drafter"]): r for r in rows}
        assert set(by) == {(0, "none"), (1, f"draft:{preset}"), (3, f"draft:{preset}")}
        for k in (1, 3):
            r = by[(k, f"draft:{preset}")]
            cost = r["draft_cost"]
            assert r["identical_to_plain"] and cost["draft_ms_per_cycle"] == r["phase_ms"]["draft"] > 0
            assert 0 < cost["draft_share_of_cycle"] < 1 and cost["verify_ms_per_cycle"] > 0
            assert cost["draft_step_vs_plain_step"] == pytest.approx(cost["draft_step_ms"] / cost["plain_step_ms"])
            even = cost["break_even_acceptance"]
            assert even == break_even_acceptance(k, cost["cycle_ms"], cost["plain_step_ms"])
        assert "break-even acceptance" not in json.dumps(by[(0, "none")])
    # the presets' shapes, with the target's vocabulary
    from engine import Engine, random_model
    from engine.presets import random_draft

    target = Engine(random_model("tiny", 1, "cpu", "float32"), None, set())
    for preset, kinds in (("qwen3-0.6b", {"full_attention"}), ("qwen3.5-0.8b", {"full_attention", "linear_attention"})):
        d = random_draft(f"random:{preset}", target, layers=4)
        cfg = d.trunk.config
        assert d.name == f"draft:{preset}" and cfg.vocab_size == 4096 and cfg.hidden_size == 1024
        assert cfg.tie_word_embeddings and d.trunk.lm.lm_head.weight is d.trunk.lm.model.embed_tokens.weight
        assert set(cfg.layer_types) == kinds and d.loaded.mtp is None
    assert (random_draft("random:qwen3-0.6b", target, 1).trunk.config.num_attention_heads,
            random_draft("random:qwen3.5-0.8b", target, 1).trunk.config.linear_num_value_heads) == (16, 16)
    with pytest.raises(EngineError, match="random draft presets are random:qwen3-0.6b"):
        random_draft("random:nope", target)


def test_break_even_acceptance_solves_for_plains_rate():
    from app.cmd_bench import break_even_acceptance
    from engine.autodepth import expected_tokens

    a = break_even_acceptance(3, 25.0, 10.0)  # a cycle of 2.5 plain steps must commit 2.5 tokens
    assert expected_tokens([a] * 3, 3) == pytest.approx(2.5, abs=1e-9)
    assert break_even_acceptance(3, 9.0, 10.0) == 0.0  # cheaper than a plain step: any acceptance wins
    assert break_even_acceptance(3, 41.0, 10.0) is None  # dearer than 4 plain steps: even acceptance 1 loses


def test_bench_refuses_bad_random_drafts_in_one_line(capsys):
    from app.cli import main

    for args, why in ((["--draft-model", "random:nope"], "random draft presets are"),
                      (["--draft-layers", "2"], "--draft-layers: only with --draft-model random:")):
        assert main(["bench", "--random-weights", "tiny", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err


def test_a_draft_that_fails_to_load_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """The chat's model picker sends SwitchModel(path, draft=...): a draft model that cannot load fails the switch
    with its reason, and the way back loads the previous model with the draft it had (none), not the bad one."""
    import queue

    from app.worker import DRAFT_ENV, EngineLoaded, EngineLoadFailed, EngineWorker, SwitchModel

    target = write_qwen3(tmp_path / "target", seed=4)
    monkeypatch.setenv(DRAFT_ENV, "")
    posted = queue.Queue()
    worker = EngineWorker(posted.put, str(target), "cpu", None)
    worker.start()
    try:
        next_posted(posted, EngineLoaded)
        worker.submit(SwitchModel(str(target), draft=str(tmp_path / "no-such-draft")))
        failed = next_posted(posted, EngineLoadFailed)
        assert failed.kept == "target" and "no-such-draft" in failed.error
        next_posted(posted, EngineLoaded)
        assert worker.engine is not None and worker.engine.draft_drafter is None
        assert os.environ[DRAFT_ENV] == ""
    finally:
        worker.shutdown(timeout=10)


def test_a_dense_qwen3_under_tensor_parallelism_is_refused_in_one_line(tmp_path, capsys):
    """Its ungated q_proj is not [query | gate] per head, as the shard plan slices it: refused before any rank
    starts, not a shape error from a rank's load."""
    from app.cli import main

    target = write_qwen3(tmp_path / "dense", seed=4)
    capsys.readouterr()
    code = main(["run", "--model", str(target), "--tp", "2", "--device", "cpu", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "dense Qwen3 models are not sharded yet" in err[0], err
