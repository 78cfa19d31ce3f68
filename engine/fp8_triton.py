"""Block-128 FP8 linears at decode, verify and short-prefill widths: Triton kernels that stream the FP8 weight
and dequantize it in registers (W8A16), for CUDA in 16-bit.

At batch 1-5 a linear costs what reading its weight costs, so FP8 should run at twice bf16's speed. cuBLAS's
torch._scaled_mm reached only 1.3-2.6 TB/s of FP8 bytes at M=1 on the H200 (issue #23), and dequantizing to bf16
before F.linear reads the weight once, then writes and reads it again at twice the size. Here each program owns
BLOCK_N output columns and a slice of K, loads [BLOCK_N, 128] FP8 tiles and scales each tile's float32 partial
by its block scale (one per 128x128 block: per output column inside a tile, so the scale multiplies the partial,
not the weight). Five forms:
  - rows: the tile converted to float32 once, then CUDA-core multiply-adds row after row (a runtime loop, so
    decoding's one row costs one row);
  - dot: a tensor-core dot of the tile against 16 / 64 / 128 padded activation rows (verify, graph prefills);
  - dotbits: the same dot, its FP8 bytes made bf16 by moving bits instead of conversion instructions (bf16
    inputs; on the H200 0.175 ms over the 27B shape's seven projections at four rows against dot's 0.208);
  - stream (one row): a few weight rows read 512-2048 columns at a time into a float32 accumulator of the tile's
    shape, summed once at the end. The other forms read 128 columns of 32-128 rows a tile and reduce every tile;
    a simple kernel that only reads reaches 4.68 TB/s on the H200 (packaging/bench/hbm_read.py) where they
    stream 16-bit weights at 3.6-4.2;
  - streambits (one row): the stream form, its FP8 bytes made float32 by bit moves (_fp8_stream_bits: Triton's
    conversions held the stream form near the rate they issue at).
Partials of K slices land in a float32 buffer that the last slice to finish sums, in slice order, into x's
dtype (splitk.store_tile); an unsplit configuration writes the output directly. Results are deterministic.

Activations stay in bf16 / fp16: the config's dynamic per-token-group activation scheme would add activation
rounding for nothing at these widths, where the tensor cores idle while the weight streams in.

The kernel and configuration are timed per (N, K, width bucket) at load (install): 1 row, 4 rows, 64 rows;
never inside a CUDA-graph capture (an untimed shape takes a default). Like cuBLAS's bf16 matmuls, which pick
their algorithm by M, a verify pass's rows may round differently from one-row steps; `bench --precision`
measures what that does to bf16 text, and float32 (the exact dequantizing path) is the lossless reference.
Wider inputs (long prefills) dequantize with one kernel and use cuBLAS: compute-bound there, the extra write and
read of the 16-bit weight are a small share.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.nn.functional as F

from .fp8 import BLOCK, FP8Linear, dequantize
from .kernels import relative_error
from .splitk import INTERPRET, bucket, fastest, linear_by_columns, output, pdl, triton

if triton is not None:
    import triton.language as tl

    from .splitk import after_previous, store_tile  # (Triton functions: CPU-only installs have none)

MAX_ROWS = 256  # widths up to this run the kernels (decode, verify, graph prefills); wider ones dequantize
SELF_CHECK_TOL = 2e-2
A8_TOL = 6e-2  # the FP8 x FP8 prefill path's: its activations are rounded to e4m3 (about 3e-2 measured)
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
CONFIGS["dotbits"] = CONFIGS["dot"]  # the dot form, its FP8 bytes made bf16 by bit moves (_fp8_as_bf16)
# the stream form's (BLOCK_N, tiles of BLOCK_K columns per program, warps, stages, BLOCK_K); one row only
# (the winners of eight at the 27B shape's projections, bf16 and FP8: quant_kernels_{bf16,fp8}_stream_h200.json)
CONFIGS["stream"] = [(4, ALL, 4, 3, 1024), (4, 8, 4, 4, 2048), (8, ALL, 8, 3, 1024), (8, ALL, 4, 3, 512),
                     (32, ALL, 8, 3, 256)]
CONFIGS["streambits"] = CONFIGS["stream"]  # the stream form, its FP8 bytes made float32 by bit moves
# the stream form's tiles for 2-8 rows (_fp8_stream_rows): BLOCK_N x BLOCK_K of at most 1,024 weights a 4-warp
# program (2,048 an 8-warp one), so that eight rows' products stay in registers. On the H100 (the demo model,
# gdn_choice68_h100.txt) the 384-row shapes took the first ones, the 1,024-1,552-row ones kept the dot form
CONFIGS["streamrows"] = [(4, ALL, 4, 2, 256), (2, ALL, 4, 2, 512), (8, ALL, 4, 2, 128), (1, ALL, 4, 2, 1024),
                         (4, 8, 4, 3, 256), (16, ALL, 8, 2, 128), (8, ALL, 8, 2, 256)]
ROWS_MAX = 8  # the widths the row kernel may serve (its cost grows with them)
_chosen: dict[tuple, tuple] = {}  # (N, K, bucket, device index) -> the timed (kernel, configuration)


if triton is not None:
    @triton.jit
    def _fp8_rows(X, W, S, Y, P, LOCKS, M, N, K, stride_xm, stride_wn, stride_sn, KS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                  PDL: tl.constexpr = False):
        after_previous(PDL)
        pn, pk = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        r = tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for b in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k = b * BLOCK_K + kk
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0.0).to(tl.float32)
            if SCALED:
                s = tl.load(S + (n // BLOCK_K) * stride_sn + b, mask=n < N, other=0.0)
            for m in range(M):  # a runtime loop: one row costs one row's multiply-adds
                x = tl.load(X + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], 1)
                if SCALED:
                    part = part * s
                acc = tl.where(r[:, None] == m, acc + part[None, :], acc)
        store_tile(Y, P, LOCKS, acc, r[:, None], n[None, :], (r[:, None] < M) & (n[None, :] < N), M, N, pn)

    @triton.jit
    def _fp8_dot(X, W, S, Y, P, LOCKS, M, N, K, stride_xm, stride_wn, stride_sn, KS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                 BITS: tl.constexpr = False, ASM: tl.constexpr = False, PDL: tl.constexpr = False):
        """BITS (bf16 inputs): W holds the FP8 bytes as uint8, made bf16 by _fp8_as_bf16's bit moves instead of
        Triton's conversion (two conversion instructions a weight, issued at 16 a clock per SM on the H200,
        which held this kernel near 2.3 TB/s). Those bf16 are the weights times 2^-120, so the inputs are scaled
        by 2^64 (exact) to keep every product clear of float32's subnormals, and the sums by 2^56 at the end."""
        after_previous(PDL)
        pn, pk, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for b in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k = b * BLOCK_K + kk
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
            if BITS:
                x = (x.to(tl.float32) * 18446744073709551616.0).to(x.dtype)  # 2^64
                part = tl.dot(x, tl.trans(_fp8_as_bf16(w, ASM)))
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if SCALED:
                part = part * tl.load(S + (n // BLOCK_K) * stride_sn + b, mask=n < N, other=0.0)[None, :]
            acc += part
        if BITS:
            acc = acc * 72057594037927936.0  # 2^(120 - 64)
        store_tile(Y, P, LOCKS, acc, m[:, None], n[None, :], (m[:, None] < M) & (n[None, :] < N), M, N,
                   pn + pm * tl.num_programs(0))

    @triton.jit
    def _fp8_stream(X, W, S, Y, P, LOCKS, N, K, stride_wn, stride_sn, KS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SCALED: tl.constexpr, EVEN: tl.constexpr, BITS: tl.constexpr = False,
                    PDL: tl.constexpr = False):
        """One input row: BLOCK_N weight rows, BLOCK_K columns a tile (runs of 0.5-4 KB of each row), multiplied
        into a [BLOCK_N, BLOCK_K] float32 accumulator and summed once after the last tile. SCALED: the FP8 block
        scale multiplies the input columns (BLOCK_N divides 128, so one scale row serves the program). EVEN: whole
        tiles, no masks. BITS: W holds the FP8 bytes as int32 words (stride_wn in words), see _fp8_stream_bits."""
        after_previous(PDL)
        pn, pk = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        if BITS:
            _fp8_stream_bits(X, W, S, Y, P, LOCKS, N, K, stride_wn, stride_sn, pn, pk, n, KS, BLOCK_N, BLOCK_K,
                             SCALED, EVEN)
            return
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for c in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k = c * BLOCK_K + kk
            if EVEN:
                w = tl.load(W + n[:, None] * stride_wn + k[None, :])
                x = tl.load(X + k).to(tl.float32)
            else:
                w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                            other=0.0)
                x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            if SCALED:
                x = x * tl.load(S + (pn * BLOCK_N // 128) * stride_sn + k // 128, mask=k < K, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        store_tile(Y, P, LOCKS, tl.sum(acc, 1)[None, :], tl.arange(0, 1)[:, None], n[None, :], (n < N)[None, :], 1,
                   N, pn)

    @triton.jit
    def _fp8_stream_rows(X, W, S, Y, P, LOCKS, M, N, K, stride_xm, stride_wn, stride_sn, KS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                         PDL: tl.constexpr = False):
        """The stream form's wide tiles for a verify pass's few rows ("streamrows"): each tile of the weight is
        read once and multiplied into every row, [BLOCK_M, BLOCK_N, BLOCK_K] products summed over the columns.
        For a small model a call is mostly its latency: the dot form reads 128 columns a step in a chain of
        steps, the row form reduces every 128, where here a row of the demo model's weights is one tile."""
        after_previous(PDL)
        pn, pk = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for c in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k = c * BLOCK_K + kk
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0.0).to(tl.float32)
            x = tl.load(X + r[:, None] * stride_xm + k[None, :], mask=(r[:, None] < M) & (k[None, :] < K),
                        other=0.0).to(tl.float32)
            if SCALED:
                x = x * tl.load(S + (pn * BLOCK_N // 128) * stride_sn + k // 128, mask=k < K, other=0.0)[None, :]
            acc += tl.sum(w[None, :, :] * x[:, None, :], 2)
        store_tile(Y, P, LOCKS, acc, r[:, None], n[None, :], (r[:, None] < M) & (n[None, :] < N), M, N, pn)

    @triton.jit
    def _fp8_stream_bits(X, W, S, Y, P, LOCKS, N, K, stride_wn, stride_sn, pn, pk, n, KS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr, EVEN: tl.constexpr):
        """The stream form without conversion instructions ("streambits"). Triton makes an FP8 weight float32
        with 1.5 conversions (e4m3x2 -> f16x2, then f16 -> f32 each), issued at 16 a clock per SM on the H200:
        about 2.8 TB/s of FP8 bytes, where the stream form sat (2.8-3.5, against 4.2-4.6 for bf16 weights, whose
        conversion is a shift). Here each int32 word holds four weights, byte j of word c being column 4c + j:
        shifted to the top of the word, shifted arithmetically right by 4 and masked with 0x87F00000, a byte is
        the float32 whose sign, exponent field and top mantissa bits are its own, the FP8 value times 2^-120,
        exactly for all 256 bytes (subnormals become float32 subnormals); two or three integer operations a weight.
        The inputs are scaled by 2^64 (exact) so that no product falls into float32's subnormals, the sums by
        2^56 at the end. K must be a multiple of 4."""
        W4: tl.constexpr = BLOCK_K // 4
        kw = tl.arange(0, W4)
        acc = tl.zeros([BLOCK_N, W4], tl.float32)
        for c in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k4 = c * W4 + kw  # word indices; their columns 4 * k4 + j
            ok = 4 * k4 < K
            if EVEN:
                w = tl.load(W + n[:, None] * stride_wn + k4[None, :])
            else:
                w = tl.load(W + n[:, None] * stride_wn + k4[None, :], mask=(n[:, None] < N) & ok[None, :], other=0)
            s = 18446744073709551616.0  # 2^64
            if SCALED:  # (the four columns of a word share their 128-column block)
                s = s * tl.load(S + (pn * BLOCK_N // 128) * stride_sn + (4 * k4) // 128, mask=ok, other=0.0)
            for j in tl.static_range(4):
                if EVEN:
                    x = tl.load(X + 4 * k4 + j).to(tl.float32) * s
                else:
                    x = tl.load(X + 4 * k4 + j, mask=ok, other=0.0).to(tl.float32) * s
                f = (((w << (24 - 8 * j)) >> 4) & -2014314496).to(tl.float32, bitcast=True)  # 0x87F00000
                acc += f * x[None, :]
        total = tl.sum(acc, 1) * 72057594037927936.0  # 2^(120 - 64)
        store_tile(Y, P, LOCKS, total[None, :], tl.arange(0, 1)[:, None], n[None, :], (n < N)[None, :], 1, N, pn)

    @triton.jit
    def _fp8_as_bf16(w, ASM: tl.constexpr):
        """FP8 e4m3 bytes (uint8) as bf16 by moving bits: the sign to bit 15, exponent and mantissa 4 bits under
        it. The bf16 is the FP8 value times 2^-120, exactly for every byte, subnormals included (bf16 keeps
        float32's exponent range). ASM (CUDA): four bytes a register, per pair two logic ops, a shift and a PRMT;
        else (Triton's interpreter) the same per byte."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 v, t; prmt.b32 v, $2, 0, 0x1404; shr.b32 t, v, 4; and.b32 t, t, 0x07F007F0;"
                " and.b32 v, v, 0x80008000; or.b32 $0, v, t; prmt.b32 v, $2, 0, 0x3424; shr.b32 t, v, 4;"
                " and.b32 t, t, 0x07F007F0; and.b32 v, v, 0x80008000; or.b32 $1, v, t; }",
                "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)
        return (((w.to(tl.int32) << 24) >> 20) & 0x87F0).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _fp8_dequantize(W, S, Y, N, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(1)
        k = b * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = (n[:, None] < N) & (k[None, :] < K)
        w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.load(S + (n // BLOCK_K) * stride_sn + b, mask=n < N, other=0.0)
        tl.store(Y + n[:, None].to(tl.int64) * K + k[None, :], (w * s[:, None]).to(Y.dtype.element_ty), mask=ok)


    @triton.jit
    def _fp8_quantize_groups(X, Q, S, M, M_PAD, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows of X (padded to M_PAD with zeros) in e4m3, one float32 scale per row and 128 columns: amax / 448,
        as Qwen's FP8 releases declare their activations ("activation_scheme": "dynamic")."""
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        b = tl.program_id(1)
        k = b * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
        tl.store(Q + m[:, None].to(tl.int64) * K + k[None, :], (x / s[:, None]).to(Q.dtype.element_ty),
                 mask=(m[:, None] < M_PAD) & (k[None, :] < K))
        tl.store(S + b * M_PAD + m, s, mask=m < M_PAD)  # [K / 128, M_PAD]: M-major, as cuBLASLt reads 1x128 scales


def dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8.dequantize's weight [N, K] in one kernel: the FP8 bytes read once and the 16-bit weight written once
    (torch's form goes through a float32 [N, K]: at the 27B shape's gate / up projection 0.7 GB written and read
    again per long-prefill chunk). The same products, rounded once to dtype."""
    N, K = weight.shape
    y = torch.empty(N, K, device=weight.device, dtype=dtype)
    _fp8_dequantize[(triton.cdiv(N, 64), triton.cdiv(K, BLOCK))](weight, scale, y, N, K, weight.stride(0),
                                                                 scale.stride(0), BLOCK_N=64, BLOCK_K=BLOCK)
    return y


def _launch(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, choice) -> torch.Tensor:
    """One (kernel, configuration): the K slices' float32 partials summed by the last slice, or, unsplit, the
    output written directly in x's dtype. scale None: a 16-bit weight, streamed the same way (linear16_triton.py)."""
    kind, (block_n, ks, warps, stages, *wide) = choice
    scaled = scale is not None
    scale = scale if scaled else weight  # (a pointer the kernel never reads)
    M, K = x2.shape
    N = weight.shape[0]
    stream = kind.startswith("stream")  # (stream, streambits: one row; streamrows: its tiles, a few rows)
    block_k = wide[0] if stream else BLOCK  # (the stream forms' tile width; the others' is a scale block)
    blocks = triton.cdiv(K, block_k)
    ks = min(ks, blocks)
    slices = triton.cdiv(blocks, ks)
    block_m = triton.next_power_of_2(max(M, 1)) if kind == "rows" else max(16, bucket(M)) if M > 8 else 16
    tiles = triton.cdiv(N, block_n) * (1 if stream or kind == "rows" else triton.cdiv(M, block_m))
    out, part, locks = output(M, N, slices, tiles, x2)
    if kind == "streamrows":
        _fp8_stream_rows[(triton.cdiv(N, block_n), slices)](
            x2, weight, scale, out, part, locks, M, N, K, x2.stride(0), weight.stride(0), scale.stride(0), KS=ks,
            BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, SCALED=scaled, num_warps=warps,
            num_stages=stages, **pdl(x2))
    elif stream:
        bits = kind == "streambits"  # (the FP8 bytes as int32 words: K a multiple of 4, streams_bits)
        _fp8_stream[(triton.cdiv(N, block_n), slices)](
            x2, weight.view(torch.int32) if bits else weight, scale, out, part, locks, N, K,
            weight.stride(0) // 4 if bits else weight.stride(0), scale.stride(0), KS=ks, BLOCK_N=block_n,
            BLOCK_K=block_k, SCALED=scaled, EVEN=N % block_n == 0 and K % block_k == 0, BITS=bits, num_warps=warps,
            num_stages=stages, **pdl(x2))
    elif kind == "rows":
        _fp8_rows[(triton.cdiv(N, block_n), slices)](
            x2, weight, scale, out, part, locks, M, N, K, x2.stride(0), weight.stride(0), scale.stride(0),
            KS=ks, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, SCALED=scaled, num_warps=warps,
            num_stages=stages, **pdl(x2))
    else:
        bits = kind == "dotbits" and scaled and x2.dtype == torch.bfloat16  # (else: Triton's conversion, if any)
        _fp8_dot[(triton.cdiv(N, block_n), slices, triton.cdiv(M, block_m))](
            x2, weight.view(torch.uint8) if bits else weight, scale, out, part, locks, M, N, K, x2.stride(0),
            weight.stride(0), scale.stride(0), KS=ks, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK,
            SCALED=scaled, BITS=bits, ASM=bits and not INTERPRET, num_warps=warps, num_stages=stages, **pdl(x2))
    return out


def streams_bits(weight: torch.Tensor) -> bool:
    """Whether the streambits form can read this FP8 weight as int32 words: rows of a multiple of 4 bytes, each
    starting on a word."""
    return weight.stride(-1) == 1 and weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0 \
        and weight.storage_offset() % 4 == 0


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
    """fp8.matmul's kernel: up to MAX_ROWS rows through the Triton op, wider inputs dequantized (by a kernel) for
    cuBLAS."""
    if x.numel() // x.shape[-1] <= MAX_ROWS:
        return fp8_linear_op(x, weight, scale)
    x2 = x.reshape(-1, x.shape[-1])
    y = linear_by_columns(x2, weight.shape[0], weight.shape[1],
                          lambda start, end: dequantized(weight[start:end], scale[start // BLOCK:], x.dtype))
    return y.view(*x.shape[:-1], -1)


def matmul_a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """matmul, except that wider inputs whose shape cuBLASLt's block scaling takes run FP8 x FP8 (fp8_linear_a8)."""
    if x.numel() // x.shape[-1] > MAX_ROWS and a8_shape(weight):
        return fp8_linear_a8(x, weight, scale)
    return matmul(x, weight, scale)


def a8_shape(weight: torch.Tensor) -> bool:
    """Whole 128-blocks, and K's blocks a multiple of 4 (the 1x128 scales' alignment)."""
    N, K = weight.shape
    return N % BLOCK == 0 and K % (4 * BLOCK) == 0


@torch.library.custom_op("mtpchat::fp8_linear_a8", mutates_args=())
def fp8_linear_a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Long prefills at FP8 tensor-core speed: x quantized per row and 128 columns to e4m3 (one kernel), then
    cuBLASLt's block-scaled FP8 GEMM (1x128 activation scales, the weight's 128x128 ones). On the H200 at 2,048
    rows of the 27B shape: 0.28-0.56 ms for the matmul against bf16 cuBLAS's 0.51-0.91 ms
    (packaging/bench/fp8_prefill_ops.py). Rows are padded to a multiple of 4 (the scales' alignment)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    mp = -(-M // 4) * 4
    q = torch.empty(mp, K, device=x.device, dtype=torch.float8_e4m3fn)
    sx = torch.empty(K // BLOCK, mp, device=x.device, dtype=torch.float32)
    _fp8_quantize_groups[(triton.cdiv(mp, 32), K // BLOCK)](x2, q, sx, M, mp, K, x2.stride(0), BLOCK_M=32,
                                                            BLOCK_K=BLOCK)
    y = F.scaled_mm(q, weight.t(), sx.t(), F.ScalingType.BlockWise1x128, scale.t(), F.ScalingType.BlockWise128x128,
                    output_dtype=x.dtype)
    return y[:M].reshape(*x.shape[:-1], weight.shape[0])


@fp8_linear_a8.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def tune(weight: torch.Tensor, scale: torch.Tensor, rows: int = 1) -> tuple:
    """The fastest (kernel, configuration) for this weight shape at `rows` rows, remembered for its bucket."""
    N, K = weight.shape
    key = (N, K, bucket(rows), weight.device.index)
    if key not in _chosen:
        x = torch.randn(rows, K, device=weight.device, dtype=torch.bfloat16)
        kinds = ("rows", "dot", "dotbits", "streamrows") if rows <= ROWS_MAX else ("dot", "dotbits")
        if rows == 1:  # (the stream forms serve one row only)
            kinds = ("stream",) + (("streambits",) if streams_bits(weight) else ()) + kinds
        _chosen[key] = fastest([(kind, c) for kind in kinds for c in CONFIGS[kind]],
                               lambda choice: _launch(x, weight, scale, choice))
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
                    head, head_scale = w[:2 * BLOCK], s[:2]  # long prefills' dequantizing kernel: exact
                    if not torch.equal(dequantized(head, head_scale, dtype), dequantize(head, head_scale, dtype)):
                        worst = float("inf")
        except Exception as e:  # a Triton / driver failure: keep the dequantizing matmul
            reason = f"Triton FP8 kernel failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        else:
            if not worst < SELF_CHECK_TOL:  # NaN too
                reason = f"Triton FP8 kernel self-check failed: error {worst:.1e}"
    if reason is not None:
        return f"weight-only: each matmul dequantizes its FP8 weight first ({reason})"
    why_not_a8, a8_error = _a8_check(targets, device, dtype)
    for m, _, _ in targets:
        m.fp8_kernel = matmul if why_not_a8 else matmul_a8
    prefill = (f"dequantized by a kernel, then cuBLAS ({why_not_a8})" if why_not_a8 else
               f"FP8 x FP8 block-scaled cuBLASLt, activations in e4m3 per row and 128 columns (self-check "
               f"{a8_error:.1e})")
    return f"Triton W8A16 kernel: FP8 weights streamed, dequantized in registers, up to {MAX_ROWS} rows " \
           f"(self-check {worst:.1e}, {len(checked)} shapes timed); longer prefills: {prefill}"


def _a8_check(targets: list, device: torch.device, dtype: torch.dtype) -> tuple[str | None, float]:
    """(why long prefills keep 16-bit activations, or None; the FP8 x FP8 path's worst relative error against the
    dequantized matmul). Its activation rounding (e4m3: 3 mantissa bits) costs about 3e-2 of the output's range at
    the 27B shape's projections, against 4e-3 for the W8A16 kernel, so it is kept to prefills: they build the
    state, and decoding's and verify's rows stay W8A16. MTPCHAT_FP8_PREFILL=w8a16 opts out."""
    if os.environ.get("MTPCHAT_FP8_PREFILL") == "w8a16":
        return "MTPCHAT_FP8_PREFILL=w8a16", 0.0
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "no FP8 tensor cores below compute capability 8.9", 0.0
    if not hasattr(F, "scaled_mm"):
        return f"torch {torch.__version__} has no block-scaled F.scaled_mm", 0.0
    worst, checked = 0.0, set()
    try:
        for _, w, s in targets:
            if a8_shape(w) and tuple(w.shape) not in checked:
                checked.add(tuple(w.shape))
                gen = torch.Generator(device=w.device).manual_seed(7)
                x = torch.randn(MAX_ROWS + 3, w.shape[1], generator=gen, device=w.device).to(dtype)
                worst = max(worst, relative_error(fp8_linear_a8(x, w, s), F.linear(x, dequantize(w, s, dtype))))
    except Exception as e:  # an older cuBLASLt / torch without 1x128 x 128x128 block scaling
        return f"F.scaled_mm failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}", 0.0
    if not checked:
        return "no weight shape in whole blocks of 4 x 128 columns", 0.0
    if not worst < A8_TOL:
        return f"FP8 x FP8 self-check failed: error {worst:.1e}", 0.0
    return None, worst
