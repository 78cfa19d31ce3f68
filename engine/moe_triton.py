"""The sparse-MoE MLP at decode / verify widths (1 to 8 rows) as two Triton GEMV kernels, for CUDA.

At these widths the routed experts cost what reading their weights costs (Qwen3-Next-80B: 10 experts of 6 MiB
each, per layer and token). moe_grouped sorts the (token, expert) pairs by expert to use torch._grouped_mm: about
eight small kernels of argsort / searchsorted / gathers around two grouped GEMMs that reach about half the
H200's bandwidth. Here each pair reads its expert's rows in place, where they lie, with no sort and no gather:

  1. gate_up: one program per (pair, block of intermediate rows): gate and up rows against the token's hidden
     row, float32 accumulation, act = silu(gate) * up into a small float32 buffer [N * k, I];
  2. down: one program per (token, block of output rows): the token's k pairs in routing order,
     sum of weight * (down[e] @ act), float32 accumulation, written once (no atomics).

Deterministic, and a token's routed output does not depend on which other tokens share the batch: every program
computes one pair or one token with the same code whatever N is (N only sizes the grid), so a verify pass
gives its rows what decoding them one at a time gives. Tokens that share an expert read its tiles from programs
launched side by side (the pair / token index is the grid's fastest axis), so the repeat mostly hits L2.

The kernels sit behind the custom op mtpchat::moe_experts, so torch.compile traces through (fullgraph) and CUDA
graphs capture them. Block sizes are fixed (no autotuning: nothing to run at capture time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fusion import dense_mlp

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, available() says no
    triton = None

# kernel 1: 16 intermediate rows (x2: gate and up) by 256 hidden columns a step. Rows of 512 contiguous bytes
# (bf16) coalesce, and at the 80B shape (I = 512) one token's 10 pairs make 320 programs: a few per SM of the
# H200's 132, enough loads in flight to stream the weights.
GATE_UP_BLOCK_I, GATE_UP_BLOCK_H = 16, 256
# kernel 2: 8 output rows by up to 512 intermediate columns (a whole expert row at the 80B shape). H = 2048 gives
# 256 programs for a single token; the loop over the k pairs is unrolled (k is a compile-time constant), so the
# loads of later pairs are issued before the earlier ones are summed.
DOWN_BLOCK_H, DOWN_BLOCK_I = 8, 512
NUM_WARPS = 4
SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"]) modules


def available() -> bool:
    """Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, idx_ptr, w_ptr, act_ptr, stride_xn, stride_we, stride_wr,
                        K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
        pair = tl.program_id(0)
        token = pair // K
        e = tl.load(idx_ptr + pair)  # int64: e * stride_we overflows int32 for large expert tensors
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        cols = tl.arange(0, BLOCK_H)
        gate_ptrs = w_ptr + e * stride_we + rows[:, None] * stride_wr + cols[None, :]
        up_ptrs = gate_ptrs + I * stride_wr  # the up rows follow the I gate rows
        # element-wise accumulation, one reduction at the end: no cross-thread reduction inside the loop
        acc_gate = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            col_ok = h0 + cols < H
            mask = (rows[:, None] < I) & col_ok[None, :]
            x = tl.load(x_ptr + token * stride_xn + h0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_gate += tl.load(gate_ptrs + h0, mask=mask, other=0.0).to(tl.float32) * x
            acc_up += tl.load(up_ptrs + h0, mask=mask, other=0.0).to(tl.float32) * x
        gate, up = tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)
        tl.store(act_ptr + pair * I + rows, gate * tl.sigmoid(gate) * up, mask=rows < I)

    @triton.jit
    def _down_kernel(act_ptr, idx_ptr, weights_ptr, w_ptr, out_ptr, stride_we, stride_wr, stride_on,
                     K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
        token = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_I)
        acc = tl.zeros((BLOCK_H, BLOCK_I), dtype=tl.float32)
        for j in tl.static_range(K):  # routing order, whatever the batch: the sum rounds the same way
            pair = token * K + j
            e = tl.load(idx_ptr + pair)
            weight = tl.load(weights_ptr + pair)
            ptrs = w_ptr + e * stride_we + rows[:, None] * stride_wr + cols[None, :]
            for i0 in tl.static_range(0, I, BLOCK_I):
                col_ok = i0 + cols < I
                mask = (rows[:, None] < H) & col_ok[None, :]
                a = tl.load(act_ptr + pair * I + i0 + cols, mask=col_ok, other=0.0) * weight
                acc += tl.load(ptrs + i0, mask=mask, other=0.0).to(tl.float32) * a[None, :]
        out = tl.sum(acc, axis=1)
        tl.store(out_ptr + token * stride_on + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)


    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, idx_ptr, stride_l, E: tl.constexpr, K: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
        # one program per row: float32 softmax over the E router logits, then K rounds of argmax, each round
        # masking out the expert it took; what torch.softmax + torch.topk (a sort) + the renormalisation do in
        # four kernels
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < E, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(cols < E, p / tl.sum(p, 0), -1.0)
        slots = tl.arange(0, BLOCK_K)
        weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.argmax(p, 0)
            weights = tl.where(slots == j, tl.max(p, 0), weights)
            ids = tl.where(slots == j, best.to(tl.int64), ids)
            p = tl.where(cols == best, -1.0, p)
        if NORM:
            weights = weights / tl.sum(weights, 0)
        tl.store(weights_ptr + row * K + slots, weights, mask=slots < K)
        tl.store(idx_ptr + row * K + slots, ids, mask=slots < K)


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits [N, E]: (weights [N, k] float32, expert ids [N, k] int64), as
    engine.model.route computes them, in one kernel."""
    N, E = logits.shape
    weights = torch.empty(N, k, device=logits.device, dtype=torch.float32)
    idx = torch.empty(N, k, device=logits.device, dtype=torch.int64)
    if N:
        _route_kernel[(N,)](logits, weights, idx, logits.stride(0), E=E, K=k, BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(k), NORM=norm, num_warps=4)
    return weights, idx


def launch(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> torch.Tensor:
    """Routed experts' weighted sum [N, H] for rows h [N, H], expert ids idx [N, k], routing weights [N, k].
    gate_up [E, 2I, H], down [E, H, I]: rows contiguous (last stride 1), any other strides."""
    N, H = h.shape
    K = idx.shape[1]
    I = down.shape[2]
    assert gate_up.shape[1:] == (2 * I, H) and down.shape[1] == H, (gate_up.shape, down.shape)
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1, "expert rows must be contiguous"
    h, idx, weights = h.contiguous(), idx.contiguous(), weights.float().contiguous()
    act = torch.empty(N * K, I, device=h.device, dtype=torch.float32)
    out = torch.empty(N, H, device=h.device, dtype=h.dtype)
    if N == 0:
        return out
    block_i, block_h = min(GATE_UP_BLOCK_I, triton.next_power_of_2(I)), min(GATE_UP_BLOCK_H, triton.next_power_of_2(H))
    _gate_up_kernel[(N * K, triton.cdiv(I, block_i))](
        h, idx, gate_up, act, h.stride(0), gate_up.stride(0), gate_up.stride(1),
        K=K, H=H, I=I, BLOCK_I=block_i, BLOCK_H=block_h, num_warps=NUM_WARPS,
    )
    block_h, block_i = min(DOWN_BLOCK_H, triton.next_power_of_2(H)), min(DOWN_BLOCK_I, triton.next_power_of_2(I))
    _down_kernel[(N, triton.cdiv(H, block_h))](
        act, idx, weights, down, out, down.stride(0), down.stride(1), out.stride(0),
        K=K, H=H, I=I, BLOCK_H=block_h, BLOCK_I=block_i, num_warps=NUM_WARPS,
    )
    return out


@torch.library.custom_op("mtpchat::moe_experts", mutates_args=())
def moe_experts(h: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int,
                norm: bool) -> torch.Tensor:
    """The routed part of the MoE for rows h [N, H] with router logits [N, E]: routing and the experts."""
    weights, idx = route(logits, k, norm)
    return launch(h, idx, weights, gate_up, down)


@moe_experts.register_fake
def _(h, logits, gate_up, down, k, norm):
    return h.new_empty(h.shape)


def moe_triton(block, x: torch.Tensor) -> torch.Tensor:
    """What moe_rowwise(block, x) computes, x [1, N, H], through the three kernels above plus the router's and
    the shared expert's matmuls."""
    experts, router = block.experts, block.gate
    if type(experts.act_fn).__name__ not in SILU:  # the kernel's activation is SiLU (Qwen3-Next / 3.5)
        raise ValueError(f"moe_triton supports SiLU experts only, not {type(experts.act_fn).__name__}")
    h = x.reshape(-1, x.shape[-1])
    y = moe_experts(h, F.linear(h, router.weight), experts.gate_up_proj, experts.down_proj, router.top_k,
                    bool(getattr(router, "norm_topk_prob", True)))
    shared = dense_mlp(block.shared_expert, h) * torch.sigmoid(block.shared_expert_gate(h))
    return (y + shared).view(x.shape)
