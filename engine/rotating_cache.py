"""Keys and values of sliding-window attention layers: a ring bounded by the window, with exact rollback.

A query at position p sees the keys at positions p - window + 1 .. p (transformers' sliding_window_overlay:
kv > q - window). The ring holds the last `window` positions; position p lives in slot p % window. A pass over T
tokens attends over [ring as it was | the T new keys] under a mask by absolute position, then writes the new
entries over the oldest ones. Once the ring has wrapped, those overwritten entries are gone, so trimming a length
(as the full-attention KVCache does) cannot rewind it: while a pass is speculative (verify, a draft model's chained
steps) it keeps a record, the overwritten slots' old entries and the pass's new ones, and settle(n) rewinds every
record past position n: the old entries restored, then the accepted prefix of the pass re-written (the seed's
RotatingKVCache protocol). Records stack, newest first, so a chain of single-token draft steps rewinds too.

Rows of a pass never depend on later rows, so what settle(n) leaves is independent of the rejected tail, bit for
bit (tests/test_sliding_window.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import new_serial


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
class Pass:
    """What the layers of one forward share: the mask [T, window + T] (True: a key the query sees), the slots the
    last min(T, window) new entries go to, and the record when speculative."""
    start: int
    width: int
    mask: torch.Tensor
    slots: torch.Tensor
    record: Record | None


class RotatingKV:
    """[layers, kv_heads, window, head_dim] keys and values of every sliding-window layer, batch 1."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, window: int, dtype, device):
        self.window, self.layers = window, layers
        self.k = torch.zeros(layers, kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((window,), -1, dtype=torch.long, device=device)  # each slot's position, -1: empty
        self.records: list[Record] = []
        self.current: Pass | None = None
        self.serial = new_serial()

    def begin(self, start: int, width: int, speculative: bool) -> None:
        """Before a forward over positions start .. start + width - 1: the mask from the ring as it is, then the
        ring's positions advanced (each layer writes its own entries in attend)."""
        W, dev = self.window, self.pos.device
        new_pos = torch.arange(start, start + width, device=dev)
        key_pos = torch.cat([self.pos, new_pos])
        q = new_pos[:, None]
        mask = (key_pos[None, :] >= 0) & (key_pos[None, :] <= q) & (q - key_pos[None, :] < W)
        kept = new_pos[-W:]  # (a pass wider than the window: only its last `window` entries stay)
        slots = kept % W
        record = None
        if speculative:
            record = Record(start, width, slots, self.pos[slots].clone(), self.k[:, :, slots].clone(),
                            self.v[:, :, slots].clone())
            self.records.append(record)
        self.pos[slots] = kept
        self.current = Pass(start, width, mask, slots, record)

    def layer(self, i: int) -> tuple["RingLayer", None]:
        """Sliding layer i's view: (its ring, None); model.attention tells the two kinds of state apart by that
        None."""
        return RingLayer(self, i), None

    def attend(self, i: int, q, k, v, scale: float) -> torch.Tensor:
        """Queries q [1, Hq, T, D] of the current pass over layer i's ring and the new keys k, values v
        [1, H, T, D]; then the new entries stored."""
        p = self.current
        keys = torch.cat([self.k[i].unsqueeze(0), k], 2)
        values = torch.cat([self.v[i].unsqueeze(0), v], 2)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=p.mask, scale=scale, enable_gqa=True)
        n = p.slots.shape[0]
        self.k[i][:, p.slots] = k[0, :, -n:]
        self.v[i][:, p.slots] = v[0, :, -n:]
        if p.record is not None:
            p.record.new_k[i], p.record.new_v[i] = k, v
        return o

    def settle(self, keep: int) -> None:
        """Keep what the passes wrote for positions below `keep`, rewind the rest: the records past it are undone,
        newest first (old entries restored, the accepted prefix of a pass re-written); all records are then
        committed. keep: the processed length (TrunkCaches.processed after a commit or an abort)."""
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
        self.records = []
        self.current = None

    def reset(self) -> None:
        self.pos.fill_(-1)
        self.records = []
        self.current = None

    def snapshot(self) -> tuple:
        """The ring's committed contents (reuse.py: a conversation restored to an earlier prompt)."""
        return self.k.clone(), self.v.clone(), self.pos.clone()

    def restore(self, snap: tuple) -> None:
        for dst, src in zip((self.k, self.v, self.pos), snap):
            dst.copy_(src)
        self.records = []
        self.current = None

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class RingLayer:
    ring: RotatingKV
    index: int

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        return self.ring.attend(self.index, q, k, v, scale)
