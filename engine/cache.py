"""The engine's caches and the speculative transaction over them.

Attention KV is preallocated and grows in whole chunks; trimming is setting a length. With --kv-cache-dtype fp8
it is stored as e4m3 codes with a float32 scale per (head, position) (quantize_kv): half a 16-bit cache's memory,
lossy (the text can differ from the 16-bit cache's), but the same codes at every pass width, so speculation stays
exact against plain decoding over the same cache. GDN state (the short-conv window and the recurrent state)
cannot be trimmed, so a verify pass never writes it: it stashes the exact kernel inputs, and commit(m) replays the
accepted prefix from the untouched pre-verify state (see gdn.py).
"""

from __future__ import annotations

import itertools

import torch

from .fp8 import FP8_MAX

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


FP8 = torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> e4m3 codes [..., D] and float32 scales [...]: each vector's largest magnitude maps to 448, so
    nothing saturates and every vector keeps e4m3's 3-bit relative precision whatever its size."""
    scale = x.float().abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_kv(pair, dtype) -> torch.Tensor:
    """(codes, scales) -> the vectors in dtype; a 16-bit (or float32) cache tensor passes through."""
    if not isinstance(pair, tuple):
        return pair
    codes, scale = pair
    return (codes.view(FP8).float() * scale[..., None]).to(dtype)


class KVCache:
    """Keys and values of every full-attention layer: [layers, kv_heads, capacity, head_dim], batch 1. fp8: e4m3
    codes with float32 scales [layers, kv_heads, capacity] (quantize_kv). The codes are kept as their bytes
    (uint8) and read through float8 views: zeros, copies and index_put exist for uint8 on every device and torch
    version, and a compiled layer's write into a layer's view of the cache (a select_scatter) then never mixes a
    mask with float8, which inductor's CPU code generation refuses."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, chunk: int = RESERVE_CHUNK,
                 fp8: bool = False):
        self.shape = (layers, kv_heads, 0, head_dim)
        self.dtype, self.device, self.chunk, self.fp8 = dtype, device, chunk, fp8
        self.k, self.v, self.k_scale, self.v_scale = self._buffers(0)
        self.length = 0
        self.serial = new_serial()

    def _buffers(self, capacity: int):
        """Zeros, not empty: graph-mode attention reads the whole capacity under a mask, and 0 * NaN is NaN."""
        L, H, _, D = self.shape
        if not self.fp8:
            k = torch.zeros((L, H, capacity, D), dtype=self.dtype, device=self.device)
            return k, torch.zeros_like(k), None, None
        k = torch.zeros((L, H, capacity, D), dtype=torch.uint8, device=self.device)
        scale = torch.zeros((L, H, capacity), device=self.device)
        return k, torch.zeros_like(k), scale, torch.zeros_like(scale)

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
        new = self._buffers(cap)
        for old, buf in zip((self.k, self.v, self.k_scale, self.v_scale), new):
            if buf is not None:
                buf[:, :, : self.length] = old[:, :, : self.length]
        self.k, self.v, self.k_scale, self.v_scale = new
        self.serial = new_serial()

    def layer(self, i: int):
        """Layer i's keys and values [H, capacity, D]: views, so the layer code never indexes by layer number
        (a compiled layer then serves every layer of its kind; see graphs.compile_block). fp8: (codes, scales)
        pairs of views."""
        if self.fp8:
            return (self.k[i], self.k_scale[i]), (self.v[i], self.v_scale[i])
        return self.k[i], self.v[i]

    def trim(self, length: int) -> None:
        self.length = length


def _store(cache, at, x: torch.Tensor):
    """x [1, H, T, D] into one layer's keys or values at `at` (a slice or device-side positions); returns the
    cache's views with a batch dimension: [1, H, N, D], or fp8 ([1, H, N, D] codes as bytes, [1, H, N] scales)."""
    if isinstance(cache, tuple):
        codes, scales = cache
        c, scales[:, at] = quantize_kv(x[0])
        codes[:, at] = c.view(torch.uint8)
        return codes.unsqueeze(0), scales.unsqueeze(0)
    cache[:, at] = x[0]
    return cache.unsqueeze(0)


def kv_write(keys, values, pos: int, k: torch.Tensor, v: torch.Tensor):
    """Store k, v [1, H, T, D] at positions pos..pos+T-1 of one layer's cache; return everything up to them
    [1, H, pos + T, D] in k's dtype (views of a 16-bit cache; an fp8 cache's dequantized: the attention sees the
    stored values at every width)."""
    end = pos + k.shape[2]
    keys, values = _store(keys, slice(pos, end), k), _store(values, slice(pos, end), v)
    return dequantize_kv(_head(keys, end), k.dtype), dequantize_kv(_head(values, end), k.dtype)


def _head(stored, n: int):
    """The first n positions of a cache view (or of an fp8 pair's codes and scales)."""
    if isinstance(stored, tuple):
        return stored[0][:, :, :n], stored[1][:, :, :n]
    return stored[:, :, :n]


def kv_write_at(keys, values, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Graph-safe write at device-side positions [T] (Trunk.positions); returns the whole capacity [1, H, N, D]
    as stored (an fp8 cache: (codes, scales) pairs; the attention masks what lies past each query's position).
    An index_put (not index_copy_) so that the compiler updates the cache in place instead of copying it."""
    return _store(keys, positions, k), _store(values, positions, v)


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
