"""The runtime forward over the trunk: embeddings -> layers -> final norm -> lm_head, with the engine's caches.

transformers defines the modules and we load the weights into them; the loop, the caches and the kernels are ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams

from . import conv_triton, cycle_triton, fp8, gdn, gdn_triton, int4, rope_triton, swiglu_triton
from .cache import FP8, KVCache, GDNState, dequantize_kv, kv_write, kv_write_at
from .checkpoint import TensorFiles, model_dir, read_json
from .context import kv_cache_dtype
from .errors import EngineError
from .events import Fallback
from .fusion import dense_mlp, fuse_all, linears
from .families import (LAYER_KINDS, Family, convert_gdn_layout, family_for, fuse_experts, mtp_layers_declared,
                       sliding_window)
from .modules import DequantizingExperts, quantize_like_releases
from .norm_triton import add_then_norm
from .rotating_cache import RotatingKV
from .kernels import Backends, relative_error, select_backends


class Rotary(torch.nn.Module):
    """Rotary frequencies from the config (transformers' rope-type initialisers). For text, Qwen3.5's
    multimodal RoPE has equal positions on every axis, which is exactly this 1-D rotary embedding."""

    def __init__(self, config, device):
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        kind = rope.get("rope_type", "default")
        if kind == "default":
            dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
            base = rope.get("rope_theta", 10000.0)
            inv_freq, self.scaling = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](config, device)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, position_ids, dtype):
        """cos and the signed sin [.., rotary dim]: rotating x is x * cos + roll(x, half) * sin, where
        transformers writes cat(-x2, x1) * sin. The same products: negating a factor commutes with rounding."""
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * self.scaling
        sin[..., : freqs.shape[-1]] *= -1
        return (emb.cos() * self.scaling).to(dtype), sin.to(dtype)


def apply_rope(q, k, cos, sin, fused: bool = False):
    """Partial rotary embedding (Rotary's cos and signed sin): only the first cos.shape[-1] dims of each head
    rotate. Queries and keys [B, heads, T, D] rotate as one tensor: the same elementwise ops (the same numbers)
    in half the launches, which at batch 1 are the cost. fused (Backends.rope == "triton"): rope_triton's one
    launch, where it takes the layout."""
    if fused and rope_triton.rotatable(q, k, cos):
        return rope_triton.rotate(q, k, cos, sin)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd, hq = cos.shape[-1], q.shape[1]
    qk = torch.cat([q, k], 1)
    r = qk[..., :rd]
    qk = torch.cat([r * cos + r.roll(rd // 2, -1) * sin, qk[..., rd:]], -1)
    return qk[:, :hq], qk[:, hq:]


def masked_decode_attention(q, keys, values, future, scale: float) -> torch.Tensor:
    """A few queries q [1, H, T, D] over the cache's whole capacity [1, Hkv, N, D], the positions `future`
    [T, N] masked out (True: a position the query must not see), as plain matmuls and a softmax. SDPA's fused kernels are built for long
    query blocks; here they cost like a prefill: on the H200 (27B shape, 4 queries, inside a CUDA graph) cuDNN's
    took 1.66 ms per layer over a 32k-position cache, this 0.12 ms (0.09 ms compiled). Scores come out of a bf16
    matmul (fp32 accumulation) and the softmax runs in fp32."""
    B, H, T, D = q.shape
    group = H // keys.shape[1]
    rows = q.reshape(B, keys.shape[1], group * T, D)  # query head h reads kv head h // group: rows (group, t)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).float() * scale
    scores = scores.view(B, keys.shape[1], group, T, -1).masked_fill(future, float("-inf"))  # (no repeat)
    return torch.matmul(torch.softmax(scores.view(rows.shape[:-1] + (-1,)), -1).to(values.dtype),
                        values).reshape(B, H, T, D)


def future_of(positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """masked_decode_attention's mask [T, capacity]: True where a key lies past query t's position positions[t]."""
    return torch.arange(capacity, device=positions.device)[None, :] > positions[:, None]


def kernel_serves(path: str, capacity: int, fp8: bool) -> bool:
    """Whether graph-mode attention over a cache of `capacity` positions takes the split-K kernel
    (Backends.decode_attention: "triton" everywhere, "triton-long" past TRITON_MIN_CAPACITY and over fp8 caches)."""
    return path == "triton" or (path == "triton-long" and (fp8 or capacity > TRITON_MIN_CAPACITY))


def causal_attention(q, keys, values, pos: int, scale: float) -> torch.Tensor:
    """Queries q [1, H, T, D] at positions pos..pos+T-1 over keys / values [1, Hkv, pos + T, D]: query i sees keys
    0..pos+i. On CUDA in 16-bit: the flash kernel, no [T, pos + T] mask, grouped-query heads native (on the H200,
    27B shape: 1.2 ms for 2k queries over 8k keys, against 1.6 ms with the mask). Its causal form aligns
    bottom-right when there are more keys than queries; torch's own CausalBias(LOWER_RIGHT) calls it so and asks
    can_use_flash_attention as here, without is_causal (whose rule refuses fewer queries than keys). Never SDPA's
    dispatcher there: on the H100 its masked form took 0.53 s of the host's time a call on each new shape, and eager
    shapes are new all the time (each catch-up of the MTP head after plain steps: --depth auto ran 146 tok/s where
    depth 3 ran 1,860; packaging/bench/auto_trace.py). The CPU and float32 keep the explicit mask: the exact
    reference."""
    T = q.shape[2]
    if T == 1:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
    if q.is_cuda and q.dtype != torch.float32:
        if torch.backends.cuda.can_use_flash_attention(SDPAParams(q, keys, values, None, 0.0, False, True)):
            return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True, scale=scale)[0]
    mask = torch.ones(T, pos + T, dtype=torch.bool, device=q.device).tril(pos)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


# Graph-mode attention over a capacity up to this many positions stays the masked form: measured per call on the
# H200 (27B shape, 4 queries), masked 0.123 / 0.134 / 0.471 ms at 2k / 32k / 131k positions, the split-K kernel
# 0.153 / 0.148 / 0.213 ms: they cross near 37k. The capacity is a static shape, so each capture picks one.
TRITON_MIN_CAPACITY = 40960
# Below it the kernel serves a trunk only where it timed this many times faster than the masked form at load
# (choose_decode_attention): the timing is the eager masked form's, and --compile fuses it (on the H200, 27B shape,
# 4 queries over 2k positions: 0.123 ms eager, 0.09 compiled), so a narrower win would be a loss there.
COMPILED_MASKED_GAIN = 1.4


def attention(attn, x, pos, cos, sin, keys: torch.Tensor, values: torch.Tensor, path: str = "masked",
              rope: str = "torch") -> torch.Tensor:
    """Gated full attention (Qwen3-Next / 3.5): q_proj yields the query and a sigmoid output gate. path: the
    graph-mode attention (Backends.decode_attention); rope: Backends.rope."""
    B, T, _ = x.shape
    hd = attn.head_dim
    qg, k, v = linears(attn, ("q_proj", "k_proj", "v_proj"), x)
    if getattr(attn, "gated", True):
        q, gate = qg.reshape(B, T, -1, 2 * hd).chunk(2, dim=-1)
    else:  # dense Qwen3: no output gate
        q, gate = qg.reshape(B, T, -1, hd), None
    k = k.reshape(B, T, -1, hd)
    v = v.reshape(B, T, -1, hd).transpose(1, 2)
    # graph mode over a 16-bit cache: keys rotated and values copied straight into it, one launch, with q_norm and
    # k_norm in it where both run norm_triton's kernel
    stored = (not isinstance(pos, int) and rope == "triton" and values is not None
              and rope_triton.storable(q.transpose(1, 2), k.transpose(1, 2), v, cos, keys, values))
    norms = rope_triton.qk_norms(attn) if stored else None
    if norms is None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if stored:
        q = rope_triton.rotate_and_store(q, k, v, cos, sin, keys, values, pos, norms)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    else:
        q, k = apply_rope(q, k, cos, sin, fused=rope == "triton")
    if values is None:  # a sliding-window layer: `keys` is its ring (rotating_cache.RingLayer); in graph mode over
        # the masked form, as full attention's below (a few queries: SDPA's fused kernels cost like a prefill)
        o = keys.attend(q, k, v, attn.scaling, None if isinstance(pos, int) else masked_decode_attention)
    elif isinstance(pos, int):
        keys, values = kv_write(keys, values, pos, k, v)
        o = causal_attention(q, keys, values, pos, attn.scaling)
    else:  # CUDA-graph capture: the position lives on the device, shapes are the cache's whole capacity
        if not stored:
            keys, values = kv_write_at(keys, values, pos, k, v)  # (pos: the positions [T]; fp8: (codes, scales))
        fp8 = isinstance(keys, tuple)
        if kernel_serves(path, (keys[0] if fp8 else keys).shape[2], fp8):
            # the filled length only (attention_triton); an fp8 cache at every capacity: its codes are converted
            # in registers, where the masked form would dequantize the whole capacity each step
            ks = vs = None
            if isinstance(keys, tuple):  # (the codes' bytes as e4m3, and their scales)
                (keys, ks), (values, vs) = keys, values
                keys, values = keys.view(FP8), values.view(FP8)
            # ([B, T, heads, D], gated by the kernel: o_proj's input as it is)
            o = torch.ops.mtpchat.decode_attention(q, keys, values, pos, attn.scaling, ks, vs, gate)
            return attn.o_proj(o.view(B, T, -1))
        keys, values = dequantize_kv(keys, q.dtype), dequantize_kv(values, q.dtype)
        o = masked_decode_attention(q, keys, values, future_of(pos, keys.shape[2]), attn.scaling)
    # [B, T, heads, D] from views, no copies: the gate first, so that the product takes its contiguous layout
    o = o.transpose(1, 2) if gate is None else torch.sigmoid(gate) * o.transpose(1, 2)
    return attn.o_proj(o.reshape(B, T, -1))


MOE_ROWWISE_MAX_TOKENS = 32


def mlp(layer, x: torch.Tensor, moe: str = "rowwise") -> torch.Tensor:
    """The layer's MLP or MoE block over x, its post-attention norm's output. moe: the decode / verify-width MoE
    path (MOE_PATHS; CUDA picks one after a self-check at load)."""
    block = layer.mlp
    if hasattr(block, "gate_proj"):
        return dense_mlp(block, x)
    if hasattr(block, "experts") and x.shape[1] <= MOE_ROWWISE_MAX_TOKENS:
        return MOE_PATHS[moe](block, x)
    y = block(x)
    return y[0] if isinstance(y, tuple) else y


def route(block, h: torch.Tensor):
    """Device-side routing of rows h [N, H]: top-k expert ids [N, k] and their weights."""
    router = block.gate
    probs = torch.softmax(F.linear(h, router.weight), dim=-1, dtype=torch.float)
    weights, idx = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, idx


def combine(block, h: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shape) -> torch.Tensor:
    """Weighted sum of each row's k expert outputs y [N * k, H], plus the gated shared expert."""
    y = (y.view(h.shape[0], -1, h.shape[1]) * weights.to(y.dtype).unsqueeze(-1)).sum(1)
    shared = dense_mlp(block.shared_expert, h) * torch.sigmoid(block.shared_expert_gate(h))
    return (y + shared).view(shape)


def moe_rowwise(block, x: torch.Tensor) -> torch.Tensor:
    """Sparse MoE for decode / verify widths: device-side routing, one batched matmul per projection, no Python
    loop over experts, and every (token, expert) pair computed on its own, so a token's output does not depend
    on which other tokens share the batch (the verify pass's rows must not depend on the rejected tail). It
    gathers each pair's expert weights first: about three times the weight traffic of reading them in place."""
    h = x.reshape(-1, x.shape[-1])
    weights, idx = route(block, h)
    experts, flat = block.experts, idx.reshape(-1)
    rows = h.repeat_interleave(idx.shape[1], dim=0).unsqueeze(-1)  # [N * k, H, 1]
    gate_up, down = expert_weights(experts, flat, h.dtype)
    gate, up = torch.bmm(gate_up, rows).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(down, (experts.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
    return combine(block, h, y, weights, x.shape)


def expert_weights(experts, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [P, 2I, H], down [P, H, I]) of experts `ids` [P], gathered; FP8 and 4-bit experts dequantize only
    these, exactly in float32 (fp8.FP8Experts.dense, int4.Int4Experts.dense), so the CPU's float32 path stays the
    exact reference."""
    if isinstance(experts, DequantizingExperts):
        return experts.dense(ids, dtype)
    return experts.gate_up_proj[ids], experts.down_proj[ids]


def moe_grouped(block, x: torch.Tensor) -> torch.Tensor:
    """The same computation as moe_rowwise with the (token, expert) pairs sorted by expert and one grouped GEMM
    per projection (torch._grouped_mm): each routed expert's weights are read in place, once, and experts
    nobody routed to are not read at all. Group boundaries are computed on the device (no host sync: graph-safe).
    Not for FP8 or 4-bit experts: no grouped GEMM here reads them (dequantizing every expert per call would cost
    more than the row-wise path's gather), so moe_check skips it."""
    if isinstance(block.experts, fp8.FP8Experts):
        raise ValueError("grouped_mm does not read FP8 experts")
    if isinstance(block.experts, int4.Int4Experts):
        raise ValueError("grouped_mm does not read 4-bit experts")
    h = x.reshape(-1, x.shape[-1])
    weights, idx = route(block, h)
    experts, flat = block.experts, idx.reshape(-1)
    order = flat.argsort(stable=True)
    n_experts = experts.gate_up_proj.shape[0]
    ends = torch.searchsorted(flat[order], torch.arange(n_experts, device=h.device), right=True).to(torch.int32)
    rows = h[order // idx.shape[1]]  # the token of each sorted pair
    gate, up = torch._grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y_sorted = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=ends)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return combine(block, h, y, weights, x.shape)


def moe_triton(block, x: torch.Tensor) -> torch.Tensor:
    from .moe_triton import moe_triton

    return moe_triton(block, x)


MOE_PATHS = {"rowwise": moe_rowwise, "grouped_mm": moe_grouped, "triton": moe_triton}
MOE_WHY = {"grouped_mm": "grouped GEMM over expert-sorted rows, weights read in place",
           "triton": "Triton kernels: top-k routing, then the routed experts' weights read in place, no sort "
                     "(moe_triton.py)"}


def choose_moe(trunk) -> None:
    """Record the decode-width MoE path in the trunk's backends (used by mlp() through block())."""
    trunk.backends.moe, why = moe_check(trunk)
    if why != "no MoE layers":
        trunk.backends.choice["moe"] = (trunk.backends.moe, why)


def choose_norm(backends, modules, device, dtype) -> None:
    """The RMSNorms' forward, plain and gated: one Triton kernel each on CUDA in 16-bit (norm_triton.py), else the
    modules' own."""
    from .norm_triton import install, is_gated_rms_norm

    modules = list(modules)
    why = install(modules, device, dtype)
    backends.choice["rmsnorm"] = ("triton" if why.startswith("Triton") else "torch", why)
    if any("forward" in vars(m) for m in modules if is_gated_rms_norm(m)):  # (install gave it the kernel)
        backends.choice["gated_rmsnorm"] = ("triton", why)


def choose_fp8(backends, modules, device, dtype) -> None:
    """FP8 linears' forward: the Triton W8A16 kernel on CUDA in 16-bit (fp8_triton.py), else dequantize-then-matmul
    (exact in float32: the CPU's reference). Nothing is recorded for a model without FP8 weights."""
    from .fp8_triton import install

    why = install(modules, device, dtype)
    if why is not None:
        backends.choice["fp8_linear"] = ("triton" if why.startswith("Triton") else "dequantize", why)


def choose_linear16(backends, modules, device, dtype) -> None:
    """16-bit linears at decode / verify widths: Triton's streaming kernels for the shapes timed faster than cuBLAS
    on this GPU (linear16_triton.py). Nothing is recorded off CUDA or without 16-bit linears."""
    from .linear16_triton import install

    why = install(modules, device, dtype)
    if why is not None:
        backends.choice["linear16"] = ("triton" if why.startswith("Triton") else "cublas", why)


def choose_launch(backends, device) -> None:
    """How the decode-path kernels launch on CUDA (splitk.pdl): recorded for the diagnostics."""
    if device.type == "cuda":
        from .splitk import pdl_why_not

        why = pdl_why_not(device)
        backends.choice["launch"] = ("pdl", "programmatic dependent launch: a kernel's blocks start while the "
                                     "previous kernel drains") if why is None else ("stream order", why)


def choose_cpu_linear(backends, modules, device, dtype) -> None:
    """float32 linears at verify widths on the CPU: oneDNN over reordered weights for the shapes timed faster than
    MKL (cpu_linear.py). Nothing is recorded off the CPU."""
    from .cpu_linear import install

    why = install(modules, device, dtype)
    if why is not None:
        backends.choice["cpu_linear"] = ("onednn" if why.startswith("oneDNN") else "mkl", why)


def choose_kv_cache(trunk) -> None:
    """The full-attention KV cache's storage: the model's dtype, or fp8 (--kv-cache-dtype fp8: e4m3 codes and a
    float32 scale per head and position, cache.quantize_kv). Sliding-window rings stay in the model's dtype: they
    hold one window, whatever the context."""
    mode = kv_cache_dtype()
    trunk.backends.kv_cache = mode
    dtype = str(trunk.dtype).replace("torch.", "")
    if mode == "fp8":
        size = torch.empty((), dtype=trunk.dtype).element_size()
        trunk.backends.choice["kv_cache"] = ("fp8", f"e4m3 codes (a byte an element, {size} in {dtype}) and a "
                                                    f"float32 scale per head and position; lossy "
                                                    f"(--kv-cache-dtype fp8)")
    else:
        trunk.backends.choice["kv_cache"] = (dtype, "the model's dtype (--kv-cache-dtype fp8: a byte a value, lossy)")


def choose_decode_attention(trunk) -> None:
    """Graph-mode attention: the split-K Triton kernel over the filled length (attention_triton.py) when it
    serves this trunk and matches the masked form on random inputs, at every capacity where it also timed
    COMPILED_MASKED_GAIN times faster than the masked form over a short cache at load ("triton"), else over
    capacities past TRITON_MIN_CAPACITY and fp8 caches ("triton-long"); else the masked form, with the reason."""
    from . import attention_triton

    c = trunk.config
    fp8 = trunk.backends.kv_cache == "fp8"
    why = attention_triton.usable(trunk.device, trunk.dtype, c.head_dim)
    if why is None and os.environ.get("MTPCHAT_DECODE_ATTENTION") == "masked":
        why = "MTPCHAT_DECODE_ATTENTION=masked"
    if why is None:
        try:
            err = attention_triton.self_check(trunk.device, trunk.dtype, c.num_attention_heads,
                                              c.num_key_value_heads, c.head_dim, fp8)
            why = None if err < 2e-2 else f"self-check mismatch {err:.2g}"
        except Exception as e:  # an architecture or Triton version the kernel does not compile for
            why = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if why is not None:
        trunk.backends.choice["decode_attention"] = ("masked", f"matmuls and a softmax over the whole capacity "
                                                               f"({why})")
        return
    timed = None
    if not fp8:
        try:
            timed = attention_triton.timed_against_masked(trunk.device, trunk.dtype, c.num_attention_heads,
                                                          c.num_key_value_heads, c.head_dim)
        except Exception:  # (its graphs failed: the kernel keeps to the long caches)
            pass
    everywhere = fp8 or timed is not None and timed[0] * COMPILED_MASKED_GAIN < timed[1]
    trunk.backends.decode_attention = "triton" if everywhere else "triton-long"
    timing = ("not timed at load" if timed is None else
              f"a decode and a verify call over 2,048 positions at load: {timed[0] * 1e3:.0f} us, the masked form "
              f"{timed[1] * 1e3:.0f}")
    where = ("an fp8 cache's codes at every capacity" if fp8 else f"every capacity ({timing})" if everywhere else
             f"caches over {TRITON_MIN_CAPACITY} positions, the masked form below ({timing})")
    trunk.backends.choice["decode_attention"] = ("triton", f"split-K Triton kernel over the filled length for "
                                                           f"{where} (self-check {err:.1e})")


def moe_check(trunk) -> tuple[str, str]:
    """The fastest MoE path whose output matches moe_rowwise's on the first MoE layer: Triton kernels, then
    grouped GEMMs. CUDA only (on the CPU the row-wise form is the exact reference the tests hold). FP8 experts
    (fp8.FP8Experts) are checked the same way, through the kernels' FP8 variant, against moe_rowwise's exact
    dequantization; grouped GEMMs do not serve them. 4-bit experts (int4.Int4Experts) likewise, through
    int4_moe_triton's kernels. MTPCHAT_MOE=rowwise keeps the row-wise path (the bench's comparison)."""
    layer = next((l for l in trunk.layers if hasattr(l.mlp, "experts")), None)
    if layer is None:
        return "rowwise", "no MoE layers"
    if os.environ.get("MTPCHAT_MOE") == "rowwise":
        return "rowwise", "row-wise batched matmuls (MTPCHAT_MOE=rowwise)"
    if trunk.device.type != "cuda":
        return "rowwise", "row-wise batched matmuls over gathered expert weights (the others: CUDA only)"
    if trunk.dtype == torch.float32:  # float32 is the exactness reference: verify and decode must round alike
        return "rowwise", "row-wise batched matmuls (float32: the exact reference path; the others in 16-bit only)"
    from .moe_triton import available, unreadable

    missing = {"triton": None if available() else "triton: not installed",
               "grouped_mm": None if hasattr(torch, "_grouped_mm") else "grouped_mm: not in this torch"}
    if not missing["triton"]:
        missing["triton"] = unreadable(layer.mlp.experts)
    if isinstance(layer.mlp.experts, fp8.FP8Experts) and not missing["grouped_mm"]:
        missing["grouped_mm"] = "grouped_mm: FP8 experts"
    if isinstance(layer.mlp.experts, int4.Int4Experts) and not missing["grouped_mm"]:
        missing["grouped_mm"] = "grouped_mm: 4-bit experts"
    gen = torch.Generator(device=trunk.device).manual_seed(0)
    x = torch.randn(1, 4, trunk.config.hidden_size, generator=gen, device=trunk.device, dtype=trunk.dtype)
    failures = []
    for path in ("triton", "grouped_mm"):
        if missing[path]:
            failures.append(missing[path])
            continue
        try:
            with torch.inference_mode():
                if path == "triton":  # the first call times its kernels' configurations (moe_triton._tune)
                    MOE_PATHS[path](layer.mlp, x[:, :1])
                err = relative_error(MOE_PATHS[path](layer.mlp, x), moe_rowwise(layer.mlp, x))
        except Exception as e:  # unsupported dtype, architecture, activation or layout
            failures.append(f"{path} unavailable: {type(e).__name__}: {str(e)[:120]}")
            continue
        if err < 2e-2:
            return path, f"{MOE_WHY[path]} (self-check {err:.1e})"
        failures.append(f"{path} self-check mismatch {err:.2g}")
    return "rowwise", f"row-wise batched matmuls ({'; '.join(failures)})"


def block(trunk, layer, kind: str, h, pending, pos, cos, sin, state: tuple, rows: tuple | None):
    """One decoder layer: mixer (GDN or gated attention) and MLP, each with its residual. pending: the layer
    before's MLP output, not yet added to its residual stream h (before the first layer: None, or zeros for the
    compiled block, first_pending), and this layer's is returned the same way, (h, pending): the add happens where
    compiled code fuses it into the next layer's input norm (64 kernels fewer a step on the 27B shape), and it is
    the same add of the same operands, so eager results do not change by a bit. state: this layer's cache views
    (KVCache.layer / GDNState.layer; a GDN layer's with a padded prefill's `real` after them: Trunk.forward);
    rows: its verify stash rows, None for prefill. No layer numbers inside, so torch.compile compiles it once per
    layer kind and reuses it for every layer."""
    if pending is None:  # a pass's first layer (first_pending)
        x = layer.input_layernorm(h)
    else:
        h, x = add_then_norm(layer.input_layernorm, h, pending)
    if kind == "linear_attention":
        if rows is not None:
            x = gdn.verify(layer.linear_attn, x, *state, trunk.backends, rows)
        else:
            x = gdn.prefill(layer.linear_attn, x, trunk.backends, *state)
    else:  # full attention, or a sliding window (state: its ring, rotating_cache.RotatingKV.layer)
        x = attention(layer.self_attn, x, pos, cos, sin, *state, trunk.backends.decode_attention, trunk.backends.rope)
    h, x = add_then_norm(layer.post_attention_layernorm, h, trunk.reduce(x))
    return h, trunk.reduce(mlp(layer, x, trunk.backends.moe))


def first_pending(step, h: torch.Tensor) -> torch.Tensor | None:
    """The `pending` a pass's first layer gets from `step` (Trunk.layer_step): None for `block` (its input norm
    alone: no zeros written and added, a launch fewer a pass, the trunk's and each MTP step's); zeros for the
    compiled block, so that the first layer calls it as every other does (one compilation a layer kind)."""
    return None if step is block else torch.zeros_like(h)


def layer_slots(kinds: list[str]) -> list[int]:
    """Each layer's index within its own cache: the n-th GDN layer uses GDN slot n, likewise for attention."""
    seen: dict[str, int] = {}
    slots = []
    for kind in kinds:
        slots.append(seen.get(kind, 0))
        seen[kind] = slots[-1] + 1
    return slots


OFFSETS = 256  # positions() of passes up to this many tokens (graphs.PREFILL_WIDTHS' widest) add a kept arange


@dataclass
class Trunk:
    """The loaded text model plus everything the engine needs to run it."""

    family: Family
    config: object
    lm: torch.nn.Module  # the family's *ForCausalLM, weights loaded
    rotary: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    backends: Backends
    kinds: list[str] = field(default_factory=list)  # per layer: families.LAYER_KINDS
    slots: list[int] = field(default_factory=list)  # index of each layer in its cache (GDN or KV)
    group: object | None = None  # tensor parallelism: an object with all_reduce(x) and gather_vocab(x) (tp.py)
    graphs: object | None = None  # graphs.GraphRunner: verify steps replayed as CUDA graphs
    compiled_block: object | None = None  # torch.compile(block): one compiled region per layer kind (graphs.py)

    def __post_init__(self):
        # every way of building a trunk (checkpoint, random weights, a tensor-parallel shard) runs the same steps
        for layer in self.layers:  # dense Qwen3's attention has no output gate in q_proj
            if hasattr(layer, "self_attn"):
                layer.self_attn.gated = self.family.name != "qwen3"
        gdn.keep_constants(self.layers)  # (before fusion: it may put projections' rows in another order)
        fuse_all(self.layers)
        conv_triton.install(self.backends, self.layers, self.device, self.dtype)
        gdn_triton.install(self.backends, self.layers, self.device, self.dtype)
        rope_triton.install(self.backends, self.rotary, self.config, self.device, self.dtype)
        swiglu_triton.install(self.backends, self.lm.modules(), self.device, self.dtype)
        cycle_triton.install(self.backends, self.device, self.config.vocab_size, self.dtype)
        choose_moe(self)
        choose_norm(self.backends, self.lm.modules(), self.device, self.dtype)
        choose_fp8(self.backends, self.lm.modules(), self.device, self.dtype)
        choose_linear16(self.backends, self.lm.modules(), self.device, self.dtype)
        choose_cpu_linear(self.backends, self.lm.modules(), self.device, self.dtype)
        int4.choose(self.backends, self.lm.modules(), self.device, self.dtype)
        choose_kv_cache(self)
        choose_decode_attention(self)
        choose_launch(self.backends, self.device)
        # 0, 1, 2, ... for positions(): a graph's pass adds it to its position, one launch (an arange there was a
        # second, twice a cycle graph: the verify pass's and the head's chain)
        self.offsets = torch.arange(OFFSETS, device=self.device)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial outputs of row-parallel projections across ranks (identity on one device)."""
        return x if self.group is None else self.group.all_reduce(x)

    @property
    def embed(self):
        return self.lm.model.embed_tokens

    @property
    def layers(self):
        return self.lm.model.layers

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """float32 logits; upcast=False keeps the lm_head's dtype, for an argmax alone (the conversion is exact
        and keeps the order: the same token, one launch fewer)."""
        out = self.lm.lm_head(hidden)
        out = out.float() if upcast else out
        return out if self.group is None else self.group.gather_vocab(out)

    def new_caches(self) -> "TrunkCaches":
        c = self.config
        n_gdn = self.kinds.count("linear_attention")
        n_window = self.kinds.count("sliding_attention")
        n_attn = len(self.kinds) - n_gdn - n_window
        mixer = next((l.linear_attn for l, k in zip(self.layers, self.kinds) if k == "linear_attention"), None)
        # (a dense model has no GDN fields: empty GDN state and stash)
        dims = dict(nk=getattr(c, "linear_num_key_heads", 0), dk=getattr(c, "linear_key_head_dim", 0),
                    nv=getattr(c, "linear_num_value_heads", 0), dv=getattr(c, "linear_value_head_dim", 0),
                    kernel=getattr(c, "linear_conv_kernel_dim", 1), conv=mixer.conv_dim if mixer is not None else 0)
        window = None
        if n_window:
            window = RotatingKV(n_window, c.num_key_value_heads, c.head_dim, sliding_window(c), self.dtype,
                                self.device)
        return TrunkCaches(
            kv=KVCache(n_attn, c.num_key_value_heads, c.head_dim, self.dtype, self.device,
                       fp8=self.backends.kv_cache == "fp8"),
            gdn=GDNState(n_gdn, dims["conv"], dims["kernel"], dims["nv"], dims["dk"], dims["dv"], self.dtype,
                         self.device),
            dims=dims,
            n_gdn=n_gdn,
            window=window,
        )

    def positions(self, pos, T: int):
        """Positions pos..pos+T-1 of a pass over T tokens. An int pos (eager steps) stays one. In graph capture
        pos lives on the device (reading it on the host would sync and invalidate the capture): a scalar becomes
        the positions [T], once per pass, which the rope and every attention layer then share."""
        if isinstance(pos, int) or pos.dim() == 1:
            return pos
        return pos + (self.offsets[:T] if T <= OFFSETS else torch.arange(T, device=self.device))

    def rope(self, pos, T: int):
        """cos, sin [1, T, rotary dim] of positions pos..pos+T-1: the trunk's layers and the MTP head's (a verify
        graph with the head's refresh computes them once for both); one launch where Backends.rope is "triton"."""
        if self.backends.rope == "triton" and not torch.compiler.is_compiling():
            return rope_triton.table(self.rotary, pos, T, self.dtype, self.device)
        ids = torch.arange(pos, pos + T, device=self.device) if isinstance(pos, int) else self.positions(pos, T)
        return self.rotary(ids.unsqueeze(0), self.dtype)

    def layer_step(self, pos):
        """`block`, or its compiled form when graphs are captured (pos on the device, fixed widths): the trunk's
        layers and the MTP head's. Prefill and eager steps (pos an int) stay eager."""
        return self.compiled_block if self.compiled_block is not None and not isinstance(pos, int) else block

    def forward(self, tokens: torch.Tensor, pos: int, caches: "TrunkCaches", verify: bool, rope=None,
                chain: int = 0, real: torch.Tensor | None = None) -> torch.Tensor:
        """Run tokens [1, T] at positions pos..pos+T-1; return the hidden states after the final norm.

        verify=False (prefill) writes the GDN state; verify=True stashes for commit(m) and leaves it alone.
        chain > 0: a draft model's next chained step, a verify pass that continues the one before it: its GDN
        layers start from that pass's final state and stash their rows after its `chain` rows, so commit(m) keeps
        any prefix of the whole chain (one replay, as for one verify pass; draft_model.py). The stash must be wide
        enough already (stash_for before the chain's first step).
        real (prefill): a padded pass (graphs.GraphRunner.prefill) whose first `real` rows (a tensor on the device)
        are the prompt's: the GDN state is left after them (gdn.prefill), KV rows past them are dead, and a
        sliding-window ring takes the pass as a speculative one, settled at them by the caller.
        """
        T = tokens.shape[1]
        if verify and self.graphs is not None and isinstance(pos, int):
            return self.graphs.run(tokens, pos, caches)
        h = self.embed(tokens)
        pos = self.positions(pos, T)
        cos, sin = rope or self.rope(pos, T)
        if chain and not caches.stash.fits(caches.n_gdn, chain + T, self.dtype, self.device):
            raise RuntimeError(f"a chained step past the verify stash's {caches.stash.key[1]} rows")
        stash = caches.stash_for(chain + T, self) if verify else None
        if caches.window is not None:  # (pos: an int, or in graph mode the positions [T] on the device)
            caches.window.begin(pos, T, speculative=verify or real is not None, chained=chain > 0)
        step = self.layer_step(pos)
        pending = first_pending(step, h)
        for layer, kind, slot in zip(self.layers, self.kinds, self.slots):
            if kind == "linear_attention":
                state, rows = caches.gdn.layer(slot), stash.rows(slot) if stash is not None else None
                if real is not None:
                    state = (*state, real)
                if chain:
                    state, rows = chained(stash, slot, chain, caches.dims["kernel"] - 1)
            elif kind == "sliding_attention":
                state, rows = caches.window.layer(slot), None
            else:
                state, rows = caches.kv.layer(slot), None
            h, pending = step(self, layer, kind, h, pending, pos, cos, sin, state, rows)
        if stash is not None:
            stash.width = chain + T
        return add_then_norm(self.lm.model.norm, h, pending)[1]


def chained(stash: gdn.VerifyStash, i: int, at: int, k1: int) -> tuple[tuple, tuple]:
    """GDN layer i's (state, stash rows) for a pass continuing a chain after `at` stashed rows: the state is the
    previous pass's final state and the conv window that ends at row `at` (the stash's window columns at ..
    at + k1, which the pass's own window then starts with: gdn.verify's copy of them is onto themselves), the
    rows are the stash's from row `at` on."""
    q, k, v, g, beta, window, final = stash.rows(i)
    return (window[:, at : at + k1], stash.final[i : i + 1]), (q[at:], k[at:], v[at:], g[at:], beta[at:],
                                                              window[:, at:], final)


@dataclass
class TrunkCaches:
    kv: KVCache
    gdn: GDNState
    dims: dict
    n_gdn: int
    stash: gdn.VerifyStash | None = None
    processed: int = 0  # tokens whose state the caches hold
    window: RotatingKV | None = None  # sliding-window layers' rings (rotating_cache.py)

    def stash_for(self, width: int, trunk: Trunk) -> gdn.VerifyStash:
        if self.stash is None or not self.stash.fits(self.n_gdn, width, trunk.dtype, trunk.device):
            self.stash = gdn.VerifyStash(self.n_gdn, max(width, 8), self.dims, trunk.dtype, trunk.device)
        return self.stash

    def advance(self, n: int) -> None:
        """n more tokens were processed with the state written in place (prefill, plain decoding's graph step)."""
        self.processed += n
        self.kv.trim(self.processed)

    def commit(self, m: int, backends: Backends, graphs=None) -> None:
        """Keep the first m + 1 tokens of the verify pass that started at `processed`. graphs: the trunk's
        GraphRunner, whose graphs replay the GDN recurrence (None: eager)."""
        if self.n_gdn:
            gdn.commit(self.gdn, self.stash, m, backends, gdn.keep_rows if graphs is None else graphs.keep_rows)
        if self.window is not None:
            self.window.settle(self.processed + m + 1)
        self.advance(m + 1)

    def abort(self) -> None:
        """Discard a verify pass: the committed GDN state was never written; KV beyond `processed` is dead."""
        if self.stash is not None:
            self.stash.width = 0
        self.kv.trim(self.processed)
        if self.window is not None:
            self.window.settle(self.processed)

    def reset(self) -> None:
        if self.window is not None:
            self.window.reset()
        self.gdn.reset()
        self.processed = 0
        self.abort()


# --- loading ------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    name: str
    path: str
    raw_config: dict
    trunk: Trunk
    mtp: object | None  # engine.mtp.MTPHead
    mtp_layers: int
    params: int
    fallbacks: list[Fallback]


def default_device_dtype(device: str | None, dtype: str | None,
                         root=None) -> tuple[torch.device, torch.dtype, list[Fallback]]:
    """root: the model, whose size picks the CPU's default dtype (float32, or bfloat16 when only that fits:
    discovery.assess)."""
    fallbacks = []
    defaulted = device is None
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError("--device cuda: no CUDA device is available (use --device cpu)")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise EngineError(f"--device {device!r}: expected cpu or cuda")
    if dtype is None and device == "cpu" and root is not None:
        from .discovery import inspect_model
        from .environment import cpu_device

        cand = inspect_model(root, device=cpu_device())
        if cand.dtype_reason:
            dtype = cand.run_dtype
            fallbacks.append(Fallback("dtype", cand.dtype_reason))
    if dtype is None:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if defaulted and device == "cpu":
        fallbacks.insert(0, Fallback("cuda", f"no CUDA device: running on the CPU in {dtype} with torch kernels"))
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise EngineError(f"--dtype {dtype!r}: expected one of {', '.join(table)}")
    return torch.device(device), table[dtype], fallbacks


def load(path, device: str | None = None, dtype: str | None = None, tp=None, mtp_from=None,
         embed_on_host: str | None = None, quantize: str | None = None) -> Loaded:
    """tp: a tp.TPGroup: load only this rank's shard (see tp.py); None: the whole model on one device.
    quantize: "fp8" | "int4": a 16-bit checkpoint's weights (its MTP head's too) quantized as the quantized
    releases are (modules.quantize_like_releases): `bench --precision --quant`'s twin of the checkpoint.
    mtp_from: another release of the same model whose mtp.* tensors make the MTP head (mtp_from.py); a head that
    does not fit this model is then refused (EngineError), not a fallback.
    embed_on_host: auto | on | off: the input embedding table in page-locked host memory (host_embedding.py;
    None: MTPCHAT_EMBED_ON_HOST, else auto, so a draft model follows `--embed-on-host` too)."""
    from . import fp8, host_embedding, int4
    from .checkpoint import (fp8_checkpoint, fp8_without_fp8_weights, int4_scheme, int4_without_int4_weights,
                             unsupported_quantization)
    from .mtp import MTPHead, MTPUnusable

    embed_on_host = host_embedding.check_mode(embed_on_host, "embed_on_host")
    root = model_dir(path)
    if tp is not None:
        device = str(tp.device)
    dev, dt, fallbacks = default_device_dtype(device, dtype, root if tp is None else None)
    where = str(root / "config.json")
    raw = read_json(root / "config.json", "config")
    family = family_for(raw, where)
    quantized = unsupported_quantization(raw)
    if quantized:  # before the weights: quantized ones would otherwise fail as "unexpected" or load as garbage
        raise EngineError(f"{where}: {quantized}")
    cfg = family.text_config(raw, where)
    files = TensorFiles.open(root)
    files.fp8 = fp8_checkpoint(raw)
    files.int4 = int4_scheme(raw)
    if quantize not in (None, "bf16") and (files.fp8 or files.int4 is not None or tp is not None):
        raise EngineError(f"{where}: quantizing at load ({quantize}) takes a 16-bit checkpoint on one device")
    mislabelled = fp8_without_fp8_weights(raw, files.dtype_of) or int4_without_int4_weights(raw, files.file_of)
    if mislabelled:
        raise EngineError(f"{where}: {mislabelled}")
    if files.int4 is not None:
        int4.check_exclusions(files.int4, files.keys(), lambda k: root / files.file_of[k])
    plan = None
    if tp is not None:  # modules from the rank's local config; only the rank's slices are read
        from .tp import ShardPlan

        plan = tp.plan = ShardPlan(cfg, tp.rank, tp.world, where=where)
        files.slicer = _tp_slicer(plan, files)
        cfg = plan.local_config
        tp.vocab_size = cfg.vocab_size

    with torch.device("meta"):
        lm = family.causal_lm_class()(cfg)
    if plan is not None:
        plan.adapt(lm)  # lm_head: this rank's vocab rows
    expected = lm.state_dict()
    names = [k for k in files.keys() if family.trunk_key(k) is not None]
    placement, host_key = host_embedding.plan(embed_on_host, dev, files, names, family, tp is not None)
    tensors = files.load([k for k in names if k != host_key], device="cpu" if dev.type == "cpu" else str(dev))
    if host_key is not None:  # a table bound for the host never passes through the GPU
        tensors.update(files.load([host_key], device="cpu"))
    sd = {family.trunk_key(k): v for k, v in tensors.items()}
    origin = {family.trunk_key(k): files.file_of[k] for k in names}
    if files.fp8:  # FP8 linears become fp8.FP8Linear (on the meta device still), the rest is dequantized
        sd = fp8.adopt(lm, sd, dt, lambda k: root / origin.get(k, "?"))
        expected = lm.state_dict()
    if files.int4 is not None:  # 4-bit linears become int4.Int4Linear holding their packed tensors
        checkpoint_name = {family.trunk_key(k): k for k in names}
        sd = int4.adopt(lm, sd, files.int4, dt, lambda k: root / origin.get(k, "?"),
                        named=lambda k: checkpoint_name.get(k, k))
        expected = lm.state_dict()
    sd = convert_gdn_layout(fuse_experts(sd), set(expected), cfg)
    tied = "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    if tied:
        emb = sd["model.embed_tokens.weight"]  # tied embeddings
        sd["lm_head.weight"] = emb if plan is None else plan.vocab_rows(emb)
    _check_tensors(root, expected, sd, origin, what="trunk")
    lm.load_state_dict({k: v if fp8.keeps_dtype(k, v) else v.to(dt) for k, v in sd.items()}, strict=True,
                       assign=True)
    del tensors, sd  # the modules hold the weights now; fusing below then frees each original after its copy
    quantize_like_releases(lm, quantize or "bf16")
    # Non-persistent buffers (rotary frequencies) are not in the checkpoint: build them for real. The family's
    # own rotary module stays for transformers' generate() (the bench baseline); the engine uses its own.
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config=cfg)
    embedding, refused = host_embedding.settle(placement, lm.model.embed_tokens, dev, embed_on_host)
    fallbacks += [refused] if refused else []
    lm.to(dev).eval()  # (a table on the host is a CUDA view already: it stays)
    rotary = Rotary(cfg, dev)
    kinds = list(cfg.layer_types)
    unknown = [k for k in kinds if k not in LAYER_KINDS]
    if unknown:
        raise EngineError(f"{where}: unknown layer type {unknown[0]!r}")
    slots = layer_slots(kinds)
    backends = select_backends(dev)
    if embedding is not None:
        backends.choice["embedding"] = embedding
    for op, (name, why) in backends.choice.items():
        if name == "torch" and op.startswith("gdn") and dev.type == "cuda":
            fallbacks.append(Fallback("fla", f"{op}: {why}"))
    trunk = Trunk(family, cfg, lm, rotary, dev, dt, backends, kinds, slots, group=tp)

    head_files, declared = files, mtp_layers_declared(raw)
    if mtp_from is not None:
        from .mtp_from import head_source

        head_files, declared = head_source(mtp_from, family)
        head_files.slicer = _tp_slicer(plan, head_files) if plan is not None else None  # (its own shapes, format)
        trunk.backends.choice["mtp_head"] = ("--mtp-from", f"the MTP head's tensors from {head_files.root}")
    mtp_keys = [k for k in head_files.keys() if k.startswith("mtp.")]
    mtp, n_mtp = None, 0
    if not mtp_keys:
        why = "no mtp.* tensors in the checkpoint"
        if family.name == "qwen3":
            why = "dense Qwen3 checkpoints have no MTP head (a draft model can speculate: --draft-model)"
        if declared:
            why = f"config declares {declared} MTP layer(s) but the checkpoint has no mtp.* tensors (a stripped " \
                  f"release: --mtp-from PATH takes the head from another release of this model)"
        fallbacks.append(Fallback("speculation", f"{why}: plain decoding"))
    else:
        n_mtp = declared or len({k.split(".")[2] for k in mtp_keys if k.startswith("mtp.layers.")})
        try:
            mtp = MTPHead.build(family, cfg, trunk, n_mtp, mtp_keys, head_files, dt, quantize or "bf16")
        except MTPUnusable as e:  # the trunk still chats: plain decoding, with the reason
            if mtp_from is not None:  # asked for by name: refused, not silently dropped
                raise EngineError(f"--mtp-from {head_files.root}: {e}") from None
            mtp, n_mtp = None, 0
            fallbacks.append(Fallback("speculation", f"{e}: plain decoding"))
    # the checkpoint's count (as discovery gives it): tied embeddings once, though lm_head holds its own copy
    unique = {id(p): p for module in (lm, mtp) if module is not None for p in module.parameters()}
    params = sum(p.numel() for p in unique.values()) - (lm.lm_head.weight.numel() if tied else 0)
    params += int4.param_count(lm) + (int4.param_count(mtp) if mtp else 0)  # (their weights are buffers)
    from .discovery import _default_name  # the name discovery gives the folder (a Hub snapshot: its repo id)

    return Loaded(_default_name(root), str(root), raw, trunk, mtp, n_mtp, params, fallbacks)


def _tp_slicer(plan, files):
    """What a rank reads of each tensor in `files` (a TensorFiles): plan.selection's rows / columns, and for a
    quantized checkpoint the parts of its scales (FP8: 128-blocks) or packed tensors (GPTQ / AWQ) that hold them."""
    if files.fp8:
        return fp8.tp_slicer(plan.selection, files.shape_of)
    if files.int4 is not None:
        return int4.tp_slicer(plan.selection, files.shape_of, files.int4)
    return plan.selection


def _check_tensors(root, expected: dict, sd: dict, origin: dict, what: str) -> None:
    missing = [k for k in expected if k not in sd]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise EngineError(f"{root}: {what} tensor {missing[0]!r} is missing from the checkpoint{more}")
    unexpected = [k for k in sd if k not in expected]
    if unexpected:
        raise EngineError(f"{root}: unexpected {what} tensor {unexpected[0]!r} ({origin.get(unexpected[0], '?')}); "
                          f"config.json does not describe these weights")
    for k, t in expected.items():
        shape, want = tuple(sd[k].shape), tuple(t.shape)
        if shape != want and k.endswith("conv1d.weight") and shape == (want[0], want[2], want[1]):
            # MLX conversions transpose the short conv and also add 1 to every zero-centred norm: loading such
            # weights as HF ones would shift the norms twice (gibberish), so refuse with the reason
            raise EngineError(f"{root / origin.get(k, '?')}: {k!r} is stored as {shape} (an MLX-converted "
                              f"checkpoint: conv transposed, norms already shifted); use the original HF release")
        if shape != want:
            raise EngineError(f"{root / origin.get(k, '?')}: tensor {k!r} has shape {shape}, "
                              f"config.json implies {want}")
