"""Graph replay of the fixed-shape steps (trunk verify, MTP draft and refresh) over static buffers, with the
device-side position. On the CPU a re-run stands in for the CUDA graph (graphs.Rerun): the buffer handling,
the position tensor, the static outputs and the re-capture rules are what is tested here; tests/test_gpu.py
certifies real capture on a GPU."""

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine
from engine import DecodeControl, GenerationSettings, load_engine
from engine.drafters import OracleDrafter
from engine.errors import EngineError
from engine.events import Cycle, Finished, Tokens
from fixtures import tokens_of
from test_exactness import decode


def run(engine, prompt, depth, drafter=None, n=24):
    tokens, _, fin = decode(engine, prompt, drafter, depth=depth, max_new_tokens=n)
    return tokens, fin


DEMO = str(Path(engine.__file__).parent / "assets" / "demo")


def stopped_after(engine, prompt, settings: GenerationSettings, n: int):
    """Decode with a live control and stop once n tokens are out: (all tokens handed out, all events)."""
    control, events = DecodeControl(settings.depth), []
    for ev in engine.generate(prompt, settings, control=control):
        events.append(ev)
        if isinstance(ev, Tokens) and len(tokens_of(events)) >= n:
            control.stop()
    return tokens_of(events), events


class BufferWrites(TorchDispatchMode):
    """Counts the ops outside a graph's step that write its position (fill_) or its input buffer (a copy_ from
    elsewhere; graphs.Rerun's copy of the step's token onto itself is the step's own write)."""

    def __init__(self, graphs):
        super().__init__()
        self.graphs, self.fills, self.copies = graphs, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dest = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if dest is not None:
            self.fills += func is torch.ops.aten.fill_.Scalar and dest.data_ptr() == self.graphs.pos.data_ptr()
            buf = self.graphs.graphs[1][1][0] if self.graphs.graphs else None
            self.copies += (func is torch.ops.aten.copy_.default and buf is not None
                            and dest.data_ptr() == buf.data_ptr() != args[1].data_ptr())
        return func(*args, **(kwargs or {}))


def next_turn(engine, first, reply: list[int], question: str, n: int) -> list:
    """The events of a greedy depth-3 turn asking `question` after `first` and the reply's tokens."""
    messages = first + [{"role": "assistant", "content": engine.tokenizer.decode(reply)},
                        {"role": "user", "content": question}]
    return list(engine.generate(engine.encode_chat(messages), GenerationSettings(max_new_tokens=n, depth=3)))


@pytest.mark.parametrize("name", ["demo", "next", "q35_moe"])
def test_replayed_steps_equal_eager_and_replays_are_counted(name, ckpt, engines):
    """The demo model's head and the fixtures' (trained to draft their trunks, see fixtures.py) get drafts both
    accepted and rejected: refreshes over several positions, commits of every kind."""
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
            assert fin.stats["drafted"] > fin.stats["accepted"] > 0  # drafts accepted and rejected
        assert run(graphs, prompt, depth, OracleDrafter(plain, len(prompt), 0.4, vocab, seed=depth))[0] == plain
    report = graphs.diagnostics()["compile"]
    trunk, mtp = report["cuda_graphs"], report["mtp_cuda_graphs"]
    assert trunk["failure"] is None and mtp["failure"] is None
    assert all(trunk["replays"][str(w)] > 5 for w in (2, 4))  # depth 1 and depth 3 verify widths
    # plain decoding: the in-place step (its own graph), not a width-1 verify and a commit
    assert trunk["decode"]["failure"] is None and trunk["decode"]["replays"]["1"] > 5
    # commit's GDN replay (partly accepted verify passes): one graph per kept length, 1 at least
    assert trunk["commit"]["failure"] is None and trunk["commit"]["replays"]["1"] > 5
    # a whole verify pass kept (every draft accepted): its final state copied, as a graph of its own
    assert trunk["commit_whole"]["failure"] is None and sum(trunk["commit_whole"]["replays"].values()) > 5
    # greedy MTP cycles, a reply's first included, run as cycle graphs (the last one's commit, the drafts, the
    # verify and the head's refresh in one replay, launched before the host reads the last one), after the head
    # caught up over the prefill (speculative.launch_cycle): no verify graph with the refresh inside, which the
    # host's path takes (the oracle's cycles: the verify graph without it)
    refreshing = trunk["verify_refresh"]
    assert refreshing["failure"] is None and not refreshing["replays"], refreshing
    cycles = trunk["cycle"]
    assert cycles["failure"] is None and all(cycles["replays"][str(w)] > 2 for w in (2, 4))
    # the head's own graphs: only its catch-up over each prompt's last position and its priming over the rest of
    # the prompt during prefill, padded (graphs.padded_width; drafting and refreshing ride in the verify and
    # chain graphs)
    from engine.graphs import PREFILL_WIDTHS

    assert "1" in mtp["replays"] and set(mtp["replays"]) - {"1"} <= {str(w) for w in PREFILL_WIDTHS}, mtp["replays"]
    chains = report["mtp_draft_chain_graphs"]  # (the host's path's chained drafts: the cycle graphs draft inside)
    assert chains["failure"] is None and not chains["replays"], chains
    if name == "demo":
        assert sum(trunk["commit"]["replays"].values()) > trunk["commit"]["replays"]["1"]  # drafts were accepted
    captures = (trunk["captures"], mtp["captures"])
    assert run(graphs, prompt, 3)[0] == plain  # a later request re-uses the captured graphs
    again = graphs.diagnostics()["compile"]
    assert (again["cuda_graphs"]["captures"], again["mtp_cuda_graphs"]["captures"]) == captures


def test_a_longer_request_recaptures_after_the_caches_grow(ckpt, engines):
    eager = engines("next")
    graphs = load_engine(str(ckpt("next")), cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    run(graphs, prompt, 2, n=8)
    before = graphs.diagnostics()["compile"]["cuda_graphs"]["cycle"]["captures"]
    assert before > 0
    long_prompt = prompt * 12  # past the first KV reservation chunk: caches reallocated, graphs re-captured
    tokens, _ = run(graphs, long_prompt, 2, n=40)
    assert tokens == run(eager, long_prompt, 0, n=40)[0]
    assert graphs.diagnostics()["compile"]["cuda_graphs"]["cycle"]["captures"] > before


def test_a_failed_capture_falls_back_to_eager_steps_with_the_reason(ckpt, engines, monkeypatch):
    from engine.graphs import StepGraphs

    def refuse(self, width, inputs, step, warmup=None):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(StepGraphs, "capture", refuse)
    graphs = load_engine(str(ckpt("next")), cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    assert run(graphs, prompt, 2)[0] == run(engines("next"), prompt, 0)[0]
    report = graphs.diagnostics()["compile"]
    for part in ("cuda_graphs", "mtp_cuda_graphs", "mtp_draft_chain_graphs"):
        assert "capture refused" in report[part]["failure"] and report[part]["captures"] == 0
    assert graphs.trunk.graphs is None  # eager from now on
    reasons = [f.reason for f in graphs.fallbacks(GenerationSettings(), None) if f.feature == "cuda_graphs"]
    assert len(reasons) == 3 and all("eager steps" in r for r in reasons)


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
    def run(engine, change_at):
        control = DecodeControl(0)
        prompt = engine.encode_chat([{"role": "user", "content": "What is a dictionary in Python?"}])
        seen, fin = 0, None
        for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=48, ignore_eos=True), control=control):
            if isinstance(ev, Tokens):
                seen += len(ev.token_ids)
                if seen >= change_at:
                    control.depth = 3
            fin = ev
        mtp = engine.mtp_drafter
        widths = sorted(mtp.graphs.graphs) if mtp.graphs is not None else []
        return fin.stats["per_position_counts"], mtp.cache.k[:, :, : mtp.covered].clone(), widths

    # with graphs, greedy plain decoding runs one step ahead (plain_ahead): a depth change applies a token later
    eager, graphs = run(load_engine(DEMO), 13), run(load_engine(DEMO, cuda_graphs=True), 12)
    assert eager[0] and eager[0][0][1] > 0
    # the head's cache over the positions both cover (the graphs' refresh inside the verify pass covers the last
    # cycle's positions at its commit; the eager head covers them when it next drafts)
    n = eager[1].shape[2]
    assert graphs[1].shape[2] >= n and torch.allclose(eager[1], graphs[1][:, :, :n], atol=1e-5)
    assert graphs[0] == eager[0]
    # the head's catch-up over the plain steps' dozen positions ran as one graph replay padded to 16 rows
    # (graphs.padded_width), not eagerly
    assert 16 in graphs[2], graphs[2]


def test_a_switch_from_plain_decoding_and_a_reply_s_first_cycle_are_cycle_graphs_after_the_head_catches_up(
        monkeypatch):
    """Where the depth rises from 0, and at a reply's first cycle, the head catches up over what the plain steps
    or the prefill left it and the cycle graph is launched from there (speculative.launch_cycle): no cycle on
    the host's path (drafter.propose, then verify_pass, then the host's commit). The text is plain decoding's,
    with drafts accepted and rejected."""
    from engine import drafters, speculative

    calls = {"propose": 0, "verify_pass": 0}
    for module, name in ((drafters.MTPDrafter, "propose"), (speculative, "verify_pass")):
        def counted(*a, _f=getattr(module, name), _n=name, **k):
            calls[_n] += 1
            return _f(*a, **k)
        monkeypatch.setattr(module, name, counted)
    engine = load_engine(DEMO, cuda_graphs=True)
    prompt = engine.encode_chat([{"role": "user", "content": "What is a dictionary in Python?"}])
    plain = [t for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=40, depth=0))
             if isinstance(ev, Tokens) for t in ev.token_ids]
    for start_depth in (0, 3):
        control, events = DecodeControl(start_depth), []
        for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=40), control=control):
            events.append(ev)
            if isinstance(ev, Cycle) and ev.index == 8:
                control.depth = 3 - start_depth  # (plain -> 3, or 3 -> plain)
            if isinstance(ev, Cycle) and ev.index == 16:
                control.depth = 3  # (and back up from plain)
        cycles = [ev for ev in events if isinstance(ev, Cycle)]
        assert tokens_of(events) == plain
        assert any(c.accepted for c in cycles) and any(c.accepted < c.drafted for c in cycles)
        assert calls == {"propose": 0, "verify_pass": 0}, (start_depth, calls)


def test_plain_decoding_one_step_ahead_is_exact_and_the_next_turn_continues_from_its_extra_step():
    """Greedy plain decoding with graphs launches the step for each token before reading it (plain_ahead). The
    tokens are those of eager decoding; after an EOS, the step already run leaves every committed token
    processed, and the next turn continues from there with the same tokens as a fresh engine."""
    def turn(engine, messages):
        prompt = engine.encode_chat(messages)
        events = list(engine.generate(prompt, GenerationSettings(max_new_tokens=96, depth=0)))
        return prompt, tokens_of(events), events[0].reused_tokens, events[-1]

    ahead, eager, fresh = load_engine(DEMO, cuda_graphs=True), load_engine(DEMO), load_engine(DEMO)
    first = [{"role": "user", "content": "What is a dictionary in Python?"}]
    with BufferWrites(ahead.graph_runner.decodes) as writes:
        prompt, toks, _, fin = turn(ahead, first)
    assert fin.reason == "eos" and (prompt, toks) == turn(eager, first)[:2]
    # the chain of steps sets its position and copies its token in once, at its first step: each step after it
    # moves the position on and reads the token the step before it wrote, with nothing launched in between
    assert len(toks) > 20 and writes.fills == 1 and writes.copies == 1, (writes.fills, writes.copies)
    assert ahead.caches.processed == len(prompt) + len(toks)  # the EOS was processed by the step ahead
    assert eager.caches.processed == len(prompt) + len(toks) - 1
    assert ahead.graph_runner.decodes.replays[1] == len(toks)  # one step per token after the first, plus one
    second = first + [{"role": "assistant", "content": ahead.tokenizer.decode(toks[:-1])},
                      {"role": "user", "content": "And a list?"}]
    prompt2, toks2, reused, _ = turn(ahead, second)
    assert reused == len(prompt) + len(toks)  # everything the caches hold, the EOS included
    assert toks2 == turn(fresh, second)[1]


def test_a_cycle_launched_ahead_of_a_stop_is_dropped_and_the_next_turn_is_exact():
    """With graphs each cycle launches the next one's draft and verify before returning its tokens. A stop leaves
    that launched cycle unfinished: it is dropped (the committed state is the finished cycles'), and the next
    turn, which reuses the caches, gives a fresh engine's tokens."""
    ahead, fresh = load_engine(DEMO, cuda_graphs=True), load_engine(DEMO)
    first = [{"role": "user", "content": "What is a dictionary in Python?"}]
    prompt = ahead.encode_chat(first)
    toks, events = stopped_after(ahead, prompt, GenerationSettings(max_new_tokens=96, depth=3), 20)
    fin, cycles = events[-1], [ev for ev in events if isinstance(ev, Cycle)]
    assert fin.reason == "stop" and fin.stats["accepted"] > 0
    # each cycle reports its own draft and verify, recorded by the call that launched it
    assert all({"draft", "verify", "commit"} <= set(c.phase_ms) for c in cycles)
    runner = ahead.graph_runner  # greedy MTP: cycle graphs from the first cycle on (no verify + refresh graph)
    assert sum(runner.refreshing.replays.values()) == 0 and sum(runner.cycles.replays.values()) > 5
    verifies = sum(runner.refreshing.replays.values()) + sum(runner.cycles.replays.values())
    assert verifies == fin.stats["cycles"] + 1  # one launched ahead, never finished
    assert ahead.caches.processed == len(prompt) + len(toks) - 1  # the finished cycles' tokens, the last unprocessed
    assert ahead.mtp_drafter.cache.length == ahead.mtp_drafter.covered  # its speculative entries rolled back
    a, b = (next_turn(e, first, toks, "And a list?", 40) for e in (ahead, fresh))
    assert a[0].reused_tokens == len(prompt) + len(toks) - 1
    assert tokens_of(a) == tokens_of(b)


@pytest.mark.parametrize("where, call", [("verify_pass", 2), ("start_read", 3)])
def test_an_error_in_the_launch_ahead_comes_after_the_tokens_of_the_finished_cycle(monkeypatch, where, call):
    """The launch ahead runs after a cycle is committed and before its tokens are handed out: an out-of-memory
    error there is raised by the next cycle, so those tokens still go out, and the usual retry at a lower depth
    continues exactly. In verify_pass it fails before the verify + refresh replay; in start_read after it, when
    the replay has overwritten the refresh's outputs (kept uncopied at commit): the retry then drafts from the
    failed cycle's values, which may cost acceptance, never the text (every draft is verified). (The host's
    path: cycle graphs off; their launch ahead is the next test's.)"""
    import engine.speculative as speculative

    graphs = load_engine(DEMO, cuda_graphs=True)
    monkeypatch.setattr(speculative, "pipelined", lambda *a: False)
    prompt = graphs.encode_chat([{"role": "user", "content": "What is a dictionary in Python?"}])
    settings = GenerationSettings(max_new_tokens=40, depth=3, ignore_eos=True)
    plain = run(load_engine(DEMO), prompt, 0, n=40)[0]
    calls, real = {"n": 0}, getattr(speculative, where)

    def flaky(*a):
        calls["n"] += 1
        if calls["n"] == call:  # the launch ahead of cycle `call`
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*a)

    monkeypatch.setattr(speculative, where, flaky)
    events = list(graphs.generate(prompt, settings))
    kinds = [type(e).__name__ for e in events]
    note = kinds.index("Fallback")
    assert kinds[1:note].count("Tokens") == call  # the first token, then the finished cycles'
    assert "depth lowered to 1" in events[note].reason
    ran = call if where == "start_read" else call - 1  # the failed launch's own replay: start_read's case only
    assert graphs.diagnostics()["compile"]["cuda_graphs"]["verify_refresh"]["replays"]["4"] == ran
    assert tokens_of(events) == plain


def test_an_error_launching_a_cycle_graph_ahead_is_retried_before_its_replay_and_drops_the_state_after():
    """A cycle graph is launched before the cycle it commits is read. An out-of-memory error before its replay
    leaves that cycle to the host: its tokens go out, and the error (raised by the next call) is retried at a
    lower depth, exactly. After its replay (which may have committed the cycle on the device) nothing is known
    to be committed: the request fails with the one line that says the state was dropped, what went out is
    plain decoding's, and the next request is exact."""
    import engine.speculative as speculative
    from engine.graphs import GraphRunner

    graphs = load_engine(DEMO, cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "What is a dictionary in Python?"}])
    settings = GenerationSettings(max_new_tokens=40, depth=3, ignore_eos=True)
    plain = run(load_engine(DEMO), prompt, 0, n=40)[0]
    real_ready, real_read = GraphRunner.cycle_ready, speculative.start_read
    calls = {"ahead": 0}

    def counted(self, *a):  # (asked before each launch ahead)
        calls["ahead"] += 1
        if calls["ahead"] == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_ready(self, *a)

    fail_at = 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphRunner, "cycle_ready", counted)
        events = list(graphs.generate(prompt, settings))
    kinds = [type(e).__name__ for e in events]
    note = kinds.index("Fallback")
    assert "depth lowered to 1" in events[note].reason
    # the first token, the cycle that started the cycle graphs (after the head's catch-up over the prompt), two
    # launched ahead
    assert kinds[1:note].count("Tokens") == 4
    assert tokens_of(events) == plain

    def broken_read(values, flight):
        if calls["ahead"] == 2:
            raise RuntimeError("injected: the copy to the host failed")
        return real_read(values, flight)

    calls["ahead"], fail_at = 0, None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphRunner, "cycle_ready", counted)
        mp.setattr(speculative, "start_read", broken_read)
        out = []
        with pytest.raises(EngineError, match="state was dropped"):
            for ev in graphs.generate(prompt, settings):
                out += ev.token_ids if isinstance(ev, Tokens) else []
    assert out == plain[: len(out)] and len(out) > 1
    assert run(graphs, prompt, 3, n=40)[0] == plain


def test_a_stop_id_among_accepted_drafts_ends_a_cycle_graph_s_reply_where_plain_decoding_does():
    """A cycle graph commits the cycle before it on the device, cut after its first stop id as the host cuts
    it: when a reply ends on an accepted draft the committed state is the reply's, exactly (the next turn,
    reusing it, decodes what a fresh engine decodes)."""
    graphs, fresh = load_engine(DEMO, cuda_graphs=True), load_engine(DEMO)
    first = [{"role": "user", "content": "What is a dictionary in Python?"}]
    prompt = graphs.encode_chat(first)
    plain = run(fresh, prompt, 0, n=60)[0]
    _, sources, _ = decode(graphs, prompt, depth=3, max_new_tokens=60)
    # stop ids that come out as accepted drafts, first seen past the first cycles
    candidates = [t for i, (t, src) in enumerate(zip(plain, sources)) if src == "draft" and i >= 8
                  and t not in plain[:i]][:4]
    assert len(candidates) >= 2
    ended = 0
    for stop in candidates:
        graphs.stop_ids = fresh.stop_ids = frozenset({stop})
        want = plain[: plain.index(stop) + 1]
        tokens, srcs, fin = decode(graphs, prompt, depth=3, max_new_tokens=60, ignore_eos=False)
        assert tokens == want and fin.reason == "eos"
        ended += srcs[-1] == "draft"
        assert graphs.caches.processed == len(prompt) + len(tokens) - 1
        assert graphs.mtp_drafter.cache.length == graphs.mtp_drafter.covered
        a, b = (next_turn(e, first, tokens, "And a list?", 24) for e in (graphs, fresh))
        assert a[0].reused_tokens > len(prompt) and tokens_of(a) == tokens_of(b)
    assert ended >= 2 and sum(graphs.graph_runner.cycles.replays.values()) > 10


def test_sampled_decoding_with_graphs_and_cycles_launched_ahead_draws_what_eager_decoding_draws():
    """Sampling with a seed: with graphs (plain decoding's in-place step at depth 0, and every cycle launching
    the next one's draft and verify ahead) the request's generator is drawn in the same order as eager decoding
    draws it, so the same seed gives the same text at each depth."""
    graphs, eager = load_engine(DEMO, cuda_graphs=True), load_engine(DEMO)
    prompt = eager.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    for depth in (0, 2):
        kw = dict(depth=depth, temperature=0.8, top_p=0.9, seed=7, max_new_tokens=40)
        want, _, fin = decode(eager, prompt, **kw)
        got, _, fin_graphs = decode(graphs, prompt, **kw)
        assert got == want
        if depth:
            assert fin_graphs.stats["accepted"] > 0 and fin_graphs.stats["cycles"] == fin.stats["cycles"]
    report = graphs.diagnostics()["compile"]["cuda_graphs"]
    assert report["decode"]["replays"]["1"] > 20 and report["replays"]["3"] > 5  # both paths ran


def test_a_sampled_plain_step_launched_ahead_of_a_stop_leaves_its_token_processed():
    """Sampled plain decoding with graphs launches the next in-place step ahead too. It cannot be taken back: a
    stop leaves every committed token processed (as greedy plain decoding's step ahead does), the head has seen
    them all, and the next turn reuses them and decodes what a fresh engine decodes."""
    ahead, fresh = load_engine(DEMO, cuda_graphs=True), load_engine(DEMO)
    first = [{"role": "user", "content": "Tell me a story about a cat."}]
    prompt = ahead.encode_chat(first)
    settings = GenerationSettings(max_new_tokens=64, depth=0, temperature=0.8, seed=3)
    toks, _ = stopped_after(ahead, prompt, settings, 10)
    assert ahead.caches.processed == len(prompt) + len(toks)
    assert ahead.mtp_drafter.covered + sum(h.shape[1] for h in ahead.mtp_drafter.pending) == len(prompt) + len(toks)
    a, b = (next_turn(e, first, toks, "And a dog?", 30) for e in (ahead, fresh))
    assert tokens_of(a) == tokens_of(b)


def test_the_refresh_inside_the_verify_graph_keeps_the_head_cache_causal():
    """Greedy MTP cycles with graphs run the head over every verified position inside the verify graph and keep
    the accepted prefix: after many partly accepted cycles its cache equals one causal pass over the committed
    sequence (DESIGN.md's refresh invariant), with no refresh of its own run."""
    graphs = load_engine(DEMO, cuda_graphs=True)
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    tokens, fin = run(graphs, prompt, 3, n=40)
    assert fin.stats["accepted"] > 0 and fin.stats["drafted"] > fin.stats["accepted"]  # full and partial cycles
    # every cycle but the last, whose one token (k = 0) is plain decoding's step: the head only observes it (all
    # in cycle graphs, which run the verify + refresh graph's refresh, the first after the head's catch-up over
    # the prompt)
    runner = graphs.graph_runner
    assert sum(runner.refreshing.replays.values()) == 0
    assert sum(runner.refreshing.replays.values()) + sum(runner.cycles.replays.values()) == fin.stats["cycles"] - 1
    mtp, n = graphs.mtp_drafter, graphs.caches.processed
    assert mtp.covered == n - 1 and mtp.pending[0].shape[1] == 1
    seq = torch.tensor(prompt + tokens)
    with torch.inference_mode():
        fresh = graphs.trunk.new_caches()
        fresh.kv.reserve(n)
        hidden = graphs.trunk.forward(seq[:n].unsqueeze(0), 0, fresh, verify=False)
        cache = graphs.loaded.mtp.new_cache()
        cache.reserve(n)
        graphs.loaded.mtp(hidden, seq[1 : n + 1].unsqueeze(0), 0, cache)
    c = mtp.covered
    torch.testing.assert_close(mtp.cache.k[:, :, :c], cache.k[:, :, :c], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mtp.cache.v[:, :, :c], cache.v[:, :, :c], rtol=1e-4, atol=1e-4)
