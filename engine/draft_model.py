"""A separate, smaller model as the drafter (--draft-model): it proposes k tokens by k chained single-token steps
on its own caches, the target verifies them in one pass, and the draft keeps exactly what the target accepted.

The draft's chain is one speculative transaction over its own caches, like the target's verify pass: its first
step runs over the committed tokens it has not processed yet (t_n at least, the last committed token), each
later step over the draft before it. Every step is a verify-mode pass (Trunk.forward with chain=): GDN layers
stash their kernel inputs row after row and never write the committed state, attention KV goes past the committed
length, sliding-window rings keep a record per step (rotating_cache.py). Settling keeps the rows whose tokens were
committed (the catch-up, t_n and the accepted drafts): KV trimmed, the GDN recurrence replayed over the kept rows
from the committed state (gdn.commit, one call for the whole chain), each ring's later records undone; a failure
anywhere drops the whole chain.

The engine tells the drafter what a cycle committed through keep / observe_kept (speculative.finish): keep(hidden)
in the commit's prepare names the chain and the verify rows kept, observe_kept in its apply settles it;
rollback() alone (a failed or dropped cycle) drops the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .drafters import stops_after
from .errors import EngineError
from .sampling import probabilities, sample

PRIME_CHUNK = 512  # tokens per draft prefill pass (its catch-up over a prompt, or after plain decoding)
CATCH_UP = 16  # more unprocessed committed tokens than this are prefilled before a chain, not chained


@dataclass
class Chain:
    start: int  # the draft's processed length when the chain began
    width: int  # tokens of the first step: the committed ones the draft had not processed, t_n last
    k: int  # drafts proposed (k - 1 steps after the first)
    fed: list  # the tokens each step ran over (device tensors)
    rolled: bool = False  # the engine rolled the cycle back; settled (dropped) at the drafter's next use


class DraftModelDrafter:
    """Drafts with a separate model of the target's tokenizer. name: "draft:<folder name>" (stats, events)."""

    def __init__(self, loaded, graphs: bool = False):
        self.loaded, self.trunk = loaded, loaded.trunk
        self.name = f"draft:{loaded.name}"
        self.caches = self.trunk.new_caches()
        # greedy chains as one graph per (first width, k) (graphs.StepGraphs; on the CPU its stand-in): at batch 1
        # a small draft's steps are launch-bound. Not for sliding-window drafts: a chain's later steps would have
        # to read the entries a graph-mode pass leaves in the ring's record (rotating_cache.py), not in the ring.
        self.graphs = None
        if graphs and self.caches.window is None:
            from .graphs import StepGraphs

            self.graphs = StepGraphs(self.trunk.device)
        self.seen = torch.empty(0, dtype=torch.long, device=self.trunk.device)  # tokens the caches hold
        self.chain: Chain | None = None
        self.req = None  # the request the last proposal served (its committed prefix is checked once per request)

    @classmethod
    def for_target(cls, loaded, target) -> "DraftModelDrafter":
        """The drafter for `target` (an Engine): CUDA graphs where the target has them, and the target's compiled
        layers under --compile (one compiled function, recompiled per layer shape), so that the draft's small
        kernels fuse as the target's do: on the H200 a 0.6B-shape draft step took 2.4 ms uncompiled, 14% of the
        27B shape's step."""
        loaded.trunk.compiled_block = target.trunk.compiled_block
        return cls(loaded, graphs=target.graph_runner is not None)

    # -- committed state ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.caches.reset()
        self.chain, self.req = None, None

    def _settle(self, chain: Chain | None = None, kept: int = 0) -> None:
        """Settle the pending chain: keep `kept` target verify rows of it (its catch-up tokens too), or none."""
        c, self.chain = self.chain, None
        if c is None:
            return
        n = c.width - 1 + min(kept, c.k) if (c is chain and kept) else 0
        if n == 0:
            self.caches.abort()
            return
        self.caches.commit(n - 1, self.trunk.backends)
        self._remember(torch.cat(c.fed)[:n])

    def _remember(self, tokens: torch.Tensor) -> None:
        """Append tokens to `seen` (a device copy; grown by doubling)."""
        n, have = tokens.shape[0], self.caches.processed - tokens.shape[0]
        if have + n > self.seen.shape[0]:
            grown = torch.empty(2 * (have + n), dtype=torch.long, device=self.seen.device)
            grown[:have] = self.seen[:have]
            self.seen = grown
        self.seen[have : have + n] = tokens

    def _check(self, seq: torch.Tensor) -> None:
        """The draft's state must be a prefix of the committed sequence: a new request (another conversation, a
        regenerate, the target restored to an earlier snapshot) may not extend what the draft processed. One
        comparison and host sync per request (prefill's, not the decode loop's); a mismatch restarts the draft.
        So does a state holding the whole sequence (a turn restored to exactly what the draft had processed):
        drafting feeds at least the last token, whose logits give the first draft."""
        P = self.caches.processed
        if P and (P >= seq.shape[0] or not torch.equal(self.seen[:P], seq[:P])):
            self.caches.reset()

    def _prefill(self, seq: torch.Tensor, upto: int) -> None:
        """Process committed tokens seq[processed:upto] in place (no transaction: they are committed)."""
        c = self.caches
        for s in range(c.processed, upto, PRIME_CHUNK):
            part = seq[s : min(upto, s + PRIME_CHUNK)]
            c.kv.reserve(part.shape[0])
            self.trunk.forward(part.unsqueeze(0), c.processed, c, verify=False)
            c.advance(part.shape[0])
            self._remember(part)

    @property
    def covered(self) -> int:
        return self.caches.processed

    def reserve(self, n: int) -> None:
        """Room for n more positions now, for a whole request (api.Engine.generate): a reallocated KV cache means
        re-capturing the chain graphs."""
        self.caches.kv.reserve(n)

    def chain_graph(self, inp: torch.Tensor, P: int, k: int):
        """The greedy chain [k] as one graph replay: the first step over inp [1, w] at position P, then k - 1
        single-token steps over the argmax before (all on the device). None when it cannot be captured."""
        t, c, w = self.trunk, self.caches, inp.shape[1]

        def step(inp, pos):
            h = t.forward(inp, pos, c, verify=True)
            token = t.logits(h[0, -1:], upcast=False).argmax(-1)
            out = [token]
            for j in range(1, k):
                h = t.forward(token.view(1, 1), pos + (w + j - 1), c, verify=True, chain=w + j - 1)
                token = t.logits(h[0, -1:], upcast=False).argmax(-1)
                out.append(token)
            return torch.cat(out)

        key = (c.kv.serial, c.stash.serial, c.gdn.serial)
        out = self.graphs.try_run(key, (inp,), P, step, "draft model graph", width=(w, k))
        if out is None:
            return None
        c.stash.width = w + k - 1  # (the side effect of the forwards the replay ran)
        return out.clone()  # (static: the next replay overwrites it)

    # -- the drafter interface (drafters.MTPDrafter's) -------------------------------------------------------------

    def observe(self, hidden: torch.Tensor) -> None:
        self._settle(None)  # (a prefill: whatever was pending is gone)

    def keep(self, hidden: torch.Tensor):
        """In a commit's prepare: the pending chain and the target's verify rows kept (hidden [1, m + 1, H]);
        a chain rolled back already (a failed cycle, before a plain step) is named by nobody."""
        chain = self.chain if self.chain is not None and not self.chain.rolled else None
        return chain, hidden.shape[1]

    def observe_kept(self, kept) -> None:
        chain, n = kept if kept is not None else (None, 0)
        self._settle(chain, n)

    def rollback(self) -> None:
        """The cycle is undone or about to be settled by observe_kept: mark the chain, settle it at the next use."""
        if self.chain is not None:
            self.chain.rolled = True

    def prime(self, seq_tokens: torch.Tensor, upto: int) -> None:
        """During the target's prefill: the draft catches up on the committed tokens whose successor is known."""
        self._settle(None)
        self._check(seq_tokens)
        self._prefill(seq_tokens, upto)

    def propose(self, seq_tokens: torch.Tensor, k: int, timer, req=None):
        """k drafts [k] from k chained steps, and their distributions q [k, V] when sampling (the draft's logits
        after the request's temperature / top-k / top-p, as the target's p); fewer after a draft whose
        probability is below its floor (drafters.stops_after). The chain stays pending until the cycle commits
        (observe_kept) or is rolled back."""
        self._settle(None)
        greedy = req is None or req.sampling.greedy
        seq, t, c = seq_tokens, self.trunk, self.caches
        L = seq.shape[0]
        with timer.phase("draft"):
            if req is not self.req:
                self._check(seq)
                self.req = req
            if L - 1 - c.processed > CATCH_UP:  # (after plain decoding, or a request the draft has not seen)
                self._prefill(seq, L - 1)
            P = c.processed
            width = L - P
            c.kv.reserve(width + k)
            c.stash_for(width + k - 1, t)  # the whole chain's rows: a chained step cannot reallocate the stash
            fed, drafts, qs = [seq[P:L]], [], []
            self.chain = Chain(P, width, k, fed)
            if greedy and self.graphs is not None:
                out = self.chain_graph(seq[P:L].view(1, -1), P, k)
                if out is not None:
                    fed += list(out[:-1].split(1))
                    return out, None
            for j in range(k):
                inp = fed[-1].view(1, -1)
                h = t.forward(inp, P + (width + j - 1 if j else 0), c, verify=True, chain=width + j - 1 if j else 0)
                logits = t.logits(h[0, -1:])
                if greedy:
                    d = logits.argmax(-1)
                else:  # drafts sampled from q, the draft's distribution after the same processing as p
                    qs.append(probabilities(logits, req.sampling))
                    d = sample(qs[-1], req.generator)
                drafts.append(d)
                if stops_after(j, logits, d, qs, req):
                    self.chain.k = j + 1  # (its last draft is not fed, as a full chain's is not: _settle)
                    break
                if j + 1 < k:
                    fed.append(d)
            return torch.cat(drafts), (torch.cat(qs) if qs else None)


# --- loading and the checks ----------------------------------------------------------------------------------


def load_draft(path, target) -> DraftModelDrafter:
    """Load the draft model at `path` for `target` (an Engine) on the target's device and dtype; EngineError with
    one line when it cannot draft for it: another vocabulary or token ids, a larger model, tensor parallelism."""
    from .api import load_tokenizer
    from .model import load

    if target.trunk.group is not None:
        raise EngineError("--draft-model: not with tensor parallelism (--tp) yet")
    t = target.trunk
    try:
        loaded = load(path, str(t.device), str(t.dtype).replace("torch.", ""))
    except EngineError as e:
        raise EngineError(f"--draft-model: {e}") from None
    check_pair(loaded, load_tokenizer(Path(loaded.path)), target)
    return DraftModelDrafter.for_target(loaded, target)


def check_pair(draft, draft_tokenizer, target) -> None:
    """The draft proposes token ids the target reads as the same tokens, from the same vocabulary: the lm_head
    sizes agree (q and p have one support) and the tokenizers map every token string to the same id."""
    dv, tv = draft.trunk.config.vocab_size, target.trunk.config.vocab_size
    if dv != tv:
        raise EngineError(f"--draft-model {draft.name}: its vocabulary has {dv:,} entries, the target's {tv:,}: "
                          f"a draft must share the target's tokenizer")
    if target.tokenizer is not None and draft_tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise EngineError(f"--draft-model {draft.name}: its tokenizer maps tokens to other ids than the target's "
                          f"({target.loaded.name}): a draft must share the target's tokenizer")
    if draft.params > target.loaded.params:
        raise EngineError(f"--draft-model {draft.name}: it is larger than the target ({draft.params / 1e6:,.1f}M "
                          f"parameters against {target.loaded.params / 1e6:,.1f}M): drafting would cost more than "
                          f"it saves")
