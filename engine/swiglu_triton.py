"""The SwiGLU MLP's activation, silu(gate) * up, as one Triton kernel on CUDA in 16-bit instead of torch's two
(silu, then the product), for every dense MLP and shared expert (fusion.dense_mlp): in the CUDA graphs the engine
runs without torch.compile by default each is a graph node of ~2 us, eight a plain step of the demo model.

The torch form's rounding: silu computed in float32 and rounded to the activations' dtype, then the product of the
two 16-bit values in float32, rounded again. Its exp is Triton's (tl.exp), not CUDA's expf, so a value may land
one ulp apart from the torch form's: the self-check at load compares them with a tolerance, and plain decoding and
verify passes both take the kernel. Under torch.compile the torch form runs (inductor fuses it).
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

BLOCK = 1024  # columns a program: the 27B shape's 17,408 in 17 programs a row


if triton is not None:
    from .splitk import after_previous

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Columns [BLOCK * program 1, +BLOCK) of row program 0: silu(g) rounded, times u, rounded."""
        after_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < I
        g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * I + cols, (act * u).to(dt), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] (rows of any stride, unit stride along I: a fused gate / up output's
    two halves): a new contiguous [..., I]."""
    I = gate.shape[-1]
    g, u = gate.reshape(-1, I), up.reshape(-1, I)
    out = torch.empty(g.shape[0], I, device=gate.device, dtype=gate.dtype)
    _swiglu_kernel[(g.shape[0], triton.cdiv(I, BLOCK))](g, u, out, g.stride(0), u.stride(0), I, BLOCK=BLOCK,
                                                        num_warps=4, **pdl(out))
    return out.view(gate.shape)


def takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """The layouts swiglu() takes (rows of one stride each, unit stride along I), outside torch.compile's tracing."""
    return (gate.stride(-1) == 1 and up.stride(-1) == 1 and gate.shape == up.shape
            and not torch.compiler.is_compiling())


def is_swiglu_mlp(module) -> bool:
    """A dense SwiGLU MLP (transformers' *MLP, a shared expert): gate / up / down projections and silu."""
    act = getattr(module, "act_fn", None)
    return (all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLUActivation", "SiLU"))


def _width(mlp) -> int:
    """The MLP's intermediate width (a quantized or sharded gate_proj's too)."""
    gate = mlp.gate_proj
    return getattr(gate, "out_features", None) or gate.weight.shape[0]


def _self_check(width: int, device, dtype) -> float:
    """The kernel against the torch form at one row and at five, the halves of one fused [rows, 2 * width]."""
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for rows in (1, 5):
        y = (torch.randn(rows, 2 * width, generator=gen, device=device) * 4).to(dtype)
        gate, up = y.split(width, -1)
        worst = max(worst, relative_error(swiglu(gate, up), torch.nn.functional.silu(gate) * up))
    return worst


def install(backends, modules, device, dtype) -> None:
    """Mark every dense SwiGLU MLP among `modules` (mlp.swiglu = True: fusion.dense_mlp takes the kernel) where it
    may run and passes its self-check at each MLP width; the reason in backends.choice["swiglu"] either way
    (backends None: the MTP head's, recorded by the trunk's). Nothing is recorded for a model without them."""
    mlps = [m for m in modules if is_swiglu_mlp(m)]
    if not mlps:
        return
    why, worst = self_checked(supported(torch.device(device), dtype), "SwiGLU", "MTPCHAT_SWIGLU",
                              lambda: max(_self_check(w, device, dtype) for w in {_width(m) for m in mlps}))
    for m in mlps:
        m.swiglu = why is None
    if backends is not None:
            backends.choice["swiglu"] = (("triton", f"silu(gate) * up in one Triton kernel (self-check {worst:.1e})")
                                     if why is None else ("torch", f"silu, then the product, as torch ops ({why})"))
