"""Replacing a submodule by its dotted path (the quantized loaders turn meta nn.Linear / experts modules into
their quantized forms before the state dict is loaded), what the quantized experts modules share, and quantizing
a 16-bit model as the quantized releases are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DequantizingExperts(nn.Module):
    """MoE experts held quantized (fp8.FP8Experts, int4.Int4Experts) standing in for transformers' fused experts
    module: subclasses give `act_fn` and dense(ids, dtype) -> (gate_up [P, 2I, H], down [P, H, I]), the routed
    experts' weights dequantized exactly (in float32) to dtype; moe_rowwise gathers through dense."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts loop (experts in ascending order, each one's (slot, token) pairs slot-major), each
        routed expert dequantized first (the block's own forward: long prefills): on the CPU in float32 it
        computes what transformers computes on the dequantized twin."""
        out = torch.zeros_like(hidden_states)
        by_slot = top_k_index.t()
        for e in top_k_index.unique().tolist():
            slot, token = torch.where(by_slot == e)
            gate_up, down = self.dense(torch.tensor([e], device=top_k_index.device), hidden_states.dtype)
            gate, up = F.linear(hidden_states[token], gate_up[0]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, down[0]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def child(model: nn.Module, path: str) -> tuple[nn.Module | None, str, nn.Module | None]:
    """(owner, attribute name, module) of the submodule at `path`; (None, name, None) when its owner is missing."""
    parent, _, name = path.rpartition(".")
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None, name, None
    return owner, name, getattr(owner, name, None)


def plain_linear(module, shape: tuple[int, int]) -> bool:
    """A bias-free nn.Linear (not a subclass) whose weight is [N, K] = shape."""
    return type(module) is nn.Linear and module.bias is None and tuple(module.weight.shape) == tuple(shape)


QUANTIZATIONS = ("bf16", "fp8", "int4")


def quantize_like_releases(module: nn.Module, quant: str) -> None:
    """Quantize module's weights in place as the quantized checkpoints hold them. "fp8": the linears Qwen's FP8
    releases quantize become fp8.FP8Linear, routed experts fp8.FP8Experts; "int4": the same linears 4-bit
    (int4.quantize_linears), experts stay in the model dtype; "bf16": nothing. The bench's random-weight models
    and `bench --precision --quant`'s twin of a 16-bit checkpoint."""
    if quant == "fp8":
        from .fp8 import quantize_experts, quantize_linears

        quantize_linears(module)
        quantize_experts(module)
    elif quant == "int4":
        from .int4 import quantize_linears

        quantize_linears(module)
