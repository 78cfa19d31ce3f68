"""Graph replay of the fixed-shape steps (trunk verify, MTP draft and refresh) over static buffers, with the
device-side position. On the CPU a re-run stands in for the CUDA graph (graphs.Rerun): the buffer handling,
the position tensor, the static outputs and the re-capture rules are what is tested here; tests/test_gpu.py
certifies real capture on a GPU."""

from pathlib import Path

import pytest
import torch

import engine
from engine import GenerationSettings, load_engine
from engine.drafters import OracleDrafter
from engine.events import Finished
from test_exactness import decode


def run(engine, prompt, depth, drafter=None, n=24):
    tokens, _, fin = decode(engine, prompt, drafter, depth=depth, max_new_tokens=n)
    return tokens, fin


DEMO = str(Path(engine.__file__).parent / "assets" / "demo")


@pytest.mark.parametrize("name", ["demo", "next", "q35_moe"])
def test_replayed_steps_equal_eager_and_replays_are_counted(name, ckpt, engines):
    """The demo model's trained head gets drafts accepted (refreshes over several positions); the tiny random
    fixtures cover the other families' layouts (their heads draft, but nothing they draft is accepted)."""
    path = DEMO if name == "demo" else str(ckpt(name))
    eager = load_engine(path) if name == "demo" else engines(name)
    graphs = load_engine(path, cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain, _ = run(eager, prompt, 0)
    vocab = graphs.trunk.config.vocab_size
    for depth in (0, 1, 3):
        tokens, fin = run(graphs, prompt, depth)
        assert tokens == plain
        assert isinstance(fin, Finished)
        if depth:
            assert fin.stats["drafted"] > 0 and (fin.stats["accepted"] > 0 or name != "demo")
        assert run(graphs, prompt, depth, OracleDrafter(plain, len(prompt), 0.4, vocab, seed=depth))[0] == plain
    report = graphs.diagnostics()["compile"]
    trunk, mtp = report["cuda_graphs"], report["mtp_cuda_graphs"]
    assert trunk["failure"] is None and mtp["failure"] is None
    assert all(trunk["replays"][str(w)] > 5 for w in (2, 4))  # depth 1 and depth 3 verify widths
    # plain decoding: the in-place step (its own graph), not a width-1 verify and a commit
    assert trunk["decode"]["failure"] is None and trunk["decode"]["replays"]["1"] > 5
    # commit's GDN replay (partly accepted verify passes): one graph per kept length, 1 at least
    assert trunk["commit"]["failure"] is None and trunk["commit"]["replays"]["1"] > 5
    assert mtp["replays"]["1"] > 5  # draft steps (and one-position refreshes)
    if name == "demo":
        assert sum(mtp["replays"].values()) > mtp["replays"]["1"]  # refreshes over several accepted positions
    captures = (trunk["captures"], mtp["captures"])
    assert run(graphs, prompt, 3)[0] == plain  # a later request re-uses the captured graphs
    again = graphs.diagnostics()["compile"]
    assert (again["cuda_graphs"]["captures"], again["mtp_cuda_graphs"]["captures"]) == captures


def test_a_longer_request_recaptures_after_the_caches_grow(ckpt, engines):
    eager = engines("next")
    graphs = load_engine(str(ckpt("next")), cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    run(graphs, prompt, 2, n=8)
    before = graphs.diagnostics()["compile"]["cuda_graphs"]["captures"]
    long_prompt = prompt * 12  # past the first KV reservation chunk: caches reallocated, graphs re-captured
    tokens, _ = run(graphs, long_prompt, 2, n=40)
    assert tokens == run(eager, long_prompt, 0, n=40)[0]
    assert graphs.diagnostics()["compile"]["cuda_graphs"]["captures"] > before


def test_a_failed_capture_falls_back_to_eager_steps_with_the_reason(ckpt, engines, monkeypatch):
    from engine.graphs import StepGraphs

    def refuse(self, width, inputs, step, warmup=None):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(StepGraphs, "capture", refuse)
    graphs = load_engine(str(ckpt("next")), cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    assert run(graphs, prompt, 2)[0] == run(engines("next"), prompt, 0)[0]
    report = graphs.diagnostics()["compile"]
    for part in ("cuda_graphs", "mtp_cuda_graphs"):
        assert "capture refused" in report[part]["failure"] and report[part]["captures"] == 0
    assert graphs.trunk.graphs is None  # eager from now on
    reasons = [f.reason for f in graphs.fallbacks(GenerationSettings(), None) if f.feature == "cuda_graphs"]
    assert len(reasons) == 2 and all("eager steps" in r for r in reasons)


def test_a_failed_decode_capture_leaves_plain_decoding_on_the_verify_graph(ckpt, engines):
    graphs = load_engine(str(ckpt("next")), cuda_graphs=True)

    def refuse(width, inputs, step, warmup=None):
        raise RuntimeError("decode capture refused")

    graphs.graph_runner.decodes.capture = refuse
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    assert run(graphs, prompt, 0)[0] == run(engines("next"), prompt, 0)[0]
    report = graphs.diagnostics()["compile"]["cuda_graphs"]
    assert "decode capture refused" in report["decode"]["failure"] and report["replays"]["1"] > 5
    assert graphs.trunk.graphs is not None  # the verify graphs still run
    reasons = [f.reason for f in graphs.fallbacks(GenerationSettings(), None) if f.feature == "cuda_graphs"]
    assert len(reasons) == 1 and "verifies one token" in reasons[0]


def test_plain_steps_before_a_live_depth_change_feed_the_head_what_eager_steps_do():
    """At depth 0 the head still observes each step's hidden state (for a later depth change); replayed graphs
    overwrite their static outputs, so what it keeps must be a copy: the head's drafts after the change, and so
    the acceptance, must be those of eager steps."""
    from engine import DecodeControl
    from engine.events import Tokens

    def run(engine):
        control = DecodeControl(0)
        prompt = engine.encode_chat([{"role": "user", "content": "What is a dictionary in Python?"}])
        seen, fin = 0, None
        for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=48, ignore_eos=True), control=control):
            if isinstance(ev, Tokens):
                seen += len(ev.token_ids)
                if seen >= 12:
                    control.depth = 3
            fin = ev
        mtp = engine.mtp_drafter
        return fin.stats["per_position_counts"], mtp.cache.k[:, :, : mtp.covered].clone()

    eager, graphs = run(load_engine(DEMO)), run(load_engine(DEMO, cuda_graphs=True))
    assert eager[0] and eager[0][0][1] > 0
    assert eager[1].shape == graphs[1].shape and torch.allclose(eager[1], graphs[1], atol=1e-5)
    assert graphs[0] == eager[0]
