"""The decode loop: prefill -> (draft -> verify -> accept -> commit)* ; plain decoding is depth 0 of the same loop.

State passed explicitly: `Request` holds the committed sequence and the counters of one generation; the trunk
caches hold the processed prefix: every committed token but the last, or (after greedy plain decoding ran one
step ahead, see `ahead`) every committed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .events import DRAFT, TARGET, Cycle
from . import sampling
from .sampling import SamplingParams, probabilities, sample
from .timing import PhaseTimer


@dataclass
class Request:
    seq: torch.Tensor  # committed tokens on the device (prompt + generated); capacity grows by doubling
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
    ahead: torch.Tensor | None = None  # the token of a plain step already run for the last committed token
    host: tuple | None = None  # (pinned host buffer, CUDA event): tokens read without waiting for later steps
    launched: object = None  # the next cycle's Launched draft and verify, or the exception its launch raised

    def append(self, tokens: torch.Tensor) -> None:
        n = tokens.shape[0]
        if self.length + n > self.seq.shape[0]:
            grown = torch.empty(2 * (self.length + n), dtype=self.seq.dtype, device=self.seq.device)
            grown[: self.length] = self.seq[: self.length]
            self.seq = grown
        self.seq[self.length : self.length + n] = tokens
        self.length += n


def prefill(trunk, caches, drafter, ids: torch.Tensor, chunk: int, timer: PhaseTimer) -> torch.Tensor:
    """Process prompt ids [n] in chunks; return the last position's logits [1, V]."""
    with timer.phase("prefill"):
        for s in range(0, ids.shape[0], chunk):
            part = ids[s : s + chunk].unsqueeze(0)
            caches.kv.reserve(part.shape[1])
            h = trunk.forward(part, caches.processed, caches, verify=False)
            caches.advance(part.shape[1])
            if drafter is not None:
                drafter.observe(h)
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
    """Leave the committed state after an exception in a cycle (the caller re-raises e). After an in-place step
    the caches hold t_n already, so an out-of-memory error cannot be retried: it becomes an error the caller
    does not retry (it then drops the state, and the next request starts from zero)."""
    back_to_committed(caches, drafter)
    if stepped and isinstance(e, torch.OutOfMemoryError):
        raise RuntimeError(f"out of memory after a decoding step: {str(e).splitlines()[0][:160]}") from e


def decode_step(trunk, caches, drafter, inp: torch.Tensor):
    """Plain decoding's in-place graph step over the last committed token inp [1, 1] -> (hidden, logits, argmax),
    static; None when the step has no graph. The replay writes the state (all or nothing), so the token counts
    as processed at once, and the head observes its hidden state at once: a step is never taken back."""
    caches.kv.reserve(1)
    stepped = trunk.graphs.decode(inp, caches.processed, caches)
    if stepped is not None:
        caches.advance(1)
        if drafter is not None:
            drafter.rollback()
            drafter.observe(stepped[0])  # (the head runs over it only after a depth change)
    return stepped


def plain_step(trunk, caches, drafter, req: Request) -> torch.Tensor | None:
    """decode_step for the last committed token, read on the device. Returns its greedy token (a copy: the graph's
    outputs are static), or None when the step has no graph."""
    stepped = decode_step(trunk, caches, drafter, req.seq[req.length - 1 : req.length].unsqueeze(0))
    return None if stepped is None else stepped[2].clone()


def runs_plain_ahead(trunk, req: Request, depth: int) -> bool:
    """Greedy plain decoding with graphs runs one step ahead of the host itself (plain_ahead)."""
    return depth == 0 and req.sampling.greedy and trunk.graphs is not None


def start_read(values: torch.Tensor, req: Request):
    """Copy values [n] (long) to the host behind the work queued so far, into req.host's pinned buffer; returns
    the event to wait on (None on the CPU, where the copy is done). Waiting on it does not wait for work launched
    afterwards."""
    n = values.shape[0]
    if req.host is None or req.host[0].shape[0] < n:
        cuda = values.is_cuda
        req.host = torch.empty(max(n, 16), dtype=torch.long, pin_memory=cuda), torch.cuda.Event() if cuda else None
    buf, ready = req.host
    buf[:n].copy_(values, non_blocking=True)
    if ready is not None:
        ready.record()
    return ready


def plain_ahead(trunk, caches, drafter, req: Request, depth: int, timer: PhaseTimer):
    """Greedy plain decoding one step ahead: the step for token n + 1 is launched before the host reads token
    n + 1, its input taken on the device. The GPU then never waits for the host (the graph launch, 0.4 ms on the
    27B shape, and the loop's bookkeeping, about 0.45 ms more, measured on the H200 with profile_step.py
    --host); a step cannot be taken back, so the one past a reply's end leaves its last token processed too
    (the next turn's prompt holds it). Same tokens as cycle(). None when the step has no graph."""
    timer.start_cycle()
    try:
        with timer.phase("verify"):
            token, req.ahead = req.ahead, None
            if token is None and (token := plain_step(trunk, caches, drafter, req)) is None:
                return None
            req.append(token)  # committed: greedy plain decoding keeps every token it makes
            ready = start_read(token, req)
            if depth == 0 and len(req.generated) + 1 < req.max_new:
                req.ahead = plain_step(trunk, caches, drafter, req)  # processes the token just appended
        with timer.phase("accept"):
            if ready is not None:
                ready.synchronize()
            tok = int(req.host[0][0])
    except BaseException as e:
        abandon(caches, drafter, e, stepped=True)
        raise
    req.cycles += 1
    req.generated.append(tok)
    if tok in req.stop_ids:
        req.finish, req.ahead = "eos", None  # the step ahead processed the EOS; its own token is dropped
    elif len(req.generated) >= req.max_new:
        req.finish = "length"
    return [tok], [TARGET], Cycle(req.cycles, 0, 0, 0, [], timer.collect(), 1)


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
    drafts: torch.Tensor  # [k]
    hidden: torch.Tensor  # the verify pass's hidden states [1, k + 1, H] (static with graphs)
    packed: torch.Tensor  # [m, the target's token per position (k + 1), the drafts (k)]
    ready: object  # the event after which req.host holds `packed` (None on the CPU)
    stepped: bool  # plain decoding's in-place graph step ran: t_n is processed already
    refreshed: tuple | None = None  # the head refreshed inside the verify graph: (first draft, hidden), static


def launch(trunk, caches, drafter, req: Request, depth: int, timer: PhaseTimer) -> Launched:
    """Draft and verify one cycle and start copying its acceptance to the host; nothing waits for the GPU.
    Leaves the committed state on any exception."""
    k = min(depth, req.max_new - len(req.generated) - 1) if drafter is not None else 0
    seq = req.seq[: req.length]
    stepped, refreshed = False, None
    try:
        drafts, q = drafter.propose(seq, k, timer, req) if k > 0 else (seq[:0], None)
        with timer.phase("verify"):
            inp = (torch.cat([seq[-1:], drafts]) if k else seq[-1:]).unsqueeze(0)
            out = decode_step(trunk, caches, drafter, inp) if k == 0 and trunk.graphs is not None else None
            stepped = out is not None
            if stepped:
                (hidden, logits, _), packed = out, None
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
            ready = start_read(packed, req)
    except BaseException as e:
        abandon(caches, drafter, e, stepped)
        raise
    return Launched(k, drafts, hidden, packed, ready, stepped, refreshed)


def drop_launched(caches, drafter, req: Request) -> None:
    """Forget a cycle launched ahead that will not be finished (the reply stopped): like a failed cycle, it
    leaves the committed state (a plain in-place step leaves its token processed, as plain_ahead's does)."""
    launched, req.launched = req.launched, None
    if isinstance(launched, Launched):
        back_to_committed(caches, drafter)


def cycle(trunk, caches, drafter, req: Request, depth: int, timer: PhaseTimer):
    """One cycle. Returns (new tokens, their sources, Cycle stats). Leaves committed state on any exception.

    With graphs, the next cycle's draft and verify are launched before this one returns (req.launched): the
    GPU works while the host hands out this cycle's tokens, and the next call only waits for them. Its depth
    is this call's: a live depth change applies one cycle later."""
    launched, req.launched = req.launched, None
    if isinstance(launched, Exception):  # raised by the launch ahead, after that cycle's tokens were handed out
        raise launched
    if launched is None and (req.ahead is not None or runs_plain_ahead(trunk, req, depth)):
        done = plain_ahead(trunk, caches, drafter, req, depth, timer)  # a depth change applies after its step
        if done is not None:
            return done
    if launched is None:  # (a launched cycle's phases were recorded by the call before: they count here)
        timer.start_cycle()
        launched = launch(trunk, caches, drafter, req, depth, timer)
    out, sources, stats = finish(trunk, caches, drafter, req, launched, timer)
    if req.finish is None and trunk.graphs is not None and not runs_plain_ahead(trunk, req, depth):
        try:
            req.launched = launch(trunk, caches, drafter, req, depth, timer)
        except Exception as e:  # raised on the next call: this cycle's tokens are committed and go out first
            req.launched = e
    return out, sources, stats


def finish(trunk, caches, drafter, req: Request, c: Launched, timer: PhaseTimer):
    """Read a launched cycle's acceptance (the one host sync of the cycle), commit it, count it."""
    k = c.k
    try:
        if c.ready is not None:
            c.ready.synchronize()
        host = req.host[0][: 2 * k + 2].tolist()
        m, targets_h, drafts_h = host[0], host[1 : k + 2], host[k + 2 :]
        out = drafts_h[:m] + [targets_h[m]]
        sources = [DRAFT] * m + [TARGET]
        for j, tok in enumerate(out):  # stop at the first EOS: plain decoding would never process past it
            if tok in req.stop_ids:
                out, sources, m = out[: j + 1], sources[: j + 1], j
                req.finish = "eos"
                break
        with timer.phase("commit"):
            if not c.stepped:
                caches.commit(m, trunk.backends, trunk.graphs)
                if drafter is not None:
                    drafter.rollback()
                    if c.refreshed:  # the head ran over the verify pass already: keep its accepted prefix
                        drafter.refreshed(m + 1, *c.refreshed)
                    else:
                        drafter.observe(c.hidden[:, : m + 1])
        # the committed tokens from the device (no copy to it): packed[1 + i] is the target's token at i; greedy
        # acceptance makes the accepted drafts equal to it, sampling does not. (Outside the commit phase: plain
        # decoding appends its tokens too; the phase is the speculative transaction's own cost.)
        accepted = sources.count(DRAFT)
        req.append(c.packed[1 : 1 + len(out)] if req.sampling.greedy
                   else torch.cat([c.drafts[:accepted], c.packed[1 + accepted : 1 + len(out)]]))
    except BaseException as e:
        abandon(caches, drafter, e, c.stepped)
        raise
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
    stats = Cycle(req.cycles, k, judged, accepted, accepted_flags, timer.collect(), len(out))
    return out, sources, stats
