"""GPU checks (run through the device tool): FLA kernels selected and exact in float32; speculation lossless."""

import pytest
import torch

from engine import GenerationSettings, load_engine
from engine.drafters import OracleDrafter
from engine.events import Tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tokens(engine, prompt, depth, drafter=None, n=32):
    s = GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True)
    return [t for e in engine.generate(prompt, s, drafter=drafter) if isinstance(e, Tokens) for t in e.token_ids]


@pytest.mark.parametrize("name", ["next", "next_moe", "q35", "q35_moe"])
def test_fla_float32_speculation_equals_plain_and_cpu(name, ckpt):
    gpu = load_engine(str(ckpt(name)), device="cuda", dtype="float32")
    cpu = load_engine(str(ckpt(name)), device="cpu", dtype="float32")
    try:
        import fla  # noqa: F401
        assert gpu.trunk.backends.choice["gdn_recurrent"][0] == "fla"
    except ImportError:
        pass
    prompt = gpu.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain = tokens(gpu, prompt, 0)
    assert plain == tokens(cpu, prompt, 0)
    vocab = gpu.trunk.config.vocab_size
    for depth in (1, 2, 3, 4):
        assert tokens(gpu, prompt, depth) == plain
        assert tokens(gpu, prompt, depth, OracleDrafter(plain, len(prompt), 0.4, vocab, seed=depth)) == plain


@pytest.mark.parametrize("name", ["next", "q35_moe"])
def test_cuda_graphs_certified_and_lossless(name, ckpt):
    eager = load_engine(str(ckpt(name)), device="cuda", dtype="float32", cuda_graphs=False)
    graphs = load_engine(str(ckpt(name)), device="cuda", dtype="float32", cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain = tokens(eager, prompt, 0)
    vocab = graphs.trunk.config.vocab_size
    for depth in (0, 1, 3):
        assert tokens(graphs, prompt, depth) == plain
        assert tokens(graphs, prompt, depth, OracleDrafter(plain, len(prompt), 0.4, vocab, seed=depth)) == plain
    report = graphs.diagnostics()["compile"]["cuda_graphs"]
    assert report["failure"] is None and set(report["captured_widths"]) >= {2, 4}
    # the widths of depths 1 and 3 replayed many times (a clipped last cycle may use another width once), and
    # plain decoding's in-place step
    assert all(int(report["replays"][str(w)]) > 5 for w in (2, 4))
    assert report["decode"]["failure"] is None and int(report["decode"]["replays"]["1"]) > 5
    assert report["commit"]["failure"] is None and int(report["commit"]["replays"]["1"]) > 5  # commit's replay
    # greedy MTP cycles, a reply's first included (after the head's catch-up over the prompt), are cycle graphs
    # (the last cycle's commit, the drafts, verify and refresh), timed apart by the events inside; the verify
    # graphs with the head's refresh are the host's path's (none here)
    refreshing, whole = report["verify_refresh"], report["cycle"]
    assert refreshing["failure"] is None and not refreshing["replays"], refreshing
    assert whole["failure"] is None and all(int(whole["replays"][str(w)]) > 2 for w in (2, 4))
    from engine import GenerationSettings
    from engine.events import Cycle

    cycles = [ev for ev in graphs.generate(prompt, GenerationSettings(max_new_tokens=16, depth=3, ignore_eos=True))
              if isinstance(ev, Cycle)]
    # Each phase timed by the events inside the cycle graphs. (Per cycle it may not show: each call reports the
    # cycle it launched ahead, and a phase whose events have not finished when the host reads them, without a
    # sync, counts in a later call: on the H200 a middle cycle came without its draft time.)
    for phase in ("commit", "draft", "verify", "refresh"):
        assert sum(c.phase_ms.get(phase, 0.0) for c in cycles[1:-1]) > 0, phase
    # (read after that 16-token reply, whose clipped last cycles may capture a width of their own: on the H100
    # the Qwen3-Next case captured two cycle graphs there)
    report = graphs.diagnostics()["compile"]["cuda_graphs"]
    captures = (report["captures"], report["verify_refresh"]["captures"], report["cycle"]["captures"])
    tokens(graphs, prompt, 3)  # a further request re-uses the captured graphs: no re-capture
    again = graphs.diagnostics()["compile"]["cuda_graphs"]
    assert (again["captures"], again["verify_refresh"]["captures"], again["cycle"]["captures"]) == captures


@pytest.mark.parametrize("name", ["q35", "next_moe"])
def test_compiled_graphs_decode_like_eager_in_float32(name, ckpt):
    """--compile: the compiled layers (inductor, inside the graphs) write the GDN conv cache and the verify stash's
    final states as the eager steps do: plain and speculative tokens equal the eager engine's."""
    eager = load_engine(str(ckpt(name)), device="cuda", dtype="float32", cuda_graphs=False)
    compiled = load_engine(str(ckpt(name)), device="cuda", dtype="float32", cuda_graphs=True, compile=True)
    prompt = compiled.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain = tokens(eager, prompt, 0)
    vocab = compiled.trunk.config.vocab_size
    assert tokens(compiled, prompt, 0) == plain
    for depth in (1, 3):
        assert tokens(compiled, prompt, depth, OracleDrafter(plain, len(prompt), 0.4, vocab, seed=depth)) == plain
    report = compiled.diagnostics()["compile"]["cuda_graphs"]
    assert report["decode"]["failure"] is None
    if name == "next_moe":  # float32: the row-wise MoE path, whose compiled verify steps disagreed (not_compiled)
        assert not report["compiled"] and "row-wise MoE" in report["compile_failure"]
    else:
        assert report["compiled"] and report["compile_failure"] is None


def test_triton_moe_passes_its_self_check_in_bf16_and_speculation_stays_exact_in_float32(ckpt):
    """bf16 on CUDA selects the Triton MoE (weights read in place); float32 keeps the row-wise path, so the
    float32 exactness above still holds for MoE families."""
    bf16 = load_engine(str(ckpt("q35_moe")), device="cuda", dtype="bfloat16")
    assert bf16.trunk.backends.moe == "triton", bf16.trunk.backends.choice["moe"]
    f32 = load_engine(str(ckpt("q35_moe")), device="cuda", dtype="float32")
    assert f32.trunk.backends.moe == "rowwise"
    prompt = bf16.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    assert len(tokens(bf16, prompt, 3)) == 32  # runs through the loop, graphs included


def test_fused_prefill_attention_matches_the_masked_reference_in_bf16(monkeypatch):
    """Prefill's causal attention on CUDA (the flash kernel, grouped-query heads, no mask) against the explicit
    boolean mask in float32, at an offset (a follow-up turn's chunk, the MTP head's catch-up) and from position 0.
    Never through SDPA's dispatcher, whose cuDNN choice builds a plan per new shape (0.53 s a call, H100)."""
    import torch.nn.functional as F

    from engine import model
    from engine.model import causal_attention

    def dispatcher(*args, **kwargs):
        raise AssertionError("SDPA's dispatcher: a plan per shape where cuDNN is chosen")

    monkeypatch.setattr(model, "F", type("F", (), {"scaled_dot_product_attention": staticmethod(dispatcher)}))

    g = torch.Generator(device="cuda").manual_seed(0)
    for T, S in ((96, 300), (256, 256), (700, 2048)):
        q = torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        mask = torch.ones(T, S, dtype=torch.bool, device="cuda").tril(S - T)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        out = causal_attention(q, k, v, S - T, 128 ** -0.5)
        assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("words", [30, 150])
def test_long_and_graph_prefills_equal_the_cpu_in_float32(words, ckpt):
    """A prompt over several prefill chunks (flash attention at an offset, FLA's chunked kernel) and a short one
    replayed from a prefill graph (padded, the padding's GDN rows made no-ops: FLA's chunked kernel inside the
    graph): greedy texts equal the CPU's, and the MTP depths equal plain."""
    cpu = load_engine(str(ckpt("next")), device="cpu")
    graphs = load_engine(str(ckpt("next")), device="cuda", dtype="float32", cuda_graphs=True)
    text = " ".join(f"cat{i % 17} sun{i % 5}" for i in range(words))
    prompt = graphs.encode_chat([{"role": "user", "content": f"Summarise: {text}"}])
    s = lambda depth: GenerationSettings(max_new_tokens=24, depth=depth, ignore_eos=True, reuse=False,
                                         prefill_chunk=128)
    run = lambda e, depth: [t for ev in e.generate(prompt, s(depth)) if isinstance(ev, Tokens) for t in ev.token_ids]
    plain = run(cpu, 0)
    for depth in (0, 2):
        assert run(graphs, depth) == plain
    prefills = graphs.diagnostics()["compile"]["cuda_graphs"]["prefill"]
    # every 128-token chunk, and the short prompt whole, replayed from a prefill graph
    assert prefills["failure"] is None and sum(prefills["replays"].values()) >= 2 * -(-len(prompt) // 128)

