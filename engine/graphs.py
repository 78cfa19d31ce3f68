"""CUDA graphs for the decode loop's fixed-shape steps: the trunk's verify pass, plain decoding's in-place step
(GraphRunner.decode), the GDN replay of commit, and the MTP head's draft and refresh steps. One graph per width
over static buffers; the position lives on the device, so one graph serves every position.

A verify pass reads the committed state and writes only the stash and KV rows past the committed length, so a
replay is always safe; graphs are re-captured when a cache or the stash is reallocated (the key changes).
Capture is certified by replay counters, not by configuration: diagnostics report what actually replayed.

On the CPU there are no graphs; `Rerun` stands in for one (replay = run the step again on the same static
buffers into the same outputs), so the buffer handling is tested where CI runs.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from .splitk import PDL_OFF
from .timing import HostMark


def compile_block(backend: str = "inductor"):
    """The decoder layer compiled once per layer kind and reused by every layer of that kind: parameters are
    graph inputs and the layer's cache views are arguments (model.block), so a 64-layer model compiles a handful
    of regions instead of one unrolled graph per verify width. The GDN kernels stay behind their custom ops
    (kernels.py): the FLA kernels selected are the ones that run inside the compiled code."""
    from .model import block

    # Static widths: one compiled region per (layer kind, verify width). Measured on the H200 (27B shape), the
    # dynamic-width code that automatic dynamic shapes switch to at the second width cost about 6 ms more per
    # verify step than the width-1 code; the compilations are a few seconds each.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # inductor's kernels launched like splitk.pdl's (its own codegen waits where a kernel reads the previous one's
    # output); on CUDA Hopper and later only, by inductor's own check. (A process-wide setting: the engine owns it.)
    if not PDL_OFF and hasattr(torch._inductor.config.triton, "enable_pdl"):
        torch._inductor.config.triton.enable_pdl = True
    return torch.compile(block, fullgraph=True, dynamic=False, backend=backend)


def not_compiled(trunk) -> str | None:
    """Why --compile leaves this model's layers eager inside the graphs, or None. On the H200 (torch 2.11),
    compiled verify steps of the row-wise MoE path gave the Qwen3-Next MoE fixture, in float32, a token 0.4
    logits below the eager step's top one at the 4th token of a depth-1 reply (the dense models' compiled steps,
    and the CPU's inductor over the same MoE steps, agree with eager): until that is understood, a model whose
    MoE runs the row-wise path on CUDA is not compiled. (The Triton MoE path's experts are a custom op.)"""
    moe = trunk.backends.choice.get("moe")  # (recorded for models with MoE layers only: model.choose_moe)
    if trunk.device.type == "cuda" and moe is not None and moe[0] == "rowwise":
        return ("--compile: not for the row-wise MoE path on CUDA (its compiled verify steps disagreed with the "
                "eager ones on the H200): eager layers inside the CUDA graphs")
    return None


def put_back(tensors, fn: Callable):
    """fn() with tensors (the GDN state's, or every buffer a step writes in place) put back afterwards: a
    capture's warm-up runs the same kernels as the step, and must not advance the state that the step writes."""
    saved = [t.clone() for t in tensors]
    try:
        return fn()
    finally:  # also when the warm-up fails after its GDN layers ran: the caller then steps eagerly from it
        for t, old in zip(tensors, saved):
            t.copy_(old)


class Rerun:
    """The CPU stand-in for a captured graph."""

    def __init__(self, fn: Callable, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for static, new in zip(_tensors(self.out), _tensors(self.fn())):
            static.copy_(new)


def _tensors(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


class StepGraphs:
    """Replays step(*static_inputs, pos) as one graph per width (input shape). run() raises if a capture fails;
    try_run() records why and returns None, and the owner runs eagerly from then on."""

    def __init__(self, device: torch.device, max_width: int = 8, group=None, chained: bool = False):
        self.device, self.max_width, self.group = device, max_width, group
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        # chained (plain decoding's one-token steps): each replay also moves the position one on, on the device,
        # and the step writes its token into its own input buffer, so the chain's next replay launches nothing
        # before it (on the H200's 80B-A3B slice the position's fill, the token's copy and its clone between two
        # replays were 18 us of a 1.07 ms step)
        self.chained = chained
        self.at: int | None = None  # the position self.pos holds once the work queued so far has run (None: unknown)
        self.fed: tuple[int, int] | None = None  # chained: (width, position) of the token its last replay wrote
        self.graphs: dict[int, tuple] = {}
        self.key = None
        self.replays: dict[int, int] = {}
        self.captures = 0
        self.warmup_s = 0.0
        self.failure: str | None = None
        self.reset()

    def reset(self) -> None:
        """Drop every graph. A new memory pool too: capturing into the pool of freed graphs trips the caching
        allocator (`use_count > 0` assertion, seen on the H200)."""
        self.graphs = {}
        self.at = self.fed = None
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def run(self, key, inputs: tuple[torch.Tensor, ...], pos: int | None, step: Callable,
            warmup: Callable | None = None, width: int | None = None):
        """warmup: what the capture's warm-up runs instead of step, for a step that writes state it also reads
        (the warm-up must leave that state alone). width: the graph's key among this key's graphs, when it is not
        the first input's width. key: the serial numbers of the buffers the step reads and writes (cache.py)."""
        return self.replay(self.ready(key, inputs, pos, step, warmup, width), inputs)

    def ready(self, key, inputs, pos, step, warmup=None, width=None) -> int:
        """Capture the graph for this width if needed and set the position; returns the width."""
        if key != self.key:
            self.reset()
            self.key = key
        width = inputs[0].shape[1] if width is None else width
        if pos is not None and pos != self.at:  # (commit's step takes no position)
            self.at = None
            self.pos.fill_(pos)
            self.at = pos
        if width not in self.graphs:
            self.capture(width, inputs, step, warmup)
        return width

    def replay(self, width: int, inputs, fed: bool = False):
        """fed: the inputs are the token a chained graph's last replay wrote (the caller vouches for it: that
        token went into the sequence as it was); copied anyway unless that replay was at this width and left the
        position where this one runs."""
        graph, bufs, out = self.graphs[width]
        if not (fed and self.fed == (width, self.at)):
            for buf, x in zip(bufs, inputs):
                buf.copy_(x)
        at, self.at, self.fed = self.at, None, None  # (a replay that raises leaves both unknown)
        graph.replay()
        if at is not None:
            self.at = at + 1 if self.chained else at
            self.fed = (width, self.at) if self.chained else None
        self.replays[width] = self.replays.get(width, 0) + 1
        return out

    def try_run(self, key, inputs: tuple[torch.Tensor, ...], pos: int, step: Callable, what: str,
                warmup: Callable | None = None, width: int | None = None, fed: bool = False):
        """run(), except that a capture that fails is recorded and answered None (the owner runs eagerly from
        then on). A replay that fails raises: it may have written state in place, which only the caller can
        judge."""
        width = self.try_ready(key, inputs, pos, step, what, warmup, width)
        return None if width is None else self.replay(width, inputs, fed)

    def try_ready(self, key, inputs, pos, step, what: str, warmup: Callable | None = None, width=None):
        """ready(), except that a capture that fails is recorded and answered None."""
        if self.failure is not None:  # failed once: no capture is tried again
            return None
        try:
            return self.ready(key, inputs, pos, step, warmup, width)
        except Exception as e:
            self.failure = f"{what} capture failed ({type(e).__name__}: {str(e)[:160]})"
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return None

    def capture(self, width: int, inputs, step: Callable, warmup: Callable | None = None) -> None:
        """Under tensor parallelism every rank must run the same code, graphs or eager: a capture that failed on
        any rank fails on all of them (one collective per capture, none per replay)."""
        error = None
        try:
            self._capture(width, inputs, step, warmup or step)
        except Exception as e:
            error = e
        if self.group is not None and not self.group.all_ok(error is None):
            self.graphs.pop(width, None)
            raise error or RuntimeError("capture failed on another tensor-parallel rank")
        if error is not None:
            raise error

    def _capture(self, width: int, inputs, step: Callable, warmup: Callable) -> None:
        bufs = tuple(x.clone() for x in inputs)
        self.fed = None  # (the warm-up writes the input buffers; the position it leaves alone)

        def fn():
            out = step(*bufs, self.pos)
            if self.chained:
                self.pos.add_(1)
            return out

        def warm():
            return warmup(*bufs, self.pos)

        if self.device.type != "cuda":
            graph = Rerun(fn, warm())
            self.graphs[width] = (graph, bufs, graph.out)
            self.captures += 1
            return
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compilation and Triton autotuning must not happen in capture
            for _ in range(2):
                warm()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.warmup_s += time.perf_counter() - t0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs[width] = (graph, bufs, out)
        self.captures += 1

    def report(self) -> dict:
        return {"captured_widths": sorted(self.graphs), "captures": self.captures, "failure": self.failure,
                "replays": {str(k): v for k, v in sorted(self.replays.items())}}


# A chat turn's prefill (tens to hundreds of tokens) is launch-bound when eager: on the H200 a 200-token prompt of
# the 27B shape took 107 ms, its kernels a fraction of that. Up to the widest bucket it replays a graph instead.
PREFILL_WIDTHS = (16, 32, 64, 96, 128, 160, 192, 224, 256)  # (padding costs compute: buckets 32 apart)


def padded_width(n: int) -> int | None:
    """The graph width a pass over n positions is padded to (PREFILL_WIDTHS), None when wider than all: the
    trunk's short prefills and the MTP head's catch-ups over them (drafters.MTPDrafter.run_head)."""
    return next((w for w in PREFILL_WIDTHS if w >= n), None)


STOPS = 16  # stop ids a cycle graph can cut a reply at


class Ahead:
    """What the cycle graph (GraphRunner.cycle) keeps on the device from one replay to the next: the last
    committed token, the MTP head's next first draft and hidden, the request's stop ids, and the previous
    cycle's acceptance [m, targets] (m = -1: nothing pending), and the committed position."""

    def __init__(self, width: int, hidden_size: int, dtype, device):
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        # a cycle's tokens [1, T]: the last committed token, the head's first draft, the chain's drafts
        self.row = torch.zeros((1, width), dtype=torch.long, device=device)
        self.last, self.first = self.row[:, :1], self.row[0, 1:2]
        self.h = torch.zeros((1, 1, hidden_size), dtype=dtype, device=device)
        self.prev = torch.full((1 + width,), -1, dtype=torch.long, device=device)
        self.stops = torch.full((STOPS,), -1, dtype=torch.long, device=device)
        self.stop_ids: frozenset = frozenset()  # what self.stops holds
        self.n = torch.zeros((), dtype=torch.long, device=device)  # settle's count, where a kernel writes it

    def set_stops(self, stop_ids: frozenset) -> None:
        """The request's stop ids, copied only when they change (a copy from host memory waits for the GPU)."""
        if stop_ids != self.stop_ids:
            self.stops.fill_(-1)
            self.stops[: len(stop_ids)] = torch.tensor(sorted(stop_ids), dtype=torch.long)
            self.stop_ids = frozenset(stop_ids)


def settle(a: Ahead, width: int) -> torch.Tensor:
    """The count n (a tensor [] on the device) of the pending cycle's tokens to commit: its accepted drafts and
    bonus token, cut after an EOS as speculative.finish cuts; 0 when nothing is pending (a.prev[0] = -1). Moves
    a.pos past them and sets a.last to the last of them. Reads nothing on the host (a cycle graph's prelude).
    With backends.cycle == "triton" the cycle graph settles inside the commit's first launch instead
    (cycle_triton.first_rows_ with settling), the same values."""
    m, targets = a.prev[0], a.prev[1 : 1 + width]
    rows = torch.arange(width, device=m.device)
    # (no host reads in a capture: comparisons, not isin; index_select, not indexing by a tensor)
    stop = (targets[:, None] == a.stops[None, :]).any(-1) & (rows <= m)  # (m = -1: nothing pending)
    n = torch.where(stop.any(), stop.int().argmax() + 1, m + 1)  # cut after an EOS, as finish does
    a.pos.add_(n)
    a.last.copy_(torch.where(n > 0, targets.index_select(0, (n - 1).clamp(min=0).view(1)), a.last))
    return n


class GraphRunner:
    """The trunk's verify steps as graphs (optionally with each layer kind compiled inside them)."""

    def __init__(self, trunk, max_width: int = 8, compile: bool = False):
        self.trunk = trunk
        self.steps = StepGraphs(trunk.device, max_width, trunk.group)
        self.commits = StepGraphs(trunk.device, max_width, trunk.group)  # commit's GDN replay, one graph per n
        self.finals = StepGraphs(trunk.device, max_width, trunk.group)  # commit of a whole verify pass (no replay)
        self.refreshing = StepGraphs(trunk.device, max_width, trunk.group)  # verify + the MTP head's refresh
        self.splits: dict[int, object] = {}  # width -> the event a refreshing graph records between the two
        self.decodes = StepGraphs(trunk.device, 1, trunk.group, chained=True)  # plain decoding's in-place step
        self.prefills = StepGraphs(trunk.device, PREFILL_WIDTHS[-1], trunk.group)  # short prefills, padded
        self.cycles = StepGraphs(trunk.device, max_width, trunk.group)  # whole greedy MTP cycles (cycle)
        # MTPCHAT_CYCLE_GRAPHS=0: off, the host's path (for comparisons: `h200.sh cycles`)
        if os.environ.get("MTPCHAT_CYCLE_GRAPHS", "") == "0":
            self.cycles.failure = "cycle graphs off (MTPCHAT_CYCLE_GRAPHS=0)"
        self.ahead = Ahead(max_width, trunk.config.hidden_size, trunk.dtype, trunk.device)
        self.turn = 0  # which of a width's two cycle graphs replayed last
        self.compile_failure: str | None = None
        if compile:
            self.compile_failure = not_compiled(trunk)
            if self.compile_failure is None:
                trunk.compiled_block = compile_block()

    def reset(self) -> None:
        self.steps.reset()
        self.commits.reset()
        self.finals.reset()
        self.decodes.reset()
        self.refreshing.reset()
        self.prefills.reset()
        self.cycles.reset()

    def keep_rows(self, state, stash, n: int, backends) -> None:
        """gdn.keep_rows as a graph per kept length n (and one per whole verify pass kept): the kernel launch
        without its Python wrapper's cost, the state written in place inside the graph (one replay, one update),
        and the conv window's copy with it. The GPU waits for this launch: the host has just read the acceptance."""
        from .gdn import keep_rows

        def step(pos):  # captured once per n, with this call's n; it writes in place and returns nothing
            keep_rows(state, stash, n, backends)
            return ()

        def warmup(pos):
            return put_back((state.conv, state.recurrent), lambda: step(pos))

        graphs = self.finals if n == stash.width else self.commits
        key = (stash.serial, state.serial)
        if graphs.try_run(key, (), None, step, "commit graph", warmup, width=n) is None:
            keep_rows(state, stash, n, backends)

    def verify(self, tokens: torch.Tensor, pos: int, caches, drafter=None):
        """A verify pass as a graph per width: (hidden, logits, greedy acceptance: sampling.accept_greedy), static
        (read them before the next replay). The lm_head and the acceptance run inside the graph: no launches
        between the replay and the cycle's one host read. None if it cannot be captured: eager from then on.

        drafter (greedy only): the MTP head's refresh runs in the same graph (MTPDrafter.refresh_verified), which
        adds (first draft, head hidden) to the outputs; on CUDA the graph records an event between the two parts
        (split(width): the phase timer's boundary between verify and refresh). None if that graph cannot be
        captured: the caller verifies without it (the graph without the head still runs)."""
        trunk, T = self.trunk, tokens.shape[1]
        stash = caches.stash_for(max(self.steps.max_width, T), trunk)
        key = (caches.kv.serial, stash.serial, caches.gdn.serial)
        split = self.split(T) if drafter is not None else None

        def step(tokens, pos):
            return self.verified(tokens, pos, caches, drafter, split)

        if drafter is not None:
            out = self.refreshing.try_run(key + (drafter.cache.serial,), (tokens,), pos, step,
                                          "verify + refresh graph")
            if out is not None:
                stash.width = T
            return out
        out = self.steps.try_run(key, (tokens,), pos, step, "CUDA graph")
        if out is None and trunk.compiled_block is not None:  # maybe the compilation: capture eager layers instead
            self.compile_failure, self.steps.failure = f"{self.steps.failure} with compiled layers: eager layers", None
            trunk.compiled_block = None
            self.steps.reset()
            self.refreshing.reset()
            self.refreshing.failure = None  # (its capture failed first, with the same compiled layers)
            out = self.steps.try_run(key, (tokens,), pos, step, "CUDA graph")
        if out is None:  # eager decoding from now on, with the reason on record
            trunk.graphs = None
            return None
        stash.width = T  # the Python side effect of the replayed forward
        return out

    def verified(self, tokens: torch.Tensor, pos, caches, drafter=None, split=None, ahead=None, rope=None) -> tuple:
        """verify's step, to be captured: (hidden, logits, packed[, first draft, head hidden]); with `ahead` (a
        cycle graph's Ahead), the acceptance's m and targets, the first draft and the head's hidden are also
        written into its prev, first and h by the launches that compute them. rope: the (cos, sin) of these
        positions, where the caller has them (pos: then the positions [T])."""
        from .sampling import accept_greedy

        trunk, T = self.trunk, tokens.shape[1]
        pos = trunk.positions(pos, T)  # (once for the trunk and the head)
        rope = rope or trunk.rope(pos, T)
        hidden = trunk.forward(tokens, pos, caches, verify=True, rope=rope)
        # (with the head's refresh the pass is greedy: only the logits' argmax is read, the same in 16 bits)
        logits = trunk.logits(hidden[0], upcast=drafter is None)
        if trunk.backends.cycle == "triton":
            from .cycle_triton import accept

            packed = accept(logits, tokens, trunk.backends, None if ahead is None else ahead.prev)
        else:
            packed = accept_greedy(logits, tokens)
            if ahead is not None:
                ahead.prev[: 1 + T].copy_(packed[: 1 + T])
        if drafter is None:
            return hidden, logits, packed
        if split is not None:
            split.record()
        into = None if ahead is None else (ahead.first, ahead.h)
        return hidden, logits, packed, *drafter.refresh_verified(hidden, packed, pos, rope, into)

    def cycle(self, T: int, caches, drafter, start: int | None = None, last: torch.Tensor | None = None,
              stops=()):
        """A whole greedy MTP cycle as one graph per width T = depth + 1, which needs nothing from the host: it
        commits the cycle replayed before it (its acceptance and stash, kept on the device in self.ahead), then
        drafts T - 1 tokens from the head's refresh of that cycle, verifies them and refreshes the head. The
        host launches the next cycle before it reads this one's acceptance, so the GPU never waits for it (on a
        small model the host's read, commit and launches between two cycles were a third of a cycle).

        start: the committed position, when nothing is pending (the last cycle was committed by the host): the
        buffers are then filled from the host's state (last: the last committed token [1]; the head's first
        draft and hidden: drafter.ready; stops: the request's stop ids), and a graph not captured yet may be.
        None: the replay commits the pending cycle, and the caller has made sure that the graph replays as it is
        (cycle_ready). Returns (packed: sampling.accept_greedy's, static; the events the replay records between
        its commit, draft, verify and refresh), or None if the graph cannot be captured (the host's path from
        then on). Each width has two graphs, replayed in turn, each with its own events: a cycle's are read after
        the next cycle was launched, which must not record them again."""
        from .gdn import keep_first

        a, trunk = self.ahead, self.trunk
        stash = caches.stash_for(max(self.steps.max_width, T), trunk)  # (start: may reallocate, re-capture)
        key = self.cycle_key(caches, drafter)
        graphs, width = self.cycles, self.steps.max_width  # (rows any cycle can keep: the previous may be wider)
        state = caches.gdn

        def step(splits):  # (the committed position is a.pos: one for both graphs of a width, every width)
            if trunk.backends.cycle == "triton":  # (settle's count found and kept in the rows' launch)
                keep_first(state, stash, a.n, width, trunk.backends, (a.prev, a.stops, a.pos, a.last))
            else:
                keep_first(state, stash, settle(a, width), width, trunk.backends)
            splits[0].record()
            pos = trunk.positions(a.pos, T)  # (and the rope table: once for the chain, the verify and the refresh)
            rope = trunk.rope(pos, T)
            if T > 2:  # (into the row after the last token and the first draft: no concatenation)
                drafter.chained(a.h, a.first, pos, T - 2, into=a.row[0, 2:T], rope=rope)
            tokens = a.row[:, :T]
            splits[1].record()
            return self.verified(tokens, pos, caches, drafter, splits[2], ahead=a, rope=rope)[2]

        def ready(turn):  # (captured at a start, both of a width at once: a reply replays the same graphs)
            splits = [self.split(("cycle", T, turn, i)) for i in range(3)]
            written = (state.conv, state.recurrent, a.pos, a.row, a.h, a.prev)
            return graphs.try_ready(key, (), None, lambda _: step(splits), "cycle graph",
                                    lambda _: put_back(written, lambda: step(splits)), width=(T, turn)), splits

        if start is not None:
            a.pos.fill_(start)
            a.last.copy_(last.view(1, 1))
            a.first.copy_(drafter.ready[0])
            a.h.copy_(drafter.ready[1])
            a.prev.fill_(-1)
            a.set_stops(stops)
        turn = self.turn ^ 1 if start is None else 0
        if start is not None and ready(1)[0] is None:
            return None
        which, splits = ready(turn)
        if which is None:
            return None
        out = graphs.replay(which, ())
        stash.width, self.turn = T, turn
        return out, splits

    def cycle_report(self) -> dict:
        """The cycle graphs' report by width (each width's two graphs together)."""
        report, replays = self.cycles.report(), {}
        for (T, _), n in self.cycles.replays.items():
            replays[str(T)] = replays.get(str(T), 0) + n
        widths = sorted({T for T, _ in self.cycles.graphs})
        return {**report, "captured_widths": widths, "replays": dict(sorted(replays.items()))}

    def cycle_key(self, caches, drafter) -> tuple:
        stash = caches.stash.serial if caches.stash is not None else None
        return caches.kv.serial, stash, caches.gdn.serial, drafter.cache.serial

    def cycle_ready(self, T: int, caches, drafter) -> bool:
        """Whether the cycle graph of width T replays as it is, with a cycle pending: captured over these very
        buffers (nothing may be reallocated or captured while that cycle's rows wait in the stash and caches)."""
        stash = caches.stash
        return (stash is not None and stash.fits(caches.n_gdn, max(self.steps.max_width, T), self.trunk.dtype,
                                                 self.trunk.device)
                and self.cycles.key == self.cycle_key(caches, drafter) and (T, self.turn ^ 1) in self.cycles.graphs)

    def split(self, key):
        """A timing event a graph records between two phases (a refreshing graph of width key: between verify
        and refresh): on CUDA an external event, so that a replay records it again; on the CPU a HostMark."""
        if key not in self.splits:
            cuda = self.trunk.device.type == "cuda"
            self.splits[key] = torch.cuda.Event(enable_timing=True, external=True) if cuda else HostMark()
        return self.splits[key]

    def run(self, tokens: torch.Tensor, pos: int, caches) -> torch.Tensor:
        """The verify pass's hidden states (Trunk.forward with verify=True)."""
        out = self.verify(tokens, pos, caches)
        return self.trunk.forward(tokens, pos, caches, verify=True) if out is None else out[0]

    def decode(self, tokens: torch.Tensor, pos: int, caches, fed: bool = False):
        """Plain decoding's step (one token, nothing to reject) as one graph that writes the GDN state in place and
        yields the logits: no stash, no commit copy of the state, no separate lm_head launch. Returns
        (hidden, logits, argmax), static: read them before the next replay. None if it cannot be captured (the caller
        then verifies and commits, as for a draft). fed: tokens is the last step's argmax (greedy), which that
        step left in the graph's input buffer: nothing is copied in."""
        from .cycle_triton import argmax

        trunk, state = self.trunk, caches.gdn
        key = (caches.kv.serial, state.serial)

        def step(tokens, pos):
            hidden = trunk.forward(tokens, pos, caches, verify=False)
            logits = trunk.logits(hidden[0])
            # greedy decoding's token, without a launch after the replay, written where the next step reads it
            return hidden, logits, argmax(logits, trunk.backends, out=tokens).view(1)

        def warmup(tokens, pos):
            return put_back((state.conv, state.recurrent), lambda: step(tokens, pos))

        return self.decodes.try_run(key, (tokens,), pos, step, "decode graph", warmup, fed=fed)

    def prefill(self, tokens: torch.Tensor, pos: int, caches):
        """A short prefill of tokens [1, n] padded to the next of PREFILL_WIDTHS, from a graph per width that writes
        the state in place as the eager prefill does, except that the padding never reaches it: its GDN rows are
        exact no-ops (gdn.prefill's `real`), its KV rows past n are dead, and a sliding-window ring keeps the rows
        below n (settled from its graph record). No verify stash, so none as wide as the widest prompt stays
        allocated (0.5 GB on the 27B shape), and no replay of the recurrence to commit. Returns the hiddens
        [1, n, H] (static: read them before the next replay) with the caches advanced by n; None when too wide, an
        MoE model (its wide MoE path is transformers' own, which syncs with the host), or not capturable: prefill
        eagerly."""
        trunk, n = self.trunk, tokens.shape[1]
        width = padded_width(n)
        if width is None or any(hasattr(layer.mlp, "experts") for layer in trunk.layers):
            return None
        caches.kv.reserve(width)
        state = caches.gdn
        key = (caches.kv.serial, state.serial)
        padded = torch.nn.functional.pad(tokens, (0, width - n))  # (id 0: any vocabulary has it)
        real = torch.full((), n, dtype=torch.long, device=trunk.device)  # (a fill on the device: no host copy)

        def step(tokens, real, pos):
            return trunk.forward(tokens, pos, caches, verify=False, real=real)

        def warmup(tokens, real, pos):
            return put_back((state.conv, state.recurrent), lambda: step(tokens, real, pos))

        hidden = self.prefills.try_run(key, (padded, real), pos, step, "prefill graph", warmup)
        if hidden is None:
            return None
        if caches.window is not None:
            caches.window.settle(caches.processed + n)
        caches.advance(n)
        return hidden[:, :n]

    @property
    def failure(self) -> str | None:
        return self.steps.failure or self.commits.failure or self.finals.failure

    def report(self) -> dict:
        return {**self.steps.report(), "commit": self.commits.report(), "commit_whole": self.finals.report(),
                "decode": self.decodes.report(), "prefill": self.prefills.report(),
                "verify_refresh": self.refreshing.report(), "cycle": self.cycle_report(),
                "compiled": self.trunk.compiled_block is not None, "compile_failure": self.compile_failure,
                "warmup_s": round(self.steps.warmup_s, 1)}
