"""What proposes tokens. One interface: reset / observe committed positions / prime (during prefill) / propose k /
rollback.

The engine calls observe(hidden) with the trunk's post-norm hidden states of newly processed positions, and
propose(seq, k) with the committed token sequence (the last token committed but not yet processed).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from .cycle_triton import argmax
from .graphs import padded_width
from .sampling import probabilities, sample


PRIME_CHUNK = 2048  # positions the MTP head runs over at once when catching up (prefill's priming, a depth change)


class MTPDrafter:
    """The checkpoint's own MTP head. Its cache only ever holds verified positions: every proposal first runs
    the head over positions it has not seen (priming after a prefill, refresh after a verify), with the trunk's
    hiddens and the shifted tokens, then chains k - 1 speculative steps that are dropped before the next cycle.

    Greedy decoding with graphs refreshes inside the trunk's verify graph instead (refresh_verified): the head
    runs over every verified position with the target's tokens, and commit keeps the accepted prefix of it
    (refreshed), as the trunk keeps a prefix of its verify pass. The next cycle's first draft is then ready
    without a launch of its own."""

    name = "mtp"

    def __init__(self, head, graphs=None):
        self.head = head
        self.cache = head.new_cache()
        self.graphs = graphs  # graphs.StepGraphs: draft and refresh steps replayed as CUDA graphs
        self.chains = None  # graphs.StepGraphs: greedy drafting's chained steps as one graph per depth
        self.reset()

    def reserve(self, n: int) -> None:
        """Room for n more positions now, for a whole request: a reallocated cache means re-capturing graphs."""
        self.cache.reserve(n)

    def run_head(self, hidden: torch.Tensor, tokens: torch.Tensor, pos: int):
        """The head over positions pos..pos+n-1 -> (logits of the last one [1, 1, V], post-norm hidden [1, n, H],
        or [1, 1, H] padded); a graph replay for n up to the graphs' width, and wider, padded as the trunk's short
        prefills are (graphs.padded_width), where the cache has room (the outputs are then static: read them
        before the next). The padding's rows come after the real ones, so they change none of them, and their KV
        past the covered positions is never read. Such catch-ups follow plain steps (--depth auto's probes, a
        depth change) and prime short prompts: eagerly, at a width new each time, one took 2.4-10.6 ms of the
        host's time on the H100's demo model, where a plain step takes 0.46 ms (packaging/bench/
        auto_trace_flash_h100.json: auto ran 0.89x plain)."""
        g, n = self.graphs, hidden.shape[1]
        if g is not None and n <= g.max_width:
            def step(hidden, tokens, pos):
                return self.head(hidden, tokens, pos, self.cache, last_only=True)

            out = g.try_run(self.cache.serial, (hidden, tokens), pos, step, "MTP graph")
            if out is not None:
                return out
        width = padded_width(n)
        if g is not None and width is not None and pos + width <= self.cache.capacity:  # (no reallocation)
            def padded(hidden, tokens, row, pos):
                return self.head(hidden, tokens, pos, self.cache, row=row)

            inputs = (F.pad(hidden, (0, 0, 0, width - n)), F.pad(tokens, (0, width - n)),  # (id 0: any vocabulary)
                      torch.full((1,), n - 1, dtype=torch.long, device=hidden.device))
            out = g.try_run(self.cache.serial, inputs, pos, padded, "MTP graph")
            if out is not None:
                return out
        return self.head(hidden, tokens, pos, self.cache, last_only=True)

    def chain(self, h: torch.Tensor, token: torch.Tensor, pos: int, n: int) -> torch.Tensor | None:
        """n greedy drafts [n] chained from the head's hidden h [1, 1, H] and its token [1] at position pos, as one
        graph per n: the launches and the Python between the steps (about 0.2 ms a step on the demo model, H200)
        are what a chain costs once the head is this small. None if it cannot be captured."""
        def step(h, token, pos):
            return self.chained(h, token, pos, n)

        return self.chains.try_run(self.cache.serial, (h, token), pos, step, "MTP draft graph", width=n)

    def chained(self, h: torch.Tensor, token: torch.Tensor, pos, n: int, into: torch.Tensor | None = None,
                rope=None):
        """chain's steps, to be captured (pos on the device): n greedy drafts [n], each argmax written into its
        place in `into` [n] (given: a cycle graph's row of tokens; by the next step's input launch where it can),
        none concatenated. The steps' positions and
        rope table are computed once for the chain (per step they cost three launches and one more), or given:
        pos the positions and rope their (cos, sin), of n or more (a cycle graph's, shared with its verify)."""
        trunk = self.head.trunk
        positions = trunk.positions(pos, n)
        cos, sin = rope or trunk.rope(positions, n)
        into = torch.empty(n, dtype=torch.long, device=token.device) if into is None else into
        logits = None
        for j in range(n):  # (step j + 1's input launch writes step j's argmax: MTPHead.forward's argmax_of)
            logits, h = self.head(h, token.view(1, 1) if j == 0 else into[j - 1 : j].view(1, 1),
                                  positions[j : j + 1], self.cache, last_only=True, upcast=False,
                                  rope=(cos[:, j : j + 1], sin[:, j : j + 1]),
                                  argmax_of=None if j == 0 else logits[:, -1])
        argmax(logits[:, -1], trunk.backends, out=into[n - 1 : n])
        return into

    def reset(self) -> None:
        self.cache.trim(0)
        self.covered = 0  # positions in the MTP cache (all verified)
        self.pending: list[torch.Tensor] = []  # trunk hiddens [1, n, H] of positions covered.. not yet run
        self.last = None  # the latest catch-up's (logits, hidden) at the last verified position
        self.ready = None  # (first draft [1], hidden [1, 1, H]) from a refresh inside the verify graph

    def refresh_verified(self, hidden: torch.Tensor, packed: torch.Tensor, pos, rope=None, into=None):
        """The refresh, inside a greedy verify graph: the head over every position of the verify pass, hidden
        [1, T, H], whose next tokens are the target's (packed: sampling.accept_greedy's [m, targets, drafts]).
        Row i is correct for i <= m, whatever m turns out to be: the head is causal, the accepted drafts equal
        the targets, and its KV past the accepted rows is dropped at commit (refreshed). Returns the next cycle's
        first draft [1] and the head's hidden [1, 1, H] at row m, selected on the device, written into
        `into` = (first, hidden) where given (a cycle graph's buffers: two copies fewer). rope: the verify pass's
        (cos, sin): the same positions."""
        T = hidden.shape[1]
        first, h = (None, None) if into is None else into
        logits, hidden_m = self.head(hidden, packed[1 : T + 1].unsqueeze(0), pos, self.cache, row=packed[:1],
                                     rope=rope, upcast=False, into=h)
        return argmax(logits[:, -1], self.head.trunk.backends, out=first), hidden_m

    def refreshed(self, n: int, first: torch.Tensor, h: torch.Tensor) -> None:
        """Commit a refresh_verified: its first n positions are verified. first and h are the graph's static
        outputs, kept as they are (copies cost two launches while the GPU waits for the host): the next cycle
        reads them before its verify replay overwrites them. Only a retry after a cycle failed past that replay
        would draft from the failed cycle's values, which costs acceptance, never exactness: every draft is
        verified, and the head's cache rows come from the trunk's hiddens and the target's tokens."""
        self.covered += n
        self.cache.trim(self.covered)
        self.pending, self.last, self.ready = [], None, (first, h)

    def observe(self, hidden: torch.Tensor) -> None:
        """hidden: the trunk's post-norm hiddens of newly processed positions, kept until the head runs over
        them (see keep)."""
        self.observe_kept(self.keep(hidden))

    def keep(self, hidden: torch.Tensor) -> torch.Tensor:
        """What observe stores: a copy (with CUDA graphs hidden is a static output that the next replay
        overwrites, and at depth 0, or in a reuse snapshot, the head may run over it only after many replays).
        Apart from observe_kept so that a commit allocates before it mutates anything."""
        return hidden.clone()

    def observe_kept(self, kept: torch.Tensor) -> None:
        self.pending.append(kept)
        self.ready = None

    def rollback(self) -> None:
        """Forget speculative entries; keep what was verified (pending hiddens stay valid)."""
        self.cache.trim(self.covered)

    def catch_up(self, seq_tokens: torch.Tensor, upto: int | None = None):
        """Run the head over the pending positions before position `upto` (all of them when None), PRIME_CHUNK
        positions at a time, like the trunk's prefill: the head's attention then holds a chunk x context block,
        never context x context. seq_tokens[p] is the committed token at position p. Each chunk leaves a
        consistent state (covered, pending, last), so a failure inside one loses no earlier chunk's work. With
        nothing to run, the last result holds and the cache is unchanged."""
        if not self.pending:
            return self.last
        hidden = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        n = hidden.shape[1] if upto is None else min(hidden.shape[1], upto - self.covered)
        if n <= 0:
            return self.last
        self.cache.reserve(n)
        for s in range(0, n, PRIME_CHUNK):
            e, C = min(n, s + PRIME_CHUNK), self.covered
            logits, out = self.run_head(hidden[:, s:e], seq_tokens[C + 1 : C + 1 + e - s].unsqueeze(0), C)
            # copies: a replayed graph's outputs are overwritten by the draft steps that follow
            self.last = logits[:, -1].clone(), out[:, -1:].clone()
            self.covered = C + e - s
            self.cache.trim(self.covered)
            self.pending = [hidden[:, e:].clone()] if e < hidden.shape[1] else []
        return self.last

    def catch_up_ready(self, seq_tokens: torch.Tensor) -> bool:
        """catch_up, leaving the next cycle's first draft and the head's hidden as a refresh inside a verify graph
        would (ready), for a cycle graph launched straight after plain steps or a prefill
        (speculative.launch_cycle): greedy only. False, with nothing caught up to draft from."""
        last = self.catch_up(seq_tokens)
        if last is None:
            return False
        self.ready = (last[0].argmax(-1), last[1])
        return True

    def prime(self, seq_tokens: torch.Tensor, upto: int) -> None:
        """During prefill, after each chunk: the head over every observed position whose next token is known
        (all but the prompt's last, which waits for the first sampled token)."""
        self.catch_up(seq_tokens, upto)

    def propose(self, seq_tokens: torch.Tensor, k: int, timer, req=None):
        """k drafts [k] on the device, and their distributions [k, V] when sampling (None when greedy), or fewer
        when a draft's probability under the head falls below its floor (stops_after). Speculative cache
        entries stay until rollback()."""
        greedy = req is None or req.sampling.greedy
        if greedy and self.ready is not None and not self.pending:  # refreshed inside the last verify graph
            (first, h), logits = self.ready, None
        else:
            with timer.phase("priming" if self.covered == 0 else "refresh"):
                logits, h = self.catch_up(seq_tokens)
            first = logits.argmax(-1) if greedy else None
        with timer.phase("draft"):
            drafts, qs = [], []
            pos = self.covered  # speculative positions start right after the verified ones
            self.cache.reserve(k + 1)  # (+1: a refresh inside the verify graph writes k + 1 positions)
            if greedy and k == 1:
                return first, None
            if greedy and k > 1 and self.chains is not None:
                chained = self.chain(h, first, pos, k - 1)
                if chained is not None:
                    return torch.cat([first, chained]), None
            for j in range(k):
                if j:
                    logits, h = self.run_head(h, drafts[-1].view(1, 1), pos + j - 1)
                    logits = logits[:, -1]
                if greedy:
                    drafts.append(first if j == 0 else logits.argmax(-1))
                else:  # drafts are sampled from q, the head's distribution after the same processing as p
                    qs.append(probabilities(logits, req.sampling))
                    drafts.append(sample(qs[-1], req.generator))
                if logits is not None and stops_after(j, logits, drafts[-1], qs, req):
                    break
            return torch.cat(drafts), (torch.cat(qs) if qs else None)


def stops_after(j: int, logits: torch.Tensor, draft: torch.Tensor, qs: list[torch.Tensor], req) -> bool:
    """Whether a chain stops after its draft j (0-based): the drafter's probability of it, q(draft) when sampling
    (the distribution it was drawn from) or the softmax at the argmax, is below the request's floor for it
    (req.draft_floors, --depth auto on the CPU: the rest of the chain would likely be rejected, and each step
    of it costs a drafter pass and a verify row). Lossless: the stop depends on the drafts alone, before the
    target sees them, and each verified position stays exact."""
    floors = req.draft_floors if req is not None else []
    if j >= len(floors):
        return False
    p = qs[-1][0, draft] if qs else torch.softmax(logits.float(), -1)[0, draft]
    return float(p) < floors[j]


_MASK = (1 << 64) - 1


def uniform(*keys: int) -> float:
    """A uniform draw in [0, 1) determined by the integer keys (splitmix64's finaliser over their mix)."""
    x = 0
    for k in keys:
        x = (x * 0x9E3779B97F4A7C15 + k + 1) & _MASK
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x / 2.0 ** 64


class OracleDrafter:
    """Replays known tokens (e.g. a plain run's output) at a controlled acceptance, for tests and benchmarks,
    independent of model quality: each token corrupted at a flat rate, or (profile) draft position i correct with
    probability profile[i] given that position i - 1 was, as real MTP heads behave; later = (n, profile): from
    the n-th generated token on, that profile instead (text that turns hard mid-reply)."""

    name = "oracle"

    def __init__(self, reference: list[int], prompt_len: int, corruption: float = 0.0, vocab: int = 2, seed: int = 0,
                 profile: list[float] | None = None, later: tuple[int, list[float]] | None = None):
        self.reference, self.prompt_len = list(reference), prompt_len
        self.corruption, self.vocab = corruption, vocab
        self.profile, self.later = profile, later
        self.seed, self.rng = seed, random.Random(seed)  # (rng: which wrong token a rejected draft proposes)

    def correct(self, i: int, start: int, so_far: bool) -> bool:
        """Whether draft position i (of a cycle at generated index `start`) proposes the reference token. The draw
        is a function of (seed, the token's index, i), not of how many came before: rows of one bench at
        different depths (auto's included) see common random numbers, so their differences are the depths',
        not the luck of their draws (with one stream per row, 128-token rows differed by about 5%)."""
        profile = self.profile
        if self.later is not None and start >= self.later[0]:
            profile = self.later[1]
        u = uniform(self.seed, start + i, i)
        if profile is None:
            return u >= self.corruption
        p = profile[min(i, len(profile) - 1)] if so_far else 0.0  # (after a miss nothing is judged)
        return u < p

    def reset(self) -> None:
        pass

    def observe(self, hidden: torch.Tensor) -> None:
        pass

    def keep(self, hidden: torch.Tensor) -> None:
        return None

    def observe_kept(self, kept) -> None:
        pass

    def prime(self, seq_tokens: torch.Tensor, upto: int) -> None:
        pass

    def rollback(self) -> None:
        pass

    def propose(self, seq_tokens: torch.Tensor, k: int, timer, req=None):
        """Deterministic proposals: q is a point mass (None)."""
        with timer.phase("draft"):
            start = seq_tokens.shape[0] - self.prompt_len  # generated tokens so far
            out, so_far = [], True
            for i in range(k):
                j = start + i
                tok = self.reference[j] if j < len(self.reference) else 0
                so_far = self.correct(i, start, so_far)
                if not so_far:
                    tok = (tok + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                out.append(tok)
            return torch.tensor(out, dtype=torch.long, device=seq_tokens.device), None
