"""transformers is the oracle: greedy output equals generate(do_sample=False); speculative equals plain."""

import pytest
import torch
import transformers as tf

from engine import GenerationSettings
from engine.drafters import OracleDrafter
from engine.events import Tokens
from fixtures import greedy_reference

FAMILIES = ["next", "next_moe", "q35", "q35_moe"]
PROMPTS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France? "
                                                                                   "Hello, how are you today?"}],
]


def decode(engine, prompt, drafter=None, **kw):
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_new_tokens", 24)
    events = list(engine.generate(prompt, GenerationSettings(**kw), drafter=drafter))
    tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    sources = [s for e in events if isinstance(e, Tokens) for s in e.sources]
    return tokens, sources, events[-1]


def assert_mtp_drafts_accepted_and_rejected(fin):
    """The MTP head drafted, and its drafts were neither all rejected nor all accepted: commit(m) ran with
    accepted drafts and with a rejected tail (the fixtures' heads are trained to draft well, not perfectly)."""
    stats = fin.stats
    assert stats["drafter"] == "mtp" and stats["drafted"] > 0, stats
    assert stats["accepted"] > 0, f"no MTP draft accepted: {stats}"
    assert stats["drafted"] - stats["accepted"] > 0, f"no MTP draft rejected: {stats}"


def assert_exact_with_kernel(engine, path, device, before_speculation=lambda: None):
    """An engine loaded with a kernel allowed (float32; on the CPU Triton's interpreter runs it): greedy decoding
    equals transformers on the checkpoint at `path` (CPU), and speculation at depths 1-4 equals plain decoding with
    drafts accepted and rejected. before_speculation runs after plain decoding (the caller's checks that the
    kernel ran)."""
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    before_speculation()
    if device.type == "cpu":
        hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        assert plain == greedy_reference(hf, prompt, 40)
    for depth in (1, 2, 3, 4):
        spec, _, fin = decode(engine, prompt, depth=depth, max_new_tokens=40)
        assert spec == plain, depth
        assert_mtp_drafts_accepted_and_rejected(fin)


@pytest.fixture(scope="module")
def hf_models(ckpt):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tf.AutoModelForCausalLM.from_pretrained(str(ckpt(name)), dtype=torch.float32).eval()
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES + ["q35_text", "next_sharded_experts"])
def test_greedy_equals_transformers_generate(name, engines, hf_models):
    engine, hf = engines(name), hf_models(name)
    for messages in PROMPTS:
        prompt = engine.encode_chat(messages)
        # a prefill chunk shorter than the prompt exercises chunked prefill
        ours, sources, fin = decode(engine, prompt, depth=0, prefill_chunk=7)
        assert len(prompt) > 7
        assert ours == greedy_reference(hf, prompt, 24)
        assert set(sources) == {"target"} and fin.stats["drafted"] == 0


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_mtp_speculation_equals_plain(name, depth, engines):
    assert_speculation_equals_plain(engines(name), depth)


def assert_greedy_equals_transformers(engine, twin) -> None:
    """Greedy decoding at decode widths (7-token prefill chunks) equals transformers on the checkpoint `twin`
    (a quantized model's exactly dequantized twin) over every prompt."""
    hf = tf.AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    for messages in PROMPTS:
        prompt = engine.encode_chat(messages)
        ours, _, _ = decode(engine, prompt, depth=0, prefill_chunk=7)
        assert ours == greedy_reference(hf, prompt, 24)


def assert_speculation_equals_plain(engine, depth: int) -> None:
    """MTP speculation at `depth` gives plain decoding's tokens, with drafts accepted and rejected."""
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    spec, sources, fin = decode(engine, prompt, depth=depth, max_new_tokens=40)
    assert spec == plain
    assert_mtp_drafts_accepted_and_rejected(fin)
    assert sources.count("draft") == fin.stats["accepted"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_oracle_full_and_zero_acceptance(name, depth, engines):
    engine = engines(name)
    prompt = engine.encode_chat(PROMPTS[1])
    plain, _, _ = decode(engine, prompt, depth=0)
    vocab = engine.trunk.config.vocab_size

    full, sources, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 0.0, vocab), depth=depth)
    assert full == plain
    assert fin.stats["acceptance_rate"] == 1.0 and sources.count("draft") > 0
    assert fin.stats["cycles"] < len(plain) - 1  # fewer verify passes than tokens

    none, sources, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 1.0, vocab), depth=depth)
    assert none == plain
    assert fin.stats["drafted"] > 0 and fin.stats["accepted"] == 0 and "draft" not in sources


class RejectAt(OracleDrafter):
    """Proposes the true continuation but corrupts draft position (cycle % k): partial acceptance at every
    position in turn. (The oracle's no-op hooks for the rest of the drafter interface.)"""

    name = "reject-at"

    def __init__(self, reference, prompt_len, vocab):
        super().__init__(reference, prompt_len, 0.0, vocab)
        self.ref, self.calls = reference, 0

    def propose(self, seq, k, timer, req=None):
        start = seq.shape[0] - self.prompt_len
        out = [self.ref[start + i] if start + i < len(self.ref) else 0 for i in range(k)]
        bad = self.calls % k
        out[bad] = (out[bad] + 1) % self.vocab
        self.calls += 1
        return torch.tensor(out, device=seq.device), None


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("depth", [2, 3, 4])
def test_partial_acceptance_at_every_position(name, depth, engines):
    engine = engines(name)
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    drafter = RejectAt(plain, len(prompt), engine.trunk.config.vocab_size)
    spec, sources, fin = decode(engine, prompt, drafter, depth=depth, max_new_tokens=40)
    assert spec == plain
    per_pos = fin.stats["per_position_acceptance"]
    assert len(per_pos) == depth and 0 < fin.stats["acceptance_rate"] < 1
    assert per_pos[0] > 0  # position 0 accepted whenever a later position was the corrupted one


@pytest.mark.parametrize("at", [5, 7])
def test_eos_inside_accepted_drafts_stops_like_plain(at, engines):
    """Plain decoding stops at the first EOS; speculation must not emit what follows an accepted EOS draft. At
    depth 4 from the first token on, token 5 is a cycle's bonus and token 7 one of its drafts: an EOS drafted and
    accepted counts as accepted (it is shown as a draft), and the drafts after it count neither way."""
    engine = engines("next")
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=30)
    stop = plain[at]  # pretend this token is EOS
    engine.stop_ids, saved = frozenset({stop}), engine.stop_ids
    try:
        ref, _, fin0 = decode(engine, prompt, depth=0, ignore_eos=False, max_new_tokens=30)
        vocab = engine.trunk.config.vocab_size
        spec, sources, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 0.0, vocab), depth=4,
                                    ignore_eos=False, max_new_tokens=30)
    finally:
        engine.stop_ids = saved
    assert ref == plain[: plain.index(stop) + 1] and fin0.reason == "eos"
    assert spec == ref and fin.reason == "eos" and "draft" in sources
    assert fin.stats["accepted"] == sources.count("draft") and fin.stats["acceptance_rate"] == 1.0
    assert fin.stats["per_position_acceptance"] == [1.0] * len(fin.stats["per_position_acceptance"])
    assert (sources[-1] == "draft") == (plain.index(stop) % 5 != 0)  # both cases happen across the two


def test_max_new_tokens_is_exact_at_every_depth(engines):
    engine = engines("next")
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=11)
    for depth in range(1, 5):
        vocab = engine.trunk.config.vocab_size
        spec, _, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 0.0, vocab), depth=depth,
                              max_new_tokens=11)
        assert spec == plain and len(spec) == 11 and fin.reason == "length"


def test_seeded_sampling_reproduces(engines):
    engine = engines("next")
    prompt = engine.encode_chat(PROMPTS[0])
    a, _, _ = decode(engine, prompt, depth=0, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    b, _, _ = decode(engine, prompt, depth=0, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    c, _, _ = decode(engine, prompt, depth=0, temperature=0.9, top_p=0.95, top_k=50, seed=8)
    greedy, _, _ = decode(engine, prompt, depth=0)
    assert a == b
    assert a != c and greedy not in (a, c)  # a different seed changes the sample, and neither is greedy


def test_sampling_speculates_and_reproduces(engines):
    engine = engines("next")
    prompt = engine.encode_chat(PROMPTS[0])
    a, sources, fin = decode(engine, prompt, depth=3, temperature=0.8, top_p=0.9, seed=1)
    b, _, _ = decode(engine, prompt, depth=3, temperature=0.8, top_p=0.9, seed=1)
    assert a == b
    assert_mtp_drafts_accepted_and_rejected(fin)
    assert not any(f.feature == "speculation" for f in fin.fallbacks)


def test_no_mtp_head_falls_back_to_plain(engines):
    engine = engines("next_nomtp")
    prompt = engine.encode_chat(PROMPTS[0])
    _, sources, fin = decode(engine, prompt, depth=2)
    assert engine.mtp_drafter is None and fin.stats["drafted"] == 0
    assert any(f.feature == "speculation" and "no mtp" in f.reason.lower() for f in fin.fallbacks)


def test_generated_pad_token_is_a_valid_input(tmp_path):
    """A fixture whose config says PAD is a token the model generates mid-reply: nothing masks it."""
    import json

    from engine import load_engine
    from fixtures import write_checkpoint

    path = write_checkpoint(tmp_path / "m", "qwen3_next")
    engine = load_engine(str(path))
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0)
    pad = plain[6]
    conf = json.loads((path / "config.json").read_text())
    conf["pad_token_id"] = pad
    (path / "config.json").write_text(json.dumps(conf))
    engine = load_engine(str(path))
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert hf.config.pad_token_id == pad
    ref = greedy_reference(hf, prompt, 24, pad_token_id=pad)
    again, _, _ = decode(engine, prompt, depth=0)
    assert again == plain == ref and pad in again[1:-1]
    vocab = engine.trunk.config.vocab_size
    for depth in (1, 3):
        spec, sources, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 0.0, vocab), depth=depth)
        assert spec == plain and fin.stats["accepted"] > 0
        mtp, _, fin = decode(engine, prompt, depth=depth)
        assert mtp == plain
        assert_mtp_drafts_accepted_and_rejected(fin)


def test_bench_precision_report_float32_is_exact(ckpt, capsys):
    import json

    from app.cli import main

    assert main(["bench", "--precision", "--model", str(ckpt("next")), "--depths", "3", "--max-new-tokens", "8",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["precision"]
    assert report["float32"]["identical_share"] == 1.0 and report["float32"]["runs"] == 16
    assert 0.0 <= report["bfloat16"]["identical_share"] <= 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_weights_follow_the_planted_map_so_the_oracle_is_accepted(dtype):
    """Bench models of real shapes with random weights: greedy output is the planted permutation of the last
    token, decisively enough that a bf16 verify pass agrees with bf16 decode steps (oracle at 1.0 = all kept)."""
    from engine import Engine
    from engine.presets import planted_next, random_model

    engine = Engine(random_model("tiny", None, "cpu", dtype), None, set())
    prompt = list(range(1, 33))
    plain, _, _ = decode(engine, prompt, depth=0)
    vocab = engine.trunk.config.vocab_size
    assert plain == [planted_next(t, vocab) for t in ([prompt[-1]] + plain)[:-1]]
    spec, sources, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 0.0, vocab), depth=3)
    assert spec == plain and fin.stats["acceptance_rate"] == 1.0 and sources.count("draft") > 0
