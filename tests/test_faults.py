"""The decode cycle is one transaction: a fault at any tensor operation of a request (faults.FaultAt) either fails
the request or is recovered from, and either way every token handed out is plain decoding's and the next request
is exact. Swept over whole requests on the demo model (real partial acceptance), eager and with the graph runner
(on the CPU graphs.Rerun stands in for each graph, so captures, replays and the launch ahead all run), greedy and
sampled, depths 0-4 and auto (chains stopped early), with out-of-memory errors (retried at a lower depth) and plain errors.

CI runs a strided subset; MTPCHAT_FAULT_SWEEP=full runs every op of the request (python3 -m pytest
tests/test_faults.py, about 2 hours on 2 CPU cores); MTPCHAT_FAULT_SWEEP=N takes every N-th op.
"""

import gc
import json
import os
import weakref
from pathlib import Path

import pytest
import torch
from faults import FaultAt, handed_out
from fixtures import _add_tensors, load_with_kv_cache, oom, write_checkpoint

import engine
from engine import AUTO, GenerationSettings, load_engine
from engine.autodepth import DepthChooser
from engine.errors import EngineError
from engine.events import Fallback, Finished, Tokens

DEMO = str(Path(engine.__file__).parent / "assets" / "demo")
NEW = 10
SWEEP = os.environ.get("MTPCHAT_FAULT_SWEEP", "")
POINTS = 10  # injection points per (configuration, mode) in the CI subset


@pytest.fixture(scope="module")
def demo():
    """name -> engine: "eager" and "graphs" (the graph runner, on the CPU); "...:fp8" over an fp8 KV cache."""
    made = {}

    def get(name):
        if name not in made:
            runner, _, kv = name.partition(":")
            made[name] = load_with_kv_cache(kv or "auto", DEMO, cuda_graphs=runner == "graphs")
        return made[name]

    return get


def settings(depth, sampled):
    return GenerationSettings(max_new_tokens=NEW, depth=depth, ignore_eos=True,
                              temperature=0.8 if sampled else 0.0, top_k=40 if sampled else 0,
                              seed=11 if sampled else None)


def prompt_of(e):
    return e.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])


def points(total: int) -> list[int]:
    """Where faults go: every op (full), every N-th, or POINTS spread evenly with an odd stride (so the points
    fall in different phases of different cycles)."""
    if SWEEP == "full":
        return list(range(1, total + 1))
    stride = int(SWEEP) if SWEEP.isdigit() else max(1, total // POINTS) | 1
    return list(range(1 + stride // 2, total + 1, stride))


# AUTO: chains of up to 4 drafts stopped after a draft the head gives less than 0.15 (--depth auto's floors on the
# CPU, fixed here so that every run takes the same ops; on this prompt chains stop at drafts 1 and 3 and run to 4)
FP8_KV = [("eager:fp8", 2, False), ("graphs:fp8", 3, False)]  # (the fp8 cache's quantizing writes faulted too)
CONFIGS = [("eager", 0, False), ("eager", 2, False), ("eager", 4, True), ("graphs", 0, False),
           ("graphs", 3, False), ("graphs", 1, True), ("graphs", 0, True), ("eager", AUTO, False), *FP8_KV]
if SWEEP:
    CONFIGS = [(g, d, s) for g in ("eager", "graphs") for s in (False, True) for d in [*range(5), AUTO]] + FP8_KV


def graph_failures(e) -> list:
    r, d = e.graph_runner, e.mtp_drafter
    if r is None:
        return []
    return [g.failure for g in (r.steps, r.commits, r.finals, r.decodes, r.refreshing, r.cycles, d.graphs, d.chains)
            if g.failure]


@pytest.mark.parametrize("runner,depth,sampled", CONFIGS)
def test_a_fault_at_any_op_hands_out_plain_tokens_and_leaves_an_exact_engine(runner, depth, sampled, demo,
                                                                             monkeypatch):
    """Greedy: every token handed out is plain decoding's. Sampled (a seed): every token handed out before the
    engine recovered is the unfaulted run's (after a retry at a lower depth the draws differ; that the text is
    still distributed as plain sampling is tests/test_sampling.py's). Both: the next request is exact."""
    if depth == AUTO:
        monkeypatch.setattr(DepthChooser, "pick", lambda self: 4)
        monkeypatch.setattr(DepthChooser, "floors", lambda self, k: [0.15] * (k - 1))
    e = demo(runner)
    prompt, s = prompt_of(e), settings(depth, sampled)
    plain, err, _ = handed_out(demo(runner.replace("graphs", "eager")), prompt, settings(0, sampled))
    assert err is None and len(plain) == NEW
    reference, err, _ = handed_out(e, prompt, s)  # (also captures every graph the request replays)
    assert err is None and (reference == plain or sampled)
    count = FaultAt()
    assert handed_out(e, prompt, s, count)[0] == reference
    outcomes = {"recovered": 0, "failed": 0}
    for mode in ("oom", "error"):
        for at in points(count.count):
            fault = FaultAt(at, mode)
            tokens, err, recovered = handed_out(e, prompt, s, fault)
            where = f"{mode} at op {at} of {count.count} ({fault.fired})"
            assert fault.fired, where
            exact = len(tokens) if recovered is None or not sampled else recovered
            assert tokens[:exact] == reference[:exact], where  # nothing wrong was handed out
            if err is None:
                assert len(tokens) == NEW and (tokens == reference or sampled), where
                outcomes["recovered"] += 1
            else:  # the injected error itself, or the engine's one line about it
                assert isinstance(err, (EngineError, torch.OutOfMemoryError, RuntimeError)), where
                assert "injected" in str(err) or "injected" in str(err.__cause__), where
                outcomes["failed"] += 1
            again, err, _ = handed_out(e, prompt, s)
            assert err is None and again == reference, where  # the next request is exact
            if graph_failures(e):  # a fault inside a capture: graphs are off for good on this engine
                e = load_engine(DEMO, cuda_graphs=True)
                assert handed_out(e, prompt, s)[0] == reference
    assert outcomes["failed"] > 0
    if depth == AUTO or depth > 0:  # an out-of-memory error in a speculative phase is retried at a lower depth
        assert outcomes["recovered"] > 0


def test_a_failed_decode_graph_warm_up_leaves_the_state_alone(demo, monkeypatch):
    """The in-place decode step's warm-up runs the GDN layers; a failure after them (here the lm_head, once) used
    to leave the state advanced by a token, and the eager verify that follows diverged at token 2."""
    e = load_engine(DEMO, cuda_graphs=True)
    prompt = prompt_of(e)
    plain = handed_out(demo("eager"), prompt, settings(0, False))[0]
    import engine.graphs as graphs

    head = e.trunk.lm.lm_head
    calls = {"warming": False, "failed": False}
    real, real_put_back = head.forward, graphs.put_back

    def warming(state, fn):  # the warm-up of a step that writes the GDN state in place (the decode graph's)
        calls["warming"] = True
        try:
            return real_put_back(state, fn)
        finally:
            calls["warming"] = False

    def once(x):  # the first lm_head inside that warm-up fails, after its GDN layers ran
        if calls["warming"] and not calls["failed"]:
            calls["failed"] = True
            raise RuntimeError("lm_head failed while warming up")
        return real(x)

    monkeypatch.setattr(graphs, "put_back", warming)
    monkeypatch.setattr(head, "forward", once)
    tokens, err, _ = handed_out(e, prompt, settings(0, False))
    assert calls["failed"] and err is None and tokens == plain
    assert "decode graph capture failed" in (e.graph_runner.decodes.failure or "")
    assert any("plain decoding verifies one token" in f.reason for f in e.fallbacks(settings(0, False), None))


def test_an_out_of_memory_error_in_commit_s_prepare_is_retried_from_the_committed_state(demo, monkeypatch):
    """The drafter's copy of the kept hiddens allocates: it used to run after the caches' commit, so an OOM there
    was retried from a state that had committed already (the last token processed twice)."""
    e = demo("eager")
    prompt = prompt_of(e)
    plain = handed_out(e, prompt, settings(0, False))[0]
    drafter = e.mtp_drafter
    keep, calls = drafter.keep, {"n": 0}

    def flaky(hidden):
        calls["n"] += 1
        if calls["n"] == 3:  # the prefill's, then the second cycle's commit
            oom()
        return keep(hidden)

    monkeypatch.setattr(drafter, "keep", flaky)
    events = list(e.generate(prompt, settings(2, False)))
    tokens = [t for ev in events if isinstance(ev, Tokens) for t in ev.token_ids]
    assert calls["n"] > 3 and tokens == plain
    assert any(isinstance(ev, Fallback) and ev.feature == "memory" for ev in events)
    assert e.caches.processed == len(prompt) + len(plain) - 1  # every committed token but the last


def test_close_frees_the_model_without_the_garbage_collector(ckpt):
    """The trunk and its graph runner point at each other: close() breaks that, so a model switch never holds two
    models until a collection."""
    gc.collect()
    gc.disable()
    try:
        e = load_engine(str(ckpt("next")), cuda_graphs=True)
        list(e.generate(prompt_of(e), settings(2, False)))
        trunk, head = weakref.ref(e.trunk), weakref.ref(e.loaded.mtp)
        e.close()
        del e
        assert trunk() is None and head() is None
    finally:
        gc.enable()


def test_graphs_are_keyed_by_buffer_serials_not_addresses():
    """A freed cache's address is handed to the next allocation: graphs captured over the old one must not match
    the new one (they would replay over buffers of other sizes)."""
    from engine.cache import KVCache

    a = KVCache(2, 2, 8, torch.float32, torch.device("cpu"))
    a.reserve(16)
    first, ptr = a.serial, a.k.data_ptr()
    del a
    b = KVCache(2, 2, 8, torch.float32, torch.device("cpu"))
    b.reserve(16)
    assert b.serial != first  # whether or not b.k.data_ptr() == ptr
    before = b.serial
    b.reserve(b.capacity)  # room already: no new buffer, same serial
    assert b.serial == before
    b.reserve(b.capacity + 1)
    assert b.serial != before


def test_a_head_with_more_mtp_layers_than_run_is_refused_with_the_reason(tmp_path):
    path = write_checkpoint(tmp_path / "two", "qwen3_next")
    from safetensors.torch import load_file

    tensors = load_file(next(path.glob("*.safetensors")))
    _add_tensors(path, {k.replace("mtp.layers.0.", "mtp.layers.1."): v for k, v in tensors.items()
                        if k.startswith("mtp.layers.0.")})
    conf = json.loads((path / "config.json").read_text())
    conf["num_nextn_predict_layers"] = 2
    (path / "config.json").write_text(json.dumps(conf))
    e = load_engine(str(path))
    assert e.mtp_drafter is None
    reasons = [f.reason for f in e.loaded.fallbacks if f.feature == "speculation"]
    assert reasons and "declares 2 MTP layers" in reasons[0] and "plain decoding" in reasons[0]
    events = list(e.generate(prompt_of(e), settings(2, False)))
    assert isinstance(events[-1], Finished) and events[-1].stats["drafted"] == 0
