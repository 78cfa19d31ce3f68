"""Replacing a submodule by its dotted path (the quantized loaders turn meta nn.Linear / experts modules into
their quantized forms before the state dict is loaded)."""

from __future__ import annotations

from torch import nn


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
