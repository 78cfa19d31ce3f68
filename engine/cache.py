"""The engine's caches and the speculative transaction over them.

Attention KV is preallocated and grows in whole chunks; trimming is setting a length. GDN state (the short-conv
window and the recurrent state) cannot be trimmed, so a verify pass never writes it: it stashes the exact kernel
inputs, and commit(m) replays the accepted prefix from the untouched pre-verify state (see gdn.py).
"""

from __future__ import annotations

import itertools

import torch

# Every buffer allocation gets a new serial number: CUDA graphs are keyed by the serials of the buffers they were
# captured over. (A bare data_ptr() is not an identity: a freed buffer's address is handed to the next one.)
_serials = itertools.count(1)


def new_serial() -> int:
    return next(_serials)


RESERVE_CHUNK = 256  # KV grows in whole chunks so a verify pass never reallocates mid-cycle
# ... and by at least this factor: a long prompt's chunks (or a conversation's turns) then copy the cache a few
# times in all rather than once per chunk (quadratic), and CUDA graphs, captured over the cache's buffers, are
# re-captured every few turns rather than every turn. Graph-mode decode attention reads the whole capacity: the
# factor bounds what that costs over the filled length.
GROWTH = 1.25


class KVCache:
    """Keys and values of every full-attention layer: [layers, kv_heads, capacity, head_dim], batch 1."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, chunk: int = RESERVE_CHUNK):
        self.shape = (layers, kv_heads, 0, head_dim)
        self.dtype, self.device, self.chunk = dtype, device, chunk
        self.k = torch.zeros(self.shape, dtype=dtype, device=device)
        self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self.length = 0
        self.serial = new_serial()

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for n more positions: capacity grows by GROWTH at least, in whole chunks (>= the verify
        width)."""
        need = self.length + n
        if need <= self.capacity:
            return
        cap = -(-max(need, int(self.capacity * GROWTH)) // self.chunk) * self.chunk
        L, H, _, D = self.shape
        # zeros, not empty: graph-mode attention reads the whole capacity under a mask, and 0 * NaN is NaN
        k = torch.zeros((L, H, cap, D), dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v
        self.serial = new_serial()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values [H, capacity, D]: views, so the layer code never indexes by layer number
        (a compiled layer then serves every layer of its kind; see graphs.compile_block)."""
        return self.k[i], self.v[i]

    def trim(self, length: int) -> None:
        self.length = length


def kv_write(keys, values, pos: int, k: torch.Tensor, v: torch.Tensor):
    """Store k, v [1, H, T, D] at positions pos..pos+T-1 of one layer's cache; return views of everything up to them."""
    T = k.shape[2]
    keys[:, pos : pos + T] = k[0]
    values[:, pos : pos + T] = v[0]
    return keys[:, : pos + T].unsqueeze(0), values[:, : pos + T].unsqueeze(0)


def kv_write_at(keys, values, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Graph-safe write at device-side positions [T] (Trunk.positions); returns the whole capacity [1, H, N, D]
    (the attention masks what lies past each query's position). An index_put (not index_copy_) so that the
    compiler updates the cache in place instead of copying it."""
    keys[:, positions] = k[0]
    values[:, positions] = v[0]
    return keys.unsqueeze(0), values.unsqueeze(0)


class GDNState:
    """Committed conv windows [L, C, K-1] and recurrent states [L, Hv, Dk, Dv] (float32) of all GDN layers."""

    def __init__(self, layers: int, conv_dim: int, kernel: int, hv: int, dk: int, dv: int, dtype, device):
        self.conv = torch.zeros(layers, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(layers, hv, dk, dv, dtype=torch.float32, device=device)
        self.serial = new_serial()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GDN layer i's conv window [C, K-1] and recurrent state [1, Hv, Dk, Dv]: views."""
        return self.conv[i], self.recurrent[i : i + 1]

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()
