"""W4A16 skinny GEMM for decode and verify widths (1 .. 16 rows): Int4Linear's packed weights (int4.py's layout:
qweight int32 [K/8, N] packed along K, zeros uint8 [G, N], scales [G, N]) dequantized in registers, one group's
zeros and scales per K-block, and one tl.dot per block with float32 accumulation.

Each program owns BLOCK_N output columns for every row (no split-K: no atomics, so a row's result does not depend
on the other rows of the batch, and verify's rows round like decoding's). The dequantized tile is (q - zero) *
scale in float32, rounded to the activation's dtype, as the fallback (dequantize, then F.linear) rounds it.
Act-order weights come with their rows sorted by group (int4.py): the input columns are permuted to match before the
kernel. Behind the custom op mtpchat::int4_linear (opaque to torch.compile, replayable in CUDA graphs); block sizes
come from the shapes (no autotuning: nothing to benchmark when first called in a graph warm-up).
"""

from __future__ import annotations

import torch

from .kernels import relative_error

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, usable() says why not
    triton = None

MAX_ROWS = 16  # tl.dot's smallest M tile: 1 .. 16 rows share one program shape
SELF_CHECK_TOL = 2e-2


def block_k(group_size: int, k: int) -> int | None:
    """The K-block: a power of two from 16 to 128 inside one group (so one zero / scale row serves it)."""
    g = k if group_size == -1 else group_size
    for b in (128, 64, 32, 16):
        if g % b == 0:
            return b
    return None


def usable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve Int4Linear here, or None."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not _interpreting():
        return "CUDA only"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit activations only ({str(dtype).replace('torch.', '')}: dequantize, then matmul)"
    return None


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for 1..16 rows: none compiles inside a graph capture
    def _w4a16_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, y_ptr, M, N, K, GROUP, stride_xm, stride_ym, stride_q, stride_z,
                      stride_s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_p = tl.arange(0, BLOCK_K // 8)  # packed rows of a K-block
        offs_k = tl.arange(0, BLOCK_K)
        shifts = tl.arange(0, 8) * 4
        n_ok = offs_n < N
        m_ok = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rows = k0 // 8 + offs_p
            packed = tl.load(qw_ptr + rows[:, None].to(tl.int64) * stride_q + offs_n[None, :],
                             mask=(rows < K // 8)[:, None] & n_ok[None, :], other=0)
            q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: row 8i + j
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))
            g = k0 // GROUP
            z = tl.load(z_ptr + g * stride_z + offs_n, mask=n_ok, other=0).to(tl.float32)
            s = tl.load(s_ptr + g * stride_s + offs_n, mask=n_ok, other=0).to(tl.float32)
            w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x_ptr.dtype.element_ty)
            ks = k0 + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :],
                        other=0.0)
            acc += tl.dot(x, w)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def _block_n(n: int) -> int:
    # enough programs to fill an H200's 132 SMs at the narrow projections, wide tiles for the long ones
    return 64 if n >= 8192 else 32


def _launch(x2: torch.Tensor, qweight, zeros, scales, group: int) -> torch.Tensor:
    m, k = x2.shape
    n = qweight.shape[1]
    bk = block_k(group, k)
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    bn = _block_n(n)
    _w4a16_kernel[(triton.cdiv(n, bn),)](x2, qweight, zeros, scales, y, m, n, k, k if group == -1 else group,
                                         x2.stride(0), y.stride(0), qweight.stride(0), zeros.stride(0),
                                         scales.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk,
                                         num_warps=4)
    return y


@torch.library.custom_op("mtpchat::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group: int) -> torch.Tensor:
    """x [M <= 16, K] (rows already in the weight's sorted order) times the 4-bit weight: [M, N]. The weight's
    tensors may be column slices of a fused projection's (their rows strided; columns contiguous)."""
    return _launch(x.contiguous(), qweight, zeros, scales, group)


@int4_linear.register_fake
def _(x, qweight, zeros, scales, group):
    return x.new_empty(x.shape[0], qweight.shape[1])


def forward(lin, x: torch.Tensor) -> torch.Tensor:
    """Int4Linear's forward through the kernel (lin.kernel is set by install)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if lin.perm is not None:
        x2 = x2.index_select(1, lin.perm)
    return int4_linear(x2, lin.qweight, lin.zeros, lin.scales, lin.group_size).view(*shape[:-1], -1)


def install(modules, device, dtype) -> str | None:
    """Give every Int4Linear in `modules` the kernel for its decode / verify widths, after a self-check per
    distinct shape against the float32 dequantized reference; all or none. Returns the choice with its reason
    (None: no Int4Linear modules)."""
    from .int4 import Int4Linear

    lins = [m for m in modules if isinstance(m, Int4Linear)]
    if not lins:
        return None
    device = torch.device(device)
    why = usable(device, dtype)
    if why is None and any(block_k(m.group_size, m.in_features) is None for m in lins):
        why = "a group size without a 16..128 power-of-two K-block"
    worst, checked = 0.0, set()
    if why is None:
        try:
            for m in lins:
                key = (m.in_features, m.out_features, m.group_size, m.perm is not None)
                if key not in checked:
                    checked.add(key)
                    worst = max(worst, self_check(m, dtype))
        except Exception as e:  # an architecture or Triton version the kernel does not compile for
            why = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if why is None and worst > SELF_CHECK_TOL:
            why = f"self-check mismatch {worst:.2g}"
    for m in lins:
        m.kernel = None if why else forward
    if why:
        return f"dequantize, then matmul ({why})"
    return f"Triton W4A16 kernel for 1..{MAX_ROWS} rows (self-check {worst:.1e} over {len(checked)} shapes)"


def self_check(lin, dtype) -> float:
    """Relative error of the kernel against the float32 dequantized weight on random rows (1 and 5 rows)."""
    gen = torch.Generator(device=lin.qweight.device).manual_seed(0)
    x = torch.randn(5, lin.in_features, generator=gen, device=lin.qweight.device).to(dtype)
    ref = x.float() @ lin.dequantized(torch.float32).T
    return max(relative_error(forward(lin, x[:1]).float(), ref[:1]), relative_error(forward(lin, x).float(), ref))
