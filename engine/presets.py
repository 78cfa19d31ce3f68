"""Real model shapes with random weights: speed at scale without downloading the weights."""

from __future__ import annotations

import torch

from .errors import EngineError
from .events import Fallback
from .families import SUPPORTED
from .kernels import select_backends
from .model import Loaded, Rotary, Trunk, default_device_dtype, layer_slots

PRESETS = {
    # Qwen3.5-27B (dense): 64 layers, 3 GDN : 1 attention
    "qwen3.5-27b": ("qwen3_5_text", dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False)),
    # Qwen3-Next-80B-A3B (MoE): 48 layers, 512 experts, 10 routed + 1 shared
    "qwen3-next-80b-a3b": ("qwen3_next", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})),
    # a few-layer toy of the 27B shape for quick checks
    "tiny": ("qwen3_next", dict(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=0,
        tie_word_embeddings=False)),
}


def preset_config(preset: str, layers: int | None):
    """(family, text config, raw config dict) of a preset, optionally cut to its first `layers` layers."""
    if preset not in PRESETS:
        raise EngineError(f"--random-weights {preset!r}: presets are {', '.join(PRESETS)}")
    model_type, kw = PRESETS[preset]
    kw = dict(kw)
    if layers is not None:
        if layers < 1:
            raise EngineError("--layers must be at least 1")
        kw["num_hidden_layers"] = layers
    kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                         for i in range(kw["num_hidden_layers"])]
    family = SUPPORTED[model_type]
    return family, family.text_config({"model_type": model_type, **kw}), {"model_type": model_type, **kw}


def random_model(preset: str, layers: int | None, device: str | None, dtype: str | None, seed: int = 0) -> Loaded:
    from .mtp import MTPHead

    family, cfg, kw = preset_config(preset, layers)
    dev, dt, fallbacks = default_device_dtype(device, dtype)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with dev:
            lm = family.causal_lm_class()(cfg)
            head = MTPHead(MTPHead.layer_config(cfg, bool(kw.get("num_experts"))), family, 1)
    finally:
        torch.set_default_dtype(old)
    lm.eval()
    kinds = list(cfg.layer_types)
    trunk = Trunk(family, cfg, lm, Rotary(cfg, dev), dev, dt, select_backends(dev), kinds, layer_slots(kinds))
    head.trunk = trunk
    head.eval()
    fallbacks.append(Fallback("weights", f"random weights in the {preset} shape: output text is meaningless"))
    params = sum(p.numel() for p in lm.parameters())
    return Loaded(f"random:{preset}", f"random:{preset}", kw, trunk, head, 1,
                  params, fallbacks)


def weight_bytes_per_token(trunk) -> int:
    """Bytes of matmul weights one decode step reads: every Linear of the trunk and lm_head; of routed experts
    only the top-k share."""
    total = 0
    cfg = trunk.config
    for name, p in trunk.lm.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        b = p.numel() * p.element_size()
        if ".experts." in name and getattr(cfg, "num_experts", 0):
            b = b * cfg.num_experts_per_tok // cfg.num_experts
        total += b
    return total
