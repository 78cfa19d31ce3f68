"""The speculative transaction: tail independence (bit-exact), the MTP cache's causal prefix, failure safety."""

import pytest
import torch

from engine import GenerationSettings
from engine.errors import EngineError
from engine.drafters import OracleDrafter
from engine.events import Tokens
from engine.timing import PhaseTimer

FAMILIES = ["next", "next_moe", "q35", "q35_moe"]


def committed_state(engine):
    c, d = engine.caches, engine.mtp_drafter
    n = c.processed
    return {
        "conv": c.gdn.conv.clone(), "recurrent": c.gdn.recurrent.clone(),
        "k": c.kv.k[:, :, :n].clone(), "v": c.kv.v[:, :, :n].clone(), "processed": n,
        "mtp_k": d.cache.k[:, :, : d.covered].clone(), "mtp_v": d.cache.v[:, :, : d.covered].clone(),
        "covered": d.covered,
    }


def prime(engine, prompt):
    """Prefill a prompt through the engine's own phases; return the committed sequence tensor."""
    from engine.speculative import prefill

    engine.caches.reset()
    engine.mtp_drafter.reset()
    ids = torch.tensor(prompt)
    logits = prefill(engine.trunk, engine.caches, engine.mtp_drafter, ids, 512, PhaseTimer(ids.device))
    return torch.cat([ids, logits.argmax(-1)])


def verify_and_commit(engine, seq, drafts, m):
    timer = PhaseTimer(seq.device)
    d = engine.mtp_drafter
    d.propose(seq, len(drafts), timer)  # MTP priming/refresh + speculative chain entries
    inp = torch.cat([seq[-1:], torch.tensor(drafts, dtype=torch.long)]).unsqueeze(0)
    engine.caches.kv.reserve(inp.shape[1])
    hidden = engine.trunk.forward(inp, engine.caches.processed, engine.caches, verify=True)
    engine.caches.commit(m, engine.trunk.backends)
    d.rollback()
    d.observe(hidden[:, : m + 1])
    bonus = engine.trunk.logits(hidden[0, m]).argmax(-1).view(1)  # the target's token after the kept prefix
    return torch.cat([seq, torch.tensor(drafts[:m], dtype=torch.long), bonus])


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("k,m", [(3, 0), (3, 1), (4, 2), (2, 2)])
def test_commit_is_independent_of_the_rejected_tail(name, k, m, engines):
    engine = engines(name)
    prompt = engine.encode_chat([{"role": "user", "content": "Hello, how are you today?"}])
    vocab = engine.trunk.config.vocab_size
    shared = [(7 * i + 3) % vocab for i in range(m)]
    tails = ([(11 * i + 5) % vocab for i in range(k - m)], [(13 * i + 17) % vocab for i in range(k - m)])
    states = []
    with torch.inference_mode():
        for tail in tails:
            seq = prime(engine, prompt)
            seq = verify_and_commit(engine, seq, shared + tail, m)
            engine.mtp_drafter.propose(seq, 1, PhaseTimer(seq.device))  # refresh over the committed positions
            engine.mtp_drafter.rollback()
            states.append(committed_state(engine))
    a, b = states
    assert a["processed"] == b["processed"] == len(prompt) + m + 1 == len(seq) - 1
    assert a["covered"] == b["covered"] == a["processed"]
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key  # bit-exact


@pytest.mark.parametrize("name", ["next", "q35_moe"])
def test_mtp_cache_equals_causal_recomputation(name, engines):
    """After cycles with full and partial acceptance, the MTP cache and its next draft equal a from-scratch
    causal computation over the committed sequence."""
    engine = engines(name)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    vocab = engine.trunk.config.vocab_size
    with torch.inference_mode():
        seq = prime(engine, prompt)
        for drafts, m in [([1, 2, 3], 3), ([4, 5, 6], 1), ([7, 8], 0), ([9, 10, 11, 12], 2)]:
            seq = verify_and_commit(engine, seq, [d % vocab for d in drafts], m)
        incremental, _ = engine.mtp_drafter.propose(seq, 2, PhaseTimer(seq.device))
        inc = committed_state(engine)
        engine.mtp_drafter.rollback()

        # from scratch: one prefill over all processed tokens, one MTP pass over all positions
        n = engine.caches.processed
        fresh_caches = engine.trunk.new_caches()
        fresh_caches.kv.reserve(n)
        hidden = engine.trunk.forward(seq[:n].unsqueeze(0), 0, fresh_caches, verify=False)
        head = engine.loaded.mtp
        cache = head.new_cache()
        cache.reserve(n + 2)
        logits, out = head(hidden, seq[1 : n + 1].unsqueeze(0), 0, cache)
        d1 = logits[:, -1].argmax(-1)
        logits2, _ = head(out[:, -1:], d1.view(1, 1), n, cache)
    assert inc["covered"] == n
    torch.testing.assert_close(inc["mtp_k"], cache.k[:, :, :n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(inc["mtp_v"], cache.v[:, :, :n], rtol=1e-4, atol=1e-4)
    assert incremental.tolist() == [int(d1), int(logits2[:, -1].argmax(-1))]


PHASES = ["propose", "forward", "commit", "observe", "consumer"]


@pytest.mark.parametrize("phase", PHASES)
def test_failure_in_any_phase_leaves_a_correct_engine(phase, engines, monkeypatch):
    """A failure before a cycle mutates anything committed raises as it is; one inside commit's apply (the state
    written in place) is an EngineError that names it. Either way the next request is exact, with the MTP head
    and with another drafter."""
    engine = engines("next")
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    settings = GenerationSettings(max_new_tokens=20, depth=3, ignore_eos=True)
    plain = [t for e in engine.generate(prompt, GenerationSettings(max_new_tokens=20, depth=0, ignore_eos=True))
             if isinstance(e, Tokens) for t in e.token_ids]
    vocab = engine.trunk.config.vocab_size

    class Boom(RuntimeError):
        pass

    calls = {"n": 0}

    def failing(original):
        def wrapper(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise Boom(phase)
            return original(*a, **kw)
        return wrapper

    targets = {"propose": (engine.mtp_drafter, "propose"), "forward": (engine.trunk, "forward"),
               "commit": (engine.caches, "commit"), "observe": (engine.mtp_drafter, "keep")}
    raised = EngineError if phase == "commit" else Boom
    with pytest.raises(raised) as info:
        if phase == "consumer":
            for i, ev in enumerate(engine.generate(prompt, settings)):
                if i == 4:
                    raise Boom(phase)
        else:
            obj, attr = targets[phase]
            monkeypatch.setattr(obj, attr, failing(getattr(obj, attr)))
            list(engine.generate(prompt, settings))
    if raised is EngineError:
        assert "Boom" in str(info.value) and "state was dropped" in str(info.value)
    monkeypatch.undo()
    assert calls["n"] >= 3 or phase == "consumer"
    # the committed state after the failure is what a fresh prefill of the committed tokens gives
    for drafter in (None, OracleDrafter(plain, len(prompt), 0.3, vocab, seed=2)):
        again = [t for e in engine.generate(prompt, settings, drafter=drafter)
                 if isinstance(e, Tokens) for t in e.token_ids]
        assert again == plain


def test_failed_verify_keeps_committed_gdn_state(engines, monkeypatch):
    """A verify pass that dies half-way must not have touched the committed recurrent / conv state."""
    engine = engines("q35")
    prompt = engine.encode_chat([{"role": "user", "content": "Hello"}])
    with torch.inference_mode():
        seq = prime(engine, prompt)
        before = committed_state(engine)
        layers = engine.trunk.layers
        last = len(layers) - 1
        original = layers[last].mlp.down_proj.forward  # the last layer's last matmul

        def boom(*a, **kw):
            raise RuntimeError("late failure")

        monkeypatch.setattr(layers[last].mlp.down_proj, "forward", boom)
        with pytest.raises(RuntimeError):
            engine.trunk.forward(torch.cat([seq[-1:], torch.tensor([1, 2])]).unsqueeze(0),
                                 engine.caches.processed, engine.caches, verify=True)
        engine.caches.abort()
        monkeypatch.setattr(layers[last].mlp.down_proj, "forward", original)
        after = committed_state(engine)
    for key in ("conv", "recurrent", "k", "v"):
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("name", ["next", "q35_moe"])
def test_graph_mode_forward_equals_eager(name, engines):
    """The CUDA-graph variant (device-side position, whole-capacity KV under a mask) computes the same verify
    pass; checked on the CPU where the same code runs without capture."""
    engine = engines(name)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    with torch.inference_mode():
        seq = prime(engine, prompt)
        engine.caches.kv.reserve(64)
        inp = torch.cat([seq[-1:], torch.tensor([5, 6, 7])]).unsqueeze(0)
        eager = engine.trunk.forward(inp, engine.caches.processed, engine.caches, verify=True).clone()
        stash_eager = engine.caches.stash.q[:, :4].clone()
        static = engine.trunk.forward(inp, torch.tensor(engine.caches.processed), engine.caches, verify=True)
        engine.caches.abort()
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.caches.stash.q[:, :4], stash_eager, rtol=1e-5, atol=1e-5)
