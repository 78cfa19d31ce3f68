"""The routed experts of a 4-bit MoE (int4.Int4Experts) at decode / verify widths as two Triton GEMV kernels (W4A16),
for CUDA: moe_triton.py's two kernels with the weights read packed and dequantized in registers.

moe_triton.py's form, for the same reasons (read each pair's expert where it lies: no sort, no gather, no
dequantized copy; deterministic; a token's output does not depend on the batch, since every program computes one
pair or one token with the same code whatever the width, which only sizes the grid):

  1. gate_up: one program per (pair, BLOCK_N gate columns and the same up columns): K-blocks of BLOCK_K rows
     of H, packed words [BLOCK_K / 8, BLOCK_N] (int4.py's layout: packed along K, columns contiguous: coalesced),
     float32 element-wise accumulation, act = silu(gate) * up into a float32 buffer [N * k, I];
  2. down: one program per (token, BLOCK_N output columns): the token's k pairs in routing order, sum of
     weight * (down[e] @ act), written once (no atomics).

A K-block lies inside one group (int4_triton.block_k: 16..128 rows dividing the group size), so one zero and one
scale per column serve it (int4_triton._packed_block reads them). Nibble j of every word is input row 8i + j of
the block: it is OR-ed into the mantissa of the float32 2^23 (the float's value is 2^23 + q: no conversion
instruction), 2^23 + zero is subtracted and the scale multiplies; both exact in float32 (q - zero is a small
integer, the scale a float16 / bfloat16 one), so the weight is the one Int4Experts.dense computes in float32,
before any rounding to 16 bits. One row a pair: no tensor-core dot has 16 rows to fill, so CUDA cores.

Act-order experts (rows sorted by group per expert and projection, int4.Int4Experts.*_perm: sorted row i is input
row perm[i]) read the activation's rows through the permutation (gate's and up's their own), as int4_triton
permutes the input columns, here inside the kernel, per pair.

The shared expert is not one of the pairs (moe_triton's inline_shared: the releases keep it 16-bit); moe_triton
runs it beside. The kernels sit behind the custom op mtpchat::int4_moe_experts (torch.compile traces through,
CUDA graphs capture them), autotuned per shape on the first call (model.moe_check makes it at
load with one row, then holds the path to moe_rowwise's exactly dequantized experts before choosing it).
"""

from __future__ import annotations

import torch

from .int4_triton import block_k, blockable
from .moe_triton import _configs, buffers, route, triton

if triton is not None:
    import triton.language as tl

    from .int4_triton import _packed_block  # (a Triton function: CPU-only installs have none)

# (BLOCK_N columns, warps); the first is the interpreter's. Columns are int32 words: 32 of them, 128 contiguous
# bytes a packed row. Not timed on a GPU yet: the autotuner picks among them at the first call.
GATE_UP_CONFIGS = [(32, 4), (64, 4), (16, 4), (128, 4), (64, 8), (16, 2)]
DOWN_CONFIGS = [(32, 4), (16, 4), (64, 4), (16, 2), (8, 2), (128, 8)]


def unreadable(experts) -> str | None:
    """Why the kernels cannot read these 4-bit experts (moe_triton.unreadable's answer for them), or None."""
    if not blockable(zip(experts.group_sizes, (experts.hidden_dim, experts.intermediate_dim))):
        return f"triton: 4-bit experts' group sizes {experts.group_sizes} have no 16..128 power-of-two K-block"
    return None


if triton is not None:

    @triton.jit
    def _weights(packed, j: tl.constexpr, zero_base, scale):
        """Nibble j of every word [BLOCK_K / 8, BLOCK_N] dequantized in float32, exactly: (2^23 + q) - (2^23 +
        zero), times the scale."""
        q = (((packed >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)  # 0x4B000000: 2^23
        return (q - zero_base[None, :]) * scale[None, :]

    @triton.autotune(_configs(GATE_UP_CONFIGS, ("BLOCK_N",)), key=["H", "I", "K", "GROUP", "BLOCK_K", "PERM"])
    @triton.jit
    def _gate_up_kernel(x_ptr, idx_ptr, qw_ptr, z_ptr, s_ptr, perm_ptr, act_ptr, stride_xn, stride_qe, stride_qr,
                        stride_ze, stride_zr, stride_se, stride_sr, stride_pe, K: tl.constexpr, H: tl.constexpr,
                        I: tl.constexpr, GROUP: tl.constexpr, PERM: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        pair = tl.program_id(0)  # K pairs per token
        token = pair // K
        e = tl.load(idx_ptr + pair)  # int64: e * stride_qe overflows int32 for large expert stacks
        qw, z, s = qw_ptr + e * stride_qe, z_ptr + e * stride_ze, s_ptr + e * stride_se
        gate_perm = perm_ptr + e * stride_pe  # PERM: the gate's sorted rows' sources, then the up's
        up_perm = gate_perm + H
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate columns; the up's are I further
        n_ok = n < I
        i = tl.arange(0, BLOCK_K // 8)
        x_row = x_ptr + token * stride_xn
        acc_gate = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            pg, zg, sg = _packed_block(qw, z, s, k0, n, n_ok, H, GROUP, stride_qr, stride_zr, stride_sr, BLOCK_K)
            pu, zu, su = _packed_block(qw + I, z + I, s + I, k0, n, n_ok, H, GROUP, stride_qr, stride_zr,
                                       stride_sr, BLOCK_K)
            zg, zu = zg + 8388608.0, zu + 8388608.0  # 2^23 + zero
            for j in tl.static_range(8):
                ks = k0 + i * 8 + j  # the sorted rows of nibble j
                k_ok = ks < H
                if PERM:
                    xg = tl.load(x_row + tl.load(gate_perm + ks, mask=k_ok, other=0), mask=k_ok, other=0.0)
                    xu = tl.load(x_row + tl.load(up_perm + ks, mask=k_ok, other=0), mask=k_ok, other=0.0)
                else:
                    xg = tl.load(x_row + ks, mask=k_ok, other=0.0)
                    xu = xg
                acc_gate += _weights(pg, j, zg, sg) * xg.to(tl.float32)[:, None]
                acc_up += _weights(pu, j, zu, su) * xu.to(tl.float32)[:, None]
        gate, up = tl.sum(acc_gate, axis=0), tl.sum(acc_up, axis=0)
        tl.store(act_ptr + pair * I + n, gate * tl.sigmoid(gate) * up, mask=n_ok)

    @triton.autotune(_configs(DOWN_CONFIGS, ("BLOCK_N",)), key=["H", "I", "K", "GROUP", "BLOCK_K", "PERM"])
    @triton.jit
    def _down_kernel(act_ptr, idx_ptr, weights_ptr, qw_ptr, z_ptr, s_ptr, perm_ptr, out_ptr, stride_qe, stride_qr,
                     stride_ze, stride_zr, stride_se, stride_sr, stride_pe, stride_on, K: tl.constexpr,
                     H: tl.constexpr, I: tl.constexpr, GROUP: tl.constexpr, PERM: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        token = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (of H)
        n_ok = n < H
        i = tl.arange(0, BLOCK_K // 8)
        acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(K):  # routing order, whatever the batch: the sum rounds the same way
            pair = token * K + j
            e = tl.load(idx_ptr + pair)
            weight = tl.load(weights_ptr + pair)
            qw, z, s = qw_ptr + e * stride_qe, z_ptr + e * stride_ze, s_ptr + e * stride_se
            perm = perm_ptr + e * stride_pe
            a_row = act_ptr + pair * I
            for k0 in range(0, I, BLOCK_K):
                p, zz, ss = _packed_block(qw, z, s, k0, n, n_ok, I, GROUP, stride_qr, stride_zr, stride_sr, BLOCK_K)
                zz = zz + 8388608.0
                for b in tl.static_range(8):
                    ks = k0 + i * 8 + b
                    k_ok = ks < I
                    if PERM:
                        a = tl.load(a_row + tl.load(perm + ks, mask=k_ok, other=0), mask=k_ok, other=0.0)
                    else:
                        a = tl.load(a_row + ks, mask=k_ok, other=0.0)
                    acc += _weights(p, b, zz, ss) * (a * weight)[:, None]
        out = tl.sum(acc, axis=0)
        tl.store(out_ptr + token * stride_on + n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def launch(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: tuple, down: tuple,
           groups: tuple[int, int], perms: tuple = (None, None)) -> torch.Tensor:
    """The routed experts' weighted sum [N, H] for rows h [N, H], expert ids idx [N, k] (all routed: >= 0),
    routing weights [N, k]. gate_up, down: Int4Experts' (qweight, zeros, scales) of each, [E, H/8, 2I] / [E, G_H,
    2I] and [E, I/8, H] / [E, G_I, H], columns contiguous; groups: their group sizes (-1: one group); perms:
    gate_up_perm [E, 2, H] and down_perm [E, I] (int32), or None. h in any float dtype (float32 in the CPU tests;
    the engine installs 16-bit only), all arithmetic float32, the output in h's dtype."""
    N, H = h.shape
    K = idx.shape[1]
    (gq, gz, gs), (dq, dz, ds) = gate_up, down
    I = dq.shape[1] * 8
    assert gq.shape[1:] == (H // 8, 2 * I) and dq.shape[2] == H, (gq.shape, dq.shape)
    assert all(t.stride(-1) == 1 for t in (gq, gz, gs, dq, dz, ds)), "packed columns must be contiguous"
    bks = [block_k(g, k) for g, k in zip(groups, (H, I))]
    if None in bks:
        raise ValueError(f"no 16..128 power-of-two K-block for 4-bit experts' group sizes {groups}")
    gate_up_group, down_group = (k if g == -1 else g for g, k in zip(groups, (H, I)))
    gp, dp = (p.contiguous() if p is not None else None for p in perms)
    h, idx, weights, act, out = buffers(h, idx, weights, I)
    if N == 0:
        return out
    _gate_up_kernel[lambda meta: (N * K, triton.cdiv(I, meta["BLOCK_N"]))](
        h, idx, gq, gz, gs, gq if gp is None else gp, act, h.stride(0), gq.stride(0), gq.stride(1), gz.stride(0),
        gz.stride(1), gs.stride(0), gs.stride(1), 0 if gp is None else gp.stride(0), K=K, H=H, I=I,
        GROUP=gate_up_group, PERM=gp is not None, BLOCK_K=bks[0])
    _down_kernel[lambda meta: (N, triton.cdiv(H, meta["BLOCK_N"]))](
        act, idx, weights, dq, dz, ds, dq if dp is None else dp, out, dq.stride(0), dq.stride(1), dz.stride(0),
        dz.stride(1), ds.stride(0), ds.stride(1), 0 if dp is None else dp.stride(0), out.stride(0), K=K, H=H, I=I,
        GROUP=down_group, PERM=dp is not None, BLOCK_K=bks[1])
    return out


@torch.library.custom_op("mtpchat::int4_moe_experts", mutates_args=())
def int4_moe_experts(h: torch.Tensor, logits: torch.Tensor, gate_up_qweight: torch.Tensor,
                     gate_up_zeros: torch.Tensor, gate_up_scales: torch.Tensor, down_qweight: torch.Tensor,
                     down_zeros: torch.Tensor, down_scales: torch.Tensor, k: int, norm: bool, gate_up_group: int,
                     down_group: int, gate_up_perm: torch.Tensor | None = None,
                     down_perm: torch.Tensor | None = None) -> torch.Tensor:
    """The routed part of a 4-bit MoE for rows h [N, H] with router logits [N, E]: moe_triton's routing kernel,
    then the two kernels above (launch's arguments, as Int4Experts holds them)."""
    weights, idx = route(logits, gate_up_qweight.shape[0], k, norm)
    return launch(h, idx, weights, (gate_up_qweight, gate_up_zeros, gate_up_scales),
                  (down_qweight, down_zeros, down_scales), (gate_up_group, down_group), (gate_up_perm, down_perm))


@int4_moe_experts.register_fake
def _(h, logits, gate_up_qweight, gate_up_zeros, gate_up_scales, down_qweight, down_zeros, down_scales, k, norm,
      gate_up_group, down_group, gate_up_perm=None, down_perm=None):
    return h.new_empty(h.shape)


def routed(h: torch.Tensor, logits: torch.Tensor, experts, k: int, norm: bool) -> torch.Tensor:
    """int4_moe_experts on an Int4Experts' tensors (moe_triton.moe_triton's 4-bit branch)."""
    ex = experts
    return int4_moe_experts(h, logits, ex.gate_up_qweight, ex.gate_up_zeros, ex.gate_up_scales, ex.down_qweight,
                            ex.down_zeros, ex.down_scales, k, norm, *ex.group_sizes, ex.gate_up_perm, ex.down_perm)
