"""16-bit linears at decode and verify widths through fp8_triton's kernels where they beat cuBLAS on this GPU.

The kernels stream a bf16 / fp16 weight as they stream an FP8 one, without the scale (fp8_triton._launch with
scale None). At one to eight rows a linear costs what reading its weight costs, and cuBLAS reads some shapes
slowly: on the H200, per call inside CUDA graphs (packaging/bench/quant_kernels.py --quant bf16,
quant_kernels_bf16_{80b,27b}_h200.json), the 80B-A3B's 2048-column out_proj / o_proj took 7.5 us against 6.0, its
fused GDN input projection 15.1 against 13.7, GDN's b + a (64 rows, bf16 in FP8 releases) 4.6 against 3.5; the
27B's gate / up 88.6 against 84.2, down 49.3 against 46.7, b + a 6.1 against 4.5. cuBLAS was faster elsewhere
(the 27B's attention q / k / v and o_proj, the 80B's 513-row router at one row) until the one-row stream form
(fp8_triton._fp8_stream), which beats it at all of the 27B's (quant_kernels_bf16_stream_h200.json: 34.8 against
39.2 us at q / k / v, 555 against 617 at the lm_head).

So nothing is assumed: at load each 16-bit weight shape is timed at one row and at four (a depth-3 verify), for
cuBLAS and a few configurations of the kernels, and each width bucket keeps the fastest (cuBLAS included). Wider
inputs (prefill) always run cuBLAS. Like cuBLAS, which picks its algorithm by M, a verify pass's rows may round
differently from one-row steps; float32 (the exact reference) never comes here. MTPCHAT_LINEAR16=cublas opts out.
"""

from __future__ import annotations

import os
import types
from typing import Iterable

import torch
import torch.nn.functional as F

from .fp8_triton import ALL, CONFIGS, _launch
from .kernels import relative_error
from .splitk import bucket, fastest, triton

ROWS_MAX = 8  # widths that may run the kernels (decoding, verify); wider ones run cuBLAS
SELF_CHECK_TOL = 1e-2
CUBLAS = None  # the choice "F.linear"
# (kernel, (BLOCK_N, K blocks per program, warps, stages)) tried besides cuBLAS: the winners of the H200 runs above
# (rows at one row; the tensor-core form wins at four on the big models' shapes, where the row form's cost grows
# with the rows), and the stream form's configurations at one row (fp8_triton.CONFIGS). At four rows the row form's
# small tiles too: on a small model a call is mostly its latency (the demo model on an H100: the dot form 3.3 us a
# call at four rows where one row's stream form took 2.0, cycle_demo_63_h100.json), and timing keeps what wins.
# (Stop 70's wide row tiles, a whole 256-512-column stretch of a row a tile, lost to the dot form at every demo
# shape at four rows on the H100: 2.7-2.9 us a call against 1.9-2.7, quant_kernels_bf16_demo71_h100.json; deleted.)
CANDIDATES = {
    1: [("rows", (64, 4, 4, 3)), ("rows", (64, ALL, 8, 3)), ("rows", (64, 8, 4, 4)), ("rows", (64, 16, 8, 4)),
        ("rows", (32, 2, 4, 3)), ("rows", (16, 1, 4, 3)), ("dot", (64, 4, 4, 3)), ("dot", (64, ALL, 4, 3))]
    + [("stream", c) for c in CONFIGS["stream"]],
    4: [("dot", (64, 4, 4, 3)), ("dot", (64, 16, 4, 4)), ("dot", (64, ALL, 4, 3)), ("dot", (32, 2, 4, 3)),
        ("dot", (16, 2, 2, 3)), ("rows", (32, 2, 4, 3)), ("rows", (16, 1, 4, 3)), ("rows", (64, 4, 4, 3))]
    + [("streamrows", c) for c in CONFIGS["streamrows"]],
}
_chosen: dict[tuple, tuple | None] = {}  # (N, K, bucket, device index) -> the timed choice (None: cuBLAS)


@torch.library.custom_op("mtpchat::linear16", mutates_args=())
def linear16_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T by the choice timed for this width at load (the compile boundary; CUDA graphs
    capture the launch)."""
    x2 = x.reshape(-1, x.shape[-1])
    choice = _chosen.get((weight.shape[0], weight.shape[1], bucket(x2.shape[0]), x.device.index))
    if choice is CUBLAS:
        return F.linear(x, weight)
    y = _launch(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, None, choice)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@linear16_op.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), through the timed choice at 1 to ROWS_MAX rows."""
    return linear16_op(x, weight) if 0 < x.numel() // x.shape[-1] <= ROWS_MAX else F.linear(x, weight)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return matmul(x, self.weight)


def tune(weight: torch.Tensor, rows: int):
    """The fastest of cuBLAS and CANDIDATES[rows] for this weight shape at `rows` rows, kept for its bucket."""
    key = (weight.shape[0], weight.shape[1], bucket(rows), weight.device.index)
    if key not in _chosen:
        x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
        _chosen[key] = fastest([CUBLAS] + CANDIDATES[rows], lambda c: F.linear(x, weight) if c is CUBLAS
                               else _launch(x, weight, None, c))
    return _chosen[key]


def targets(modules: Iterable, dtypes=(torch.bfloat16, torch.float16)) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(module, weight) of every bias-free nn.Linear of `dtypes` that runs on its own and every module holding a
    fused weight of them (fusion.py; not FP8's); a Linear fused into its parent's weight never runs alone."""
    modules = list(modules)
    fused = {id(getattr(m, n)) for m in modules if getattr(m, "fused_scale_inv", None) is None
             for n in getattr(m, "fused_names", ())}
    out = []
    for m in modules:
        if type(m) is torch.nn.Linear and m.bias is None and id(m) not in fused:
            out.append((m, m.weight))
        elif getattr(m, "fused_weight", None) is not None and getattr(m, "fused_scale_inv", None) is None:
            out.append((m, m.fused_weight))
    return [(m, w) for m, w in out if w.dtype in dtypes]


def _why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    if os.environ.get("MTPCHAT_LINEAR16") == "cublas":
        return "MTPCHAT_LINEAR16=cublas"
    if triton is None:
        return "Triton is not installed"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')}: the exact reference"
    return None


def install(modules: Iterable, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Time every 16-bit linear's shape (CUDA only: None elsewhere, nothing recorded), check the kernels against
    F.linear, and give the modules whose shape a kernel serves faster at some width the timed matmul; all or
    none. Returns what was chosen and why."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    found = targets(modules)
    if not found:
        return None
    reason = _why_not(device, dtype)
    if reason is None:
        worst, shapes = 0.0, {}
        try:
            for _, w in found:
                key = tuple(w.shape)
                if key not in shapes:
                    shapes[key] = [tune(w, rows) for rows in CANDIDATES]
                    gen = torch.Generator(device=w.device).manual_seed(0)
                    for rows in (1, 5):
                        x = torch.randn(rows, w.shape[1], generator=gen, device=w.device).to(w.dtype)
                        worst = max(worst, relative_error(linear16_op(x, w).float(), F.linear(x.float(), w.float())))
        except Exception as e:  # a Triton / driver failure: cuBLAS
            reason = f"Triton failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        else:
            if not worst < SELF_CHECK_TOL:  # NaN too
                reason = f"Triton self-check failed: error {worst:.1e}"
    if reason is not None:
        for (n, k) in {tuple(w.shape) for _, w in found}:  # nothing half-chosen stays behind
            for rows in CANDIDATES:
                _chosen.pop((n, k, bucket(rows), device.index), None)
        return f"cuBLAS ({reason})"
    served = {shape for shape, picks in shapes.items() if any(c is not CUBLAS for c in picks)}
    for m, w in found:
        if tuple(w.shape) in served:
            if isinstance(m, torch.nn.Linear):
                # a bound method in the instance dict (as norm_triton's): deepcopy rebinds it, del m.forward undoes it
                m.forward = types.MethodType(_forward, m)
            else:
                m.plain_kernel = matmul
    at = {rows: sum(picks[i] is not CUBLAS for picks in shapes.values()) for i, rows in enumerate(CANDIDATES)}
    return (f"Triton streaming kernels where timed faster than cuBLAS: {at[1]} of {len(shapes)} weight shapes at one "
            f"row, {at[4]} at 2-{ROWS_MAX} (self-check {worst:.1e}); cuBLAS for the rest and wider inputs")
