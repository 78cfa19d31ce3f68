"""Verify widths on the CPU in float32: oneDNN's matmul over each weight reordered once at load.

On the CPU torch's F.linear runs MKL: a GEMV for decoding's one row, a GEMM for more, and at the small models' shapes
the GEMM's cost grows with the rows (one thread, the demo model's lm_head 8192 x 384: 0.36 ms at one row, 0.74 at
two, 1.75 at five), so a verify pass of k + 1 rows paid for nearly k + 1 decode steps of matmul, and speculation
barely paid on the CPU. oneDNN's matmul over the weight reordered for up to ROWS_MAX rows (torch.ops.mkldnn: what
inductor's CPU lowering calls) streams it once for all of them: 0.37 ms at two rows, 0.65 at five. Its calls
cost about 25 us more than MKL's, so decoding's one row and prefills stay with F.linear, and each weight shape is
timed at load at two rows: a shape where oneDNN is not faster keeps F.linear at every width.

A verify pass's rows round differently from one-row steps (another summation order in float32), as MKL's GEMM
already did against its GEMV; a row's result does not depend on the others in the call (tests). The reordered
copies double the float32 weights they serve, so they are made only while they take at most a quarter of the
memory available. MTPCHAT_CPU_LINEAR=mkl opts out; =onednn serves every shape, untimed (A/B runs, the tests).
"""

from __future__ import annotations

import functools
import os
import time
import types
from typing import Iterable

import torch
import torch.nn.functional as F

from .environment import cpu_memory
from .kernels import relative_error
from .linear16_triton import targets

ROWS_MAX = 8  # verify widths (2-5 rows at depths 1-4, the MTP head's refreshes); wider inputs run F.linear
MEMORY_SHARE = 0.25  # of the available memory the reordered copies may take
SELF_CHECK_TOL = 1e-5  # float32 rounding of another summation order, relative to the output's largest value


def reordered(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in oneDNN's layout for inputs of up to ROWS_MAX rows (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_MAX)


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), through oneDNN and `packed` (reordered(weight)) at 2 to ROWS_MAX rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= ROWS_MAX or torch.compiler.is_compiling():  # (inductor lowers F.linear its own way: the
        return F.linear(x, weight)  # reordered weight, an opaque tensor, is no graph constant to it)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]).contiguous(), packed, None, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return matmul(x, self.weight, self.cpu_packed)


def _ms(fn, reps: int = 12) -> float:
    """The median of reps timed calls after two untimed ones (a shared CPU's stalls land in the tail)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def _serves(weight: torch.Tensor, packed: torch.Tensor, timed: bool) -> bool:
    """Whether oneDNN with `packed` (reordered(weight)) agrees with F.linear at five rows and (timed) beats it at
    two."""
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    if not relative_error(matmul(x, weight, packed), F.linear(x, weight)) < SELF_CHECK_TOL:
        raise ValueError(f"the oneDNN matmul disagrees with F.linear at {tuple(weight.shape)}")
    return not timed or _ms(lambda: matmul(x[:2], weight, packed)) < _ms(lambda: F.linear(x[:2], weight))


def _why_not(mode: str | None, dtype: torch.dtype, nbytes: int) -> str | None:
    if mode == "mkl":
        return "MTPCHAT_CPU_LINEAR=mkl"
    if dtype != torch.float32:
        return f"{str(dtype).removeprefix('torch.')}: oneDNN's reordered weights serve float32 here"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    available = cpu_memory()[1]
    if nbytes > MEMORY_SHARE * available:
        return f"their reordered copies ({nbytes / 2**30:.1f} GiB) would take over a quarter of the " \
               f"{available / 2**30:.1f} GiB available"
    return None


def install(modules: Iterable, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """On the CPU, give every float32 linear whose shape oneDNN runs faster at two rows the reordered weight and
    the matmul above; all chosen or none on failure. Returns what was chosen and why (None off the CPU or without
    linears)."""
    device = torch.device(device)
    if device.type != "cpu":
        return None
    found = targets(modules, (dtype,))
    if not found:
        return None
    mode = os.environ.get("MTPCHAT_CPU_LINEAR")
    reason = _why_not(mode, dtype, sum(w.numel() * w.element_size() for _, w in found))
    chosen: dict[tuple, bool] = {}  # weight shape -> served
    packs: dict[int, torch.Tensor] = {}  # id(module) -> its reordered weight, where served
    if reason is None:
        try:
            for m, w in found:
                shape = tuple(w.shape)
                if shape in chosen and not chosen[shape]:
                    continue
                packed = reordered(w)  # (each weight reordered once: the first of a shape is the one timed)
                if shape not in chosen:
                    chosen[shape] = _serves(w, packed, timed=mode != "onednn")
                if chosen[shape]:
                    packs[id(m)] = packed
        except Exception as e:  # (an op this torch build lacks, a failed self-check)
            reason = f"oneDNN failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if reason is None and not packs:
        reason = f"oneDNN timed no faster at two rows for any of the {len(chosen)} weight shapes"
    if reason is not None:
        return f"MKL ({reason})"
    for m, w in found:
        if id(m) in packs:
            if isinstance(m, torch.nn.Linear):
                m.cpu_packed = packs[id(m)]
                m.forward = types.MethodType(_forward, m)  # (as linear16_triton's: del m.forward undoes it)
            else:
                m.plain_kernel = functools.partial(matmul, packed=packs[id(m)])
    served = sum(chosen.values())
    copies = sum(w.numel() * w.element_size() for m, w in found if id(m) in packs)
    how = "untimed: MTPCHAT_CPU_LINEAR=onednn" if mode == "onednn" else "timed faster than MKL at two rows"
    return (f"oneDNN with reordered weights ({copies / 2**20:.0f} MiB) at 2-{ROWS_MAX} rows for {served} of "
            f"{len(chosen)} weight shapes ({how}); MKL for one row, prefills and the rest")
