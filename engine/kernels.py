"""Backend selection per op: FLA Triton kernels on CUDA when installed and sane, torch reference code elsewhere.

Every GDN kernel here takes the *kernel inputs* the speculative transaction stashes: q, k [B, T, Hk, Dk],
v [B, T, Hv, Dv], g, beta [B, T, Hv] (after the short convolution, before the in-kernel L2 norm), and a float32
recurrent state [B, Hv, Dk, Dv]. They return (output [B, T, Hv, Dv], final state).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import gdn_triton


# the small kernels' (conv_triton, rope_triton, swiglu_triton) self-checks: worst relative error against the torch
# form, as norm_triton's (on a GPU the rope kernels agree bit for bit; Triton's interpreter truncates to bf16 where a
# GPU rounds: ~1e-2 there)
SMALL_KERNEL_TOL = 2e-2


def supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a small fused Triton kernel (conv_triton, rope_triton, swiglu_triton) leaves the torch form in place
    here, or None: they run on CUDA in 16-bit; float32 and the CPU keep the exact reference path."""
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')}: the exact reference path"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not CUDA"
    return None


def self_checked(why: str | None, label: str, env: str, check) -> tuple[str | None, float]:
    """A small kernel's verdict at load: why the torch form stays (None: the kernel runs) and check()'s worst
    relative error against it. why: the module's supported(); then the opt-out (env=torch), a Triton / driver
    failure in check(), or an error at SMALL_KERNEL_TOL or above (NaN too)."""
    if why is None and os.environ.get(env) == "torch":
        why = f"{env}=torch"
    worst = float("nan")
    if why is None:
        try:
            with torch.no_grad():
                worst = check()
            if not worst < SMALL_KERNEL_TOL:
                why = f"Triton {label} self-check failed: error {worst:.1e}"
        except Exception as e:
            why = f"Triton {label} failed: {type(e).__name__}: {str(e)[:120]}"
    return why, worst


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's max abs: the load-time self-checks' measure (NaN stays NaN)."""
    got, ref = got.float(), ref.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(q, k, hv):
    if q.shape[2] != hv:  # grouped value heads: each key head serves hv // hk value heads
        rep = hv // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return q, k


def torch_recurrent(q, k, v, g, beta, state):
    """The gated delta rule one token at a time, in float32. Exact reference and the CPU kernel."""
    out_dtype = v.dtype
    q, k = _expand_heads(q, k, v.shape[2])
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        kv_mem = (s * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).to(out_dtype), s


def torch_chunk(q, k, v, g, beta, state, chunk: int = 64):
    """Chunked (WY) form for long prompts on CPU: the same math as the recurrence, O(T/chunk) sequential steps."""
    out_dtype = v.dtype
    B, T, _, Dk = q.shape
    q, k = _expand_heads(q, k, v.shape[2])
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = _l2norm(q) * Dk**-0.5
    k = _l2norm(k)
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    H, n = q.shape[1], (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    kb, vb = k * beta[..., None], v * beta[..., None]
    gc = g.cumsum(-1)
    decay = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(0)
    a = -(kb @ k.transpose(-1, -2) * decay).masked_fill(strict, 0)
    for i in range(1, chunk):  # (I - A)^-1 by forward substitution
        a[..., i, :i] = a[..., i, :i] + (a[..., i, :, None] * a[..., :, :i]).sum(-2)
    a = a + torch.eye(chunk, device=q.device)
    u = a @ vb
    w = a @ (kb * gc[..., None].exp())
    s = state.float().clone()
    out = torch.empty_like(v)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    for i in range(n):
        qi, ki, gi = q[:, :, i], k[:, :, i], gc[:, :, i]
        attn = (qi @ ki.transpose(-1, -2) * decay[:, :, i]).masked_fill(causal, 0)
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = (qi * gi[..., None].exp()) @ s + attn @ v_new
        s = s * gi[..., -1, None, None].exp() + (ki * (gi[..., -1, None] - gi).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.reshape(B, H, n * chunk, -1)[:, :, :T]
    return out.transpose(1, 2).to(out_dtype), s


def fla_recurrent(q, k, v, g, beta, state):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    # grouped value heads (HV > H) natively: value head i reads key head i // (HV // H), as _expand_heads does
    return fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


# Blocks of 16 value columns, one warp a program: on the H200 (27B shape, gdn_ops_h200.json) 15-24% faster than
# FLA wrapper's 8 at every width measured: 4.74 against 5.58 us a layer decoding, 8.9 against 11.0 at 4 rows, 81
# against 107 us for commit's replay of 48 layers
RECURRENT_LAUNCH = {"BV": 16, "num_warps": 1, "num_stages": 3}


def fla_recurrent_into(q, k, v, g, beta, state, final, launch=RECURRENT_LAUNCH) -> torch.Tensor:
    """FLA's fused recurrent kernel launched with its final state written into `final`, which may be `state`
    itself: each program loads its own block of the state once, before the first token, and stores the same
    block after the last, so the aliasing is safe. FLA's wrapper always allocates a new final state, which then
    costs a copy (3.1 MB a layer, 0.11 ms a token on the 27B shape: into the committed state when decoding, into
    the verify stash when speculating), so the kernel is launched directly, with the wrapper's own arguments; a
    self-check at load (environment.fla_inplace_status) guards the signature."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel

    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # the kernel's pointer arithmetic
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BV = min(launch["BV"], triton.next_power_of_2(V))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    kernel[(triton.cdiv(V, BV) * B * HV,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=o, h0=state, ht=final,
        cu_seqlens=None, scale=K**-0.5, T=T, H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False, num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    return o


def fla_chunk(q, k, v, g, beta, state):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # grouped value heads (HV > H) natively: value head i reads key head i // (HV // H), as _expand_heads does
    return chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


# --- compile boundaries ------------------------------------------------------------------------------------
# FLA marks its entry points torch.compiler.disable: under torch.compile(fullgraph=True) that is an error. Each
# GDN kernel therefore runs behind an inference custom op, opaque to the compiler, so decode / verify steps
# compile as one graph while the selected kernel is still the one that runs.

IMPLEMENTATIONS = {"torch": (torch_recurrent, torch_chunk), "fla": (fla_recurrent, fla_chunk)}


def run_gdn(q, k, v, g, beta, state, final, impl: str, chunked: bool, direct: bool) -> torch.Tensor:
    """The kernel's output; `final` [B, Hv, Dk, Dv] (contiguous, float32) receives the final state, which may be
    `state` itself. direct: the FLA recurrent kernel writes it there (fla_recurrent_into); otherwise it is
    copied from the kernel's own. A few tokens take gdn_triton's kernel where install() timed it faster."""
    if not chunked:
        config = gdn_triton.choice(q, v)
        if config is not None:
            return gdn_triton.recurrent_into(q, k, v, g, beta, state, final, config)
    if direct:
        return fla_recurrent_into(q, k, v, g, beta, state, final)
    out, last = IMPLEMENTATIONS[impl][int(chunked)](q, k, v, g, beta, state)
    final.copy_(last)
    # a fresh tensor (no input aliasing, as custom ops require), contiguous whatever the kernel returned: compiled
    # code trusts the fake's strides below (a mismatch failed every verify width > 1 on the H200)
    return out.contiguous()


@torch.library.custom_op("mtpchat::gdn", mutates_args=("final",))
def gdn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, final: torch.Tensor, impl: str, chunked: bool, direct: bool) -> torch.Tensor:
    """A verify pass: the committed `state` is read, the final state goes to the stash's `final`."""
    return run_gdn(q, k, v, g, beta, state, final, impl, chunked, direct)


@gdn_op.register_fake
def _(q, k, v, g, beta, state, final, impl, chunked, direct):
    # not empty_like(v): v is a strided view of the conv output, the kernels' outputs are not
    return v.new_empty(v.shape)


def split_qkv(qkv: torch.Tensor, heads: list[int]):
    """q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]: views of the short conv's output qkv [B, T, C]."""
    hk, dk, hv, dv = heads
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    B, T = qkv.shape[:2]
    return q.reshape(B, T, hk, dk), k.reshape(B, T, hk, dk), v.reshape(B, T, hv, dv)


# The conv output goes in whole (split inside): compiled code materialises each custom-op input as a buffer of
# its own, and q, k, v as three inputs cost two more kernels a layer (H200, 27B shape: 240 input kernels a step)
@torch.library.custom_op("mtpchat::gdn_update", mutates_args=("state",))
def gdn_update_op(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, heads: list[int],
                  impl: str, chunked: bool, direct: bool) -> torch.Tensor:
    return run_gdn(*split_qkv(qkv, heads), g, beta, state, state, impl, chunked, direct)


@gdn_update_op.register_fake
def _(qkv, g, beta, state, heads, impl, chunked, direct):
    return qkv.new_empty(*qkv.shape[:2], heads[2], heads[3])


def store_conv_state(conv: torch.Tensor, window: torch.Tensor) -> None:
    """The in-place conv-cache update of prefill and plain decoding: one layer's conv [C, K-1] = the last K-1
    inputs of the window. Plain torch, so that compiled code folds the copy into the kernel that builds the window
    (as a custom op it cost two kernels a layer: the window materialised for it, then the copy; 96 a step on the
    27B shape)."""
    conv.copy_(window[0, :, window.shape[-1] - conv.shape[-1]:])


@dataclass
class Kernel:
    """A GDN kernel behind the custom-op boundary."""

    impl: str
    chunked: bool
    direct: bool = False  # the kernel writes its final state where it is asked to (fla_recurrent_into), no copy

    def verify(self, q, k, v, g, beta, state, final):
        """The output; `state` is left alone, `final` receives the final state (a verify pass into its stash)."""
        if torch.compiler.is_compiling():  # the op is the compile boundary
            return gdn_op(q, k, v, g, beta, state, final, self.impl, self.chunked, self.direct)
        # eager calls skip the custom op's dispatch: about 135 us a call on this CPU, 10% of the demo model's step
        return run_gdn(q, k, v, g, beta, state, final, self.impl, self.chunked, self.direct)

    def update(self, qkv, g, beta, state, heads: list[int]):
        """The output; `state` becomes the final state (prefill, plain decoding). qkv: the conv output [B, T, C],
        heads: [Hk, Dk, Hv, Dv] (split_qkv)."""
        if torch.compiler.is_compiling():
            return gdn_update_op(qkv, g, beta, state, heads, self.impl, self.chunked, self.direct)
        return self.update_rows(*split_qkv(qkv, heads), g, beta, state)

    def update_rows(self, q, k, v, g, beta, state):
        """update() over q, k, v given apart (commit's replay of stashed rows; eager only)."""
        return run_gdn(q, k, v, g, beta, state, state, self.impl, self.chunked, self.direct)


@dataclass
class Backends:
    """The kernel chosen for each op and why; diagnostics print it as is."""

    gdn_chunk: object = field(default_factory=lambda: Kernel("torch", True))
    gdn_recurrent: object = field(default_factory=lambda: Kernel("torch", False))
    moe: str = "rowwise"  # the decode-width MoE path (model.MOE_PATHS)
    # graph-mode attention: "masked" (model), "triton" (attention_triton) or "triton-long" (the kernel over
    # capacities past model.TRITON_MIN_CAPACITY and fp8 caches, the masked form below): model.choose_decode_attention
    decode_attention: str = "masked"
    kv_cache: str = "auto"  # the attention KV cache's storage: "auto" (the model's dtype) or "fp8" (cache.py)
    short_conv: str = "torch"  # GDN's short conv and gates at decode / verify widths: "torch" or "triton" (conv_triton)
    rope: str = "torch"  # the rotary embedding's table and rotation: "torch" or "triton" (rope_triton)
    cycle: str = "torch"  # the cycle graphs' bookkeeping (commit, acceptance): "torch" or "triton" (cycle_triton)
    argmax: str = "torch"  # greedy tokens: "torch" or "triton" (cycle_triton.argmax, timed at load)
    choice: dict[str, tuple[str, str]] = field(default_factory=dict)  # op -> (backend, reason)


def select_backends(device: torch.device) -> Backends:
    b = Backends()
    reason = _fla_unusable_reason(device)
    if reason is None:
        from .environment import fla_inplace_status

        direct, why = fla_inplace_status(device.index or 0)
        b.gdn_chunk, b.gdn_recurrent = Kernel("fla", True), Kernel("fla", False, direct)
        b.choice["gdn_chunk"] = ("fla", "flash-linear-attention Triton kernel on CUDA")
        b.choice["gdn_recurrent"] = ("fla", "flash-linear-attention Triton kernel on CUDA; "
                                            + ("final state written in place" if direct else f"final state copied ({why})"))
    else:
        b.choice["gdn_chunk"] = ("torch", f"chunked torch reference: {reason}")
        b.choice["gdn_recurrent"] = ("torch", f"recurrent torch reference: {reason}")
    b.choice["conv1d"] = ("torch", "short conv over the conv-input window (stashed for rollback): products summed "
                                   "over the kernel for up to 64 tokens, depthwise F.conv1d for longer prefills")
    b.choice["gated_rmsnorm"] = ("torch", "module's own gated RMSNorm")
    b.choice["attention"] = ("torch-sdpa", "eager 16-bit passes on CUDA: torch's flash kernel, bottom-right causal "
                                           "(SDPA's dispatcher cost 0.53 s on each new shape); elsewhere torch "
                                           "scaled_dot_product_attention; inside CUDA graphs matmuls + softmax over "
                                           "the whole KV cache")
    return b


def _fla_unusable_reason(device: torch.device) -> str | None:
    """None when FLA may run here; otherwise why not (switch, device, import, or the numerical self-check)."""
    from .environment import DeviceInfo, fla_status

    info = DeviceInfo(kind=device.type, name="", total_bytes=0, free_bytes=0, index=device.index or 0)
    usable, why = fla_status(info)
    return None if usable else why
