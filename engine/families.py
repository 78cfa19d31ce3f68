"""One small adapter per model family: which transformers classes define it, where its tensors live.

The engine never uses the families' forward passes; it borrows their modules (projections, norms, MLP / MoE
blocks) and runs its own loop over them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .errors import EngineError


@dataclass(frozen=True)
class Family:
    name: str  # "qwen3_next" | "qwen3_5" | "qwen3_5_moe" | "qwen3" (dense: every layer attention, no MTP head)
    wrapped: bool  # vision-language release: trunk under model.language_model.*, vision under model.visual.*

    def text_config(self, raw: dict, where: str = "config.json"):
        """The transformers config object of the text trunk; EngineError naming `where` (the config file) when
        config.json cannot describe a model the engine can run."""
        import transformers as tf

        text = self._text_fields(raw, where)
        _check_norm_eps(text, where)
        cls = {"qwen3_next": tf.Qwen3NextConfig, "qwen3_5": tf.Qwen3_5TextConfig,
               "qwen3_5_moe": tf.Qwen3_5MoeTextConfig, "qwen3": tf.Qwen3Config}[self.name]
        try:
            cfg = cls(**text)
        except Exception as e:  # transformers' own validation: a wrong type or value of some field
            raise EngineError(f"{where}: invalid {self.name} config ({' '.join(str(e).split())[:300]})") from None
        _check_rope_type(cfg, where)
        _check_sliding_window(cfg, where)
        return cfg

    def _text_fields(self, raw: dict, where: str) -> dict:
        text = raw.get("text_config", raw) if self.wrapped else raw
        if not isinstance(text, dict):
            raise EngineError(f"{where}: text_config is not a JSON object")
        text = dict(text)
        # Qwen3.5 keeps tie_word_embeddings at the top level of wrapped configs.
        if self.wrapped and "tie_word_embeddings" in raw:
            text.setdefault("tie_word_embeddings", raw["tie_word_embeddings"])
        return _drop_meta(text)

    def causal_lm_class(self):
        import transformers as tf

        return {
            "qwen3_next": tf.Qwen3NextForCausalLM,
            "qwen3_5": tf.Qwen3_5ForCausalLM,
            "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
            "qwen3": tf.Qwen3ForCausalLM,
        }[self.name]

    def decoder_layer_class(self):
        import importlib

        mod = importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")
        prefix = {"qwen3_next": "Qwen3Next", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen3": "Qwen3"}[self.name]
        return getattr(mod, f"{prefix}DecoderLayer"), getattr(mod, f"{prefix}RMSNorm")

    def trunk_key(self, key: str) -> str | None:
        """Checkpoint key -> key in the text CausalLM's state dict; None for tensors the text model ignores."""
        if key.startswith("mtp."):
            return None
        if self.wrapped:
            if key.startswith("model.visual.") or key.startswith("visual."):
                return None
            if key.startswith("model.language_model."):
                return "model." + key[len("model.language_model."):]
        return key


SUPPORTED = {
    "qwen3_next": Family("qwen3_next", wrapped=False),
    "qwen3_5": Family("qwen3_5", wrapped=True),
    "qwen3_5_text": Family("qwen3_5", wrapped=False),
    "qwen3_5_moe": Family("qwen3_5_moe", wrapped=True),
    "qwen3_5_moe_text": Family("qwen3_5_moe", wrapped=False),
    # dense Qwen3 (0.6B .. 32B): plain (ungated) attention with per-head q/k norms, optional sliding-window layers;
    # no MTP head, so alone it decodes plainly; it drafts for the others (the same tokenizer as Qwen3-Next)
    "qwen3": Family("qwen3", wrapped=False),
}

# The layer kinds the engine runs: GDN, full attention, and attention over a sliding window (rotating_cache.py)
LAYER_KINDS = ("linear_attention", "full_attention", "sliding_attention")


def family_for(raw_config: dict, where: str) -> Family:
    model_type = raw_config.get("model_type")
    if model_type not in SUPPORTED:
        raise EngineError(
            f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED))}"
        )
    return SUPPORTED[model_type]


def mtp_layers_declared(raw: dict) -> int | None:
    for cfg in (raw, raw.get("text_config") or {}):
        for field in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
            if isinstance(cfg.get(field), int):
                return cfg[field]
    return None


def _check_norm_eps(text: dict, where: str) -> None:
    # NaN / inf / <= 0 would be accepted by transformers and normalise every hidden to NaN or inf: garbage text
    eps = text.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise EngineError(f"{where}: rms_norm_eps must be a small positive number, got {eps!r}")


def _check_rope_type(cfg, where: str) -> None:
    """The engine's rotary embedding (model.Rotary) knows the default RoPE and transformers' initialisers; an
    unknown kind would surface as a KeyError deep inside transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else rope
    known = ["default", *ROPE_INIT_FUNCTIONS]
    if kind not in known:
        raise EngineError(f"{where}: rope_type {kind!r} is not supported (known: {', '.join(known)})")


def sliding_window(cfg) -> int | None:
    """The window of the config's sliding_attention layers (positions a query sees, itself included), None when
    it has none. transformers' Qwen3Config drops sliding_window unless use_sliding_window, and derives
    layer_types from max_window_layers; other configs declare layer_types and sliding_window directly."""
    kinds = getattr(cfg, "layer_types", None) or []
    if "sliding_attention" not in kinds:
        return None
    return getattr(cfg, "sliding_window", None)


def _check_sliding_window(cfg, where: str) -> None:
    kinds = getattr(cfg, "layer_types", None) or []
    if "sliding_attention" in kinds:
        w = getattr(cfg, "sliding_window", None)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise EngineError(f"{where}: sliding_attention layers need a sliding_window of at least 1 position, "
                              f"got {w!r}")


def _drop_meta(cfg: dict) -> dict:
    for k in ("architectures", "transformers_version", "auto_map", "model_type"):
        cfg.pop(k, None)
    return cfg


# --- tensor layout conversions -------------------------------------------------------------------------------

PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoints (experts.N.{gate,up,down}_proj) -> transformers' fused 3-D parameters. FP8 experts'
    block scales (what fp8.adopt keeps) stack alike, as `gate_up_proj_scale_inv` (each expert's gate block rows,
    then its up ones) and `down_proj_scale_inv`: the layout fp8.FP8Experts holds."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in tensors.items():
        m = PER_EXPERT.match(k)
        if m:
            part = m.group(3) + ("" if m.group(4) == "weight" else "_scale_inv")
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[part] = v
        else:
            out[k] = v
    for prefix, experts in groups.items():
        n = max(experts) + 1
        scaled = any("gate_proj_scale_inv" in e for e in experts.values())
        suffixes = ("", "_scale_inv") if scaled else ("",)
        want = {p + s for p in ("gate_proj", "up_proj", "down_proj") for s in suffixes}
        missing = [i for i in range(n) if set(experts.get(i, {})) != want]
        if missing:
            raise EngineError(f"{prefix}: expert {missing[0]} is incomplete in the checkpoint")
        for s in suffixes:
            out[f"{prefix}.gate_up_proj{s}"] = torch.stack(
                [torch.cat([experts[i]["gate_proj" + s], experts[i]["up_proj" + s]], 0) for i in range(n)]
            )
            out[f"{prefix}.down_proj{s}"] = torch.stack([experts[i]["down_proj" + s] for i in range(n)])
    return out


def convert_gdn_layout(tensors: dict[str, torch.Tensor], module_keys: set[str], cfg) -> dict[str, torch.Tensor]:
    """Qwen3-Next packs GDN projections per key head (`in_proj_qkvz` + `in_proj_ba`); Qwen3.5 keeps them apart
    (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Convert whichever the checkpoint has into what the
    module expects."""
    if not hasattr(cfg, "linear_num_key_heads"):  # a dense model: no GDN layers
        return dict(tensors)
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = nv // nk
    out = dict(tensors)
    for k in list(tensors):
        if k.endswith("linear_attn.in_proj_qkvz.weight"):
            base = k[: -len("in_proj_qkvz.weight")]
            if base + "in_proj_qkv.weight" not in module_keys:
                continue
            w = out.pop(k)
            hidden = w.shape[-1]
            q, kk, v, z = torch.split(w.view(nk, 2 * dk + 2 * r * dv, hidden), [dk, dk, r * dv, r * dv], dim=1)
            out[base + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, hidden) for x in (q, kk, v)])
            out[base + "in_proj_z.weight"] = z.reshape(-1, hidden)
            b, a = torch.split(out.pop(base + "in_proj_ba.weight").view(nk, 2 * r, hidden), [r, r], dim=1)
            out[base + "in_proj_b.weight"] = b.reshape(-1, hidden)
            out[base + "in_proj_a.weight"] = a.reshape(-1, hidden)
        elif k.endswith("linear_attn.in_proj_qkv.weight"):
            base = k[: -len("in_proj_qkv.weight")]
            if base + "in_proj_qkvz.weight" not in module_keys:
                continue
            w = out.pop(k)
            hidden = w.shape[-1]
            q, kk, v = torch.split(w, [nk * dk, nk * dk, nv * dv])
            z = out.pop(base + "in_proj_z.weight")
            parts = [x.reshape(nk, -1, hidden) for x in (q, kk, v, z)]
            out[base + "in_proj_qkvz.weight"] = torch.cat(parts, 1).reshape(-1, hidden)
            b = out.pop(base + "in_proj_b.weight").reshape(nk, r, hidden)
            a = out.pop(base + "in_proj_a.weight").reshape(nk, r, hidden)
            out[base + "in_proj_ba.weight"] = torch.cat([b, a], 1).reshape(-1, hidden)
    return out
