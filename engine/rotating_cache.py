"""Keys and values of sliding-window attention layers: a ring bounded by the window, with exact rollback.

A query at position p sees the keys at positions p - window + 1 .. p (transformers' sliding_window_overlay:
kv > q - window). The ring holds the last `window` positions; position p lives in slot p % window. A pass over T
tokens attends over [ring as it was | the T new keys] under a mask by absolute position, then writes the new
entries over the oldest ones. Once the ring has wrapped, those overwritten entries are gone, so trimming a length
(as the full-attention KVCache does) cannot rewind it: while a pass is speculative (verify, a draft model's chained
steps) it keeps a record, the overwritten slots' old entries and the pass's new ones, and settle(n) rewinds every
record past position n: the old entries restored, then the accepted prefix of the pass re-written (the seed's
RotatingKVCache protocol). Records stack, newest first, so a chain of single-token draft steps rewinds too.

In a CUDA graph (graphs.py: the position a device tensor, nothing read on the host) a speculative pass does not
write the ring at all: its new entries go to one static record owned by the ring (GraphRecord, allocated once, so
every replay writes the same memory), and settle(n), eager on the host after the commit or abort, writes the rows
below n from it; the mask and the slots come from the positions on the device. A replay, or a capture's warm-ups
(which run the step two or three times), then always reads the committed ring, like a verify pass over the
full-attention KV, and a failed replay leaves it as it was. The plain in-place step (graph or eager) writes the
ring in place; ring entries at or past the pass's first position are stale (a warm-up wrote them) and masked out.

Rows of a pass never depend on later rows, so what settle(n) leaves is independent of the rejected tail, bit for
bit (tests/test_sliding_window.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import new_serial

# The widest graph-mode pass: graphs.PREFILL_WIDTHS[-1] (verify passes are at most limits.MAX_DEPTH + 1 wide).
GRAPH_ROWS = 256


@dataclass
class Record:
    """One speculative pass: positions start .. start + width - 1; the slots it overwrote with their old
    entries (keys / values [L, H, n, D], positions [n]) and the pass's new keys / values per layer [1, H, T, D]."""
    start: int
    width: int
    slots: torch.Tensor
    old_pos: torch.Tensor
    old_k: torch.Tensor
    old_v: torch.Tensor
    new_k: dict = field(default_factory=dict)
    new_v: dict = field(default_factory=dict)


@dataclass
class GraphRecord:
    """The graph-mode speculative pass, all on the device: its new keys / values [L, H, GRAPH_ROWS, D] (rows 0 ..
    width - 1), its first position and its width (0-dim; width 0: no pass pending)."""
    k: torch.Tensor
    v: torch.Tensor
    start: torch.Tensor
    width: torch.Tensor


@dataclass
class Pass:
    """What the layers of one forward share: the mask [T, window + T] (True: a key the query sees), the slots the
    last min(T, window) new entries go to (None in graph mode while speculative: nothing goes to the ring), the
    host record when speculative and eager, the device one when speculative in graph mode."""
    start: int | torch.Tensor
    width: int
    mask: torch.Tensor
    slots: torch.Tensor | None
    record: Record | None
    graph: GraphRecord | None = None


class RotatingKV:
    """[layers, kv_heads, window, head_dim] keys and values of every sliding-window layer, batch 1."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, window: int, dtype, device):
        self.window, self.layers = window, layers
        self.k = torch.zeros(layers, kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((window,), -1, dtype=torch.long, device=device)  # each slot's position, -1: empty
        self.records: list[Record] = []
        self.graph: GraphRecord | None = None  # allocated by the first graph-mode speculative pass
        self.current: Pass | None = None
        self.serial = new_serial()

    def begin(self, start, width: int, speculative: bool, chained: bool = False) -> None:
        """Before a forward over positions start .. start + width - 1: the mask from the ring as it is, then the
        ring's positions advanced (each layer writes its own entries in attend), except in a graph-mode speculative
        pass (its entries go to the graph record). start: an int (eager), or in graph mode the pass's positions
        [width] on the device. chained: a draft model's later chained step (Trunk.forward's chain)."""
        W, dev = self.window, self.pos.device
        on_device = not isinstance(start, int)
        if on_device and speculative and chained:  # (draft_model.py keeps sliding-window drafts' chains eager)
            raise RuntimeError("a chained graph-mode step over a sliding-window ring: the steps before it left "
                               "their entries in the graph record, not in the ring")
        new_pos = start if on_device else torch.arange(start, start + width, device=dev)
        q, ring, new = new_pos[:, None], self.pos[None, :], new_pos[None, :]
        # (ring entries at or past the pass's first position are stale: see the module docstring)
        mask = torch.cat([(ring >= 0) & (ring < new_pos[0]) & (q - ring < W), (new <= q) & (q - new < W)], 1)
        if on_device and speculative:
            g = self.graph_record(width)
            g.start.copy_(new_pos[0])
            g.width.fill_(width)
            self.current = Pass(start, width, mask, None, None, g)
            return
        if not on_device and self.graph is not None:
            # a graph pass pending at an eager one was a capture that failed (its warm-up ran): never settled
            self.graph.width.zero_()
        kept = new_pos[-W:]  # (a pass wider than the window: only its last `window` entries stay)
        slots = kept % W
        record = None
        if speculative:
            record = Record(start, width, slots, self.pos[slots].clone(), self.k[:, :, slots].clone(),
                            self.v[:, :, slots].clone())
            self.records.append(record)
        self.pos[slots] = kept
        self.current = Pass(start, width, mask, slots, record)

    def graph_record(self, width: int) -> GraphRecord:
        if width > GRAPH_ROWS:
            raise RuntimeError(f"a graph-mode sliding-window pass of {width} tokens (at most {GRAPH_ROWS})")
        if self.graph is None:
            L, H, _, D = self.k.shape
            k = torch.zeros(L, H, GRAPH_ROWS, D, dtype=self.k.dtype, device=self.k.device)
            zero = torch.zeros((), dtype=torch.long, device=self.k.device)
            self.graph = GraphRecord(k, torch.zeros_like(k), zero.clone(), zero.clone())
        return self.graph

    def layer(self, i: int) -> tuple["RingLayer", None]:
        """Sliding layer i's view: (its ring, None); model.attention tells the two kinds of state apart by that
        None."""
        return RingLayer(self, i), None

    def attend(self, i: int, q, k, v, scale: float, masked=None) -> torch.Tensor:
        """Queries q [1, Hq, T, D] of the current pass over layer i's ring and the new keys k, values v
        [1, H, T, D]; then the new entries stored. masked: the graph-mode attention (model.masked_decode_attention,
        over the mask's complement), None: SDPA."""
        p = self.current
        keys = torch.cat([self.k[i].unsqueeze(0), k], 2)
        values = torch.cat([self.v[i].unsqueeze(0), v], 2)
        if masked is not None:
            o = masked(q, keys, values, ~p.mask, scale)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=p.mask, scale=scale, enable_gqa=True)
        if p.graph is not None:  # graph mode, speculative: into the static record, settle writes the ring
            T = k.shape[2]
            p.graph.k[i, :, :T] = k[0]
            p.graph.v[i, :, :T] = v[0]
            return o
        n = p.slots.shape[0]
        self.k[i][:, p.slots] = k[0, :, -n:]
        self.v[i][:, p.slots] = v[0, :, -n:]
        if p.record is not None:
            p.record.new_k[i], p.record.new_v[i] = k, v
        return o

    def settle(self, keep: int) -> None:
        """Keep what the passes wrote for positions below `keep`, rewind the rest: the records past it are undone,
        newest first (old entries restored, the accepted prefix of a pass re-written); all records are then
        committed; then the graph-mode pass, if one is pending (settle_graph). keep: the processed length
        (TrunkCaches.processed after a commit or an abort)."""
        W = self.window
        for r in reversed(self.records):
            if keep >= r.start + r.width:
                break  # this pass and every older one are kept whole
            self.pos[r.slots] = r.old_pos
            self.k[:, :, r.slots] = r.old_k
            self.v[:, :, r.slots] = r.old_v
            a = keep - r.start  # the pass's accepted prefix
            if a > 0:
                lo = max(0, a - W)
                kept = torch.arange(r.start + lo, r.start + a, device=self.pos.device)
                slots = kept % W
                self.pos[slots] = kept
                for i in r.new_k:
                    self.k[i][:, slots] = r.new_k[i][0, :, lo:a]
                    self.v[i][:, slots] = r.new_v[i][0, :, lo:a]
                break  # (older passes lie wholly below keep)
        if self.graph is not None:
            self.settle_graph(keep)
        self.records = []
        self.current = None

    def settle_graph(self, keep: int) -> None:
        """Write the pending graph-mode pass's rows below `keep` into the ring, on the device (its start is there,
        unknown to the host). Every slot the pass may touch (min(GRAPH_ROWS, window) consecutive positions from its
        start: distinct slots, so no write races another) takes the latest position below keep that lives in it,
        when that position is one of the pass's rows; every other slot keeps its entry. With no pass pending (width
        0) nothing is taken; the record is then cleared."""
        g, W = self.graph, self.window
        slots = (g.start + torch.arange(min(GRAPH_ROWS, W), device=self.pos.device)) % W
        latest = keep - 1 - (keep - 1 - slots) % W
        row = latest - g.start
        take = (row >= 0) & (row < g.width)
        src = row.clamp(0, GRAPH_ROWS - 1)
        self.pos[slots] = torch.where(take, latest, self.pos[slots])
        self.k[:, :, slots] = torch.where(take[:, None], g.k[:, :, src], self.k[:, :, slots])
        self.v[:, :, slots] = torch.where(take[:, None], g.v[:, :, src], self.v[:, :, slots])
        g.width.zero_()

    def reset(self) -> None:
        self.pos.fill_(-1)
        self.drop()

    def drop(self) -> None:
        """Forget every pending pass, host records and the graph-mode one."""
        self.records = []
        self.current = None
        if self.graph is not None:
            self.graph.width.zero_()

    def snapshot(self) -> tuple:
        """The ring's committed contents (reuse.py: a conversation restored to an earlier prompt)."""
        return self.k.clone(), self.v.clone(), self.pos.clone()

    def restore(self, snap: tuple) -> None:
        for dst, src in zip((self.k, self.v, self.pos), snap):
            dst.copy_(src)
        self.drop()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class RingLayer:
    ring: RotatingKV
    index: int

    def attend(self, q, k, v, scale: float, masked=None) -> torch.Tensor:
        return self.ring.attend(self.index, q, k, v, scale, masked)
