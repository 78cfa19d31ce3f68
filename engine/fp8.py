"""Qwen's official FP8 checkpoints (fine-grained e4m3, 128x128 blocks), weight-only.

Layout (transformers' FineGrainedFP8, vLLM's block-FP8 loader, the Qwen FP8 model cards): config.json's
quantization_config is {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}; each quantized linear stores `*.weight` as
float8_e4m3fn [N, K] and `*.weight_scale_inv` as float32 [ceil(N/128), ceil(K/128)], and the real weight is
weight * scale_inv per 128x128 block (edge blocks partial).

Here the weights stay FP8 in memory and each matmul dequantizes them to the activation dtype first: exact in
float32 on the CPU (the tests' oracle is transformers on the dequantized twin), and the fallback on GPUs until
block-scaled FP8 kernels exist (issue #23). Activations are never quantized, so activation_scheme is moot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EngineError
from .modules import DequantizingExperts, child, plain_linear
from .families import PER_EXPERT

BLOCK = 128
SCALE = ".weight_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn,)
# safetensors' spelling of the one FP8 format the config may name; F8_E5M2 etc. are refused by name
SAFETENSORS_FP8 = "F8_E4M3"


# What Qwen's FP8 releases leave in bf16 besides 1-D norms and the 3-D conv: embeddings, lm_head, GDN in_proj_a /
# in_proj_b (Qwen3-Next packs them as in_proj_ba), the router and the shared-expert gate, the vision tower
NOT_CONVERTED = ["model.embed_tokens", "model.language_model.embed_tokens", "lm_head", "linear_attn.in_proj_a",
                 "linear_attn.in_proj_b", "linear_attn.in_proj_ba", "mlp.gate", "mlp.shared_expert_gate",
                 "model.visual"]


def eligible(key: str, t: torch.Tensor) -> bool:
    """A linear weight Qwen's FP8 releases quantize (norms are 1-D, the conv 3-D: neither is eligible)."""
    if not key.endswith(".weight") or t.dim() != 2:
        return False
    module = key[: -len(".weight")]
    return not any(module.endswith(n) or module.startswith(n + ".") for n in NOT_CONVERTED)


def config_problem(q: dict) -> str | None:
    """Why a quantization_config with quant_method fp8 is not the block-128 e4m3 layout this module reads; None
    when it is. A missing fmt means e4m3 (transformers' quantizer knows no other); a missing block size means
    per-tensor FP8, a different layout (one `weight_scale` per tensor)."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        return f"quantization_config fp8 fmt {fmt!r} is not supported (only 'e4m3')"
    block = q.get("weight_block_size")
    if block is None:
        return "quantization_config fp8 has no weight_block_size (per-tensor FP8): only Qwen's block-128 layout " \
               "(weight_block_size [128, 128]) is supported"
    if not isinstance(block, (list, tuple)) or list(block) != [BLOCK, BLOCK]:
        return f"quantization_config fp8 weight_block_size {block!r} is not supported (only [128, 128])"
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":  # static schemes store input scales this loader would ignore
        return f"quantization_config fp8 activation_scheme {scheme!r} is not supported (only 'dynamic')"
    return None


def scale_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // BLOCK), -(-k // BLOCK)


def expand_scale(scale_inv: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The per-block scale [..., ceil(N/128), ceil(K/128)] as one value per element [..., N, K] (edge blocks
    cut); leading dims (stacked experts) pass through."""
    return scale_inv.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., N, K] (float8_e4m3fn) times its block scale [..., ceil(N/128), ceil(K/128)], in float32
    (exact: an e4m3 value times a float32 scale is one rounding of a product with 4 significant bits), then in
    `dtype`. Whole blocks broadcast the scale over a blocked view instead of expanding it: the same products,
    without an [N, K] float32 copy of the scale (long prefills dequantize FP8 experts per call)."""
    n, k = weight.shape[-2:]
    scale_inv = scale_inv.to(torch.float32)
    if n % BLOCK == 0 and k % BLOCK == 0:
        blocked = weight.to(torch.float32).unflatten(-1, (k // BLOCK, BLOCK)).unflatten(-3, (n // BLOCK, BLOCK))
        return (blocked * scale_inv[..., :, None, :, None]).flatten(-2).flatten(-3, -2).to(dtype)
    return (weight.to(torch.float32) * expand_scale(scale_inv, n, k)).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (float8_e4m3fn weight, float32 scale_inv [..., ceil(N/128), ceil(K/128)]) per 128x128
    block, scale_inv = amax / 448 as Qwen's quantizer does (the tests' and the bench's FP8 checkpoints)."""
    n, k = w.shape[-2:]
    lead = w.shape[:-2]
    rows, cols = scale_shape(n, k)
    padded = torch.zeros(*lead, rows * BLOCK, cols * BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    amax = padded.view(*lead, rows, BLOCK, cols, BLOCK).abs().amax(dim=(-3, -1))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # an all-zero block: any scale, its values are 0
    q = (w.float() / expand_scale(scale_inv, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, kernel=None) -> torch.Tensor:
    """x @ (weight scaled by scale_inv).T: through `kernel` (fp8_triton.matmul, installed at load on CUDA) when
    given, else by dequantizing the weight to x's dtype first (exact in float32: the CPU's reference)."""
    if kernel is not None:
        return kernel(x, weight, scale_inv)
    return F.linear(x, dequantize(weight, scale_inv, x.dtype))


class FP8Linear(nn.Module):
    """A bias-free Linear whose weight is block-128 FP8: forward runs `matmul` (dequantize-then-F.linear unless
    fp8_triton.install gave it a kernel). `weight` is a Parameter (parameter counts and module.to(device) see
    it); `weight_scale_inv` a persistent buffer, so both are in the state dict under the checkpoint's names."""

    fp8_kernel = None  # fp8_triton.install sets it per module (and on modules holding a fused FP8 weight)

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv",
                             torch.empty(scale_shape(out_features, in_features), dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.weight_scale_inv, self.fp8_kernel)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block {BLOCK}"


class FP8Experts(DequantizingExperts):
    """MoE experts in block-128 FP8, stacked as transformers' fused experts module stacks them (gate_up_proj
    [E, 2I, H]: each expert's gate rows, then its up rows; down_proj [E, H, I]), with float32 block scales:
    gate_up_proj_scale_inv [E, 2 * ceil(I/128), ceil(H/128)] — the gate's block rows, then the up's, each half its
    own, so the scales stay exact when I is not whole blocks (when it is, as in Qwen's MoE releases: I = 512 or
    768, that is the plain concatenation along N) — and down_proj_scale_inv [E, ceil(H/128), ceil(I/128)].
    families.fuse_experts stacks the checkpoint's per-expert tensors into these names. It stands in for
    transformers' experts module: its forward (what the block's own forward calls: long prefills) dequantizes each
    routed expert before its matmuls; the engine's decode-width paths take `dense` (model.moe_rowwise) or read the
    FP8 tiles in their kernels (moe_triton.py)."""

    def __init__(self, experts: nn.Module, device=None):
        super().__init__()
        n_experts, two_i, hidden = experts.gate_up_proj.shape
        inter = two_i // 2
        self.num_experts, self.hidden_dim, self.intermediate_dim = n_experts, hidden, inter
        self.act_fn = experts.act_fn
        fp8 = dict(dtype=torch.float8_e4m3fn, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter, hidden, **fp8), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, inter, **fp8), requires_grad=False)
        rows, cols = scale_shape(inter, hidden)
        self.register_buffer("gate_up_proj_scale_inv",
                             torch.empty(n_experts, 2 * rows, cols, dtype=torch.float32, device=device))
        self.register_buffer("down_proj_scale_inv",
                             torch.empty(n_experts, *scale_shape(hidden, inter), dtype=torch.float32, device=device))

    def dense(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [P, 2I, H], down [P, H, I]) of experts `ids` [P], dequantized exactly (in float32) to dtype."""
        w, s = self.gate_up_proj[ids], self.gate_up_proj_scale_inv[ids]
        halves = dequantize(w.unflatten(-2, (2, self.intermediate_dim)), s.unflatten(-2, (2, -1)), dtype)
        return halves.flatten(-3, -2), dequantize(self.down_proj[ids], self.down_proj_scale_inv[ids], dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, " \
               f"fp8 block {BLOCK}"


def stacked_experts(module: nn.Module) -> bool:
    """transformers' fused experts module (3-D gate_up_proj / down_proj parameters), not yet FP8."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and not isinstance(module, FP8Experts))


@torch.no_grad()
def quantize_experts(model: nn.Module) -> int:
    """Turn every fused experts module of `model` into FP8Experts holding its weights quantized as Qwen's
    per-expert releases are (each expert's gate, up and down matrices on their own); returns how many. The tests'
    random blocks and the bench's random-weight FP8 models; one module at a time."""
    count = 0
    for name, module in list(model.named_modules()):
        if not stacked_experts(module):
            continue
        experts = FP8Experts(module, device="meta")
        inter = experts.intermediate_dim
        q, s = quantize(module.gate_up_proj.unflatten(-2, (2, inter)))  # gate and up apart: [E, 2, I, H]
        experts.gate_up_proj = nn.Parameter(q.flatten(-3, -2), requires_grad=False)
        experts.gate_up_proj_scale_inv = s.flatten(-3, -2)
        q, s = quantize(module.down_proj)
        experts.down_proj, experts.down_proj_scale_inv = nn.Parameter(q, requires_grad=False), s
        owner, attr, _ = child(model, name)
        setattr(owner, attr, experts)
        count += 1
    return count


@torch.no_grad()
def quantize_linears(model: nn.Module) -> int:
    """Turn every eligible bias-free nn.Linear of `model` into an FP8Linear holding its weight quantized as Qwen's
    releases are (the bench's random-weight FP8 models); returns how many. One layer at a time, so the peak is
    the model plus one weight in float32."""
    count = 0
    for name, lin in list(model.named_modules()):
        if type(lin) is not nn.Linear or lin.bias is not None or not eligible(name + ".weight", lin.weight):
            continue
        fp8 = FP8Linear(lin.in_features, lin.out_features, device="meta")
        q, s = quantize(lin.weight)
        fp8.weight = nn.Parameter(q, requires_grad=False)
        fp8.weight_scale_inv = s
        owner, attr, _ = child(model, name)
        setattr(owner, attr, fp8)
        count += 1
    return count


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def keeps_dtype(key: str, t: torch.Tensor) -> bool:
    """Loaded as stored, not cast to the model dtype: FP8 weights and their float32 scales (the stacked experts'
    too: `gate_up_proj_scale_inv`)."""
    return is_fp8(t) or key.endswith("_scale_inv")


def adopt(model: nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype, where,
          named: str = "") -> dict[str, torch.Tensor]:
    """Prepare state dict `sd` (the model's key names) for `model`, built on the meta device: each FP8 weight whose
    module is a bias-free nn.Linear turns that module into an FP8Linear and keeps weight and scale; per-expert FP8
    weights (experts.J.{gate,up,down}_proj) turn their fused experts module into FP8Experts and keep weights and
    scales, which fuse_experts then stacks, provided all of that module's expert weights are FP8; any other FP8
    weight (GDN projections whose packing the loader converts, experts mixing FP8 and plain weights) is dequantized
    here to `dtype`, so the layout conversions after this see plain weights. EngineError, one line,
    for an FP8 weight without its scale, a scale of the wrong shape or a scale without an FP8 weight. where(key):
    the file that holds tensor `key`; `named` prefixes the names in messages (the MTP head's keys lose `mtp.`)."""
    scales = {k[: -len(SCALE)]: v for k, v in sd.items() if k.endswith(SCALE)}
    mixed = {m.group(1) for k, t in sd.items() if (m := PER_EXPERT.match(k)) and k.endswith(".weight")
             and not is_fp8(t)}  # experts modules with a plain weight: they stack in the model dtype
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key.endswith(SCALE):
            continue
        base = key.removesuffix(".weight")
        if not is_fp8(t):
            if base in scales and key.endswith(".weight"):
                raise EngineError(f"{where(key)}: tensor {named + base + SCALE!r} scales {named + key!r}, which is "
                                  f"{t.dtype} (not FP8)")
            out[key] = t
            continue
        scale = scales.pop(base, None)
        if scale is None or not key.endswith(".weight"):
            raise EngineError(f"{where(key)}: FP8 tensor {named + key!r} has no {named + base + SCALE!r} (every FP8 "
                              f"weight needs its float32 block scale)")
        _check_scale(where(base + SCALE), named + key, t, scale)
        expert = PER_EXPERT.match(key)
        if expert and expert.group(1) not in mixed and _install_experts(model, expert.group(1)):
            out[key], out[base + SCALE] = t, scale.to(torch.float32)
        elif _install(model, base, t):
            out[key], out[base + SCALE] = t, scale.to(torch.float32)
        else:
            out[key] = dequantize(t, scale, dtype)
    if scales:
        orphan = next(iter(scales))
        raise EngineError(f"{where(orphan + SCALE)}: tensor {named + orphan + SCALE!r} has no weight {named + orphan + '.weight'!r} "
                          f"beside it")
    return out


def tp_slicer(slicer, shape_of: dict):
    """Tensor parallelism over an FP8 checkpoint: `slicer` (tp.ShardPlan.selection) picks a rank's rows or columns
    of each weight; a weight's block scale then takes the same rows or columns in 128-blocks. EngineError, one
    line, when a rank's slice does not cover whole blocks (its scales would be shared with another rank's rows)."""
    from .tp import Selection

    def select(key: str, shape: tuple[int, ...]):
        if not key.endswith(SCALE):
            return slicer(key, shape)
        weight = key[: -len(SCALE)] + ".weight"
        full = shape_of.get(weight)
        sel = slicer(weight, full) if full is not None else None
        if sel is None:
            return None
        n = full[sel.dim]
        blocks = []
        for i, (a, b) in enumerate(sel.ranges):
            last = i == len(sel.ranges) - 1
            if sel.zero or sel.size is not None or a % BLOCK or (b % BLOCK and not (b == n and last)):
                raise EngineError(f"--tp: FP8 weight {weight!r}: this rank's {'rows' if sel.dim == 0 else 'columns'} "
                                  f"[{a}, {b}) of {n} are not whole {BLOCK}-blocks, so its scales cannot be split; "
                                  f"try another --tp or one device")
            blocks.append((a // BLOCK, -(-b // BLOCK)))
        return Selection(sel.dim, blocks)

    return select


def _check_scale(where: str, key: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    want = scale_shape(*weight.shape) if weight.dim() == 2 else None
    if want is None or tuple(scale.shape) != want:
        raise EngineError(f"{where}: tensor {key.removesuffix('.weight') + SCALE!r} has shape {tuple(scale.shape)}; "
                          f"FP8 weight {key!r} {tuple(weight.shape)} in 128x128 blocks needs {want}")


def _install_experts(model: nn.Module, prefix: str) -> bool:
    """Make the fused experts module at `prefix` an FP8Experts on the meta device (once); False where there is
    none (then the caller dequantizes, and the state-dict checks judge the result)."""
    owner, name, experts = child(model, prefix)
    if isinstance(experts, FP8Experts):
        return True
    if experts is None or not stacked_experts(experts):
        return False
    setattr(owner, name, FP8Experts(experts, device="meta"))
    return True


def _install(model: nn.Module, base: str, weight: torch.Tensor) -> bool:
    """Replace the nn.Linear at `base` by an FP8Linear on the meta device; False where `base` is not a bias-free
    Linear of the weight's shape (then the caller dequantizes, and the state-dict checks judge the result)."""
    owner, name, lin = child(model, base)
    if not plain_linear(lin, weight.shape):
        return False
    setattr(owner, name, FP8Linear(lin.in_features, lin.out_features, device="meta"))
    return True
