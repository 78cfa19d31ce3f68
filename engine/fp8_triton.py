"""Block-128 FP8 linears at decode, verify and short-prefill widths: Triton kernels that stream the FP8 weight
and dequantize it in registers (W8A16), for CUDA in 16-bit.

At batch 1-5 a linear costs what reading its weight costs, so FP8 should run at twice bf16's speed. cuBLAS's
torch._scaled_mm reached only 1.3-2.6 TB/s of FP8 bytes at M=1 on the H200 (issue #23), and dequantizing to bf16
before F.linear reads the weight once, then writes and reads it again at twice the size. Here each program owns
BLOCK_N output columns and a slice of K, loads [BLOCK_N, 128] FP8 tiles and scales each tile's float32 partial
by its block scale (one per 128x128 block: per output column inside a tile, so the scale multiplies the partial,
not the weight). Two kernels:
  - rows: the tile converted to float32 once, then CUDA-core multiply-adds row after row (a runtime loop, so
    decoding's one row costs one row);
  - dot: a tensor-core dot of the tile against 16 / 64 / 128 padded activation rows (verify, graph prefills).
Partials of K slices land in a float32 buffer summed, in order, by a third kernel that writes x's dtype; an
unsplit configuration writes the output directly. No atomics: results are deterministic.

Activations stay in bf16 / fp16: the config's dynamic per-token-group activation scheme would add activation
rounding for nothing at these widths, where the tensor cores idle while the weight streams in.

The kernel and configuration are timed per (N, K, width bucket) at load (install): 1 row, 4 rows, 64 rows;
never inside a CUDA-graph capture (an untimed shape takes a default). Like cuBLAS's bf16 matmuls, which pick
their algorithm by M, a verify pass's rows may round differently from one-row steps; `bench --precision`
measures what that does to bf16 text, and float32 (the exact dequantizing path) is the lossless reference.
Wider inputs (long prefills) dequantize and use cuBLAS: compute-bound there, the extra read is a small share.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.nn.functional as F

from .fp8 import BLOCK, FP8Linear, dequantize
from .kernels import relative_error

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module imports, install() says why not
    triton = None

MAX_ROWS = 256  # widths up to this run the kernels (decode, verify, graph prefills); wider ones dequantize
SELF_CHECK_TOL = 2e-2
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ALL = 1 << 20  # "K blocks per program": all of them, no split (the output is written once, in its dtype)
# (kernel, BLOCK_N, K blocks of 128 per program, warps, stages); per kernel the first is the untimed default.
# "rows": CUDA-core multiply-adds, one row after another over the tile converted once (decoding's one row: on
# the H200 3.0-3.6 TB/s of FP8 bytes where the tensor-core form reached 2.0-2.8); "dot": a tensor-core dot of
# the tile against 16 (64, 128) padded rows, whose cost does not grow with the rows (verify, prefill).
CONFIGS = {
    "rows": [(64, 8, 4, 4), (64, ALL, 8, 3), (64, 8, 8, 3), (64, 4, 4, 3), (32, 8, 4, 4), (64, 8, 8, 4),
             (64, 16, 8, 4)],
    "dot": [(64, 8, 4, 3), (32, 8, 4, 4), (64, 4, 4, 3), (128, 8, 8, 3), (64, 16, 4, 4), (128, 16, 8, 4),
            (64, ALL, 4, 3)],
}
ROWS_MAX = 8  # the widths the row kernel may serve (its cost grows with them)
_chosen: dict[tuple, tuple] = {}  # (N, K, bucket, device index) -> the timed (kernel, configuration)


def bucket(rows: int) -> int:
    """Widths timed together: decoding's 1, verify's 2-8, then BLOCK_M 16 / 64 / 128 for wider verify passes and
    graph prefills."""
    return 1 if rows == 1 else 8 if rows <= 8 else 16 if rows <= 16 else 64 if rows <= 64 else 128


if triton is not None:
    @triton.jit
    def _fp8_rows(X, W, S, P, M, N, K, stride_xm, stride_wn, stride_sn, KS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pn, pk = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        r = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for b in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k = b * BLOCK_K + kk
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0.0).to(tl.float32)
            s = tl.load(S + (n // BLOCK_K) * stride_sn + b, mask=n < N, other=0.0)
            for m in range(M):  # a runtime loop: one row costs one row's multiply-adds
                x = tl.load(X + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], 1) * s
                acc = tl.where(r[:, None] == m, acc + part[None, :], acc)
        tl.store(P + (pk * M + r[:, None]) * N + n[None, :], acc.to(P.dtype.element_ty),
                 mask=(r[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _fp8_dot(X, W, S, P, M, N, K, stride_xm, stride_wn, stride_sn, KS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pn, pk, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for b in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k = b * BLOCK_K + kk
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
            s = tl.load(S + (n // BLOCK_K) * stride_sn + b, mask=n < N, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s[None, :]
        tl.store(P + (pk * M + m[:, None]) * N + n[None, :], acc.to(P.dtype.element_ty),
                 mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _sum_slices(P, Y, MN, SLICES: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for sl in range(SLICES):  # in order: deterministic
            acc += tl.load(P + sl * MN + i, mask=i < MN, other=0.0)
        tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=i < MN)


def _launch(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, choice) -> torch.Tensor:
    """One (kernel, configuration): the K slices' float32 partials summed by one more kernel, or, unsplit, the
    output written directly in x's dtype."""
    kind, (block_n, ks, warps, stages) = choice
    M, K = x2.shape
    N = weight.shape[0]
    blocks = triton.cdiv(K, BLOCK)
    slices = triton.cdiv(blocks, min(ks, blocks))
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    part = out if slices == 1 else torch.empty(slices, M, N, device=x2.device, dtype=torch.float32)
    if kind == "rows":
        block_m = triton.next_power_of_2(max(M, 1))
        _fp8_rows[(triton.cdiv(N, block_n), slices)](
            x2, weight, scale, part, M, N, K, x2.stride(0), weight.stride(0), scale.stride(0), KS=min(ks, blocks),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, num_warps=warps, num_stages=stages)
    else:
        block_m = max(16, bucket(M)) if M > 8 else 16
        _fp8_dot[(triton.cdiv(N, block_n), slices, triton.cdiv(M, block_m))](
            x2, weight, scale, part, M, N, K, x2.stride(0), weight.stride(0), scale.stride(0), KS=min(ks, blocks),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, num_warps=warps, num_stages=stages)
    if slices > 1:
        _sum_slices[(triton.cdiv(M * N, 1024),)](part, out, M * N, SLICES=slices, BLOCK=1024)
    return out


def _config(M: int, N: int, K: int, device: torch.device):
    return _chosen.get((N, K, bucket(M), device.index), ("rows", CONFIGS["rows"][0]) if M <= ROWS_MAX
                       else ("dot", CONFIGS["dot"][0]))


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16 / fp16) @ (weight [N, K] float8_e4m3fn scaled per 128x128 block by scale).T."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = _launch(x2, weight, scale, _config(x2.shape[0], weight.shape[0], weight.shape[1], x.device))
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("mtpchat::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The compile boundary (torch.compile traces around it; CUDA graphs capture the launch)."""
    return linear(x, weight, scale)


@fp8_linear_op.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8.matmul's kernel: up to MAX_ROWS rows through the Triton op, wider inputs dequantized for cuBLAS."""
    if x.numel() // x.shape[-1] <= MAX_ROWS:
        return fp8_linear_op(x, weight, scale)
    return F.linear(x, dequantize(weight, scale, x.dtype))


def _time(fn, reps: int = 32) -> float:
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


def tune(weight: torch.Tensor, scale: torch.Tensor, rows: int = 1) -> tuple:
    """The fastest (kernel, configuration) for this weight shape at `rows` rows, remembered for its bucket."""
    N, K = weight.shape
    key = (N, K, bucket(rows), weight.device.index)
    if key not in _chosen:
        x = torch.randn(rows, K, device=weight.device, dtype=torch.bfloat16)
        kinds = ("rows", "dot") if rows <= ROWS_MAX else ("dot",)
        choices = [(kind, c) for kind in kinds for c in (CONFIGS[kind][:1] if INTERPRET else CONFIGS[kind])]
        timed = {}
        for choice in choices:
            try:
                timed[choice] = 0.0 if INTERPRET else _time(lambda: _launch(x, weight, scale, choice))
            except Exception:  # a configuration this GPU cannot hold (shared memory): skip it
                continue
        _chosen[key] = min(timed, key=timed.get)
    return _chosen[key]


def _self_check(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int) -> float:
    gen = torch.Generator(device=weight.device).manual_seed(rows)
    x = torch.randn(rows, weight.shape[1], generator=gen, device=weight.device).to(dtype)
    with torch.no_grad():
        return relative_error(linear(x, weight, scale), F.linear(x, dequantize(weight, scale, dtype)))


def _why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"{device.type.upper()}: the exact dequantized reference"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')}: the exact dequantized reference"
    return None


def _fp8_weights(modules: Iterable) -> list[tuple]:
    """(module, weight, scale) of every FP8Linear and every module holding a fused FP8 weight (fusion.py)."""
    out = []
    for m in modules:
        if isinstance(m, FP8Linear):
            out.append((m, m.weight, m.weight_scale_inv))
        elif getattr(m, "fused_scale_inv", None) is not None:
            out.append((m, m.fused_weight, m.fused_scale_inv))
    return out


def install(modules: Iterable, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Give every FP8 matmul (fp8.matmul's callers: FP8Linear, fused projections) the kernel when it may run
    here, after timing its configurations per weight shape and checking it against the dequantized reference at
    decode, verify and graph-prefill widths; all or none. Returns what was chosen and why, or None when there is
    no FP8 weight."""
    targets = _fp8_weights(modules)
    if not targets:
        return None
    device = torch.device(device)
    reason = _why_not(device, dtype)
    if reason is None:
        worst, checked = 0.0, set()
        try:
            for _, w, s in targets:
                if tuple(w.shape) not in checked:
                    checked.add(tuple(w.shape))
                    for rows in (1, 4, 64):  # decoding, verify, a graph prefill
                        tune(w, s, rows)
                    worst = max(worst, *(_self_check(w, s, dtype, r) for r in (1, 5, 12, 40)))
        except Exception as e:  # a Triton / driver failure: keep the dequantizing matmul
            reason = f"Triton FP8 kernel failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        else:
            if not worst < SELF_CHECK_TOL:  # NaN too
                reason = f"Triton FP8 kernel self-check failed: error {worst:.1e}"
    if reason is not None:
        return f"weight-only: each matmul dequantizes its FP8 weight first ({reason})"
    for m, _, _ in targets:
        m.fp8_kernel = matmul
    return f"Triton W8A16 kernel: FP8 weights streamed, dequantized in registers, up to {MAX_ROWS} rows " \
           f"(self-check {worst:.1e}, {len(checked)} shapes timed)"
