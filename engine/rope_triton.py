"""Rotary embedding on CUDA in 16-bit as two Triton kernels: the cos / sin table of a pass's positions, and the
rotation of one attention layer's queries and keys.

model.Rotary's torch form is about ten kernels a pass (positions, the product with inv_freq, cat, sin, cos, the
scaling, the sign, two casts) and model.apply_rope six a layer (cat of q and k, the rotary half's two products,
the roll, the sum, cat with the pass-through dims). The engine runs its CUDA graphs without torch.compile by
default, so each is a graph node of ~2 us: on the demo model a plain step had 21 of its 150 launches here and a
depth-3 cycle ~70 of its ~300 (packaging/bench/launch_census.py), the head's passes rope's own each time.

Both kernels do the torch form's arithmetic in its order, rounding where it rounds: float32 angles
(position.float() * inv_freq), sin and cos (tl.sin / tl.cos lower to libdevice's __nv_sinf / __nv_cosf: CUDA's
sinf / cosf, which torch's kernels call), times the scaling, cast to the activations' dtype; then x * cos and
roll(x) * sin each rounded to that dtype (no FMA), and their sum. On an H100 both equal the torch form bit for bit
(tests/test_rope_triton.py).
The self-check at load compares them with the torch form (install). Under torch.compile the torch form runs
(inductor fuses it with its neighbours).
"""

from __future__ import annotations

import torch

from .kernels import relative_error, self_checked, supported
from .splitk import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, install() says why not
    triton = None



if triton is not None:
    from .splitk import after_previous

    @triton.jit
    def _table_kernel(pos_ptr, pos0, inv_ptr, cos_ptr, sin_ptr, scaling, HALF: tl.constexpr, BLOCK: tl.constexpr,
                      ON_DEVICE: tl.constexpr, PDL: tl.constexpr = False):
        """Row t of cos and of the signed sin [T, 2 * HALF]: position pos_ptr[t] (ON_DEVICE) or pos0 + t."""
        after_previous(PDL)
        t = tl.program_id(0)
        if ON_DEVICE:
            p = tl.load(pos_ptr + t).to(tl.float32)
        else:
            p = (pos0 + t).to(tl.float32)
        i = tl.arange(0, BLOCK)
        m = i < HALF
        f = p * tl.load(inv_ptr + i, mask=m, other=0.0)
        c = (tl.cos(f) * scaling).to(cos_ptr.dtype.element_ty)
        s = tl.sin(f) * scaling
        row = t * 2 * HALF
        tl.store(cos_ptr + row + i, c, mask=m)
        tl.store(cos_ptr + row + HALF + i, c, mask=m)
        tl.store(sin_ptr + row + i, (-s).to(sin_ptr.dtype.element_ty), mask=m)  # (the first half's sign)
        tl.store(sin_ptr + row + HALF + i, s.to(sin_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rotate_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, out_ptr, sq_h, sq_t, sk_h, sk_t, T, HQ,
                       v_ptr, sv_h, sv_t, kc_ptr, vc_ptr, sc_h, sc_n, pos_ptr, HK, wq_ptr, wk_ptr, eps, shift,
                       D: tl.constexpr, RD: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr = False,
                       NORM: tl.constexpr = False, PDL: tl.constexpr = False):
        """One head row (head h of q, then of k, then with STORE of v, at token t): its first RD dims rotated
        (v's none), the rest copied; into out [HQ + HK, T, D], or with STORE k's and v's rows into one layer's
        key / value cache [HK, N, D] at position pos_ptr[t]. NORM: q's and k's rows are RMS-normed first, with
        weights wq / wk (attention's q_norm / k_norm, norm_triton._rms_norm_kernel's arithmetic, rounded to the
        activations' dtype as its output is)."""
        after_previous(PDL)
        row = tl.program_id(0)
        h, t = row // T, row % T
        if h < HQ:
            src = q_ptr + h * sq_h + t * sq_t
        elif h < HQ + HK:
            src = k_ptr + (h - HQ) * sk_h + t * sk_t
        else:
            src = v_ptr + (h - HQ - HK) * sv_h + t * sv_t
        d = tl.arange(0, BLOCK)
        rot = (d < RD) & (h < HQ + HK)
        x = tl.load(src + d, mask=d < D, other=0.0)
        partner = tl.where(d < RD // 2, d + RD // 2, d - RD // 2)  # roll(x, RD / 2) over the rotary dims
        xr = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * RD + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * RD + d, mask=rot, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if NORM:
            if h < HQ + HK:
                w_ptr = wq_ptr if h < HQ else wk_ptr
                xf = x.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
                w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
                wr = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
                x = (xf * rstd * (shift + w)).to(dt)
                xr = (xr * rstd * (shift + wr)).to(dt).to(tl.float32)
        y = ((x.to(tl.float32) * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
        dst = out_ptr + row * D
        if STORE:
            at = tl.load(pos_ptr + t) * sc_n
            if h >= HQ + HK:
                dst = vc_ptr + (h - HQ - HK) * sc_h + at
            elif h >= HQ:
                dst = kc_ptr + (h - HQ) * sc_h + at
        tl.store(dst + d, tl.where(rot, y, x), mask=d < D)


def table(rotary, pos, T: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """model.Rotary's (cos, sin) [1, T, rotary dim] of positions pos..pos+T-1 (pos an int) or of the positions
    pos [T] on the device, in one launch."""
    half = rotary.inv_freq.shape[0]
    cos = torch.empty(1, T, 2 * half, device=device, dtype=dtype)
    sin = torch.empty_like(cos)
    on_device = isinstance(pos, torch.Tensor)
    _table_kernel[(T,)](pos if on_device else cos, 0 if on_device else pos, rotary.inv_freq, cos, sin,
                        float(rotary.scaling), HALF=half, BLOCK=triton.next_power_of_2(half), ON_DEVICE=on_device,
                        num_warps=1, **pdl(cos))
    return cos, sin


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """model.apply_rope in one launch: q [1, HQ, T, D], k [1, HK, T, D] (any head and token strides, unit
    stride along D), cos / sin [1, T, RD] contiguous; the rotated (q, k) as views of one [1, HQ + HK, T, D]."""
    _, hq, T, D = q.shape
    hk, rd = k.shape[1], cos.shape[-1]
    out = torch.empty(1, hq + hk, T, D, device=q.device, dtype=q.dtype)
    _rotate_kernel[((hq + hk) * T,)](q, k, cos, sin, out, q.stride(1), q.stride(2), k.stride(1), k.stride(2), T, hq,
                                     q, 0, 0, out, out, 0, 0, cos, hk, cos, cos, 0.0, 0.0, D=D, RD=rd,
                                     BLOCK=triton.next_power_of_2(D),
                                     num_warps=1, enable_fp_fusion=False, **pdl(q))  # (no FMA: each product
    return out[:, :hq], out[:, hq:]  # rounds, as torch's)


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, norms=None) -> torch.Tensor:
    """rotate() with the rotated keys and the values [1, HK, T, D] written straight into one layer's cache keys /
    values [HK, N, D] at positions [T] (graph mode's cache.kv_write_at: two index_puts fewer, one launch in all);
    returns the rotated queries [1, HQ, T, D]. norms: qk_norms(attn), q and k not normed yet (two launches
    fewer)."""
    _, hq, T, D = q.shape
    hk, rd = k.shape[1], cos.shape[-1]
    wq, wk, eps, shift = norms if norms is not None else (cos, cos, 0.0, 0.0)
    out = torch.empty(1, hq, T, D, device=q.device, dtype=q.dtype)
    _rotate_kernel[((hq + 2 * hk) * T,)](q, k, cos, sin, out, q.stride(1), q.stride(2), k.stride(1), k.stride(2), T,
                                         hq, v, v.stride(1), v.stride(2), keys, values, keys.stride(0),
                                         keys.stride(1), positions, hk, wq, wk, float(eps), float(shift), D=D, RD=rd,
                                         BLOCK=triton.next_power_of_2(D), STORE=True, NORM=norms is not None,
                                         num_warps=1, enable_fp_fusion=False, **pdl(q))
    return out


def qk_norms(attn):
    """(q_norm's weight, k_norm's, eps, shift) where both norms run norm_triton's kernel (installed after its
    self-check) alike, for rotate_and_store to apply; else None (their own forwards run)."""
    from . import norm_triton

    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if not (norm_triton.runs_kernel(qn) and norm_triton.runs_kernel(kn)):
        return None
    eps, shift = norm_triton._eps(qn), qn.norm_shift
    if eps is None or (norm_triton._eps(kn), kn.norm_shift) != (eps, shift) or qn.weight.shape != kn.weight.shape:
        return None
    return qn.weight, kn.weight, eps, shift


def rotatable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """The layouts rotate() takes (batch 1, unit stride along D, a contiguous table), outside torch.compile's
    tracing: anything else takes the torch form."""
    return (q.shape[0] == 1 and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous()
            and not torch.compiler.is_compiling())


def storable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, keys, values) -> bool:
    """Whether rotate_and_store() takes these: rotate()'s layouts, v with unit stride along D, and a 16-bit cache
    of q's dtype laid out as cache.KVCache's layer views (an fp8 cache's (codes, scales) quantizes: no)."""
    return (rotatable(q, k, cos) and v.stride(-1) == 1 and isinstance(keys, torch.Tensor)
            and isinstance(values, torch.Tensor) and keys.dtype == values.dtype == q.dtype
            and keys.stride() == values.stride() and keys.stride(-1) == 1)


def _self_check(rotary, heads: tuple[int, int], head_dim: int, device, dtype) -> float:
    """Both kernels against the torch form (model.Rotary, model.apply_rope; the cache write's index_put) at one
    token and at four, at positions near 0 and far out (device positions and an int start), with strided queries
    as attention makes them."""
    from .model import apply_rope

    gen = torch.Generator(device=device).manual_seed(0)
    hq, hk = heads
    worst = 0.0
    for T, start in ((1, 7), (4, 131_000)):
        ids = torch.arange(start, start + T, device=device)
        ref_cos, ref_sin = rotary(ids.unsqueeze(0), dtype)
        for pos in (start, ids):
            cos, sin = table(rotary, pos, T, dtype, torch.device(device))
            worst = max(worst, relative_error(cos, ref_cos), relative_error(sin, ref_sin))
        qg = torch.randn(1, T, hq, 2 * head_dim, generator=gen, device=device).to(dtype)
        q = qg[..., :head_dim].transpose(1, 2)  # (attention's: half of q_proj's rows, heads then tokens)
        k = torch.randn(1, T, hk, head_dim, generator=gen, device=device).to(dtype).transpose(1, 2)
        for got, ref in zip(rotate(q, k, ref_cos, ref_sin), apply_rope(q, k, ref_cos, ref_sin)):
            worst = max(worst, relative_error(got, ref))
        # rotate_and_store: into a cache of 16 positions (where rotate() wrote its rows, and nothing else)
        v = torch.randn(1, T, hk, head_dim, generator=gen, device=device).to(dtype).transpose(1, 2)
        keys, values = (torch.zeros(hk, 16, head_dim, device=device, dtype=dtype) for _ in range(2))
        at = torch.arange(16 - T, 16, device=device)
        q_got = rotate_and_store(q, k, v, ref_cos, ref_sin, keys, values, at)
        q_ref, k_ref = apply_rope(q, k, ref_cos, ref_sin)
        want_k, want_v = torch.zeros_like(keys), torch.zeros_like(values)
        want_k[:, at], want_v[:, at] = k_ref[0], v[0]
        worst = max(worst, relative_error(q_got, q_ref), relative_error(keys, want_k), relative_error(values, want_v))
        # with q_norm and k_norm in the launch (qk_norms): against transformers' zero-centred RMSNorm, then the above
        wq, wk = (torch.randn(head_dim, generator=gen, device=device).to(dtype) * 0.1 for _ in range(2))
        q_got = rotate_and_store(q, k, v, ref_cos, ref_sin, keys, values, at, (wq, wk, 1e-6, 1.0))
        q_ref, k_ref = apply_rope(_rms_norm(q, wq), _rms_norm(k, wk), ref_cos, ref_sin)
        want_k[:, at] = k_ref[0]
        worst = max(worst, relative_error(q_got, q_ref), relative_error(keys, want_k))
    return worst


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' Qwen3-Next RMSNorm (zero-centred weight), the self-check's reference."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def install(backends, rotary, config, device, dtype) -> None:
    """backends.rope = "triton" where the kernels may run and pass their self-check on this model's heads; the
    reason in backends.choice["rope"] either way."""
    heads = (config.num_attention_heads, config.num_key_value_heads)
    why, worst = self_checked(supported(torch.device(device), dtype), "rope", "MTPCHAT_ROPE",
                              lambda: _self_check(rotary, heads, config.head_dim, device, dtype))
    if why is None:
        backends.rope = "triton"
        backends.choice["rope"] = ("triton", "cos / sin table in one Triton kernel a pass, queries and keys rotated "
                                             f"in one a layer (self-check {worst:.1e})")
    else:
        backends.choice["rope"] = ("torch", f"rotary embedding as torch ops ({why})")
