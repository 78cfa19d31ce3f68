"""Dense Qwen3 and sliding-window attention: transformers is the oracle (its sliding-window masks), speculation
equals plain decoding while verify passes wrap the rotating ring, and the ring's rollback is exact: what it holds
after a commit is independent of the rejected tail, bit for bit (the seed's tail-independence property). The same
with the graph runner (graphs.Rerun stands in for each CUDA graph on the CPU: the position on the device, the
pass's new entries in the ring's static record until settle), and a fault inside a graph-mode verify leaves the
committed ring as it was."""

from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from draft_fixtures import write_qwen3
from fixtures import greedy_reference
from faults import FaultAt, handed_out
from test_exactness import PROMPTS, decode

from engine import GenerationSettings, load_engine
from engine.drafters import OracleDrafter
from engine.rotating_cache import RotatingKV

WINDOW = 8  # smaller than every prompt here and than prompt + k: verify passes wrap the ring


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (engine, transformers model): "dense" (every layer full attention), "sliding" (layer 0 full,
    layers 1-3 over a window of WINDOW positions) and "graphs" (the sliding checkpoint with the graph runner)."""
    made, paths = {}, {}

    def path_of(name):
        if name not in paths:
            paths[name] = write_qwen3(tmp_path_factory.mktemp(name), seed=3,
                                      window=WINDOW if name == "sliding" else None)
        return paths[name]

    def get(name):
        if name not in made:
            path = path_of("sliding" if name == "graphs" else name)
            made[name] = (load_engine(str(path), cuda_graphs=name == "graphs"),
                          tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
        return made[name]

    get.path = path_of
    return get


@pytest.mark.parametrize("name", ["dense", "sliding"])
def test_greedy_equals_transformers_generate(name, models):
    engine, hf = models(name)
    assert engine.trunk.family.name == "qwen3"
    assert (hf.config.layer_types.count("sliding_attention"), engine.trunk.kinds.count("sliding_attention")) == \
        ((3, 3) if name == "sliding" else (0, 0))
    for messages in PROMPTS:
        prompt = engine.encode_chat(messages)
        assert len(prompt) > 3 * WINDOW
        ref = greedy_reference(hf, prompt, 30)
        for chunk in (5, 512):  # prefill passes narrower than the window, and one pass several windows wide
            ours, sources, fin = decode(engine, prompt, depth=0, prefill_chunk=chunk, max_new_tokens=30)
            assert ours == ref, chunk
            assert set(sources) == {"target"}


def test_a_dense_target_alone_decodes_plainly_and_says_why(models):
    engine, _ = models("dense")
    _, _, fin = decode(engine, engine.encode_chat(PROMPTS[0]), depth=2)
    assert engine.mtp_drafter is None and fin.stats["drafted"] == 0
    assert any(f.feature == "speculation" and "no MTP head" in f.reason and "--draft-model" in f.reason
               for f in fin.fallbacks)


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 12])
def test_speculation_equals_plain_while_verify_passes_wrap_the_window(depth, models):
    """The oracle replays plain decoding's tokens, a fifth of them corrupted: drafts accepted and rejected; at
    depth 12 one verify pass (13 tokens) is wider than the window and overwrites the whole ring, rejected tail
    included."""
    engine, _ = models("sliding")
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    drafter = OracleDrafter(plain, len(prompt), 0.2, engine.trunk.config.vocab_size, seed=depth)
    spec, sources, fin = decode(engine, prompt, drafter, depth=depth, max_new_tokens=40)
    assert spec == plain
    assert fin.stats["accepted"] > 0 and fin.stats["drafted"] > fin.stats["accepted"]
    assert sources.count("draft") == fin.stats["accepted"]


def ring_state(engine):
    w = engine.caches.window
    return w.k.clone(), w.v.clone(), w.pos.clone()


@pytest.mark.parametrize("runner", ["sliding", "graphs"])
@pytest.mark.parametrize("k,m", [(3, 0), (4, 2), (5, 5), (11, 3), (11, 10)])
def test_commit_is_independent_of_the_rejected_tail(k, m, runner, models):
    """Two verify passes that share t_n and m drafts, then differ: after commit(m) the rings (keys, values,
    positions) and the next step's logits are identical bit for bit. k = 11: a pass wider than the window. With
    the graph runner the verify pass replays a graph and leaves the ring alone (its entries wait in the record)."""
    engine, _ = models(runner)
    trunk, caches = engine.trunk, engine.caches
    prompt = torch.tensor(engine.encode_chat(PROMPTS[1]))
    vocab = trunk.config.vocab_size
    shared = [(7 * i + 3) % vocab for i in range(m)]
    tails = ([(11 * i + 5) % vocab for i in range(k - m)], [(13 * i + 17) % vocab for i in range(k - m)])
    states = []
    with torch.inference_mode():
        for tail in tails:
            caches.reset()
            engine.turns.reset()
            caches.kv.reserve(len(prompt) + k + 2)
            trunk.forward(prompt[:-1].unsqueeze(0), 0, caches, verify=False)
            caches.advance(len(prompt) - 1)
            before = ring_state(engine)
            inp = torch.tensor([[int(prompt[-1])] + shared + tail])
            trunk.forward(inp, caches.processed, caches, verify=True)
            if trunk.graphs is None:
                assert not torch.equal(ring_state(engine)[2], before[2])  # the pass overwrote slots
            else:  # the committed ring as it was; the pass in the record
                assert all(torch.equal(a, b) for a, b in zip(ring_state(engine), before))
                assert int(caches.window.graph.width) == k + 1
            caches.commit(m, trunk.backends, trunk.graphs)
            if trunk.graphs is not None:
                assert not torch.equal(ring_state(engine)[2], before[2])  # settle wrote the kept rows
            nxt = torch.tensor([[5]])
            h = trunk.forward(nxt, caches.processed, caches, verify=True)
            states.append((ring_state(engine), trunk.logits(h[0])))
            caches.abort()
    (ring_a, logits_a), (ring_b, logits_b) = states
    assert all(torch.equal(a, b) for a, b in zip(ring_a, ring_b))
    assert torch.equal(logits_a, logits_b)
    engine.turns.reset()
    if trunk.graphs is not None:  # both verify widths replayed graphs
        assert trunk.graphs.steps.replays[k + 1] >= 2 and trunk.graphs.steps.replays[1] >= 2


def test_stacked_records_rewind_to_any_prefix():
    """Chained single-token passes (a draft model's steps) and a wide pass, each recorded: settling at any
    position leaves exactly the ring that writing only the kept positions gives."""
    torch.manual_seed(0)
    W, L, H, D = 4, 2, 2, 3
    new = torch.randn(L, 1, H, 20, D)

    def run(widths, keep, speculative_from):
        ring, start = RotatingKV(L, H, D, W, torch.float32, torch.device("cpu")), 0
        for w in widths:
            ring.begin(start, w, speculative=start >= speculative_from)
            for i in range(L):
                q = torch.randn(1, H, w, D)
                ring.attend(i, q, new[i, :, :, start : start + w], new[i, :, :, start : start + w], 1.0)
            start += w
        ring.settle(keep)
        return ring

    for keep in range(6, 17):
        got = run([3, 3, 1, 1, 1, 7], keep, speculative_from=6)  # records from position 6 on
        want = run([keep], keep, speculative_from=99)
        assert torch.equal(got.pos, want.pos), keep
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v), keep


def test_a_graph_mode_pass_settles_to_any_prefix():
    """A speculative pass with its positions on the device (graph mode: the ring is left alone, the entries go to
    its graph record), narrower and wider than the window, from any start: settling at any position leaves
    exactly the ring that writing only the kept positions gives, and clears the record. A chained graph-mode step
    is refused (its steps before would be missing from the ring)."""
    torch.manual_seed(0)
    W, L, H, D = 4, 2, 2, 3
    new = torch.randn(L, 1, H, 30, D)

    def write(ring, start, w, speculative, positions=None):
        ring.begin(start if positions is None else positions, w, speculative=speculative)
        for i in range(L):
            kv = new[i, :, :, start : start + w]
            ring.attend(i, torch.randn(1, H, w, D), kv, kv, 1.0)

    def ring_after(prefix):
        ring = RotatingKV(L, H, D, W, torch.float32, torch.device("cpu"))
        if prefix:
            write(ring, 0, prefix, speculative=False)
        return ring

    for start in (0, 3, 6):
        for w in (1, 3, 4, 9):
            for keep in range(start, start + w + 1):
                got = ring_after(start)
                before = got.pos.clone(), got.k.clone()
                write(got, start, w, True, torch.arange(start, start + w))
                assert torch.equal(got.pos, before[0]) and torch.equal(got.k, before[1])  # (nothing written yet)
                got.settle(keep)
                want = ring_after(keep)
                assert torch.equal(got.pos, want.pos), (start, w, keep)
                assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v), (start, w, keep)
                assert int(got.graph.width) == 0
    with pytest.raises(RuntimeError, match="chained graph-mode step"):
        ring_after(0).begin(torch.arange(3, 4), 1, speculative=True, chained=True)


def test_a_restored_turn_brings_its_window_back(models):
    """Reuse across turns: a regenerate (the same prompt again) restores the prompt's snapshot; the ring, which
    cannot trim back, comes back from it (without it the second reply diverged)."""
    engine, hf = models("sliding")
    prompt = engine.encode_chat(PROMPTS[0])
    ref = greedy_reference(hf, prompt, 20)
    first, _, _ = decode(engine, prompt, depth=0, max_new_tokens=20)
    again, _, fin = decode(engine, prompt, depth=0, max_new_tokens=20)
    assert fin.stats["reused_tokens"] == len(prompt)
    assert first == again == ref


def test_a_released_qwen3_config_counts_every_layer_as_attention():
    """Qwen3's released config.json has no layer_types: all 28 layers hold KV (not every 4th, the hybrids'
    default), which is what memory and context estimates in `models` / `doctor` count."""
    from engine.context import context_info

    info = context_info({"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16,
                         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960})
    assert info.attention_layers == 28 and info.kv_bytes_per_token("bfloat16") == 28 * 2 * 8 * 128 * 2


def test_with_the_graph_runner_speculation_equals_transformers_and_eager_plain(models):
    """Greedy through the graph runner (on the CPU graphs.Rerun runs each captured step again over its static
    buffers, so nothing may depend on a host value): plain decoding's in-place step and verify passes at depths
    1-4 and 12 (13 wide: past the window) that wrap the ring, drafts accepted and rejected; every depth gives
    transformers' tokens, which eager plain decoding gives too. The replay counters say the graphs ran."""
    eager, hf = models("sliding")
    engine, _ = models("graphs")
    prompt = engine.encode_chat(PROMPTS[0])
    ref = greedy_reference(hf, prompt, 40)
    plain, _, _ = decode(eager, prompt, depth=0, max_new_tokens=40)
    assert plain == ref
    vocab = engine.trunk.config.vocab_size
    for depth in (0, 1, 2, 3, 4, 12):
        drafter = OracleDrafter(plain, len(prompt), 0.2, vocab, seed=depth) if depth else None
        spec, sources, fin = decode(engine, prompt, drafter, depth=depth, max_new_tokens=40)
        assert spec == plain, depth
        if depth:
            assert 0 < fin.stats["accepted"] < fin.stats["drafted"], (depth, fin.stats)
            assert sources.count("draft") == fin.stats["accepted"]
    report = engine.graph_runner.report()
    assert report["failure"] is None and report["decode"]["failure"] is None, report
    assert all(report["replays"].get(str(w), 0) > 0 for w in (2, 3, 4, 5, 13)), report  # verify widths
    assert report["decode"]["replays"]["1"] >= 39  # plain decoding's in-place step
    assert report["prefill"]["failure"] is None and report["prefill"]["replays"], report  # padded past the window
    assert not any(f.feature == "cuda_graphs" for f in engine.fallbacks(GenerationSettings(), None))


def test_a_fault_inside_a_graph_mode_verify_leaves_the_committed_ring_exact(models, monkeypatch):
    """An out-of-memory error at an op inside a verify replay (faults.FaultAt; the request then retries at a lower
    depth): the retried verify pass starts from exactly the ring the failed one started from, bit for bit, and the
    reply is still plain decoding's."""
    eager, _ = models("sliding")
    engine = load_engine(str(models.path("sliding")), cuda_graphs=True)
    prompt = engine.encode_chat(PROMPTS[1])
    plain, _, _ = decode(eager, prompt, depth=0, max_new_tokens=24)
    vocab = engine.trunk.config.vocab_size
    target = SimpleNamespace(generate=lambda p, s: engine.generate(
        p, s, drafter=OracleDrafter(plain, len(prompt), 0.2, vocab, seed=5)))
    settings = GenerationSettings(max_new_tokens=24, depth=4, ignore_eos=True)
    assert handed_out(target, prompt, settings)[0] == plain  # (captures the widths this request replays)
    runner, active, calls = engine.graph_runner, {}, []
    real = runner.verify

    def verify(tokens, pos, caches, drafter=None):  # each call: [position, ring at entry, first op, last op]
        calls.append([pos, ring_state(engine), active["fault"].count, None])
        out = real(tokens, pos, caches, drafter)
        calls[-1][3] = active["fault"].count
        return out

    monkeypatch.setattr(runner, "verify", verify)
    active["fault"] = count = FaultAt()
    assert handed_out(target, prompt, settings, count)[0] == plain
    spans = [(start, end) for _, _, start, end in calls]
    assert len(spans) > 4
    for start, end in spans[1:-1:2]:  # the middle of every other replay
        calls.clear()
        active["fault"] = fault = FaultAt((start + end) // 2, "oom")
        tokens, err, recovered = handed_out(target, prompt, settings, fault)
        where = f"op {fault.at} ({fault.fired})"
        assert fault.fired and err is None and recovered is not None, where
        assert tokens == plain, where
        failed = next(i for i, c in enumerate(calls) if c[3] is None)  # (it raised)
        (pos, ring, _, _), (retry_pos, retry_ring, _, _) = calls[failed], calls[failed + 1]
        assert retry_pos == pos and all(torch.equal(a, b) for a, b in zip(ring, retry_ring)), where
    assert runner.failure is None and sum(runner.steps.replays.values()) > 3 * len(spans)


def test_a_captured_in_place_step_reads_the_ring_as_an_eager_step_does(models):
    """Plain decoding's in-place graph step writes the ring, and its capture runs it more than once (the warm-up,
    then the replay; on CUDA two warm-ups): each run must see the ring the first one saw, not the entry the
    run before wrote (a key counted twice). Its logits and ring are the eager step's, at capture and at replay."""
    engine, _ = models("graphs")
    trunk, caches, runner = engine.trunk, engine.caches, engine.graph_runner
    prompt = torch.tensor(engine.encode_chat(PROMPTS[0]))
    with torch.inference_mode():
        caches.reset()
        engine.turns.reset()
        caches.kv.reserve(len(prompt) + 2)
        trunk.forward(prompt[:-1].unsqueeze(0), 0, caches, verify=False)
        caches.advance(len(prompt) - 1)
        committed, last, P = caches.window.snapshot(), prompt[-1:].unsqueeze(0), caches.processed
        want = trunk.logits(trunk.forward(last, P, caches, verify=False)[0])
        want_ring = ring_state(engine)
        for capture in (True, False):
            caches.window.restore(committed)
            if capture:
                runner.decodes.reset()
            captures = runner.decodes.captures
            got = runner.decode(last, P, caches)[1]
            assert runner.decodes.captures == captures + capture
            assert (got - want).abs().max() < 1e-5, capture
            ring = ring_state(engine)
            assert torch.equal(ring[2], want_ring[2]) and torch.allclose(ring[0], want_ring[0], atol=1e-6)
        caches.reset()
    engine.turns.reset()


def test_a_capture_that_fails_after_its_warm_up_never_reaches_the_ring(models, monkeypatch):
    """A prefill graph whose capture fails after its warm-up ran (which wrote the ring's graph record, the prompt's
    padding rows among them), and verify graphs refused outright: the engine goes on eagerly, and no later
    settle writes that record into the ring; the reply is plain decoding's."""
    eager, _ = models("sliding")
    engine = load_engine(str(models.path("sliding")), cuda_graphs=True)
    runner = engine.graph_runner
    real = runner.prefills._capture

    def after_warm_up(width, inputs, step, warmup):
        real(width, inputs, step, warmup)
        runner.prefills.graphs.pop(width)
        raise RuntimeError("refused after the warm-up")

    def refuse(*args):
        raise RuntimeError("refused")

    monkeypatch.setattr(runner.prefills, "_capture", after_warm_up)
    monkeypatch.setattr(runner.steps, "_capture", refuse)
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(eager, prompt, depth=0, max_new_tokens=30)
    drafter = OracleDrafter(plain, len(prompt), 0.2, engine.trunk.config.vocab_size, seed=2)
    spec, _, fin = decode(engine, prompt, drafter, depth=3, max_new_tokens=30)
    assert spec == plain and 0 < fin.stats["accepted"] < fin.stats["drafted"]
    assert "refused after the warm-up" in runner.prefills.failure and "refused" in runner.steps.failure
    assert engine.trunk.graphs is None  # (eager from the failed verify capture on)
