"""The sparse-MoE MLP at decode / verify widths (1 to 8 rows) as two Triton GEMV kernels, for CUDA.

At these widths the routed experts cost what reading their weights costs (Qwen3-Next-80B: 10 experts of 6 MiB
each, per layer and token). moe_grouped sorts the (token, expert) pairs by expert to use torch._grouped_mm: about
eight small kernels of argsort / searchsorted / gathers around two grouped GEMMs that reach about half the
H200's bandwidth. Here each pair reads its expert's rows in place, where they lie, with no sort and no gather:

  1. gate_up: one program per (pair, block of intermediate rows): gate and up rows against the token's hidden
     row, float32 accumulation, act = silu(gate) * up into a small float32 buffer [N * k, I];
  2. down: one program per (token, block of output rows): the token's k pairs in routing order,
     sum of weight * (down[e] @ act), float32 accumulation, written once (no atomics).

When the router and the shared expert's sigmoid gate were fused into one matmul (fusion.py) and the shared
expert has the routed experts' shape, the shared expert runs in the same two kernels: it is one more pair per
token (expert id -1: its own weight pointers) whose weight is sigmoid(gate logit), computed by the routing
kernel. That removes the shared expert's two matmuls, its activation, the gate's dot product and the sum: six
launches of tiny kernels per layer (Qwen3-Next-80B: 12 of 48 layers measured 0.2 ms of 1.4 per step in them).

Deterministic, and a token's routed output does not depend on which other tokens share the batch: every program
computes one pair or one token with the same code whatever N is (N only sizes the grid), so a verify pass
gives its rows what decoding them one at a time gives. Tokens that share an expert read its tiles from programs
launched side by side (the pair / token index is the grid's fastest axis), so the repeat mostly hits L2.

FP8 experts (fp8.FP8Experts: block-128 e4m3 with float32 scales, Qwen's FP8 releases) run in the same two kernels
with SCALED set: each program loads its FP8 tile (half the bytes of bf16), converts it to float32 in registers
and multiplies by its 128x128 block's scale. A tile's rows always lie in one 128-row block (every BLOCK_I and
BLOCK_H below divides 128), so the scale is one value per 128 columns: it multiplies the activation's columns
(x * s, a vector), not each weight. The shared expert runs inline when its weights have the routed experts'
dtype: FP8 with its scales in an FP8 checkpoint, bf16 in a bf16 one.

The kernels sit behind the custom op mtpchat::moe_experts, so torch.compile traces through (fullgraph) and CUDA
graphs capture them. Block sizes (and the down kernel's form) are timed per shape (H, I, k, dtype) on the first
call, which the engine makes at load (model.moe_check), long before any capture: each configuration at one row
and at four, the two times summed (_tune). Timed on one width alone the choice favoured it: on 4 rows the H200
picked a down configuration 50% slower at one; on 1 row an FP8 gate / up 29% slower at four. The width is not
in the key, so every width runs the same configuration and rows stay batch-invariant.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .fp8 import FP8Experts
from .fusion import dense_mlp
from .int4 import Int4Experts
from .splitk import fastest, output, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, available() says no
    triton = None
else:
    from .splitk import after_previous, store_tile

# kernel 1: BLOCK_I intermediate rows (x2: gate and up) by BLOCK_H hidden columns a step, warps; kernel 2, its form
# ("rows": BLOCK_H output rows of a token's every pair a program; "split": of one pair, the pairs' partials summed
# by the last to finish, in routing order), BLOCK_H output rows by up to BLOCK_I intermediate columns, warps.
# The H200 at the 80B shape, per call inside a CUDA graph at 1 / 4 rows (packaging/bench/moe_configs_h200.json):
# bf16 gate / up 9.6 / 40.5 us at (2, 1024, 4) against 12.8 / 48.0 at (16, 256, 4), the earlier fixed choice;
# FP8 down 14.6 us at 4 rows split (16, 512, 2) against 20.1 for the best "rows" form (the split form's 11 x 16
# programs a token keep more loads in flight than 128 programs each walking 11 pairs).
GATE_UP_CONFIGS = [(16, 256, 4), (2, 1024, 4), (4, 2048, 4), (8, 2048, 4), (2, 1024, 8), (8, 1024, 8)]
DOWN_CONFIGS = [("rows", 8, 512, 4), ("rows", 8, 128, 8), ("rows", 16, 128, 8), ("rows", 16, 256, 8),
                ("rows", 4, 512, 4), ("split", 16, 512, 2), ("split", 32, 256, 4), ("split", 32, 128, 2)]
# FP8 experts: a tile's rows must lie in one 128-row block of scales (kernel 1's BLOCK_I, kernel 2's BLOCK_H)
assert all(128 % c[0] == 0 for c in GATE_UP_CONFIGS) and all(128 % c[1] == 0 for c in DOWN_CONFIGS)
TUNE_ROWS = (1, 4)  # a configuration's cost: its time at decoding's one row plus at a depth-3 verify's four
# Triton's interpreter (CPU tests) cannot time configurations: the first of each, nothing timed
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"]) modules
_chosen: dict[tuple, tuple] = {}  # (H, I, K, scaled, dtype, device index) -> (gate / up, down configuration)


def available() -> bool:
    """Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


def _configs(sets, names):
    """Autotuning configurations from tuples of the block sizes `names`, then the warps."""
    sets = sets[:1] if INTERPRET else sets
    return [triton.Config(dict(zip(names, s[:-1])), num_warps=s[-1]) for s in sets]


if triton is not None:

    @triton.jit
    def _pair_expert(idx_ptr, pair, w_ptr, shared_ptr, s_ptr, shared_s_ptr, stride_we, stride_se):
        """(weights, block scales) of the expert a pair reads: a routed one's in the stacked tensors, or (id -1)
        the shared expert's own, whose rows are laid out like a routed expert's."""
        e = tl.load(idx_ptr + pair)  # int64: e * stride_we overflows int32 for large expert tensors
        if e >= 0:
            base = w_ptr + e * stride_we
            scales = s_ptr + e * stride_se
        else:
            base = shared_ptr
            scales = shared_s_ptr
        return base, scales

    @triton.jit
    def _add_down_pair(acc, act_ptr, pair, weight, base, scales, rows, cols, stride_wr, H: tl.constexpr,
                       I: tl.constexpr, SCALED: tl.constexpr, BLOCK_I: tl.constexpr):
        """acc [rows, BLOCK_I] plus one pair's down rows times its weighted activation, column by column (scales:
        the tile's block row of the pair's scales)."""
        for i0 in tl.static_range(0, I, BLOCK_I):
            col_ok = i0 + cols < I
            mask = (rows[:, None] < H) & col_ok[None, :]
            a = tl.load(act_ptr + pair * I + i0 + cols, mask=col_ok, other=0.0) * weight
            if SCALED:
                a = a * tl.load(scales + (i0 + cols) // 128, mask=col_ok, other=0.0)
            acc += tl.load(base + rows[:, None] * stride_wr + i0 + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32) * a[None, :]
        return acc

    @triton.jit
    def _gate_up_kernel(x_ptr, idx_ptr, w_ptr, shared_ptr, s_ptr, shared_s_ptr, act_ptr, stride_xn, stride_we,
                        stride_wr, stride_se, stride_sr, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                        SCALED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):
        after_previous(PDL)
        pair = tl.program_id(0)  # K pairs per token: its routed experts, then the shared expert if inline
        token = pair // K
        base, scales = _pair_expert(idx_ptr, pair, w_ptr, shared_ptr, s_ptr, shared_s_ptr, stride_we, stride_se)
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        cols = tl.arange(0, BLOCK_H)
        gate_ptrs = base + rows[:, None] * stride_wr + cols[None, :]
        up_ptrs = gate_ptrs + I * stride_wr  # the up rows follow the I gate rows
        # SCALED: this tile's block row of scales, the gate's, then the up's (their own ceil(I / 128) block rows)
        gate_scales = scales + (tl.program_id(1) * BLOCK_I // 128) * stride_sr
        up_scales = gate_scales + tl.cdiv(I, 128) * stride_sr
        # element-wise accumulation, one reduction at the end: no cross-thread reduction inside the loop
        acc_gate = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            col_ok = h0 + cols < H
            mask = (rows[:, None] < I) & col_ok[None, :]
            x = tl.load(x_ptr + token * stride_xn + h0 + cols, mask=col_ok, other=0.0).to(tl.float32)
            x_gate, x_up = x, x
            if SCALED:  # the block scale of each column, on the activation: one multiply per column
                x_gate = x * tl.load(gate_scales + (h0 + cols) // 128, mask=col_ok, other=0.0)
                x_up = x * tl.load(up_scales + (h0 + cols) // 128, mask=col_ok, other=0.0)
            acc_gate += tl.load(gate_ptrs + h0, mask=mask, other=0.0).to(tl.float32) * x_gate[None, :]
            acc_up += tl.load(up_ptrs + h0, mask=mask, other=0.0).to(tl.float32) * x_up[None, :]
        gate, up = tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)
        tl.store(act_ptr + pair * I + rows, gate * tl.sigmoid(gate) * up, mask=rows < I)

    @triton.jit
    def _down_kernel(act_ptr, idx_ptr, weights_ptr, w_ptr, shared_ptr, s_ptr, shared_s_ptr, out_ptr, stride_we,
                     stride_wr, stride_se, stride_sr, stride_on, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                     SCALED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                     PDL: tl.constexpr = False):
        after_previous(PDL)
        token = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_I)
        acc = tl.zeros((BLOCK_H, BLOCK_I), dtype=tl.float32)
        for j in tl.static_range(K):  # routing order, whatever the batch: the sum rounds the same way
            pair = token * K + j
            base, scales = _pair_expert(idx_ptr, pair, w_ptr, shared_ptr, s_ptr, shared_s_ptr, stride_we, stride_se)
            scales += (tl.program_id(1) * BLOCK_H // 128) * stride_sr  # SCALED: this tile's block row
            acc = _add_down_pair(acc, act_ptr, pair, tl.load(weights_ptr + pair), base, scales, rows, cols,
                                 stride_wr, H, I, SCALED, BLOCK_I)
        out = tl.sum(acc, axis=1)
        tl.store(out_ptr + token * stride_on + rows, out.to(out_ptr.dtype.element_ty), mask=rows < H)

    @triton.jit
    def _down_split_kernel(act_ptr, idx_ptr, weights_ptr, w_ptr, shared_ptr, s_ptr, shared_s_ptr, out_ptr, part_ptr,
                           locks_ptr, n_tokens, stride_we, stride_wr, stride_se, stride_sr, K: tl.constexpr,
                           H: tl.constexpr, I: tl.constexpr, SCALED: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_I: tl.constexpr, PDL: tl.constexpr = False):
        after_previous(PDL)
        # grid (token's row block, pair): one pair's BLOCK_H output rows a program; splitk.store_tile has the last
        # pair to finish sum the K partials in routing order (a token's rows computed alike whatever N is)
        blocks: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
        tile = tl.program_id(0)
        token, block = tile // blocks, tile % blocks
        pair = token * K + tl.program_id(1)
        rows = block * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_I)
        base, scales = _pair_expert(idx_ptr, pair, w_ptr, shared_ptr, s_ptr, shared_s_ptr, stride_we, stride_se)
        scales += (block * BLOCK_H // 128) * stride_sr
        acc = _add_down_pair(tl.zeros((BLOCK_H, BLOCK_I), dtype=tl.float32), act_ptr, pair,
                             tl.load(weights_ptr + pair), base, scales, rows, cols, stride_wr, H, I, SCALED, BLOCK_I)
        token_row = tl.zeros((1, 1), dtype=tl.int32) + token
        store_tile(out_ptr, part_ptr, locks_ptr, tl.sum(acc, axis=1)[None, :], token_row, rows[None, :],
                   rows[None, :] < H, n_tokens, H, tile)

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, idx_ptr, stride_l, E: tl.constexpr, K: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr,
                      PDL: tl.constexpr = False):
        after_previous(PDL)
        # one program per row: float32 softmax over the E router logits, then K rounds of argmax, each round
        # masking out the expert it took; what torch.softmax + torch.topk (a sort) + the renormalisation do in
        # four kernels. SHARED: logit E is the shared expert's gate; its pair (id -1) follows the K routed ones
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
        KP: tl.constexpr = K + SHARED
        tl.store(weights_ptr + row * KP + slots, weights, mask=slots < K)
        tl.store(idx_ptr + row * KP + slots, ids, mask=slots < K)
        if SHARED:
            gate = tl.load(logits_ptr + row * stride_l + E).to(tl.float32)
            tl.store(weights_ptr + row * KP + K, tl.sigmoid(gate))
            tl.store(idx_ptr + row * KP + K, -1)


def route(logits: torch.Tensor, E: int, k: int, norm: bool, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits [N, E (+1: the shared expert's gate logit, with shared)]: (weights
    [N, k (+1)] float32, expert ids [N, k (+1)] int64), as engine.model.route computes them, in one kernel; the
    shared pair's weight is sigmoid(gate logit), its id -1."""
    N = logits.shape[0]
    kp = k + int(shared)
    weights = torch.empty(N, kp, device=logits.device, dtype=torch.float32)
    idx = torch.empty(N, kp, device=logits.device, dtype=torch.int64)
    if N:
        # one warp: its reductions are shuffles, no shared-memory round trips (80B shape: 3.5 us against 5.0 at 4)
        _route_kernel[(N,)](logits, weights, idx, logits.stride(0), E=E, K=k, BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(k), NORM=norm, SHARED=shared, num_warps=1, **pdl(logits))
    return weights, idx


def buffers(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, I: int) -> tuple[torch.Tensor, ...]:
    """The two-kernel form's operands and buffers for rows h [N, H], ids / weights [N, k] and intermediate I:
    h, idx, weights (float32) contiguous as the kernels index them, act [N * k, I] float32 (silu(gate) * up of
    each pair, between the kernels) and out [N, H] in h's dtype."""
    N, K = idx.shape
    act = torch.empty(N * K, I, device=h.device, dtype=torch.float32)
    out = torch.empty(N, h.shape[1], device=h.device, dtype=h.dtype)
    return h.contiguous(), idx.contiguous(), weights.float().contiguous(), act, out


def launch(h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor, shared_gate_up: torch.Tensor | None = None,
           shared_down: torch.Tensor | None = None, scales: tuple | None = None) -> torch.Tensor:
    """Experts' weighted sum [N, H] for rows h [N, H], expert ids idx [N, K] (-1: the shared expert), routing
    weights [N, K]. gate_up [E, 2I, H], down [E, H, I]: rows contiguous (last stride 1), any other strides; the
    shared expert's [2I, H] and [H, I] with the same row strides. scales: for FP8 weights, their float32 block
    scales (gate_up's [E, 2 * ceil(I/128), ceil(H/128)] as fp8.FP8Experts holds them, down's
    [E, ceil(H/128), ceil(I/128)], then the shared expert's two, or None without it), rows contiguous."""
    N, H = h.shape
    K = idx.shape[1]
    I = down.shape[2]
    assert gate_up.shape[1:] == (2 * I, H) and down.shape[1] == H, (gate_up.shape, down.shape)
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1, "expert rows must be contiguous"
    if shared_gate_up is None:  # no shared pair: any valid pointer (never read)
        shared_gate_up, shared_down = gate_up, down
    else:
        assert shared_gate_up.shape == gate_up.shape[1:] and shared_down.shape == down.shape[1:]
        assert shared_gate_up.stride() == gate_up.stride()[1:] and shared_down.stride() == down.stride()[1:]
        assert shared_gate_up.dtype == gate_up.dtype and shared_down.dtype == down.dtype
    scaled = scales is not None
    if scaled:
        gs, ds, sgs, sds = scales
        rows, cols = -(-I // 128), -(-H // 128)
        assert gs.shape[1:] == (2 * rows, cols) and ds.shape[1:] == (cols, rows), (gs.shape, ds.shape)
        assert gs.stride(-1) == 1 and ds.stride(-1) == 1, "scale rows must be contiguous"
        if shared_gate_up is gate_up:  # no shared pair
            sgs, sds = gs, ds
        else:
            assert sgs.stride() == gs.stride()[1:] and sds.stride() == ds.stride()[1:], "shared scales' strides"
    else:  # bf16 / float32 weights: any valid pointers (never read)
        gs = sgs = gate_up
        ds = sds = down
    weights_args = (gate_up, down, shared_gate_up, shared_down, gs, ds, sgs, sds)
    key = (H, I, K, scaled, gate_up.dtype, h.device.index)
    if key not in _chosen:
        _chosen[key] = _tune(H, I, K, weights_args, h) if _tunable(h) else (GATE_UP_CONFIGS[0], DOWN_CONFIGS[0])
    return _run(h, idx, weights, weights_args, *_chosen[key])


def _run(h, idx, weights, weights_args, gate_up_config, down_config) -> torch.Tensor:
    """The two kernels at one configuration each (launch's operands)."""
    gate_up, down, shared_gate_up, shared_down, gs, ds, sgs, sds = weights_args
    (N, H), K, I = h.shape, idx.shape[1], down.shape[2]
    scaled = gs is not gate_up
    h, idx, weights, act, out = buffers(h, idx, weights, I)
    if N == 0:
        return out
    block_i, block_h, warps = gate_up_config
    _gate_up_kernel[(N * K, triton.cdiv(I, block_i))](
        h, idx, gate_up, shared_gate_up, gs, sgs, act, h.stride(0), gate_up.stride(0), gate_up.stride(1),
        gs.stride(0) if scaled else 0, gs.stride(1) if scaled else 0, K=K, H=H, I=I, SCALED=scaled,
        BLOCK_I=block_i, BLOCK_H=block_h, num_warps=warps, **pdl(h))
    form, block_h, block_i, warps = down_config
    scale_strides = (ds.stride(0), ds.stride(1)) if scaled else (0, 0)
    if form == "rows":
        _down_kernel[(N, triton.cdiv(H, block_h))](
            act, idx, weights, down, shared_down, ds, sds, out, down.stride(0), down.stride(1), *scale_strides,
            out.stride(0), K=K, H=H, I=I, SCALED=scaled, BLOCK_H=block_h, BLOCK_I=block_i, num_warps=warps, **pdl(h))
        return out
    tiles = N * triton.cdiv(H, block_h)
    out, part, locks = output(N, H, K, tiles, h)
    _down_split_kernel[(tiles, K)](
        act, idx, weights, down, shared_down, ds, sds, out, part, locks, N, down.stride(0), down.stride(1),
        *scale_strides, K=K, H=H, I=I, SCALED=scaled, BLOCK_H=block_h, BLOCK_I=block_i, num_warps=warps, **pdl(h))
    return out


def _tunable(h: torch.Tensor) -> bool:
    return h.is_cuda and not INTERPRET and not torch.cuda.is_current_stream_capturing()


def _tune(H: int, I: int, K: int, weights_args: tuple, like: torch.Tensor) -> tuple:
    """The fastest gate / up and down configurations for these experts: each timed inside a CUDA graph at
    TUNE_ROWS rows of random routing (distinct experts a row, as random and real routers mostly give), summed.
    One configuration serves every width, so a verify pass's rows round as decoding's do (batch invariance); the
    sum weighs decoding's one row and verify's several alike (the H200's 80B FP8 gate / up: the one-row winner
    was 24% slower at four rows). Before any capture: model.moe_check makes the first call at load."""
    E = weights_args[0].shape[0]
    gen = torch.Generator(device=like.device).manual_seed(0)
    inputs = []
    for n in TUNE_ROWS:
        h = torch.randn(n, H, generator=gen, device=like.device).to(like.dtype)
        idx = torch.stack([torch.randperm(max(E, K), generator=gen, device=like.device)[:K] % E for _ in range(n)])
        if weights_args[2] is not weights_args[0]:  # a shared expert: the last pair, as route() places it
            idx[:, -1] = -1
        inputs.append((h, idx, torch.full((n, K), 1.0 / K, device=like.device)))
    default_down, default_gate_up = DOWN_CONFIGS[0], GATE_UP_CONFIGS[0]
    gate_up = fastest(GATE_UP_CONFIGS, lambda c: [_run(*x, weights_args, c, default_down) for x in inputs])
    down = fastest(DOWN_CONFIGS, lambda c: [_run(*x, weights_args, gate_up, c) for x in inputs])
    return gate_up, down


@torch.library.custom_op("mtpchat::moe_experts", mutates_args=())
def moe_experts(h: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int,
                norm: bool, shared_gate_up: torch.Tensor | None = None,
                shared_down: torch.Tensor | None = None, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None, shared_gate_up_scale: torch.Tensor | None = None,
                shared_down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The routed part of the MoE for rows h [N, H] with router logits [N, E]: routing and the experts. With the
    shared expert's weights, logits [N, E + 1] end with its gate logit and its gated output is included. FP8
    weights come with their block scales (launch's `scales`)."""
    shared = shared_gate_up is not None
    weights, idx = route(logits, gate_up.shape[0], k, norm, shared)
    scales = None if gate_up_scale is None else (gate_up_scale, down_scale, shared_gate_up_scale, shared_down_scale)
    return launch(h, idx, weights, gate_up, down, shared_gate_up, shared_down, scales)


@moe_experts.register_fake
def _(h, logits, gate_up, down, k, norm, shared_gate_up=None, shared_down=None, gate_up_scale=None, down_scale=None,
      shared_gate_up_scale=None, shared_down_scale=None):
    return h.new_empty(h.shape)


def inline_shared(block) -> bool:
    """The shared expert can run as one more pair in the kernels: its gate logit comes out of the router's matmul
    (fusion.py fused them), its gate / up are one weight, and it has the routed experts' shape, dtype and
    activation (FP8 ones with their scales: fusion.py concatenates FP8 gate / up only in whole 128-row blocks,
    which is FP8Experts' scale layout)."""
    shared, experts = block.shared_expert, block.experts
    if isinstance(experts, Int4Experts):  # its kernels have no shared pair (the 4-bit releases keep it 16-bit)
        return False
    if not (getattr(block, "fused_names", None) == ("gate", "shared_expert_gate")
            and getattr(shared, "fused_names", None) == ("gate_proj", "up_proj")
            and shared.fused_weight.shape == experts.gate_up_proj.shape[1:]
            and shared.down_proj.weight.shape == experts.down_proj.shape[1:]
            and shared.fused_weight.dtype == experts.gate_up_proj.dtype
            and shared.down_proj.weight.dtype == experts.down_proj.dtype
            and type(shared.act_fn).__name__ in SILU):
        return False
    if not isinstance(experts, FP8Experts):
        return True
    gs, ds = shared.fused_scale_inv, shared.down_proj.weight_scale_inv
    return (gs.shape == experts.gate_up_proj_scale_inv.shape[1:] and ds.shape == experts.down_proj_scale_inv.shape[1:]
            and gs.stride() == experts.gate_up_proj_scale_inv.stride()[1:]
            and ds.stride() == experts.down_proj_scale_inv.stride()[1:])


def unreadable(experts) -> str | None:
    """Why the kernels cannot read these experts (moe_check's reason to skip them), or None: they read transformers'
    stacked 16-bit / float32 tensors and FP8Experts, and int4_moe_triton.py's read int4.Int4Experts; any other
    form takes moe_rowwise."""
    if isinstance(experts, FP8Experts):
        return None
    if isinstance(experts, Int4Experts):
        from .int4_moe_triton import unreadable as int4_unreadable

        return int4_unreadable(experts)
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and experts.gate_up_proj.is_floating_point():
        return None
    return f"triton: no kernels for {type(experts).__name__} experts"


def moe_triton(block, x: torch.Tensor) -> torch.Tensor:
    """What moe_rowwise(block, x) computes, x [1, N, H], through the kernels above plus the router's matmul (and
    the shared expert's, when it cannot run inside them)."""
    experts, router = block.experts, block.gate
    why = unreadable(experts)
    if why:
        raise ValueError(why)
    if type(experts.act_fn).__name__ not in SILU:  # the kernel's activation is SiLU (Qwen3-Next / 3.5)
        raise ValueError(f"moe_triton supports SiLU experts only, not {type(experts.act_fn).__name__}")
    h = x.reshape(-1, x.shape[-1])
    k, norm = router.top_k, bool(getattr(router, "norm_topk_prob", True))
    fp8 = isinstance(experts, FP8Experts)
    scales = (experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv) if fp8 else (None, None)
    if inline_shared(block):  # one matmul for the router and the shared gate, then the three kernels
        shared = block.shared_expert
        shared_scales = (shared.fused_scale_inv, shared.down_proj.weight_scale_inv) if fp8 else (None, None)
        y = moe_experts(h, F.linear(h, block.fused_weight), experts.gate_up_proj, experts.down_proj, k, norm,
                        shared.fused_weight, shared.down_proj.weight, *scales, *shared_scales)
        return y.view(x.shape)
    if isinstance(experts, Int4Experts):  # 4-bit: int4_moe_triton.py's kernels after the same routing kernel
        from .int4_moe_triton import routed

        y = routed(h, F.linear(h, router.weight), experts, k, norm)
    else:
        y = moe_experts(h, F.linear(h, router.weight), experts.gate_up_proj, experts.down_proj, k, norm, None,
                        None, *scales)
    shared = dense_mlp(block.shared_expert, h) * torch.sigmoid(block.shared_expert_gate(h))
    return (y + shared).view(x.shape)
