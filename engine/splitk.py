"""What the quantized matmul kernels share (fp8_triton.py, int4_triton.py): width buckets, split-K partials summed
in order, and choosing a kernel configuration by timing it inside a CUDA graph.

At decode widths a quantized linear costs what streaming its weight costs; a narrow projection (N / BLOCK_N
programs) cannot fill 132 SMs, so K is split into slices whose float32 partials the last slice to finish sums,
in slice order (store_tile: deterministic, and a row's result does not depend on the other rows).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

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
    def store_tile(Y, P, LOCKS, acc, rows, cols, mask, M, N, tile):
        """Write this program's float32 acc [rows, cols] of output tile `tile`: into Y (x's dtype) when K is not
        split (grid axis 1 has one slice), else as its slice's partial, and the slice that arrives last sums the
        tile's partials, in slice order (deterministic), into Y. One launch instead of a second kernel that sums
        them (300 a step; the per-call time measured the same, quant_kernels_h200.json). LOCKS[tile] counts
        the arrived slices; the last one sets it back to 0 for the next launch (and graph replay). The counters
        are shared by every launch on the device, so two of these launches must not run at once: the engine
        issues its matmuls on one stream (a second stream would need its own counters)."""
        slices = tl.num_programs(1)
        if slices == 1:
            tl.store(Y + rows * N + cols, acc.to(Y.dtype.element_ty), mask=mask)
        else:
            tl.store(P + (tl.program_id(1) * M + rows) * N + cols, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the count is released
            arrived = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel")
            if arrived == slices - 1:
                total = tl.zeros_like(acc)
                for sl in range(slices):  # .cg: from L2, where the other programs' partials are
                    total += tl.load(P + (sl * M + rows) * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(Y + rows * N + cols, total.to(Y.dtype.element_ty), mask=mask)
                tl.atomic_xchg(LOCKS + tile, 0)


    @triton.jit
    def after_previous(PDL: tl.constexpr):
        """A kernel's first statement when launched with programmatic dependent launch (pdl()): wait until the
        kernel before it on the stream has finished and its writes are visible, then let the next one launch.
        Without PDL the stream's order does both and this compiles to nothing. (Asking L2 for a program's first
        weight lines before the wait, which the weights allow, changed no kernel's time per call on the H200:
        packaging/bench/quant_kernels_bf16_stream{,_noprefetch}_h200.json.)"""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


PDL_OFF = os.environ.get("MTPCHAT_PDL") == "0"
_pdl_devices: dict[int, bool] = {}


def pdl_why_not(device: torch.device) -> str | None:
    """Why kernels on this CUDA device launch in plain stream order, or None: programmatic dependent launch."""
    if triton is None or INTERPRET:
        return "no Triton kernels"
    if PDL_OFF:
        return "MTPCHAT_PDL=0"
    major, minor = torch.cuda.get_device_capability(device)
    return None if major >= 9 else f"compute capability {major}.{minor} (it needs 9.0)"


def pdl(like: torch.Tensor) -> dict:
    """Launch options for a decode-path kernel on like's device, which takes the PDL flag too: programmatic
    dependent launch on Hopper and later. The kernel's blocks are scheduled while the one before it drains, and
    wait in after_previous, so that a step's hundreds of small kernels do not each start only after the last
    one ended. On the H200 it took the 80B-A3B 12-layer slice (--compile) from 930 to 973 tok/s, nearly all of it
    from inductor's kernels (graphs.compile_block); the 27B shape, whose kernels are long, did not move."""
    if not like.is_cuda:
        return {}
    index = like.device.index if like.device.index is not None else torch.cuda.current_device()
    if index not in _pdl_devices:
        _pdl_devices[index] = pdl_why_not(torch.device("cuda", index)) is None
    return {"PDL": True, "launch_pdl": True} if _pdl_devices[index] else {}


TILES = 1 << 16  # output tiles a split launch may have (34,816 columns / 16 x 16 row blocks fit)
_locks: dict[torch.device, torch.Tensor] = {}


def output(M: int, N: int, slices: int, tiles: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(out [M, N] in like's dtype, the float32 partials [slices, M, N] (out itself unsplit), the tile counters
    for store_tile; tiles: the launch's output tiles). The counters are zeros allocated once per device outside
    any CUDA-graph capture (a capture's allocation would belong to its graph's pool): install() and tune() launch
    every kernel before graphs exist."""
    if slices > 1 and tiles > TILES:
        raise ValueError(f"{tiles} output tiles: split-K has counters for {TILES}")
    out = torch.empty(M, N, device=like.device, dtype=like.dtype)
    part = out if slices == 1 else torch.empty(slices, M, N, device=like.device, dtype=torch.float32)
    return out, part, counters(like.device)


def counters(device: torch.device) -> torch.Tensor:
    """The device's TILES arrival counters (int32 zeros, each set back to 0 by the launch that used it), for
    kernels whose last program to arrive finishes the work (store_tile, the decode attention's merge)."""
    locks = _locks.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K tile counters first needed inside a CUDA-graph capture")
        locks = _locks[device] = torch.zeros(TILES, device=device, dtype=torch.int32)
    return locks


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


# A prefill chunk's widths are past the kernels (MAX_ROWS): the weight is dequantized to 16 bits for cuBLAS. Whole,
# the 27B shape's gate / up projection is a 0.36 GB temporary, at the Int4 model's 32k-prompt peak with the fp8 KV
# cache (17.98 GB, 17.91 in column blocks on the H200); in blocks of at most this many bytes it is a fifth of that,
# and each block's matmul (thousands of rows and columns) still runs at cuBLAS's speed.
DEQUANTIZED_BYTES = 64 << 20


def linear_by_columns(x2: torch.Tensor, n: int, k: int, columns: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x2 [M, K] times a weight of n output columns that columns(start, end) dequantizes ([end - start, K] in x2's
    dtype), a block of 128-aligned columns at a time: [M, n]."""
    step = max(128, DEQUANTIZED_BYTES // (k * x2.element_size()) // 128 * 128)
    if step >= n:
        return F.linear(x2, columns(0, n))
    out = x2.new_empty(x2.shape[0], n)
    for start in range(0, n, step):
        end = min(n, start + step)
        out[:, start:end] = F.linear(x2, columns(start, end))
    return out
