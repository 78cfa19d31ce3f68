"""Projections that read the same input, as one matmul: GDN's input projections (4 in Qwen3.5, 2 in Qwen3-Next),
attention's q / k / v, the MLP's gate / up, the MoE router and the shared expert's gate. At batch 1 each projection
is a matrix-vector product whose cost is reading its weight, plus a fixed launch and ramp-up; the small ones (GDN's
b and a: 48 rows) are almost only that.
One read of the concatenated weight does the same work with a quarter to a half of the launches.

The weights are concatenated once at load; each Linear's weight becomes a view of the concatenation, so memory is
not duplicated and the modules' own forward (transformers' generate(), the bench baseline) still works.
"""

from __future__ import annotations

from itertools import groupby

import torch
import torch.nn.functional as F

from . import fp8, swiglu_triton
from .int4 import Int4Linear
from .int4 import fuse as fuse_int4

# (child module of a decoder layer, the Linear layers in it that read the same input, in output order)
GROUPS = (
    ("linear_attn", ("in_proj_qkvz", "in_proj_ba")),
    ("linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("mlp", ("gate_proj", "up_proj")),
    ("mlp.shared_expert", ("gate_proj", "up_proj")),
    ("mlp", ("gate", "shared_expert_gate")),  # MoE: the router and the shared expert's gate (1 row)
)


def _kind(lin) -> str:
    return "int4" if isinstance(lin, Int4Linear) else "fp8" if isinstance(lin, fp8.FP8Linear) else "plain"


@torch.no_grad()
def fuse_layer(layer: torch.nn.Module) -> None:
    modules = dict(layer.named_modules())
    for path, names in GROUPS:
        module = modules.get(path)
        if module is None or not all(hasattr(module, n) for n in names):
            continue
        linears = [getattr(module, n) for n in names]
        if any(getattr(lin, "bias", None) is not None for lin in linears):  # (the router has none)
            continue
        # a group mixing kinds (a quantized Qwen3.5's GDN: in_proj_qkv / in_proj_z quantized, in_proj_b /
        # in_proj_a bf16) fuses each run of one kind: two matmuls instead of four. A module holds one plain or
        # FP8 fusion (fused_*) besides a 4-bit one (int4_fused): a plain run takes it first, since b and a
        # (48 rows each) are almost only their launches (cuBLAS's split-K and its reduce: 0.59 ms of a 27B
        # 4-bit step, H200)
        runs = [list(run) for _, run in groupby(zip(names, linears), key=lambda part: _kind(part[1]))]
        for run in sorted(runs, key=lambda run: _kind(run[0][1]) != "plain"):
            kind = _kind(run[0][1])
            if len(run) > 1 and (kind == "int4" or not hasattr(module, "fused_names")):
                _fuse(module, tuple(n for n, _ in run), [lin for _, lin in run], kind)


def _fuse(module, names: tuple[str, ...], linears: list, kind: str) -> None:
    """One run of Linear layers of one kind as one weight (4-bit: int4.fuse's module.int4_fused; plain and FP8:
    module.fused_weight / fused_scale_inv)."""
    if kind == "int4":
        fuse_int4(module, names, linears)
        return
    if kind == "fp8" and not all(lin.out_features % fp8.BLOCK == 0 for lin in linears):
        # FP8 parts concatenate with their scale rows only when each part's N is whole 128-row blocks (a part's
        # last scale row would otherwise cover the next part's rows too)
        return
    fused = _concat(linears, "weight")
    # a buffer, so that a later module.to(...) converts it with the weights (they then stop sharing memory)
    module.register_buffer("fused_weight", fused, persistent=False)
    if kind == "fp8":
        module.register_buffer("fused_scale_inv", _concat(linears, "weight_scale_inv"), persistent=False)
    module.fused_names, module.fused_sizes = names, [lin.weight.shape[0] for lin in linears]


def _concat(linears, attr: str) -> torch.Tensor:
    """The Linear layers' `attr` tensors concatenated along N; each layer's own becomes a view of its rows."""
    fused = torch.cat([getattr(lin, attr) for lin in linears])
    start = 0
    for lin in linears:
        rows = getattr(lin, attr).shape[0]
        part = fused[start : start + rows]
        if attr == "weight":
            lin.weight = torch.nn.Parameter(part, requires_grad=False)
        else:
            setattr(lin, attr, part)  # (a registered buffer: assigning a tensor keeps it one)
        start += rows
    return fused


def fuse_all(layers) -> None:
    """Fuse every decoder layer in turn (peak memory: one layer's projections more than the model)."""
    for layer in layers:
        fuse_layer(layer)


def linears(module, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of module's Linear layers `names` on x: one matmul per fused run of them, else one each."""
    runs = [r for r in (getattr(module, "int4_fused_names", None), getattr(module, "fused_names", None)) if r]
    out, i = [], 0
    while i < len(names):
        run = next((r for r in runs if names[i : i + len(r)] == r), None)
        if run is None:
            out.append(getattr(module, names[i])(x))
        else:
            out.extend(_fused_outputs(module, run, x))
        i += len(run or (None,))
    return out


def _fused_outputs(module, run: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    int4 = run == getattr(module, "int4_fused_names", None)
    return whole(module, run, x).split(module.int4_fused_sizes if int4 else module.fused_sizes, dim=-1)


def whole(module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of module's Linear layers `names` on x as one tensor [..., their N summed], where they are one
    fused run (one matmul, no split); None otherwise."""
    if names == getattr(module, "int4_fused_names", None):  # 4-bit parts, concatenated by int4.fuse
        return module.int4_fused(x)
    if names != getattr(module, "fused_names", None):
        return None
    w = module.fused_weight
    # (plain_kernel: linear16_triton.matmul, where install timed a kernel faster than cuBLAS for this shape)
    return fp8.matmul(x, w, module.fused_scale_inv, getattr(module, "fp8_kernel", None)) if fp8.is_fp8(w) \
        else getattr(module, "plain_kernel", F.linear)(x, w)


def dense_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP (transformers' *MLP.forward) with gate and up as one matmul; silu(gate) * up in one launch where
    swiglu_triton.install marked the module (CUDA, 16-bit)."""
    gate, up = linears(mlp, ("gate_proj", "up_proj"), x)
    if getattr(mlp, "swiglu", False) and swiglu_triton.takes(gate, up):
        return mlp.down_proj(swiglu_triton.swiglu(gate, up))
    return mlp.down_proj(mlp.act_fn(gate) * up)
