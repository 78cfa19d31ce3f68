"""GDN's short convolution and gates at decode and verify widths as one Triton kernel, for CUDA in 16-bit.

gdn.kernel_inputs' torch form is seven kernels a layer (the products over the conv window, their sum, silu,
sigmoid, a + dt_bias, softplus, the decay's product); plain decoding adds the window's concatenation and the conv
cache's update, a verify pass the window's two copies into its stash and q, k and v's three. Those are strided
elementwise kernels of a few thousand values: on the demo model's depth-3 cycle (H100,
packaging/bench/cycle_demo_gathers_h100.json) torch's strided elementwise kernels, these among them, took 0.25 ms
of its 0.91 ms on the GPU, against 0.03 ms of a plain step's 0.40. Here one launch does all of it: each program
reads its channels' conv cache and new inputs (a verify pass: one token's each; plain decoding: every token's),
writes silu(conv) into q, k and v (a verify pass's stash rows, or the rows plain decoding hands the recurrent
kernel), the conv-input window (a verify pass's stash) or the new conv cache (plain decoding), and the first
program the gates g and beta.

The arithmetic is the torch form's: each product rounded to the inputs' dtype, summed in float32 in the kernel's
order, rounded, the bias added and rounded, silu in float32 rounded; g = -exp(A_log) * softplus(a + dt_bias) in
float32. Plain decoding and verify passes both take this kernel, so speculation sees the arithmetic plain
decoding does. Prefill keeps the torch form (F.conv1d over long prompts), as before.
"""

from __future__ import annotations

import torch

from .kernels import relative_error, self_checked, split_qkv, supported
from .splitk import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports
    triton = None

MAX_WIDTH = 8  # decode and verify widths (limits.MAX_DEPTH + 1 and the graphs' padding); wider passes: torch
BLOCK_C = 256  # channels a program (32 threads x 8 values)
BLOCK_G = 128  # gate values a step of the first program's loop

if triton is not None:
    from .splitk import after_previous

    @triton.jit
    def _window_at(x_ptr, stride_xt, stride_xc, state_ptr, stride_sc, c, cm, i, K1: tl.constexpr):
        """Column i of [conv cache (K1 columns) | new inputs] for channels c: one of the two loads is masked off."""
        s = tl.load(state_ptr + c * stride_sc + i, mask=cm & (i < K1), other=0.0)
        x = tl.load(x_ptr + (i - K1) * stride_xt + c * stride_xc, mask=cm & (i >= K1), other=0.0)
        return s + x

    @triton.jit
    def _conv_gates_kernel(x_ptr, stride_xt, stride_xc, state_ptr, stride_sc, w_ptr, bias_ptr, window_ptr,
                           stride_wc, q_ptr, k_ptr, v_ptr, stride_qt, stride_kt, stride_vt,
                           b_ptr, a_ptr, stride_bt, stride_at, decay_ptr, dt_bias_ptr, g_ptr, beta_ptr,
                           T, C, CK, HV, K1: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                           WINDOW: tl.constexpr, STORE_STATE: tl.constexpr, BLOCK: tl.constexpr,
                           GATES: tl.constexpr, PDL: tl.constexpr = False):
        after_previous(PDL)
        pid, t0, t_step = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        c = pid * BLOCK + tl.arange(0, BLOCK)
        cm = c < C
        dtype = q_ptr.dtype.element_ty
        for t in range(t0, T, t_step):
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in tl.static_range(K1 + 1):
                x = _window_at(x_ptr, stride_xt, stride_xc, state_ptr, stride_sc, c, cm, t + j, K1).to(tl.float32)
                w = tl.load(w_ptr + c * (K1 + 1) + j, mask=cm, other=0.0).to(tl.float32)
                acc += (w * x).to(dtype).to(tl.float32)
            y = acc.to(dtype).to(tl.float32)
            if HAS_BIAS:
                y = (y + tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            y = (y / (1.0 + tl.exp(-y))).to(dtype)
            tl.store(q_ptr + t * stride_qt + c, y, mask=cm & (c < CK))
            tl.store(k_ptr + t * stride_kt + (c - CK), y, mask=cm & (c >= CK) & (c < 2 * CK))
            tl.store(v_ptr + t * stride_vt + (c - 2 * CK), y, mask=cm & (c >= 2 * CK))
        if WINDOW:  # (a chained pass's cache is the window's own first columns: the same values stored back)
            if t0 == 0:  # the cache's columns; each token's program its own input's
                for i in range(K1):
                    col = _window_at(x_ptr, stride_xt, stride_xc, state_ptr, stride_sc, c, cm, i, K1)
                    tl.store(window_ptr + c * stride_wc + i, col.to(window_ptr.dtype.element_ty), mask=cm)
            for i in range(K1 + t0, K1 + T, t_step):
                col = _window_at(x_ptr, stride_xt, stride_xc, state_ptr, stride_sc, c, cm, i, K1)
                tl.store(window_ptr + c * stride_wc + i, col.to(window_ptr.dtype.element_ty), mask=cm)
        if STORE_STATE:  # the cache after the pass: the window's last K1 columns, all read before any is written
            j = tl.arange(0, KP)[None, :]
            cj, cjm = c[:, None], cm[:, None] & (j < K1)
            new = _window_at(x_ptr, stride_xt, stride_xc, state_ptr, stride_sc, cj, cjm, T + j, K1)
            tl.debug_barrier()
            tl.store(state_ptr + cj * stride_sc + j, new, mask=cjm)
        if pid == 0 and t0 == 0:
            for start in range(0, T * HV, GATES):
                e = start + tl.arange(0, GATES)
                em = e < T * HV
                row, h = e // HV, e % HV  # (not t: a name the loop above left an int would be loop-carried)
                b = tl.load(b_ptr + row * stride_bt + h, mask=em, other=0.0).to(tl.float32)
                tl.store(beta_ptr + e, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty), mask=em)
                a = tl.load(a_ptr + row * stride_at + h, mask=em, other=0.0).to(tl.float32)
                a += tl.load(dt_bias_ptr + h, mask=em, other=0.0)
                # softplus as torch's (threshold 20), log1p(e) as log(u) * e / (u - 1) (Triton's interpreter has
                # no log1p; 1 + e alone loses e below float32's epsilon)
                ea = tl.exp(tl.minimum(a, 20.0))
                u = 1.0 + ea
                soft = tl.where(u == 1.0, ea, tl.log(u) * ea / tl.where(u == 1.0, 1.0, u - 1.0))
                soft = tl.where(a > 20.0, a, soft)
                tl.store(g_ptr + e, tl.load(decay_ptr + h, mask=em, other=0.0) * soft, mask=em)


def conv_gates(mixer, x: torch.Tensor, state: torch.Tensor, b: torch.Tensor, a: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               window: torch.Tensor | None = None, store_state: bool = False) -> None:
    """One GDN layer's short conv and gates for T new tokens, in one launch.

    x: the conv inputs [C, T] (any strides), state: the conv cache [C, K-1] (unit column stride), b, a [T, Hv]
    (unit column stride). Writes silu(conv) rows into q, k [T, Hk, Dk] and v [T, Hv, Dv] (each row's heads
    contiguous: stash rows, or kernels.split_qkv's views of one [T, C] output),
    g (float32) and beta [T, Hv] (contiguous), and either window [C, K-1 + T] (unit column stride: a verify pass's
    stash) or, with store_state, the cache itself (plain decoding)."""
    C, T = x.shape
    K1 = state.shape[1]
    q, k, v = (t.flatten(1) for t in (q, k, v))
    weight, bias = mixer.conv1d.weight, mixer.conv1d.bias
    for t in (state, b, a, q, k, v) + ((window,) if window is not None else ()):
        assert t.stride(-1) == 1, t.stride()
    assert weight.is_contiguous() and weight.shape[-1] == K1 + 1 and g.is_contiguous() and beta.is_contiguous()
    HV = b.shape[-1]
    # a verify pass's tokens in programs of their own (a program's loop over T was the pass's latency: 6.8 us a
    # launch at four tokens against 3.2 at one, demo model, H100); the cache's update reads old columns that another
    # token's program would overwrite, so a pass that stores it keeps its tokens in one program
    _conv_gates_kernel[(triton.cdiv(C, BLOCK_C), 1 if store_state else T)](
        x, x.stride(1), x.stride(0), state, state.stride(0), weight, bias if bias is not None else weight,
        window if window is not None else state, window.stride(0) if window is not None else 0,
        q, k, v, q.stride(0), k.stride(0), v.stride(0), b, a, b.stride(0), a.stride(0),
        mixer.decay_rate, mixer.dt_bias_f32, g, beta, T, C, q.shape[-1], HV, K1=K1, KP=triton.next_power_of_2(K1),
        HAS_BIAS=bias is not None, WINDOW=window is not None, STORE_STATE=store_state, BLOCK=BLOCK_C, GATES=BLOCK_G,
        num_warps=1, **pdl(x))


def _self_check(mixer, device, dtype) -> float:
    """The kernel against gdn.kernel_inputs' torch form for this mixer's shapes, at one token and at four (window
    and cache variants): the worst relative error over q, k, v, g, beta, the window and the cache."""
    from .gdn import heads, kernel_inputs

    hv = mixer.num_v_heads
    weight = mixer.conv1d.weight
    C, K1 = weight.shape[0], weight.shape[-1] - 1
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for T, store in ((1, True), (4, False)):
        rand = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
        x, state, b, a = rand(C, T), rand(C, K1), rand(T, hv), rand(T, hv)
        window_ref = torch.cat([state, x], -1)
        qkv_ref, g_ref, beta_ref = kernel_inputs(mixer, window_ref.unsqueeze(0), T, b.unsqueeze(0), a.unsqueeze(0))
        qkv = torch.empty(1, T, C, device=device, dtype=dtype)
        g, beta = torch.empty(T, hv, device=device), torch.empty(T, hv, device=device, dtype=dtype)
        window = None if store else torch.empty(C, K1 + T, device=device, dtype=dtype)
        cache = state.clone()
        conv_gates(mixer, x, cache, b, a, *(t[0] for t in split_qkv(qkv, heads(mixer))), g, beta, window=window,
                   store_state=store)
        pairs = [(qkv, qkv_ref), (g, g_ref[0]), (beta, beta_ref[0])]
        pairs.append((cache, window_ref[:, T:]) if store else (window, window_ref))
        worst = max([worst] + [relative_error(got, ref) for got, ref in pairs])
    return worst


def install(backends, layers, device: torch.device, dtype: torch.dtype) -> None:
    """backends.short_conv = "triton" where the kernel may run and passes its self-check on every distinct GDN
    shape; the reason in backends.choice["conv1d"] either way (the torch form's reason is already there)."""
    mixers = [m for m in (getattr(layer, "linear_attn", None) for layer in layers) if m is not None]
    if not mixers or supported(torch.device(device), dtype) is not None:
        return
    shapes = {(tuple(m.conv1d.weight.shape), m.num_v_heads, m.conv1d.bias is not None): m for m in mixers}
    why, worst = self_checked(None, "short conv", "MTPCHAT_SHORT_CONV",
                              lambda: max(_self_check(m, device, dtype) for m in shapes.values()))
    if why is not None:
        backends.choice["conv1d"] = ("torch", f"short conv and gates as torch ops ({why})")
        return
    backends.short_conv = "triton"
    backends.choice["conv1d"] = ("triton", "short conv, silu and the gates in one Triton kernel at decode and verify "
                                           f"widths (self-check {worst:.1e}); prefill: the torch form")
