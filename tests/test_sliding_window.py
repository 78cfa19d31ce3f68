"""Dense Qwen3 and sliding-window attention: transformers is the oracle (its sliding-window masks), speculation
equals plain decoding while verify passes wrap the rotating ring, and the ring's rollback is exact: what it holds
after a commit is independent of the rejected tail, bit for bit (the seed's tail-independence property)."""

import pytest
import torch
import transformers as tf
from draft_fixtures import write_qwen3
from test_exactness import PROMPTS, decode

from engine import load_engine
from engine.drafters import OracleDrafter
from engine.rotating_cache import RotatingKV

WINDOW = 8  # smaller than every prompt here and than prompt + k: verify passes wrap the ring


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (engine, transformers model): "dense" (every layer full attention) and "sliding" (layer 0 full,
    layers 1-3 over a window of WINDOW positions)."""
    made = {}

    def get(name):
        if name not in made:
            path = write_qwen3(tmp_path_factory.mktemp(name), seed=3,
                               window=WINDOW if name == "sliding" else None)
            made[name] = (load_engine(str(path)),
                          tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
        return made[name]

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
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False)
        for chunk in (5, 512):  # prefill passes narrower than the window, and one pass several windows wide
            ours, sources, fin = decode(engine, prompt, depth=0, prefill_chunk=chunk, max_new_tokens=30)
            assert ours == ref[0, len(prompt):].tolist(), chunk
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


@pytest.mark.parametrize("k,m", [(3, 0), (4, 2), (5, 5), (11, 3), (11, 10)])
def test_commit_is_independent_of_the_rejected_tail(k, m, models):
    """Two verify passes that share t_n and m drafts, then differ: after commit(m) the rings (keys, values,
    positions) and the next step's logits are identical bit for bit. k = 11: a pass wider than the window."""
    engine, _ = models("sliding")
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
            assert not torch.equal(ring_state(engine)[2], before[2])  # the pass overwrote slots
            caches.commit(m, trunk.backends)
            nxt = torch.tensor([[5]])
            h = trunk.forward(nxt, caches.processed, caches, verify=True)
            states.append((ring_state(engine), trunk.logits(h[0])))
            caches.abort()
    (ring_a, logits_a), (ring_b, logits_b) = states
    assert all(torch.equal(a, b) for a, b in zip(ring_a, ring_b))
    assert torch.equal(logits_a, logits_b)
    engine.turns.reset()


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


def test_a_restored_turn_brings_its_window_back(models):
    """Reuse across turns: a regenerate (the same prompt again) restores the prompt's snapshot; the ring, which
    cannot trim back, comes back from it (without it the second reply diverged)."""
    engine, hf = models("sliding")
    prompt = engine.encode_chat(PROMPTS[0])
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    first, _, _ = decode(engine, prompt, depth=0, max_new_tokens=20)
    again, _, fin = decode(engine, prompt, depth=0, max_new_tokens=20)
    assert fin.stats["reused_tokens"] == len(prompt)
    assert first == again == ref[0, len(prompt):].tolist()


def test_a_released_qwen3_config_counts_every_layer_as_attention():
    """Qwen3's released config.json has no layer_types: all 28 layers hold KV (not every 4th, the hybrids'
    default), which is what memory and context estimates in `models` / `doctor` count."""
    from engine.context import context_info

    info = context_info({"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16,
                         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960})
    assert info.attention_layers == 28 and info.kv_bytes_per_token(2) == 28 * 2 * 8 * 128 * 2
