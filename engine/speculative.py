"""The decode loop: prefill -> (draft -> verify -> accept -> commit)* ; plain decoding is depth 0 of the same loop.

State passed explicitly: `Request` holds the committed sequence and the counters of one generation; the trunk
caches hold the processed prefix: every committed token but the last, or (after greedy plain decoding ran one
step ahead, see `cycle`) every committed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .events import DRAFT, TARGET, Cycle
from .graphs import STOPS
from . import sampling
from .sampling import SamplingParams, probabilities, sample
from .timing import PhaseTimer


@dataclass
class Request:
    """One generation: the committed sequence and its counters."""
    seq: torch.Tensor  # committed tokens on the device (prompt + generated), allocated for the whole request
    length: int  # committed tokens in seq
    prompt_len: int
    max_new: int
    stop_ids: frozenset[int]
    sampling: SamplingParams
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[list[int]] = field(default_factory=list)  # [drafted, accepted] per draft position
    finish: str | None = None
    # --depth auto: per draft j of the next chain, the drafter's probability of it below which the chain stops
    # after it (autodepth.stop_floors); empty: the chain runs to the cycle's depth
    draft_floors: list[float] = field(default_factory=list)
    staged: torch.Tensor | None = None  # append_values' page-locked copy of seq

    def reserve(self, n: int) -> None:
        """Room for n more tokens (the one allocation of appending, done before a commit mutates anything)."""
        if self.length + n > self.seq.shape[0]:
            grown = torch.empty(2 * (self.length + n), dtype=self.seq.dtype, device=self.seq.device)
            grown[: self.length] = self.seq[: self.length]
            self.seq = grown

    def append(self, tokens: torch.Tensor) -> None:
        """Commit tokens [n] (device): a copy into reserved room."""
        n = tokens.shape[0]
        self.reserve(n)
        self.seq[self.length : self.length + n] = tokens
        self.length += n

    def append_values(self, values: list[int]) -> None:
        """Commit tokens known on the host without waiting for the device (a plain copy from host memory waits
        for the stream): staged in page-locked memory, each position once, so no copy in flight reads a value
        written after it was queued."""
        n = len(values)
        self.reserve(n)
        part = torch.tensor(values, dtype=self.seq.dtype)
        if self.seq.is_cuda:
            if self.staged is None or self.staged.shape[0] < self.seq.shape[0]:
                self.staged = torch.empty(self.seq.shape[0], dtype=self.seq.dtype, pin_memory=True)
            part = self.staged[self.length : self.length + n].copy_(part)
        self.seq[self.length : self.length + n].copy_(part, non_blocking=True)
        self.length += n


@dataclass
class Flight:
    """What the loop has launched on the device ahead of the host, between two calls of cycle()."""
    launched: "Launched | None" = None  # the next cycle's draft and verify
    error: Exception | None = None  # its launch's failure: raised by the next cycle, after this one's tokens
    # (pinned host buffer, CUDA event) pairs, taken in turn: a launch's acceptance is read into one without
    # waiting for later steps, while the cycle launched after it reads into the other
    host: list = field(default_factory=lambda: [None, None])
    turn: int = 0


class StateLost(RuntimeError):
    """A failure after the committed state was written in place (an in-place plain step, a commit's apply):
    the caches no longer hold a committed state, so nothing is retried; the engine drops its state and the
    next request starts from zero."""


def prefill(trunk, caches, drafter, seq: torch.Tensor, chunk: int, timer: PhaseTimer) -> torch.Tensor:
    """Process the committed tokens seq [n] past those the caches hold (a reused prefix) in chunks of `chunk`;
    after each, the drafter primes over the positions whose next token is known, so that neither ever holds more
    than a chunk's activations. Returns the last position's logits [1, V]."""
    n = seq.shape[0]
    for s in range(caches.processed, n, chunk):
        part = seq[s : min(n, s + chunk)].unsqueeze(0)
        with timer.phase("prefill"):
            h = trunk.graphs.prefill(part, caches.processed, caches) if trunk.graphs is not None else None
            if h is None:  # (wide, or no graphs)
                caches.kv.reserve(part.shape[1])
                h = trunk.forward(part, caches.processed, caches, verify=False)
                caches.advance(part.shape[1])
        if drafter is not None:
            drafter.observe(h)
            with timer.phase("priming"):
                drafter.prime(seq, min(caches.processed, n - 1))
    with timer.phase("prefill"):
        return trunk.logits(h[:, -1])


def pick(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The target's token for each row of logits [N, V]."""
    if req.sampling.greedy:
        return logits.argmax(-1)
    return sample(probabilities(logits, req.sampling), req.generator)


def back_to_committed(caches, drafter) -> None:
    """Forget an uncommitted verify pass and the drafter's speculative entries."""
    caches.abort()
    if drafter is not None:
        drafter.rollback()


def abandon(caches, drafter, e: BaseException, stepped: bool) -> None:
    """Leave the committed state after an exception in a cycle (the caller re-raises e, or what this raises).
    stepped: the committed state was being written in place (an in-place plain step, a commit's apply), so it is
    not a committed state any more: StateLost, never retried."""
    back_to_committed(caches, drafter)
    if stepped and not isinstance(e, StateLost):
        raise StateLost(f"decoding failed while the state was written in place "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from e


def decode_step(trunk, caches, drafter, inp: torch.Tensor, fed: bool = False):
    """Plain decoding's in-place graph step over the last committed token inp [1, 1] -> (hidden, logits, argmax),
    static; None when the step has no graph. The replay writes the state (all or nothing on a GPU; on the CPU a
    failure inside it raises StateLost), so the token counts as processed at once, and the head observes its
    hidden state at once: a step is never taken back. fed: inp is the last step's own argmax (GraphRunner.decode)."""
    caches.kv.reserve(1)
    try:  # (a capture that fails returns None with the state put back; what raises is the replay or after it)
        stepped = trunk.graphs.decode(inp, caches.processed, caches, fed)
        kept = drafter.keep(stepped[0]) if stepped is not None and drafter is not None else None
    except BaseException as e:
        raise StateLost(f"decoding failed in an in-place step ({type(e).__name__}: {str(e)[:160]})") from e
    if stepped is not None:
        caches.advance(1)
        if drafter is not None:
            drafter.rollback()
            drafter.observe_kept(kept)  # (the head runs over it only after a depth change)
    return stepped


def start_read(values: torch.Tensor, flight: Flight):
    """Copy values [n] (long) to the host behind the work queued so far, into the next of flight's pinned
    buffers; returns (that buffer, the event to wait on: None on the CPU, where the copy is done). Waiting on it
    does not wait for work launched afterwards."""
    n = values.shape[0]
    flight.turn ^= 1
    if flight.host[flight.turn] is None or flight.host[flight.turn][0].shape[0] < n:
        cuda = values.is_cuda
        flight.host[flight.turn] = (torch.empty(max(n, 16), dtype=torch.long, pin_memory=cuda),
                                    torch.cuda.Event() if cuda else None)
    buf, ready = flight.host[flight.turn]
    buf[:n].copy_(values, non_blocking=True)
    if ready is not None:
        ready.record()
    return buf, ready


def verify_pass(trunk, caches, inp: torch.Tensor, drafter=None):
    """The target over inp [1, k + 1] at the processed position, the committed state left alone ->
    (hidden, logits, greedy acceptance or None when it ran eagerly: the caller computes it, the head's refresh
    (first draft, hidden) or None). drafter: refresh it inside the verify graph (greedy, graphs, MTP head)."""
    if trunk.graphs is not None:
        out = trunk.graphs.verify(inp, caches.processed, caches, drafter) if drafter is not None else None
        if out is not None:
            return *out[:3], out[3:]
        out = trunk.graphs.verify(inp, caches.processed, caches)
        if out is not None:
            return *out, None
    hidden = trunk.forward(inp, caches.processed, caches, verify=True)
    return hidden, trunk.logits(hidden[0]), None, None


def refreshes_in_verify(trunk, drafter, req: Request) -> bool:
    """The head's refresh runs inside the verify graph: greedy (the next tokens are the target's argmax, known
    on the device) with graphs and the MTP head (see MTPDrafter.refresh_verified)."""
    return req.sampling.greedy and trunk.graphs is not None and hasattr(drafter, "refresh_verified")


@dataclass
class Launched:
    """A cycle's draft and verify, launched; its acceptance on its way to the host."""
    k: int
    drafts: torch.Tensor | None  # [k] (None: greedy plain decoding)
    hidden: torch.Tensor  # the verify pass's hidden states [1, k + 1, H] (static with graphs)
    # [m, the target's token per position (k + 1), the drafts (k)], or a greedy in-place step's token alone (m = 0,
    # nothing drafted: the launch after the step costs no kernel to pack it)
    packed: torch.Tensor
    host: torch.Tensor  # the pinned buffer `packed` is copied into
    ready: object  # the event after which `host` holds `packed` (None on the CPU)
    stepped: bool  # plain decoding's in-place graph step ran: t_n is processed already
    refreshed: tuple | None = None  # the head refreshed inside the verify graph: (first draft, hidden), static
    stopped: bool = False  # the drafter's chain stopped short of the depth on a doubtful draft
    ahead: bool = False  # a cycle graph's (GraphRunner.cycle): the next cycle graph's replay can commit it


def launch(trunk, caches, drafter, req: Request, flight: Flight, depth: int, timer: PhaseTimer,
           fed: bool = False) -> Launched:
    """Draft and verify one cycle and start copying its acceptance to the host; nothing waits for the GPU.
    Leaves the committed state on any exception (StateLost once an in-place plain step has run). fed: the last
    token is the greedy argmax of an in-place plain step, committed as it came (decode_step)."""
    if pipelined(trunk, caches, drafter, req, depth):
        c = launch_cycle(trunk, caches, drafter, req, flight, depth, timer)
        if c is not None:
            return c
    k = min(depth, req.max_new - len(req.generated) - 1) if drafter is not None else 0
    stepped, refreshed, stopped = False, None, False
    try:
        if k:
            seq = req.seq[: req.length]
            drafts, q = drafter.propose(seq, k, timer, req)
            stopped, k = drafts.shape[0] < k, drafts.shape[0]  # (fewer: a doubtful draft, req.draft_floors)
        with timer.phase("verify"):
            # (depth 0: the last token as a view, no concatenation; plain steps are host-bound on small models)
            inp = torch.cat([seq[-1:], drafts]).unsqueeze(0) if k else req.seq[req.length - 1 : req.length][None]
            if not k:  # (no draft tensor unless sampling needs one: each op costs the host a few us)
                drafts, q = None if req.sampling.greedy else inp[0, 1:], None
            out = decode_step(trunk, caches, drafter, inp, fed) if k == 0 and trunk.graphs is not None else None
            stepped = out is not None
            if stepped:  # (greedy: the token came out of the step's graph, static: read and committed before the
                # next step is launched, in cycle)
                hidden, logits, packed = out[0], out[1], out[2] if req.sampling.greedy else None
            else:
                caches.kv.reserve(k + 1)
                head = drafter if k and refreshes_in_verify(trunk, drafter, req) else None
                hidden, logits, packed, refreshed = verify_pass(trunk, caches, inp, head)
                if refreshed:
                    timer.hand_over(trunk.graphs.split(k + 1), "refresh")
        with timer.phase("accept"):
            if not req.sampling.greedy:
                m, targets = sampling.verify_sampled(logits, drafts, q, req.sampling, req.generator)
                packed = torch.cat([m, targets, drafts])
            elif packed is None:
                packed = sampling.accept_greedy(logits, inp)
            host, ready = start_read(packed, flight)
    except BaseException as e:
        abandon(caches, drafter, e, stepped)
        raise
    return Launched(k, drafts, hidden, packed, host, ready, stepped, refreshed, stopped)


def pipelined(trunk, caches, drafter, req: Request, depth: int) -> bool:
    """Whether cycles at this depth run as cycle graphs (GraphRunner.cycle): greedy, the MTP head refreshing
    inside the graphs, chains not stopped on doubtful drafts, on one device (no tensor-parallel ranks to keep
    in step), without sliding-window rings (settled by the host), and stop ids the graph can hold."""
    runner = trunk.graphs
    return (depth >= 1 and refreshes_in_verify(trunk, drafter, req) and not req.draft_floors
            and trunk.group is None and caches.window is None and runner.cycles.failure is None
            and depth < runner.steps.max_width and len(req.stop_ids) <= STOPS)


def launch_cycle(trunk, caches, drafter, req: Request, flight: Flight, depth: int, timer: PhaseTimer,
                 after: Launched | None = None) -> Launched | None:
    """Launch a cycle graph after the committed state, or after the launched cycle `after`, which its replay
    then commits on the device (before this cycle's drafts). After the committed state the head first catches up
    over what plain steps or a prefill left it (MTPDrafter.catch_up_ready): a switch from plain decoding then
    costs that catch-up, not a cycle on the host's path (its draft, verify and commit launched one by one, and
    the GPU waiting for the host's commit before the next cycle: the demo model on an H100, 0.83 + 0.57 ms for
    the switch's two calls where plain steps take 0.165). None when it cannot: too near the reply's end, no
    room reserved, nothing for the head to draft from, or (with `after`) its graph not captured; the caller then
    takes the host's path. An exception with `after` launched is StateLost: the replay may have committed it."""
    pending = after.k + 1 if after is not None else 0  # (at most that many tokens: `after`'s, not read yet)
    k = min(depth, req.max_new - len(req.generated) - pending - 1)
    room = pending + k + 1
    if k < 1 or caches.kv.length + room > caches.kv.capacity:
        return None  # (reserving here could reallocate a cache that `after`'s uncommitted rows are in)
    runner = trunk.graphs
    if after is not None and not runner.cycle_ready(k + 1, caches, drafter):
        return None
    replaying = False
    try:
        if after is None and (drafter.ready is None or drafter.pending):
            with timer.phase("refresh"):  # (committed positions only: what propose's catch-up would run)
                if not drafter.catch_up_ready(req.seq[: req.length]):
                    return None
        if drafter.cache.length + room > drafter.cache.capacity:
            return None
        with timer.phase("commit"):
            start = caches.processed if after is None else None
            replaying = after is not None  # (from here on `after` may be committed on the device)
            out = runner.cycle(k + 1, caches, drafter, start, req.seq[req.length - 1 : req.length], req.stop_ids)
            for event, name in zip(out[1] if out is not None else (), ("draft", "verify", "refresh")):
                timer.hand_over(event, name)
        if out is None:
            return None
        packed = out[0]
        with timer.phase("accept"):
            host, ready = start_read(packed, flight)
    except BaseException as e:
        abandon(caches, drafter, e, stepped=replaying)
        raise
    return Launched(k, None, None, packed, host, ready, False, (runner.ahead.first, runner.ahead.h), ahead=True)


def drop_in_flight(caches, drafter, flight: Flight) -> None:
    """Forget what was launched ahead and will not be finished (the reply stopped or failed): like a failed
    cycle, it leaves the committed state (an in-place plain step leaves its token processed: the next turn's prompt
    holds that token)."""
    launched, flight.launched, flight.error = flight.launched, None, None
    if launched is not None and not launched.stepped:
        back_to_committed(caches, drafter)


def cycle(trunk, caches, drafter, req: Request, flight: Flight, depth: int, timer: PhaseTimer):
    """One cycle: launch (draft, verify), finish (read the acceptance, commit), and with graphs the next cycle
    launched before this one returns (flight.launched): the GPU works while the host hands out this cycle's
    tokens, and the next call only waits for them. Its depth is this call's: a live depth change applies one
    cycle later. Plain decoding is depth 0: with graphs its step runs in place, and greedy, the step for the next
    token is launched before the host reads this one (its input is read on the device), so the GPU never waits
    for the host (the graph launch, 0.4 ms on the 27B shape, and the loop's bookkeeping, about 0.45 ms more,
    measured on the H200 with profile_step.py --host). A step cannot be taken back: the one past a reply's end
    leaves its token processed (the next turn's prompt holds it).

    Returns (new tokens, their sources, Cycle stats). Leaves the committed state on any exception, or raises
    StateLost when there is none left."""
    if flight.error is not None:  # raised by the launch ahead, after that cycle's tokens were handed out
        error, flight.error = flight.error, None
        raise error
    c, flight.launched = flight.launched, None
    if c is None:  # (a launched cycle's phases were recorded by the call before: they count here)
        timer.start_cycle()
        c = launch(trunk, caches, drafter, req, flight, depth, timer)
    ahead = c.stepped and req.sampling.greedy  # its token is known on the device: committed before it is read
    if ahead:
        try:
            req.append(c.packed)
            if depth == 0 and len(req.generated) + 1 < req.max_new:
                flight.launched = launch(trunk, caches, drafter, req, flight, depth, timer, fed=True)
        except BaseException as e:
            abandon(caches, drafter, e, stepped=True)
            raise
    elif c.ahead and pipelined(trunk, caches, drafter, req, depth):
        try:  # the next cycle graph, launched before this one is read: its replay commits this one
            flight.launched = launch_cycle(trunk, caches, drafter, req, flight, depth, timer, after=c)
        except StateLost:
            raise
        except Exception as e:  # nothing launched: the host commits this cycle, the error is the next call's
            flight.error = e
    committed = c.ahead and flight.launched is not None
    out, sources, stats = finish(trunk, caches, drafter, req, flight, c, timer, appended=ahead, committed=committed)
    if req.finish is not None:
        if committed:  # (the cycle after the reply's end: its verify is forgotten, this one's commit stays)
            back_to_committed(caches, drafter)
        flight.launched = None  # a step ahead of the EOS processed it; its own token is dropped
    elif flight.launched is None and flight.error is None and trunk.graphs is not None:
        try:
            flight.launched = launch(trunk, caches, drafter, req, flight, depth, timer)
        except StateLost:
            raise
        except Exception as e:  # raised on the next call: this cycle's tokens are committed and go out first
            flight.error = e
    return out, sources, stats


def finish(trunk, caches, drafter, req: Request, flight: Flight, c: Launched, timer: PhaseTimer,
           appended: bool = False, committed: bool = False):
    """Read a launched cycle's acceptance (the one host sync of the cycle) and commit it as one transaction:
    prepare does everything that reads, allocates or can fail and mutates nothing committed; apply writes the
    trunk caches, the drafter and the request, in that order, into storage that exists already. appended: the
    cycle's one token is in the request already (greedy in-place plain steps, see cycle). committed: the cycle
    graph launched after it commits it on the device (cut after an EOS as here): the host only follows, and a
    failure leaves no committed state it knows."""
    k, stepped = c.k, c.stepped or committed
    try:  # prepare
        if c.ready is not None:
            c.ready.synchronize()
        host = c.host[: c.packed.shape[0]].tolist()
        m, targets_h, drafts_h = (0, host, []) if len(host) == 1 else (host[0], host[1 : k + 2], host[k + 2 :])
        out = drafts_h[:m] + [targets_h[m]]
        sources = [DRAFT] * m + [TARGET]
        for j, tok in enumerate(out):  # stop at the first EOS: plain decoding would never process past it
            if tok in req.stop_ids:
                out, sources, m = out[: j + 1], sources[: j + 1], j
                break
        # the committed tokens from the device (no copy to it): packed[1 + i] is the target's token at i; greedy
        # acceptance makes the accepted drafts equal to it, sampling does not
        accepted = sources.count(DRAFT)
        tokens = None
        if not appended and not committed:  # (committed: the device's copy is the next replay's by now)
            tokens = (c.packed[1 : 1 + len(out)] if req.sampling.greedy
                      else torch.cat([c.drafts[:accepted], c.packed[1 + accepted : 1 + len(out)]]))
            req.reserve(len(out))
        kept = None
        if drafter is not None and not c.stepped and not c.refreshed:
            kept = drafter.keep(c.hidden[:, : m + 1])
    except BaseException as e:
        abandon(caches, drafter, e, stepped)
        raise
    try:  # apply: a failure here leaves no committed state to go back to
        if committed:  # (its cost is in the next cycle graph's commit phase)
            caches.advance(m + 1)
            drafter.rollback()
            drafter.refreshed(m + 1, *c.refreshed)
            req.append_values(out)
        elif not c.stepped:  # (an in-place step has nothing to commit: its state is written)
            with timer.phase("commit"):
                caches.commit(m, trunk.backends, trunk.graphs)
                if drafter is not None:
                    drafter.rollback()
                    if c.refreshed:  # the head ran over the verify pass already: keep its accepted prefix
                        drafter.refreshed(m + 1, *c.refreshed)
                    else:
                        drafter.observe_kept(kept)
        # (outside the commit phase: plain decoding appends its tokens too; the phase is the speculative
        # transaction's own cost)
        if tokens is not None:
            req.append(tokens)
    except BaseException as e:
        abandon(caches, drafter, e, stepped=True)
        raise
    if any(t in req.stop_ids for t in out):
        req.finish = "eos"
    # An accepted draft that is the EOS ends the reply: it counts as accepted (its source is DRAFT), and the
    # drafts after it, past the reply's end, count neither way. (Counting the EOS draft as rejected, as m does
    # after the cut above, under-reported the demo model's depth-1 acceptance by 0.02-0.03.)
    judged = len(out) if accepted > m else k
    accepted_flags = [i < accepted for i in range(judged)]
    req.cycles += 1
    req.drafted += judged
    req.accepted += accepted
    while len(req.per_position) < judged:
        req.per_position.append([0, 0])
    for i in range(judged):
        req.per_position[i][0] += 1
        req.per_position[i][1] += int(accepted_flags[i])
    req.generated.extend(out)
    if req.finish is None and len(req.generated) >= req.max_new:
        req.finish = "length"
    stats = Cycle(req.cycles, k, judged, accepted, accepted_flags, timer.collect(), len(out), stopped=c.stopped)
    return out, sources, stats
