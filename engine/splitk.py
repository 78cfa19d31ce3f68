"""What the quantized matmul kernels share (fp8_triton.py, int4_triton.py): width buckets, split-K partials summed
in order, and choosing a kernel configuration by timing it inside a CUDA graph.

At decode widths a quantized linear costs what streaming its weight costs; a narrow projection (N / BLOCK_N
programs) cannot fill 132 SMs, so K is split into slices whose float32 partials one more kernel sums, in slice
order (no atomics: results are deterministic and a row's result does not depend on the other rows).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the modules import, their install() says why not
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def bucket(rows: int) -> int:
    """Widths timed together: decoding's 1, verify's 2-8, then BLOCK_M 16 / 64 / 128 for wider verify passes and
    graph prefills."""
    return 1 if rows == 1 else 8 if rows <= 8 else 16 if rows <= 16 else 64 if rows <= 64 else 128


if triton is not None:
    @triton.jit
    def _sum_slices(P, Y, MN, SLICES: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for sl in range(SLICES):  # in order: deterministic
            acc += tl.load(P + sl * MN + i, mask=i < MN, other=0.0)
        tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=i < MN)


def output(M: int, N: int, slices: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [M, N] in like's dtype, where the kernel writes): out itself unsplit, else float32 partials
    [slices, M, N] that finish() sums into out."""
    out = torch.empty(M, N, device=like.device, dtype=like.dtype)
    return out, out if slices == 1 else torch.empty(slices, M, N, device=like.device, dtype=torch.float32)


def finish(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if part is not out:
        MN = out.numel()
        _sum_slices[(triton.cdiv(MN, 1024),)](part, out, MN, SLICES=part.shape[0], BLOCK=1024)
    return out


def graph_ms(fn: Callable, reps: int = 32) -> float:
    """GPU milliseconds per call of fn, replayed inside a CUDA graph: a small linear takes 9-20 us on the H200,
    less than launching it from the host, so host-timed loops would rank the launch overhead, not the kernels."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def fastest(choices: Iterable, run: Callable) -> object:
    """The choice whose run(choice) is fastest in a CUDA graph; the first under Triton's interpreter (nothing to
    time). A choice this GPU cannot run (too much shared memory, say) is skipped."""
    choices = list(choices)
    if INTERPRET:
        return choices[0]
    timed = {}
    for choice in choices:
        try:
            timed[choice] = graph_ms(lambda: run(choice))
        except Exception:
            continue
    if not timed:
        raise RuntimeError("no kernel configuration ran")
    return min(timed, key=timed.get)
