"""Graph-mode attention over the KV cache's filled length only (split-K, "flash-decoding"), for CUDA in 16-bit.

Inside a CUDA graph the cache's length lives on the device, so model.masked_decode_attention reads the whole
capacity under a mask, as two matmuls and a float32 softmax: on the H200 (27B shape) 0.47 ms a layer over 131k
positions, 1.1 TB/s, which held decoding after a 128k-token prompt to 72% of its short-context rate. Here the
grid covers the capacity in splits, and each program reads keys only up to the last query's position (read on
the device): splits past it exit at once, so the cost follows the filled length, not the capacity.

One program per (kv head, split, block of query rows): rows are (query head in the group, token), as in
masked_decode_attention, so a kv head's keys are read once for its whole group. Each keeps a running max, sum and
float32 output over its keys (query row i sees keys 0..positions[i]); over a short cache the last program of a
row block to finish merges its splits, over a long one a second kernel (_merge): one or two launches a layer, where
the masked form takes nine and the merge as torch ops took nine more.
Float32 stays on the masked path: it is the exactness reference the tests hold.
"""

from __future__ import annotations

import torch

from .splitk import counters, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the masked path
    triton = None

NEG = -1.0e30 if triton is None else tl.constexpr(-1.0e30)  # the running max's start: finite, so a block whose keys are all masked gives exp(NEG - NEG) = 1


if triton is not None:
    from .splitk import after_previous

    @triton.jit
    def _splits(Q, K, V, KS, VS, POS, M, L, ACC, R, T, SPLIT, S, stride_qh, stride_qt, stride_kh, stride_sh, scale,
                LOCKS, OUT, GATE, stride_gt, stride_gh, H, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, FP8: tl.constexpr = False, MERGE: tl.constexpr = False, GATED: tl.constexpr = False,
                DOT: tl.constexpr = None, PDL: tl.constexpr = False):
        """FP8: K and V hold e4m3 codes with float32 scales KS, VS per (kv head, position) (cache.quantize_kv).
        Codes convert to q's dtype exactly; a key's scale multiplies its score column, a value's scale the
        probability that weighs it (the same products, regrouped: no dequantized tile). Q is read through its
        strides (query head h * R / T + row // T, token row % T): the rotated queries' layout, no copy first.
        MERGE: the last split program of each (kv head, row block) to arrive (LOCKS counts them, as
        splitk.store_tile does) merges the block's splits as _merge does and writes OUT (gated where GATED):
        one launch a call instead of two. DOT: the dots' input precision ("ieee" for float32 queries, which tf32,
        Triton's default, would round to 10 bits: the engine never runs float32 here, its tests do)."""
        after_previous(PDL)
        h, s, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < R
        pos = tl.load(POS + rows % T, mask=live, other=0)  # row (g, t) = g * T + t sees keys 0..positions[t]
        end = tl.minimum((s + 1) * SPLIT, tl.load(POS + T - 1) + 1)  # the filled length: the last query's
        d = tl.arange(0, D)
        q = tl.load(Q + (h * (R // T) + rows[:, None] // T) * stride_qh + (rows[:, None] % T) * stride_qt + d[None, :],
                    mask=live[:, None], other=0.0)
        m = tl.full([BLOCK_R], NEG, tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for n0 in range(s * SPLIT, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            inside = n < end
            k = tl.load(K + h * stride_kh + n[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT) * scale
            if FP8:
                scores *= tl.load(KS + h * stride_sh + n, mask=inside, other=0.0)[None, :]
            scores = tl.where((n[None, :] <= pos[:, None]) & inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            v = tl.load(V + h * stride_kh + n[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            l = l * alpha + tl.sum(p, 1)
            if FP8:
                p *= tl.load(VS + h * stride_sh + n, mask=inside, other=0.0)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT)
            m = m_new
        at = (h * S + s) * R + rows
        tl.store(M + at, m, mask=live)
        tl.store(L + at, l, mask=live)
        tl.store(ACC + at[:, None] * D + d[None, :], acc, mask=live[:, None])
        if MERGE:
            tl.debug_barrier()  # every thread's partial is written before the count is released
            tile = h * tl.num_programs(2) + rb
            if tl.atomic_add(LOCKS + tile, 1, sem="acq_rel") == S - 1:
                _merge_rows(M, L, ACC, POS, OUT, GATE, stride_gt, stride_gh, H, R, T, SPLIT, S, h, rows, live, d,
                            BLOCK_R, D, GATED)
                tl.atomic_xchg(LOCKS + tile, 0)

    @triton.jit
    def _merge_rows(M, L, ACC, POS, OUT, GATE, stride_gt, stride_gh, H, R, T, SPLIT, S, h, rows, live, d,
                    BLOCK_R: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr):
        """_splits' MERGE: the rows of one block merged over the live splits, whose partials the other programs
        wrote (read from L2: .cg)."""
        nlive = tl.load(POS + T - 1) // SPLIT + 1
        top = tl.full([BLOCK_R], NEG, tl.float32)
        for j in range(0, nlive):
            top = tl.maximum(top, tl.load(M + (h * S + j) * R + rows, mask=live, other=NEG, cache_modifier=".cg"))
        den = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for j in range(0, nlive):
            at = (h * S + j) * R + rows
            w = tl.exp(tl.load(M + at, mask=live, other=NEG, cache_modifier=".cg") - top)
            den += w * tl.load(L + at, mask=live, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * tl.load(ACC + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0,
                                        cache_modifier=".cg")
        t, head = rows % T, h * (R // T) + rows // T
        _store_gated(acc / tl.where(live, den, 1.0)[:, None], OUT, GATE,
                     ((t * H + head) * D)[:, None] + d[None, :],
                     (t * stride_gt + head * stride_gh)[:, None] + d[None, :], live[:, None], GATED)

    @triton.jit
    def _store_gated(o, OUT, GATE, at_out, at_gate, mask, GATED: tl.constexpr):
        """o (float32) written at OUT + at_out in OUT's dtype, times sigmoid(gate) where GATED (each rounded to
        that dtype, as the torch form's sigmoid and product round)."""
        dt = OUT.dtype.element_ty
        o = o.to(dt)
        if GATED:
            g = tl.load(GATE + at_gate, mask=mask, other=0.0).to(tl.float32)
            o = ((1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * o.to(tl.float32)).to(dt)
        tl.store(OUT + at_out, o, mask=mask)

    @triton.jit
    def _merge(M, L, ACC, POS, OUT, GATE, stride_gt, stride_gh, H, R, T, SPLIT, S, BLOCK_S: tl.constexpr,
               D: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False):
        """One program per (kv head, query row): the splits' running maxima, sums and outputs merged into the
        row's attention output, in q's dtype, times sigmoid(gate) where GATED (each rounded to that dtype, as
        the torch form's sigmoid and product round), written at [token, query head] (row (g, t) of kv head h
        is query head h * R / T + g): the layout o_proj reads. Only the splits up to the last query's position
        hold keys; those past it are not read."""
        after_previous(PDL)
        at = tl.program_id(0)  # = h * R + row
        h, row = at // R, at % R
        t, head = row % T, (at // R) * (R // T) + row // T
        live = tl.load(POS + T - 1) // SPLIT + 1
        offs = tl.arange(0, BLOCK_S)
        top = tl.full([BLOCK_S], NEG, tl.float32)
        for s0 in range(0, live, BLOCK_S):
            s = s0 + offs
            top = tl.maximum(top, tl.load(M + (h * S + s) * R + row, mask=s < live, other=NEG))
        top_all = tl.max(top, 0)
        d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        den = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, live, BLOCK_S):
            s = s0 + offs
            inside = s < live
            w = tl.where(inside, tl.exp(tl.load(M + (h * S + s) * R + row, mask=inside, other=NEG) - top_all), 0.0)
            den += w * tl.load(L + (h * S + s) * R + row, mask=inside, other=0.0)
            part = tl.load(ACC + ((h * S + s[:, None]) * R + row) * D + d[None, :], mask=inside[:, None], other=0.0)
            acc += tl.sum(part * w[:, None], 0)
        _store_gated(acc / tl.sum(den, 0), OUT, GATE, (t * H + head) * D + d, t * stride_gt + head * stride_gh + d,
                     d < D, GATED)


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot serve this trunk, or None when it can."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return "CUDA only"
    if dtype == torch.float32:
        return "float32: the exact reference path"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two"
    return None


SPLITS = 512  # about this many splits over a long cache, per kv head (attn_splits.py: the fastest on the H200)
STAGES = 3
MERGE_SPLITS = 32  # splits a merge step reads at once
# up to this many splits (caches up to 8,192 positions) the last split program to finish merges its row block's
# splits itself: one launch a call; over longer caches the merge kernel spreads the merge over a program a row
MERGE_IN_LAST = 32


def plan(rows: int, n: int, head_dim: int) -> tuple[int, int, int]:
    """(rows per program, keys per loop step, keys per split) for `rows` query rows over a capacity of n: about
    SPLITS splits over a long cache, so that 4 kv heads still fill the GPU."""
    block_r = max(16, min(32, triton.next_power_of_2(rows)))
    block_n = 32 if head_dim >= 256 else 64
    split = max(4 * block_n, triton.next_power_of_2(-(-n // SPLITS)))
    return block_r, block_n, split


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              scale: float, key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
              gate: torch.Tensor | None = None) -> torch.Tensor:
    """q [1, H, T, D] over keys / values [1, Hkv, N, D] (the whole capacity); query t sees keys 0..positions[t]
    (positions [T], on the device, increasing). Returns [1, T, H, D] in q's dtype (o_proj's layout: no copy
    before it), times sigmoid(gate) where gate [1, T, H, D] (any token and head strides) is given: the gated
    attention's output gate, two launches fewer. An fp8 cache: keys / values are its e4m3 codes, key_scales /
    value_scales [1, Hkv, N] their scales."""
    _, H, T, D = q.shape
    hkv, n = keys.shape[1], keys.shape[2]
    rows = (H // hkv) * T
    block_r, block_n, split = plan(rows, n, D)
    splits = -(-n // split)
    if q.stride(-1) != 1:
        q = q.contiguous()
    m = torch.empty(hkv, splits, rows, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(hkv, splits, rows, D, device=q.device, dtype=torch.float32)
    out = torch.empty(1, T, H, D, device=q.device, dtype=q.dtype)
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    fp8, gated = key_scales is not None, gate is not None
    gating = (gate if gated else out, gate.stride(1) if gated else 0, gate.stride(2) if gated else 0)
    merge_in_last = splits <= MERGE_IN_LAST
    _splits[(hkv, splits, triton.cdiv(rows, block_r))](
        q, keys, values, key_scales if fp8 else m, value_scales if fp8 else m, positions, m, l, acc, rows, T,
        split, splits, q.stride(1), q.stride(2), keys.stride(1), key_scales.stride(1) if fp8 else 0, scale,
        counters(q.device) if merge_in_last else m, out, *gating, H, BLOCK_R=block_r, BLOCK_N=block_n, D=D,
        FP8=fp8, MERGE=merge_in_last, GATED=gated, DOT="ieee" if q.dtype == torch.float32 else None, num_warps=4,
        num_stages=STAGES, **pdl(q))
    if not merge_in_last:  # (splits past the filled length are skipped: theirs would weigh exp(NEG - max) = 0)
        _merge[(hkv * rows,)](m, l, acc, positions, out, *gating, H, rows, T, split, splits, BLOCK_S=MERGE_SPLITS,
                              D=D, GATED=gated, num_warps=1 if D <= 64 else 2, **pdl(q))
    return out


@torch.library.custom_op("mtpchat::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                        scale: float, key_scales: torch.Tensor | None = None,
                        value_scales: torch.Tensor | None = None, gate: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The compile boundary (torch.compile traces around it; CUDA graphs capture the launch)."""
    return attention(q, keys, values, positions, scale, key_scales, value_scales, gate)


@decode_attention_op.register_fake
def _(q, keys, values, positions, scale, key_scales=None, value_scales=None, gate=None):
    _, H, T, D = q.shape
    return q.new_empty(1, T, H, D)


def self_check(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               fp8: bool = False) -> float:
    """Relative error against masked_decode_attention on random inputs: a verify width at an offset inside a
    capacity that is mostly empty (the case the kernel exists for), with and without the output gate (a strided
    view, as q_proj's output gives it). fp8: over an fp8 cache's codes and scales, against the masked form over
    their dequantized values."""
    from .cache import dequantize_kv, quantize_kv
    from .kernels import relative_error
    from .model import future_of, masked_decode_attention

    g = torch.Generator(device=device).manual_seed(0)
    T, n = 4, 1024
    q = torch.randn(1, heads, T, head_dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, kv_heads, n, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    positions = torch.arange(300, 300 + T, device=device)
    gate = torch.randn(1, T, heads, 2 * head_dim, device=device, dtype=dtype, generator=g)[..., head_dim:]
    future = future_of(positions, n)
    scale = head_dim ** -0.5
    ks = vs = None
    if fp8:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
    ref = masked_decode_attention(q, dequantize_kv((k, ks), dtype) if fp8 else k,
                                  dequantize_kv((v, vs), dtype) if fp8 else v, future, scale).transpose(1, 2)
    return max(relative_error(attention(q, k, v, positions, scale, ks, vs), ref),
               relative_error(attention(q, k, v, positions, scale, ks, vs, gate), torch.sigmoid(gate) * ref))


def timed_against_masked(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                         capacity: int = 2048, filled: int = 300) -> tuple[float, float]:
    """(this kernel's, the masked form's) GPU ms for a decode and a verify call together, replayed inside CUDA
    graphs, over a short cache: `capacity` positions, `filled` of them in use. The masked form reads the whole
    capacity, this kernel the filled length, so where it wins here it wins over every longer cache too. (On the
    27B shape the masked form won below about 37k positions; on a small model, whose calls are mostly their
    launches, two launches against eleven with the output gate.)"""
    from .model import future_of, masked_decode_attention
    from .splitk import graph_ms

    g = torch.Generator(device=device).manual_seed(0)
    k, v = (torch.randn(1, kv_heads, capacity, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    scale, kernel, masked = head_dim ** -0.5, 0.0, 0.0
    for T in (1, 4):
        qg = torch.randn(1, T, heads, 2 * head_dim, device=device, dtype=dtype, generator=g)
        q, gate = qg[..., :head_dim].transpose(1, 2), qg[..., head_dim:]
        positions = torch.arange(filled, filled + T, device=device)

        def the_masked():  # (as model.attention builds its mask: inside the graph, from the positions; and gates)
            return torch.sigmoid(gate) * masked_decode_attention(q, k, v, future_of(positions, capacity),
                                                                 scale).transpose(1, 2)

        kernel += graph_ms(lambda: attention(q, k, v, positions, scale, gate=gate))
        masked += graph_ms(the_masked)
    return kernel, masked

