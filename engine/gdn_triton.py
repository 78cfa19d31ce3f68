"""The gated delta rule over a few tokens (decoding, verify passes, commit's replay) as our own Triton kernel.

FLA's fused recurrent kernel loads each token's q, k, v, g and beta inside its loop over the tokens, after the
state update of the token before: at one token a call is its launch and one round of loads, at four (a depth-3
verify pass) four rounds in a chain. On an H100 the demo model's verify calls took 6.7 us against 2.6 at one token
(packaging/bench/cycle_demo_stop65_h100.json), seven a cycle. Here every token's inputs are loaded, and q and k
L2-normalised, before the first update; the updates then run from registers. The inputs are read through their
strides: commit's replay reads the first rows of the stash, which FLA's wrapper would copy first (five copies a
cycle).

The arithmetic is the torch reference's (kernels.torch_recurrent) in float32: per token the state decays by
exp(g), the value's prediction from the state is taken away and scaled by beta, the outer product added, and the
output read with the normalised query. At load (install) the kernel is checked against that reference on every
distinct GDN shape, and timed inside CUDA graphs against FLA's launch per width (one token; 2-8); each width keeps
the faster, and nothing is assumed.
"""

from __future__ import annotations

import torch

from .splitk import INTERPRET, bucket, fastest, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports
    triton = None

MAX_WIDTH = 8  # tokens a call (limits.MAX_DEPTH + 1, the graphs' padded widths); longer passes: FLA's chunked
# (value columns a program, warps): the first is the untimed default (the interpreter's), the rest are timed
CONFIGS = [(16, 1), (8, 1), (32, 1), (32, 2), (64, 2)]
_chosen: dict[tuple, tuple | None] = {}  # (Hv, Dk, Dv, width bucket, device index) -> config; None: FLA's launch

if triton is not None:
    from .splitk import after_previous

    @triton.jit
    def _row(x, rows, i):
        """Row i of a [BT, N] block as [N] (the other rows masked off; exact)."""
        return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)

    @triton.jit
    def _gdn_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, ht_ptr, o_ptr,
                         sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sb_b, sb_t, scale,
                         T: tl.constexpr, BT: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                         DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
        after_previous(PDL)
        pv, pbh = tl.program_id(0), tl.program_id(1)
        b, hv = pbh // HV, pbh % HV
        h = hv // (HV // H)  # grouped value heads: value head hv reads key head hv // (HV / H)
        t = tl.arange(0, BT)
        kk = tl.arange(0, BK)
        vv = pv * BV + tl.arange(0, BV)
        tm, km, vm = t < T, kk < DK, vv < DV
        qk_mask = tm[:, None] & km[None, :]
        q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + h * sq_h + kk[None, :], mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + b * sk_b + t[:, None] * sk_t + h * sk_h + kk[None, :], mask=qk_mask, other=0.0)
        v = tl.load(v_ptr + b * sv_b + t[:, None] * sv_t + hv * sv_h + vv[None, :], mask=tm[:, None] & vm[None, :],
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * sg_b + t * sg_t + hv, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + b * sb_b + t * sb_t + hv, mask=tm, other=0.0).to(tl.float32)
        q, k = q.to(tl.float32), k.to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * scale
        k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        state = h0_ptr + (pbh * DK + kk[:, None]) * DV + vv[None, :]
        s = tl.load(state, mask=km[:, None] & vm[None, :], other=0.0)
        o = tl.zeros([BT, BV], tl.float32)
        for i in tl.static_range(T):
            ki = _row(k, t, i)
            s = s * tl.exp(tl.sum(tl.where(t == i, g, 0.0), 0))
            delta = (_row(v, t, i) - tl.sum(s * ki[:, None], 0)) * tl.sum(tl.where(t == i, beta, 0.0), 0)
            s = s + ki[:, None] * delta[None, :]
            o = tl.where(t[:, None] == i, tl.sum(s * _row(q, t, i)[:, None], 0)[None, :], o)
        # the final state after the output: `ht` may be `h0` itself (each program reads and writes its own block)
        tl.store(ht_ptr + (pbh * DK + kk[:, None]) * DV + vv[None, :], s, mask=km[:, None] & vm[None, :])
        tl.store(o_ptr + ((b * T + t[:, None]) * HV + hv) * DV + vv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])


def _rows_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def recurrent_into(q, k, v, g, beta, state, final, config=CONFIGS[0]) -> torch.Tensor:
    """kernels.fla_recurrent_into's contract: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv] (any
    strides with the last dimension contiguous), state and final [B, Hv, Dk, Dv] float32 contiguous (final may be
    state itself); returns the output [B, T, Hv, Dv] in v's dtype."""
    q, k, v, g, beta = (_rows_last(x) for x in (q, k, v, g, beta))
    B, T, H, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    block_v, warps = config
    block_v = min(block_v, triton.next_power_of_2(DV))
    o = torch.empty(B, T, HV, DV, dtype=v.dtype, device=v.device)
    _gdn_rows_kernel[(triton.cdiv(DV, block_v), B * HV)](
        q, k, v, g, beta, state, final, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        DK**-0.5, T=T, BT=triton.next_power_of_2(T), H=H, HV=HV, DK=DK, DV=DV, BK=triton.next_power_of_2(DK),
        BV=block_v, num_warps=warps, num_stages=1, **pdl(v))
    return o


def choice(q: torch.Tensor, v: torch.Tensor):
    """The configuration timed fastest for this call's shape and width (None: FLA's launch, or not installed)."""
    T = q.shape[1]
    if T > MAX_WIDTH or not v.is_cuda and not INTERPRET:
        return None
    return _chosen.get((v.shape[2], q.shape[3], v.shape[3], bucket(T), v.device.index))


def _inputs(shape, T: int, B: int, device, dtype, seed: int):
    hk, hv, dk, dv = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k = rand(B, T, hk, dk).to(dtype), rand(B, T, hk, dk).to(dtype)
    v = rand(B, T, hv, dv).to(dtype)
    g = -torch.rand(B, T, hv, generator=gen, device=device)  # log-decays in (-1, 0], float32 as the engine's
    beta = torch.rand(B, T, hv, generator=gen, device=device).to(dtype)
    state = rand(B, hv, dk, dv) * 0.1
    return q, k, v, g, beta, state


def _self_check(shape, device, dtype) -> float:
    """Worst relative error against kernels.torch_recurrent (output and final state) at one token and at five,
    a batch of two (commit's replay runs layers as the batch), the final state written over the initial one."""
    from .kernels import relative_error, torch_recurrent

    worst = 0.0
    for T in (1, 5):
        q, k, v, g, beta, state = _inputs(shape, T, 2, device, dtype, seed=T)
        ref, ref_state = torch_recurrent(q, k, v, g, beta, state)
        got = recurrent_into(q, k, v, g, beta, state, state)
        worst = max(worst, relative_error(got, ref), relative_error(state, ref_state))
    return worst


TIMED_WIDTHS = (1, 4)  # one token; a depth-3 verify pass's four (each stands for its width bucket)


def _timed(shape, device, dtype, fla: bool) -> dict[int, tuple | None]:
    """Per width bucket, the fastest of CONFIGS and, where FLA's direct launch runs, FLA's (None)."""
    from .kernels import fla_recurrent_into

    picks = {}
    for T in TIMED_WIDTHS:
        q, k, v, g, beta, state = _inputs(shape, T, 1, device, dtype, seed=7)
        final = torch.empty_like(state)
        options = ([None] if fla else []) + CONFIGS
        picks[bucket(T)] = fastest(options, lambda c: fla_recurrent_into(q, k, v, g, beta, state, final)
                                   if c is None else recurrent_into(q, k, v, g, beta, state, final, c))
    return picks


def supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FLA's launch or the torch reference keeps every width here (None: the kernel may run): CUDA in 16-bit,
    as the other small kernels (float32 keeps the reference path)."""
    from .kernels import supported as small_kernels

    return small_kernels(device, dtype)


def install(backends, layers, device: torch.device, dtype: torch.dtype) -> None:
    """Our kernel for the widths where it is timed faster than FLA's launch (all of them where FLA cannot run),
    after its self-check on every distinct GDN shape; the choice in backends.choice["gdn_recurrent"]."""
    from .kernels import self_checked

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # (the calls' tensors say cuda:N: choice() looks up N)
        device = torch.device("cuda", torch.cuda.current_device())
    mixers = [m for m in (getattr(layer, "linear_attn", None) for layer in layers) if m is not None]
    if not mixers or supported(device, dtype) is not None:
        return
    shapes = {(m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim) for m in mixers}
    why, worst = self_checked(None, "GDN recurrence", "MTPCHAT_GDN_RECURRENT",
                              lambda: max(_self_check(s, device, dtype) for s in shapes))
    backend, reason = backends.choice.get("gdn_recurrent", ("torch", ""))
    if why is not None:
        backends.choice["gdn_recurrent"] = (backend, f"{reason}; our Triton kernel not used ({why})")
        return
    fla = backends.gdn_recurrent.impl == "fla" and backends.gdn_recurrent.direct
    ours = set()
    for hk, hv, dk, dv in shapes:
        keys = {bucket(T): (hv, dk, dv, bucket(T), device.index) for T in TIMED_WIDTHS}
        if not all(key in _chosen for key in keys.values()):  # (timed once a process: loads after it reuse it)
            for width, config in _timed((hk, hv, dk, dv), device, dtype, fla).items():
                _chosen[keys[width]] = config
        ours |= {"one token" if width == 1 else f"2-{MAX_WIDTH} tokens" for width, key in keys.items()
                 if _chosen[key] is not None}
    if ours:
        backends.choice["gdn_recurrent"] = ("triton", f"our Triton kernel at {' and '.join(sorted(ours))}, every "
                                            f"token's inputs loaded before the first update (self-check {worst:.1e}"
                                            f", timed against FLA's launch); otherwise {backend}: {reason}")
    else:
        backends.choice["gdn_recurrent"] = (backend, f"{reason}; our Triton kernel timed slower at every width")
