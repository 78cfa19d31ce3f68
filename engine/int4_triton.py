"""W4A16 matmuls on CUDA in 16-bit: Int4Linear's packed weights (int4.py's layout: qweight int32 [K/8, N] packed
along K, zeros uint8 [G, N], scales [G, N]) dequantized in registers.

Up to MAX_ROWS rows (decode, verify, graph prefills) one kernel streams the packed weight: each program owns
BLOCK_N output columns and a slice of K's blocks (BLOCK_K rows inside one group, so one zero / scale row serves a
block). Three forms compete:
  - row (decoding's one row): CUDA cores, float32 throughout (_w4a16_row). On the H200 0.123 ms over the 27B
    shape's seven projections, 1.65-2.43 TB/s of packed bytes, against dot8's 0.241 and bf16 cuBLAS's 0.260
    (packaging/bench/quant_kernels_int4_lane_h200.json). Its bound is instruction issue, not HBM: the loop was
    648 instructions a 128-row block at (64, 4, 2 warps) in sm_90 SASS (0.150 ms), 495 once each nibble took one
    LOP3 instead of two and the zero's correction one sum a block instead of an add a nibble. A thread's share
    of the tile decides it: 16 words a thread ran at 0.9 TB/s with one K slice per 8 blocks and 1.4-1.9 with one
    per 4 (the form before those two changes); 64 words a thread ran ten times slower
    (register spills, presumably: not profiled). For verify's 2-8 rows the same kernel over [rows, K / 8, N]
    tiles ran 0.637 ms at four rows against dot8's 0.256 (each row adds an FMA a weight: twice the issue
    work at four rows), so it serves one row only;
  - dot8 (verify widths and up): tensor cores without conversion instructions or a reshape (_w4a16_dot8), for
    groups of 128 (and -1): 1.0-1.25 TB/s at one to four rows. Its unpacked tile reaches the tensor cores
    through shared memory, 16 bytes of 16-bit weight for every 4-byte word: that round trip bounds it;
  - dot: the [BLOCK_K, BLOCK_N] tile unpacked, (q - zero) * scale in float32 rounded to the activation's dtype,
    reshaped into one dot's layout (any group size): 0.74-1.0 TB/s, the default every other form is checked
    against.
K slices' float32 partials are summed in slice order by the last slice to finish (splitk.store_tile). The
kernel and configuration are timed per (N, K, group, width bucket) at load inside CUDA graphs, as fp8_triton
does, among the choices whose output agrees with the dot form's default. Wider inputs (long prefills) dequantize
with a kernel into a temporary 16-bit weight, then cuBLAS: compute-bound there, the temporary's write and read
are a small share (the torch-ops unpacking it replaces cost 0.86 s for a 32-token prefill of the 27B shape).

Act-order weights come with their rows sorted by group (int4.py): the input columns are permuted to match.
Behind the custom op mtpchat::int4_linear (opaque to torch.compile, replayable in CUDA graphs).
"""

from __future__ import annotations

import torch

from .kernels import relative_error
from .splitk import bucket, fastest, linear_by_columns, output, pdl, triton

if triton is not None:
    import triton.language as tl

    from .splitk import after_previous, store_tile  # (Triton functions: CPU-only installs have none)

MAX_ROWS = 256  # widths up to this run the W4A16 kernel; wider ones dequantize, then cuBLAS
SELF_CHECK_TOL = 2e-2
ALL = 1 << 20  # "K blocks per program": all of them (no split: the output is written once, in its dtype)
NIBBLE = 0xF0000  # the row form's nibble mask, an argument (see _w4a16_row)
# (BLOCK_N, K blocks per program, warps, stages) per kernel; the first "dot" one is the untimed default
CONFIGS = {  # (pruned to the configurations that won some shape and width on the H200: quant_kernels_h200.json)
    "dot": [(64, 8, 4, 3), (128, 4, 4, 3), (128, 8, 4, 3), (128, 16, 8, 3), (64, ALL, 4, 3)],
    "dot8": [(64, 8, 4, 3), (128, 8, 4, 3), (128, 4, 4, 3), (128, 16, 8, 3)],
    # (a thread's share of the tile: BLOCK_N * 16 words / (32 * warps): 64 words ran ten times slower than 16;
    # stages: 1 loads each block as it comes, 3 stages the next two blocks' words through shared memory: the two
    # staged winners of eight, quant_kernels_ahead_h100.json)
    "row": [(64, 4, 2, 1), (32, 4, 1, 1), (64, 8, 4, 1), (128, 4, 2, 1), (64, 4, 4, 1), (32, 8, 1, 3), (64, 16, 2, 3)],
}
_chosen: dict[tuple, tuple] = {}  # (N, K, group, bucket, device index) -> the timed (kernel, configuration)


def block_k(group_size: int, k: int) -> int | None:
    """The K-block: a power of two from 16 to 128 inside one group (so one zero / scale row serves it)."""
    g = k if group_size == -1 else group_size
    for b in (128, 64, 32, 16):
        if g % b == 0:
            return b
    return None


def blockable(groups) -> bool:
    """Whether every weight of `groups`, (group size, K) pairs, has a K-block (block_k) for the kernels."""
    return all(block_k(g, k) is not None for g, k in groups)


def usable(device: torch.device, dtype: torch.dtype, groups=()) -> str | None:
    """Why the kernels cannot serve 4-bit weights here, or None; groups: (group size, K) of each weight."""
    from .splitk import INTERPRET

    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not INTERPRET:
        return "CUDA only"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit activations only ({str(dtype).replace('torch.', '')}: dequantize, then matmul)"
    if not blockable(groups):
        return "a group size without a 16..128 power-of-two K-block"
    return None


if triton is not None:

    @triton.jit
    def _packed_block(QW, Z, S, k0, n, n_ok, K, GROUP, stride_q, stride_z, stride_s, BLOCK_K: tl.constexpr,
                      EVEN: tl.constexpr = False):
        """K-block k0's packed words [BLOCK_K / 8, BLOCK_N] (word i holds input rows k0 + 8i .. k0 + 8i + 7) and
        its group's zeros and scales [BLOCK_N] in float32. EVEN: the block and the columns lie inside the weight
        and its offsets fit 32 bits (the caller checked), so no masks and no 64-bit offsets."""
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        g = k0 // GROUP
        if EVEN:
            packed = tl.load(QW + rows[:, None] * stride_q + n[None, :])
            z = tl.load(Z + g * stride_z + n).to(tl.float32)
            s = tl.load(S + g * stride_s + n).to(tl.float32)
        else:
            packed = tl.load(QW + rows[:, None].to(tl.int64) * stride_q + n[None, :],
                             mask=(rows < K // 8)[:, None] & n_ok[None, :], other=0)
            z = tl.load(Z + g * stride_z + n, mask=n_ok, other=0).to(tl.float32)
            s = tl.load(S + g * stride_s + n, mask=n_ok, other=0).to(tl.float32)
        return packed, z, s

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel per row bucket: none compiles inside a capture
    def _w4a16(X, QW, Z, S, Y, P, LOCKS, M, N, K, GROUP, stride_xm, stride_q, stride_z, stride_s,
               KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr = False):
        after_previous(PDL)
        pn, pk, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        shifts = tl.arange(0, 8) * 4
        n_ok, m_ok = n < N, m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k0 = b * BLOCK_K
            packed, z, s = _packed_block(QW, Z, S, k0, n, n_ok, K, GROUP, stride_q, stride_z, stride_s, BLOCK_K)
            q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]: row 8i + j
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))
            w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(X.dtype.element_ty)
            ks = k0 + offs_k
            x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
            acc += tl.dot(x, w)
        store_tile(Y, P, LOCKS, acc, m[:, None], n[None, :], m_ok[:, None] & n_ok[None, :], M, N,
                   pn + pm * tl.num_programs(0))

    @triton.jit(do_not_specialize=["M"])
    def _w4a16_dot8(X, QW, Z, S, Y, P, LOCKS, M, N, K, GROUP, stride_xm, stride_q, stride_z, stride_s,
                    KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MAGIC: tl.constexpr, BASE: tl.constexpr, PDL: tl.constexpr = False):
        """The tensor-core form without conversion instructions or a reshape: nibble j of every word is OR-ed
        into the mantissa of a 16-bit float BASE (128 in bf16, 1024 in fp16: the float's value is BASE + q,
        exact), BASE + zero is subtracted (exact), the group scale multiplies in x's dtype (one rounding, as
        the dequantizing reference rounds), and each nibble's [BLOCK_K / 8, BLOCK_N] tile meets the input
        columns k0 + 8i + j in its own dot."""
        after_previous(PDL)
        pn, pk, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        i = tl.arange(0, BLOCK_K // 8)
        n_ok, m_ok = n < N, m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b in range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K))):
            k0 = b * BLOCK_K
            packed, z, s = _packed_block(QW, Z, S, k0, n, n_ok, K, GROUP, stride_q, stride_z, stride_s, BLOCK_K)
            base = (z + BASE).to(X.dtype.element_ty)
            scale = s.to(X.dtype.element_ty)
            for j in tl.static_range(8):
                q = (((packed >> (4 * j)) & 0xF) | MAGIC).to(tl.int16).to(X.dtype.element_ty, bitcast=True)
                w = (q - base[None, :]) * scale[None, :]
                ks = k0 + i * 8 + j
                x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :],
                            other=0.0)
                acc += tl.dot(x, w)
        store_tile(Y, P, LOCKS, acc, m[:, None], n[None, :], m_ok[:, None] & n_ok[None, :], M, N,
                   pn + pm * tl.num_programs(0))

    @triton.jit
    def _columns8(x, R: tl.constexpr):
        """x [R, 8] -> its 8 columns [R] (splits of the last dimension: no data moves when a thread holds a row)."""
        a, b = tl.split(tl.reshape(x, (R, 4, 2)))  # j even, odd
        a0, a1 = tl.split(tl.reshape(a, (R, 2, 2)))  # j = 0, 4 | 2, 6
        b0, b1 = tl.split(tl.reshape(b, (R, 2, 2)))  # j = 1, 5 | 3, 7
        c0, c4 = tl.split(a0)
        c2, c6 = tl.split(a1)
        c1, c5 = tl.split(b0)
        c3, c7 = tl.split(b1)
        return c0, c1, c2, c3, c4, c5, c6, c7

    @triton.jit
    def _w4a16_row(X, QW, Z, S, Y, P, LOCKS, M, N, K, GROUP, stride_xm, stride_q, stride_z, stride_s, NIBBLE,
                   KS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                   STAGES: tl.constexpr, PDL: tl.constexpr = False):
        """The CUDA-core form for decoding's one row: no tensor cores, so no shared-memory round trip of the
        unpacked tile (the dot forms' bound: 16 bytes of 16-bit weight a packed word through shared memory).
        Each nibble costs a shift, one LOP3 and one FMA: moved to bits 16-19 and OR-ed under the exponent of
        128.0 it is the float 128 + q exactly, so x * (128 + q) are exact float32 products; per block the
        column sums less (128 + zero) * sum(x), times the scale: sum(x * (q - zero) * scale) in float32 (the
        weight is never rounded to 16 bits). NIBBLE is 0xF0000 passed at run time: as a constant, the mask and
        the exponent were two immediates, which LOP3 cannot take together (two LOP3s a nibble). EVEN: whole
        blocks and tiles (every real shape), so no masks and 32-bit offsets. STAGES > 1: the next STAGES - 1
        blocks' words are copied into shared memory asynchronously (cp.async, LDGSTS), so a warp has more than
        one block in flight: Triton's pipeliner stages a loop's loads without a dot only when the loop asks for
        stages (tl.range). On the H100 that took the 5,120-column projections from 10.8-11.0 us to 9.1-9.3 (at
        32 columns, 8 blocks a program, one warp; quant_kernels_ahead_h100.json); loading the next block into
        registers ahead instead (a variant measured with it) gained half as much."""
        after_previous(PDL)
        pn, pk = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        i = tl.arange(0, BLOCK_K // 8)
        n_ok = n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for b in tl.range(pk * KS, tl.minimum(pk * KS + KS, tl.cdiv(K, BLOCK_K)), num_stages=STAGES):
            k0 = b * BLOCK_K
            packed, z, s = _packed_block(QW, Z, S, k0, n, n_ok, K, GROUP, stride_q, stride_z, stride_s, BLOCK_K,
                                         EVEN)
            t = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            kb = k0 + i[:, None] * 8 + tl.arange(0, 8)[None, :]
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                xb = tl.load(X + kb).to(tl.float32)
                xs = tl.sum(tl.load(X + ks).to(tl.float32), 0)
            else:
                xb = tl.load(X + kb, mask=kb < K, other=0.0).to(tl.float32)
                xs = tl.sum(tl.load(X + ks, mask=ks < K, other=0.0).to(tl.float32), 0)
            xc = _columns8(xb, BLOCK_K // 8)
            for j in tl.static_range(8):
                if j < 4:
                    moved = packed << (16 - 4 * j)
                else:
                    moved = packed >> (4 * j - 16)
                q = ((moved & NIBBLE) | 0x43000000).to(tl.float32, bitcast=True)  # 128 + nibble j
                t += q * xc[j][:, None]
            acc += (tl.sum(t, 0) - xs * (z + 128.0)) * s
        store_tile(Y, P, LOCKS, acc[None, :], tl.arange(0, 1)[:, None], n[None, :], n_ok[None, :], 1, N, pn)

    @triton.jit
    def _dequantize(QW, Z, S, W, N, K, GROUP, stride_q, stride_z, stride_s,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The weight [N, K] (F.linear's layout, sorted rows' order) in W's dtype, as _w4a16 rounds it."""
        pn, pb = tl.program_id(0), tl.program_id(1)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = pb * BLOCK_K
        n_ok = n < N
        packed, z, s = _packed_block(QW, Z, S, k0, n, n_ok, K, GROUP, stride_q, stride_z, stride_s, BLOCK_K)
        q = tl.reshape((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(W.dtype.element_ty)
        ks = k0 + tl.arange(0, BLOCK_K)
        tl.store(W + n[None, :].to(tl.int64) * K + ks[:, None], w, mask=n_ok[None, :] & (ks < K)[:, None])


def _launch(x2: torch.Tensor, qweight, zeros, scales, group: int, choice) -> torch.Tensor:
    """One (kernel, configuration): "dot" or "dot8" (tensor cores, any width, 16 rows and more per dot), or
    "row" (CUDA cores, one row)."""
    kind, (block_n, ks, warps, stages) = choice
    M, K = x2.shape
    N = qweight.shape[1]
    bk = block_k(group, K)
    blocks = triton.cdiv(K, bk)
    slices = triton.cdiv(blocks, min(ks, blocks))
    block_m = 1 if kind == "row" else 16 if M <= 16 else bucket(M)
    out, part, locks = output(M, N, slices, triton.cdiv(N, block_n) * triton.cdiv(M, block_m), x2)
    args = (x2, qweight, zeros, scales, out, part, locks, M, N, K, K if group == -1 else group, x2.stride(0),
            qweight.stride(0), zeros.stride(0), scales.stride(0))
    if kind == "row":
        if M != 1:
            raise ValueError(f"the row form serves one row, not {M}")
        even = N % block_n == 0 and K % bk == 0 and qweight.shape[0] * qweight.stride(0) < 2**31
        _w4a16_row[(triton.cdiv(N, block_n), slices)](*args, NIBBLE, KS=min(ks, blocks), BLOCK_N=block_n,
                                                      BLOCK_K=bk, EVEN=even, STAGES=stages, num_warps=warps,
                                                      num_stages=stages, **pdl(x2))
    elif kind == "dot8":  # (its dots' K is BLOCK_K / 8: tensor cores need 16)
        if bk < 128:
            raise ValueError(f"dot8 needs 128-row K-blocks, not {bk}")
        magic, base = (0x6400, 1024.0) if x2.dtype == torch.float16 else (0x4300, 128.0)
        _w4a16_dot8[(triton.cdiv(N, block_n), slices, triton.cdiv(M, block_m))](
            *args, KS=min(ks, blocks), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, MAGIC=magic, BASE=base,
            num_warps=warps, num_stages=stages, **pdl(x2))
    else:
        _w4a16[(triton.cdiv(N, block_n), slices, triton.cdiv(M, block_m))](
            *args, KS=min(ks, blocks), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=warps,
            num_stages=stages, **pdl(x2))
    return out


def dequantize(qweight, zeros, scales, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The 16-bit weight [N, K] in the sorted rows' order (wide inputs: one kernel instead of torch's unpacking)."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    bk = block_k(group, K)
    w = torch.empty(N, K, device=qweight.device, dtype=dtype)
    _dequantize[(triton.cdiv(N, 64), triton.cdiv(K, bk))](qweight, zeros, scales, w, N, K,
                                                           K if group == -1 else group, qweight.stride(0),
                                                           zeros.stride(0), scales.stride(0), BLOCK_N=64, BLOCK_K=bk)
    return w


def _config(M: int, N: int, K: int, group: int, device: torch.device) -> tuple:
    return _chosen.get((N, K, group, bucket(M), device.index), ("dot", CONFIGS["dot"][0]))


def tune(lin, rows: int) -> tuple:
    """The fastest (kernel, configuration) for this weight at `rows` rows, remembered for its bucket. Only
    choices whose output agrees with the dot form's default are timed (that one install's self_check holds to
    the dequantized weight): a kernel form this GPU or Triton version computes wrongly is never chosen."""
    K, N = lin.qweight.shape[0] * 8, lin.qweight.shape[1]
    key = (N, K, lin.group_size, bucket(rows), lin.qweight.device.index)
    if key not in _chosen:
        x = torch.randn(rows, K, device=lin.qweight.device, dtype=torch.bfloat16)

        def run(choice):
            return _launch(x, lin.qweight, lin.zeros, lin.scales, lin.group_size, choice)

        ref = run(("dot", CONFIGS["dot"][0])).float()  # (not the float32 weight: 3 GB at the 27B shape's widest)

        def agrees(choice):
            try:
                return relative_error(run(choice).float(), ref) <= SELF_CHECK_TOL
            except Exception:  # (too much shared memory for this GPU, say: fastest() would skip it too)
                return False

        kinds = [k for k in CONFIGS if (k != "dot8" or block_k(lin.group_size, K) == 128)
                 and (k != "row" or rows == 1)]
        good = [(k, c) for k in kinds for c in CONFIGS[k] if agrees((k, c))] or [("dot", CONFIGS["dot"][0])]
        _chosen[key] = fastest(good, run)
    return _chosen[key]


@torch.library.custom_op("mtpchat::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group: int) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (rows already in the weight's sorted order) times the 4-bit weight: [M, N]. The
    weight's tensors may be column slices of a fused projection's (their rows strided; columns contiguous)."""
    x = x.contiguous()
    choice = _config(x.shape[0], qweight.shape[1], x.shape[1], group, x.device)
    return _launch(x, qweight, zeros, scales, group, choice)


@int4_linear.register_fake
def _(x, qweight, zeros, scales, group):
    return x.new_empty(x.shape[0], qweight.shape[1])


def forward(lin, x: torch.Tensor) -> torch.Tensor:
    """Int4Linear's forward where install chose the kernel: up to MAX_ROWS rows through the op, wider inputs
    through the dequantized weight."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if lin.perm is not None:
        x2 = x2.index_select(1, lin.perm)
    if x2.shape[0] > MAX_ROWS:
        def columns(start: int, end: int) -> torch.Tensor:
            return dequantize(lin.qweight[:, start:end], lin.zeros[:, start:end], lin.scales[:, start:end],
                              lin.group_size, x.dtype)

        return linear_by_columns(x2, lin.qweight.shape[1], x2.shape[1], columns).view(*shape[:-1], -1)
    return int4_linear(x2, lin.qweight, lin.zeros, lin.scales, lin.group_size).view(*shape[:-1], -1)


def install(modules, device, dtype) -> str | None:
    """Give every Int4Linear in `modules` the kernel, after timing its configurations per weight shape and a
    self-check per distinct shape against the float32 dequantized reference at decode, verify and prefill widths;
    all or none. Returns the choice with its reason (None: no Int4Linear modules)."""
    from .int4 import Int4Linear

    lins = [m for m in modules if isinstance(m, Int4Linear)]
    if not lins:
        return None
    device = torch.device(device)
    why = usable(device, dtype, [(m.group_size, m.in_features) for m in lins])
    worst, checked = 0.0, set()
    if why is None:
        try:
            for m in lins:
                key = (m.in_features, m.out_features, m.group_size, m.perm is not None)
                if key not in checked:
                    checked.add(key)
                    if device.type == "cuda":
                        for rows in (1, 4, 64):  # decoding, verify, a graph prefill
                            tune(m, rows)
                    worst = max(worst, self_check(m, dtype))
        except Exception as e:  # an architecture or Triton version the kernel does not compile for
            why = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if why is None and not worst <= SELF_CHECK_TOL:  # NaN too
            why = f"self-check mismatch {worst:.2g}"
    for m in lins:
        m.kernel = None if why else forward
    if why:
        return f"dequantize, then matmul ({why})"
    return (f"Triton W4A16 kernel up to {MAX_ROWS} rows, a dequantizing kernel then cuBLAS above (self-check "
            f"{worst:.1e} over {len(checked)} shapes)")


def self_check(lin, dtype) -> float:
    """Relative error of the kernel against the float32 dequantized weight on random rows: 1, 5 and 40 rows, and
    one more than MAX_ROWS (the dequantizing kernel); over the first 256 output columns, so that the float32
    reference stays small on a 24 GB GPU (the kernels read column slices as fused projections' parts are)."""
    from .int4 import Int4Linear

    c = min(lin.out_features, 256)
    part = Int4Linear(lin.in_features, c, lin.qweight[:, :c], lin.zeros[:, :c], lin.scales[:, :c], lin.group_size,
                      lin.perm)
    gen = torch.Generator(device=lin.qweight.device).manual_seed(0)
    x = torch.randn(MAX_ROWS + 1, lin.in_features, generator=gen, device=lin.qweight.device).to(dtype)
    ref = x.float() @ part.dequantized(torch.float32).T
    return max(relative_error(forward(part, x[:r]).float(), ref[:r]) for r in (1, 5, 40, MAX_ROWS + 1))
