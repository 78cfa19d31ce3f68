"""RMSNorm as one Triton kernel, for CUDA: Qwen3-Next / Qwen3.5's zero-centred weight (the checkpoints store
weight - 1: x * rstd * (1 + w)) and dense Qwen3's plain one (x * rstd * w), told apart by the self-check.

transformers' eager forward is about seven kernels (cast, pow, mean, add + rsqrt, mul, 1 + weight, mul, cast). The
engine runs its CUDA graphs without torch.compile by default, so each is a graph node of ~2 us, and at batch 1 the
norms (two per layer, plus q / k norms per head) are a large share of a step's kernels. Here: one program per row,
float32 accumulation, the same order of operations as the reference, the output in x's dtype.

GDN's output norm (RMSNormGated: the norm rounded to x's dtype, times the weight, times silu(gate) in float32) is
about twelve kernels a layer in transformers' form, one here (_gated_rms_norm_kernel, mtpchat::gated_rms_norm).

The kernel sits behind the custom op mtpchat::rms_norm. install() swaps it into modules' forward, except while
torch.compile traces: inductor fuses the eager math with its neighbours better than it can an opaque op. Block
sizes and warps are picked from D (no autotuning: nothing to benchmark when first called in a graph warm-up).
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Iterable

import torch

from .cycle_triton import ARGMAX_BLOCK
from .kernels import relative_error
from .splitk import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, available() says no
    triton = None

ADD_NORM = os.environ.get("MTPCHAT_ADD_NORM") != "0"  # add_then_norm's one kernel; 0: the add and the norm apart
MAX_BLOCK = 8192  # a whole row in registers up to here (Qwen3-Next hidden sizes: 2048, 4096, 5120); loops above
SELF_CHECK_TOL = 2e-2  # max abs error / max abs of the reference, on a random [3, D] input


def available() -> bool:
    """Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    from .cycle_triton import _row_argmax
    from .splitk import after_previous

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, eps, shift, D: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        after_previous(PDL)
        row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 for long prefills at large D
        x_row = x_ptr + row * stride_x
        out_row = out_ptr + row * D
        cols = tl.arange(0, BLOCK)
        if BLOCK >= D:  # the whole row in one block: read x once
            mask = cols < D
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (x * rstd * (shift + w)).to(out_ptr.dtype.element_ty), mask=mask)
        else:  # two passes over the row: sum of squares, then scale (the second read mostly hits L2)
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for d0 in range(0, D, BLOCK):
                mask = d0 + cols < D
                x = tl.load(x_row + d0 + cols, mask=mask, other=0.0).to(tl.float32)
                acc += x * x
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
            for d0 in range(0, D, BLOCK):
                mask = d0 + cols < D
                x = tl.load(x_row + d0 + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + d0 + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_row + d0 + cols, (x * rstd * (shift + w)).to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, stride_h, stride_d, eps, shift,
                             D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """The residual add and the next norm: sum = h + d rounded to h's dtype (torch's add), and the norm of
        that rounded sum as _rms_norm_kernel computes it. The whole row in one block (D <= MAX_BLOCK)."""
        after_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        total = (h + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, total, mask=mask)
        x = total.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + cols, (x * rstd * (shift + w)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _two_norms_kernel(ids_ptr, table_ptr, h_ptr, we_ptr, wh_ptr, out_ptr, x_ptr, stride_t, stride_h, stride_x, V,
                          eps_e, eps_h, shift, D: tl.constexpr, BLOCK: tl.constexpr, ARGMAX: tl.constexpr = False,
                          ABLOCK: tl.constexpr = 1, PDL: tl.constexpr = False):
        """The MTP head's input in one launch: out [rows, 2D] = [norm_e(table[ids[row]]), norm_h(h[row])], program
        (row, 0) the embedding's half, (row, 1) the hidden's, each as _rms_norm_kernel computes it. ARGMAX: ids[row]
        is first written as the argmax of the logits' row x_ptr [rows, V] (cycle_triton._row_argmax, ABLOCK
        columns a step)."""
        after_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        if tl.program_id(1) == 0:
            if ARGMAX:
                token = _row_argmax(x_ptr + row * stride_x, V, ABLOCK).to(tl.int64)
                tl.store(ids_ptr + row, token)
            else:
                token = tl.load(ids_ptr + row).to(tl.int64)
            src = table_ptr + token * stride_t
            w_ptr, eps = we_ptr, eps_e
        else:
            src = h_ptr + row * stride_h
            w_ptr, eps = wh_ptr, eps_h
        x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * 2 * D + tl.program_id(1) * D + cols,
                 (x * rstd * (shift + w)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, stride_x, stride_g, eps, D: tl.constexpr,
                               BLOCK: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False):
        """transformers' RMSNormGated (GDN's output norm), one program per row, in its order: the norm rounded to
        x's dtype, times the weight (the product rounded again where the weight is 16-bit, as torch rounds it),
        times silu(gate) in float32, rounded once more."""
        after_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
        if ROUND:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + cols, (y * (g / (1.0 + tl.exp(-g)))).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    # 32 threads x 8 bf16 (16 bytes, one vector load each) cover 256 columns: a warp is enough for a head's norm
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rows_of(x: torch.Tensor, D: int) -> torch.Tensor:
    """x [..., D] as [rows, D] with unit column stride: a view where the leading dims collapse, else a copy."""
    x2 = x.reshape(-1, D)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: float = 1.0) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D] (zero-centred: shift 1; plain: shift 0): a contiguous tensor of x's
    shape and dtype."""
    D = x.shape[-1]
    assert weight.shape == (D,), (weight.shape, x.shape)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = x.numel() // D if D else 0
    if rows == 0:
        return out
    x2 = rows_of(x, D)  # (q / k halves of a projection collapse to a view)
    block = min(triton.next_power_of_2(D), MAX_BLOCK)
    _rms_norm_kernel[(rows,)](x2, weight.contiguous(), out, x2.stride(0), float(eps), float(shift), D=D, BLOCK=block,
                              num_warps=_num_warps(block), **pdl(x2))
    return out


def add_then_norm(norm, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, norm(h + delta)): a residual add and the norm after it. One kernel where install() gave the
    norm this module's forward and its add passed the self-check, outside torch.compile (which fuses the two
    itself): the same values as the two ops, bit for bit, one launch instead of two (eager CUDA graphs run every
    op as a node of ~2 us: two of these a layer)."""
    if (not ADD_NORM or torch.compiler.is_compiling() or not getattr(norm, "add_kernel", False)
            or delta.shape != h.shape or delta.dtype != h.dtype):
        total = h + delta
        return total, norm(total)
    return launch_add(h, delta, norm.weight, _eps(norm), norm.norm_shift)


def runs_kernel(module) -> bool:
    """Whether this RMSNorm module's forward is the kernel's (installed after its self-check)."""
    return getattr(getattr(module, "forward", None), "__func__", None) is _fused_forward


def two_norms_fit(embed, norm_e, norm_h) -> bool:
    """Whether two_norms can serve this head at all, decided once (two_norms_check): both norms run the kernel
    alike (runs_kernel) and the embedding is a plain table no wider than the kernel's block."""
    return (type(embed) is torch.nn.Embedding and runs_kernel(norm_e) and runs_kernel(norm_h)
            and norm_e.norm_shift == norm_h.norm_shift and embed.weight.shape[1] <= MAX_BLOCK)


def two_norms(embed, norm_e, norm_h, ids: torch.Tensor, hidden: torch.Tensor,
              argmax_of: torch.Tensor | None = None) -> torch.Tensor | None:
    """torch.cat([norm_e(embed(ids)), norm_h(hidden)], -1) in one launch (the MTP head's input: a gather, two norms
    and a cat were four): ids [1, T], hidden [1, T, D] -> [1, T, 2D], for a head two_norms_fit. argmax_of: logits
    [T, V] whose rows' argmax the ids are, written into ids (contiguous) by the same launch first (a greedy draft
    chain's previous token: its argmax launch folded in). None where hidden is not laid out as the table (device,
    dtype, width, unit stride), argmax_of's rows are not of unit stride, or torch.compile traces (inductor fuses
    the torch form): nothing is launched then."""
    table = embed.weight
    D = hidden.shape[-1]
    if (table.device != hidden.device or table.dtype != hidden.dtype or table.shape[1] != D
            or hidden.stride(-1) != 1 or torch.compiler.is_compiling()
            or (argmax_of is not None and (argmax_of.stride(-1) != 1 or not ids.is_contiguous()))):
        return None
    T = hidden.shape[1]
    out = torch.empty(1, T, 2 * D, device=hidden.device, dtype=hidden.dtype)
    block = triton.next_power_of_2(D)
    x = hidden if argmax_of is None else argmax_of  # (never read without ARGMAX)
    _two_norms_kernel[(T, 2)](ids.reshape(-1), table, hidden, norm_e.weight, norm_h.weight, out, x, table.stride(0),
                              hidden.stride(1), x.stride(0), x.shape[-1], float(_eps(norm_e)), float(_eps(norm_h)),
                              float(norm_e.norm_shift), D=D, BLOCK=block, ARGMAX=argmax_of is not None,
                              ABLOCK=ARGMAX_BLOCK, num_warps=_num_warps(block), **pdl(hidden))
    return out


def two_norms_check(embed, norm_e, norm_h) -> bool:
    """Whether two_norms serves this head: it fits (two_norms_fit) and equals the torch form bit for bit on a few
    rows of random hiddens (MTPHead.attach; a failure of any kind: the torch form stays)."""
    if not two_norms_fit(embed, norm_e, norm_h):
        return False
    table = embed.weight
    gen = torch.Generator(device=table.device).manual_seed(0)
    ids = torch.randint(0, table.shape[0], (1, 4), generator=gen, device=table.device)
    hidden = torch.randn(1, 4, table.shape[1], generator=gen, device=table.device).to(table.dtype)
    try:
        with torch.no_grad():
            got = two_norms(embed, norm_e, norm_h, ids, hidden)
            return got is not None and torch.equal(got, torch.cat([norm_e(embed(ids)), norm_h(hidden)], -1))
    except Exception:
        return False


def launch_add(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, shift: float):
    """add_then_norm's kernel: (h + delta, its RMSNorm), contiguous tensors of h's shape and dtype (D up to
    MAX_BLOCK)."""
    D = h.shape[-1]
    assert D <= MAX_BLOCK and weight.shape == (D,), (h.shape, weight.shape)
    total = torch.empty_like(h, memory_format=torch.contiguous_format)
    out = torch.empty_like(total)
    if h.numel():
        h2, d2 = rows_of(h, D), rows_of(delta, D)
        block = triton.next_power_of_2(D)
        _add_rms_norm_kernel[(h2.shape[0],)](h2, d2, weight.contiguous(), total, out, h2.stride(0), d2.stride(0),
                                             float(eps), float(shift), D=D, BLOCK=block, num_warps=_num_warps(block),
                                             **pdl(h2))
    return total, out


def launch_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNormGated of x [..., D] with gate [..., D] and weight [D] (D up to MAX_BLOCK): a contiguous tensor of
    x's shape and dtype."""
    D = x.shape[-1]
    assert gate.shape == x.shape and weight.shape == (D,) and D <= MAX_BLOCK, (x.shape, gate.shape, weight.shape)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    x2, g2 = rows_of(x, D), rows_of(gate, D)
    block = triton.next_power_of_2(D)
    _gated_rms_norm_kernel[(x2.shape[0],)](x2, g2, weight.contiguous(), out, x2.stride(0), g2.stride(0), float(eps),
                                           D=D, BLOCK=block, ROUND=weight.element_size() < 4,
                                           num_warps=_num_warps(block), **pdl(x2))
    return out


@torch.library.custom_op("mtpchat::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype) * silu(gate.float()), in x.dtype."""
    return launch_gated(x, gate, weight, eps)


@gated_rms_norm.register_fake
def _(x, gate, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mtpchat::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: float = 1.0) -> torch.Tensor:
    """x.float() * rsqrt(mean(x.float()**2, -1) + eps) * (shift + weight.float()), cast back to x.dtype."""
    return launch(x, weight, eps, shift)


@rms_norm.register_fake
def _(x, weight, eps, shift=1.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # launch's output: contiguous


def is_rms_norm(module) -> bool:
    """A plain (one-input) RMSNorm: class name ending in RMSNorm (not the gated variants), 1-D weight and eps."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and _eps(module) is not None
            and isinstance(weight, torch.Tensor) and weight.dim() == 1)


def is_gated_rms_norm(module) -> bool:
    """GDN's output norm, forward(x, gate): class name ending in RMSNormGated, silu, a 1-D weight and eps."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNormGated") and _eps(module) is not None
            and getattr(module, "activation", "silu") == "silu" and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and weight.shape[0] <= MAX_BLOCK)


def _eps(module) -> float | None:
    """The norm's epsilon: `eps` (Qwen3-Next / 3.5) or `variance_epsilon` (dense Qwen3)."""
    return getattr(module, "eps", getattr(module, "variance_epsilon", None))


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # let inductor fuse the module's own math with its neighbours
        return type(self).forward(self, x)
    return rms_norm(x, self.weight, _eps(self), self.norm_shift)


def _fused_gated_forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return type(self).forward(self, x, gate)
    return gated_rms_norm(x, gate, self.weight, _eps(self))


def _random_rows(module, device, dtype, n: int) -> list[torch.Tensor]:
    """n self-check inputs [3, D] for the norm `module`, the same every load."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(3, module.weight.shape[0], generator=gen, device=device).to(dtype) for _ in range(n)]


def _key(module) -> tuple:
    """What a self-check covers: norms alike in this are checked once."""
    return type(module), module.weight.shape[0], _eps(module), module.weight.dtype


def _gated_self_check(module, device, dtype) -> float:
    """The gated kernel's max abs error against the module's own forward, relative to the reference's max abs."""
    x, gate = _random_rows(module, device, dtype, 2)
    with torch.no_grad():
        return relative_error(gated_rms_norm(x, gate, module.weight, _eps(module)), type(module).forward(module, x, gate))


def _self_check(module, device, dtype) -> tuple[float, float]:
    """(shift, error): the weight convention whose kernel output matches the module's own forward best, and its
    max abs error relative to the reference's max abs."""
    x, = _random_rows(module, device, dtype, 1)
    with torch.no_grad():
        ref = type(module).forward(module, x)
        return min(((shift, relative_error(rms_norm(x, module.weight, _eps(module), shift), ref))
                    for shift in (1.0, 0.0)), key=lambda t: t[1] if t[1] == t[1] else float("inf"))


def _why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    if triton is None:
        return "triton not installed"
    if device.type != "cuda":
        return device.type.upper()
    if not available():
        return "no CUDA device"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')}: the exact reference path"
    return None


def install(modules: Iterable, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Give each RMSNorm module (is_rms_norm) the fused forward, when it may run here and passes a self-check
    (one per distinct (D, eps)); all or none. Returns what was chosen, or why the torch ops stay."""
    device = torch.device(device)
    reason = _why_not(device, dtype)
    if reason is not None:
        return f"torch ops ({reason})"
    modules = list(modules)
    norms, gated = [m for m in modules if is_rms_norm(m)], [m for m in modules if is_gated_rms_norm(m)]
    if not norms and not gated:
        return "torch ops (no RMSNorm modules)"
    worst, shifts = 0.0, {}
    try:
        for key, m in {_key(m): m for m in norms}.items():
            shifts[key], err = _self_check(m, device, dtype)
            worst = max(worst, err)
        for m in {_key(m): m for m in gated}.values():
            worst = max(worst, _gated_self_check(m, device, dtype))
    except Exception as e:  # a Triton / driver failure: keep the torch ops
        return f"torch ops (Triton RMSNorm failed: {type(e).__name__}: {e})"
    if not worst < SELF_CHECK_TOL:  # also catches NaN
        return f"torch ops (Triton RMSNorm self-check failed: error {worst:.1e})"
    # a bound method in the instance dict: deepcopy rebinds it to the copy; del m.forward undoes it
    for m in norms:
        m.norm_shift = shifts[_key(m)]
        m.forward = types.MethodType(_fused_forward, m)
    for m in gated:
        m.forward = types.MethodType(_fused_gated_forward, m)
    adds = _install_adds(norms, device, dtype)
    return f"Triton fused RMSNorm{' and gated RMSNorm' if gated else ''} (self-check {worst:.1e}){adds}"


def _install_adds(norms: list, device, dtype) -> str:
    """add_then_norm's kernel for the installed norms whose row fits one block, after its own self-check against
    the add and the installed norm apart (norm.add_kernel); what was chosen, for install's line."""
    fits = {_key(m): m for m in norms if m.weight.shape[0] <= MAX_BLOCK}
    if not fits:
        return ""
    if not ADD_NORM:
        return "; residual adds apart (MTPCHAT_ADD_NORM=0)"
    try:
        worst = 0.0
        for m in fits.values():
            h, delta = _random_rows(m, device, dtype, 2)
            with torch.no_grad():
                total, out = launch_add(h, delta, m.weight, _eps(m), m.norm_shift)
                worst = max(worst, relative_error(total, h + delta), relative_error(out, m(h + delta)))
    except Exception as e:  # a Triton / driver failure: the add and the norm stay apart
        return f"; residual adds apart (Triton add + RMSNorm failed: {type(e).__name__}: {str(e)[:120]})"
    if not worst < SELF_CHECK_TOL:
        return f"; residual adds apart (Triton add + RMSNorm self-check failed: error {worst:.1e})"
    for m in norms:
        m.add_kernel = _key(m) in fits
    return f"; residual adds fused with their norms (self-check {worst:.1e})"


@contextmanager
def stock_forward(modules: Iterable):
    """The modules' own forward for a while (the bench's transformers baseline runs transformers' code): every
    forward an install bound on an instance (this module's RMSNorm, linear16_triton's linears) is set aside."""
    swapped = [(m, m.forward) for m in modules if "forward" in vars(m)]
    for m, _ in swapped:
        del m.forward
    try:
        yield
    finally:
        for m, forward in swapped:
            m.forward = forward
