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

BLOCK = 128
SCALE = ".weight_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn,)
# safetensors' spelling of the one FP8 format the config may name; F8_E5M2 etc. are refused by name
SAFETENSORS_FP8 = "F8_E4M3"


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
    """The per-block scale [ceil(N/128), ceil(K/128)] as one value per element [N, K] (edge blocks cut)."""
    return scale_inv.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] (float8_e4m3fn) times its block scale, in float32 (exact: an e4m3 value times a float32
    scale is one rounding of a product with 4 significant bits), then in `dtype`."""
    n, k = weight.shape
    return (weight.to(torch.float32) * expand_scale(scale_inv.to(torch.float32), n, k)).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn weight, float32 scale_inv) per 128x128 block, scale_inv = amax / 448 as Qwen's
    quantizer does (the tests' and the bench's FP8 checkpoints)."""
    n, k = w.shape
    rows, cols = scale_shape(n, k)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.float()
    amax = padded.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # an all-zero block: any scale, its values are 0
    q = (w.float() / expand_scale(scale_inv, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


class FP8Linear(nn.Module):
    """A bias-free Linear whose weight is block-128 FP8: forward dequantizes it to the activation's dtype and
    runs F.linear (the weight-only path). `weight` is a Parameter (parameter counts and module.to(device) see
    it); `weight_scale_inv` a persistent buffer, so both are in the state dict under the checkpoint's names."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv",
                             torch.empty(scale_shape(out_features, in_features), dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale_inv, x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block {BLOCK}"


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def keeps_dtype(key: str, t: torch.Tensor) -> bool:
    """Loaded as stored, not cast to the model dtype: FP8 weights and their float32 scales."""
    return is_fp8(t) or key.endswith(SCALE)


def adopt(model: nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype, where,
          named: str = "") -> dict[str, torch.Tensor]:
    """Prepare state dict `sd` (the model's key names) for `model`, built on the meta device: each FP8 weight whose
    module is a bias-free nn.Linear turns that module into an FP8Linear and keeps weight and scale; any other FP8
    weight (per-expert tensors that fuse_experts stacks into [E, N, K], GDN projections whose packing the loader
    converts) is dequantized here to `dtype`, so the layout conversions after this see plain weights. For now the
    MoE experts therefore run in the model dtype (FP8 expert kernels are a later session's). EngineError, one line,
    for an FP8 weight without its scale, a scale of the wrong shape or a scale without an FP8 weight. where(key):
    the file that holds tensor `key`; `named` prefixes the names in messages (the MTP head's keys lose `mtp.`)."""
    scales = {k[: -len(SCALE)]: v for k, v in sd.items() if k.endswith(SCALE)}
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
        if _install(model, base, t):
            out[key], out[base + SCALE] = t, scale.to(torch.float32)
        else:
            out[key] = dequantize(t, scale, dtype)
    if scales:
        orphan = next(iter(scales))
        raise EngineError(f"{where(orphan + SCALE)}: tensor {named + orphan + SCALE!r} has no weight {named + orphan + '.weight'!r} "
                          f"beside it")
    return out


def _check_scale(where: str, key: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    want = scale_shape(*weight.shape) if weight.dim() == 2 else None
    if want is None or tuple(scale.shape) != want:
        raise EngineError(f"{where}: tensor {key.removesuffix('.weight') + SCALE!r} has shape {tuple(scale.shape)}; "
                          f"FP8 weight {key!r} {tuple(weight.shape)} in 128x128 blocks needs {want}")


def _install(model: nn.Module, base: str, weight: torch.Tensor) -> bool:
    """Replace the nn.Linear at `base` by an FP8Linear on the meta device; False where `base` is not a bias-free
    Linear of the weight's shape (then the caller dequantizes, and the state-dict checks judge the result)."""
    parent, _, name = base.rpartition(".")
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return False
    lin = getattr(owner, name, None)
    if type(lin) is not nn.Linear or lin.bias is not None or tuple(lin.weight.shape) != tuple(weight.shape):
        return False
    setattr(owner, name, FP8Linear(lin.in_features, lin.out_features, device="meta"))
    return True
