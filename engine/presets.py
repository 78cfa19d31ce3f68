"""Real model shapes with random weights: speed at scale without downloading the weights."""

from __future__ import annotations

import torch

from .errors import EngineError
from .events import Fallback
from .families import SUPPORTED
from .kernels import select_backends
from .model import Loaded, Rotary, Trunk, default_device_dtype, layer_slots
from .modules import quantize_like_releases

PRESETS = {
    # Qwen3.5-27B (dense): 64 layers, 3 GDN : 1 attention; both real shapes take 262,144 positions (their
    # configs' max_position_embeddings; the transformers default, 32,768, would cap bench --prompt-tokens)
    "qwen3.5-27b": ("qwen3_5_text", dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=262144, tie_word_embeddings=False)),
    # Qwen3-Next-80B-A3B (MoE): 48 layers, 512 experts, 10 routed + 1 shared
    "qwen3-next-80b-a3b": ("qwen3_next", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})),
    # a few-layer toy of the 27B shape for quick checks
    "tiny": ("qwen3_next", dict(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=0,
        tie_word_embeddings=False)),
    # draft models' shapes (--draft-model random:PRESET; random_draft builds them with the target's vocabulary)
    # Qwen3-0.6B (dense, tied embeddings)
    "qwen3-0.6b": ("qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3.5-0.8B's trunk (REFERENCES.md: 24 layers, hidden 1024, tied embeddings; 3 GDN : 1 attention)
    "qwen3.5-0.8b": ("qwen3_5_text", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})),
}
DRAFT_PRESETS = ("qwen3-0.6b", "qwen3.5-0.8b")  # (no MTP head: they draft, they are not drafted for)
RANDOM_DRAFT = "random:"  # --draft-model random:PRESET


def preset_config(preset: str, layers: int | None, vocab_size: int | None = None):
    """(family, text config, raw config dict) of a preset, optionally cut to its first `layers` layers;
    vocab_size: another vocabulary (a draft's is its target's)."""
    if preset not in PRESETS:
        raise EngineError(f"--random-weights {preset!r}: presets are {', '.join(PRESETS)}")
    model_type, kw = PRESETS[preset]
    kw = dict(kw)
    if layers is not None:
        if layers < 1:
            raise EngineError("--layers must be at least 1")
        kw["num_hidden_layers"] = layers
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 or model_type == "qwen3" else "linear_attention"
                         for i in range(kw["num_hidden_layers"])]
    family = SUPPORTED[model_type]
    return family, family.text_config({"model_type": model_type, **kw}), {"model_type": model_type, **kw}


PLANTED_STEP = 7  # next(t) = (7 t + 1) mod V: a permutation for every preset's vocabulary (V not divisible by 7)


def planted_next(t: int, vocab: int) -> int:
    return (PLANTED_STEP * t + 1) % vocab


@torch.no_grad()
def plant_next_token_map(embed: torch.Tensor, lm_head: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """Make a random model's greedy choice decisive: the embedding dominates the residual stream and lm_head row
    planted_next(t) points along embedding t, so the argmax is planted_next(last token) by a wide margin.

    With plain random weights the top logits of 150k-250k near-Gaussian logits differ by less than bf16 noise,
    so a verify pass (width k+1) and a decode step (width 1) pick different argmaxes and the oracle drafter at
    "acceptance 1.0" is mostly rejected. Every weight is still read and every kernel still runs: speed is that
    of the real shape. rows: this rank's lm_head rows [start, end) under tensor parallelism."""
    V = embed.shape[0]
    start, end = rows or (0, V)
    # residual-stream scale: each sub-layer adds roughly unit-RMS output; the embedding must dominate all of them
    # (a fixed generator: under tensor parallelism every rank holds the same replicated embedding)
    embed.normal_(0.0, 300.0, generator=torch.Generator(embed.device).manual_seed(1234))
    inverse = pow(PLANTED_STEP, -1, V)
    for a in range(start, end, 16384):  # in slices: a float32 copy of a 248k-row embedding would be 5 GB
        b = min(a + 16384, end)
        unit = embed[((torch.arange(a, b, device=embed.device) - 1) * inverse) % V].float()
        lm_head[a - start : b - start] = (unit / unit.norm(dim=-1, keepdim=True)).to(lm_head.dtype)


@torch.no_grad()
def _materialise(lm, modules: list, device: torch.device) -> None:
    """Give `modules` (their own tensors only: recurse=False) real storage on `device`, initialised as post_init
    initialises them: the HF model's _init_weights on each, children before their parents as initialize_weights
    visits them (a MoE block initialises its router's weight itself). Buffers too: the rotary inv_freq."""
    for m in modules:
        m.to_empty(device=device, recurse=False)
    for m in reversed(modules):  # (module lists are parents first: reversed, every child precedes its parent)
        lm._init_weights(m)


def _builds_layerwise(quant: str, group) -> bool:
    """Whether random_model builds one decoder layer at a time (_build_layerwise): quantized without tensor
    parallelism. The bf16 path (its weights, seed for seed, are what tests and benchmarks compare) and the TP
    shards (each a fraction of the model) build whole, then quantize."""
    return quant in ("fp8", "int4") and group is None


def _build_layerwise(family, cfg, has_experts: bool, with_mtp: bool, device: torch.device, quant: str):
    """(causal LM, MTP head or None) with quantized linears, built without ever holding the bf16 model whole:
    Qwen3-Next-80B-A3B is ~160 GB in bf16, more than one H200, and ~80 GB in FP8. Built on meta (transformers'
    init_weights skips meta), then made real part by part: embeddings, final norm and lm_head first (kept in the
    model dtype, as quantized checkpoints keep them), then each decoder layer initialised and quantized before the
    next exists, then the MTP head likewise (initialised as the trunk's layers, since it is one of them)."""
    from .mtp import MTPHead

    with torch.device("meta"):
        lm = family.causal_lm_class()(cfg)
        head = MTPHead(MTPHead.layer_config(cfg, has_experts), family, 1) if with_mtp else None
    in_layers = {id(m) for m in lm.model.layers.modules()}
    _materialise(lm, [m for m in lm.modules() if id(m) not in in_layers], device)
    lm.tie_weights(recompute_mapping=False)  # to_empty gave lm_head and the embedding each new tensors: re-tie them
    for layer in lm.model.layers:
        _materialise(lm, list(layer.modules()), device)
        quantize_like_releases(layer, quant)
    if head is not None:
        _materialise(lm, list(head.modules()), device)
        quantize_like_releases(head, quant)
    return lm, head


def random_model(preset: str, layers: int | None, device: str | None, dtype: str | None, seed: int = 0,
                 group=None, quant: str = "bf16", vocab_size: int | None = None) -> Loaded:
    """Random weights in a preset's shape. group (a tp.TPGroup): this rank's shard only, on the group's device;
    the replicated tensors (embedding, norms, routers, the MTP fc) are broadcast from rank 0 so every rank
    computes the same thing. quant "fp8": the linears Qwen's FP8 releases quantize become block-128 FP8
    (fp8.quantize_linears) and the routed experts FP8 (fp8.quantize_experts), the MTP head's too, as FP8
    checkpoints load; "int4": the same linears 4-bit. Quantized, at most one decoder layer at a time is in the
    model dtype (_build_layerwise), so a model that fits only once quantized can be built. The draft presets
    (DRAFT_PRESETS) get no MTP head; vocab_size: see preset_config."""
    from .mtp import MTPHead

    family, cfg, kw = preset_config(preset, layers, vocab_size)
    with_mtp = preset not in DRAFT_PRESETS
    plan = None
    if group is not None:
        from .tp import ShardPlan

        device = str(group.device)
        plan = ShardPlan(cfg, group.rank, group.world, where=f"preset {preset}")
    lcfg = plan.local_config if plan is not None else cfg
    dev, dt, fallbacks = default_device_dtype(device, dtype)
    torch.manual_seed(seed + (group.rank if group is not None else 0))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    layerwise = _builds_layerwise(quant, group)
    try:
        if layerwise:
            lm, head = _build_layerwise(family, lcfg, bool(kw.get("num_experts")), with_mtp, dev, quant)
        else:
            with dev:
                lm = family.causal_lm_class()(lcfg)
                if plan is not None:
                    plan.adapt(lm)  # lm_head: this rank's vocab rows
                head = MTPHead(MTPHead.layer_config(lcfg, bool(kw.get("num_experts"))), family, 1) if with_mtp else None
    finally:
        torch.set_default_dtype(old)
    heads = [head] if head is not None else []
    if plan is not None:
        with torch.no_grad():
            for module, prefix in ((lm, ""), *((h, "mtp.") for h in heads)):
                for name, p in module.named_parameters():
                    if plan.selection(prefix + name, tuple(p.shape)) is None:
                        group.broadcast_(p.data)
    # the same fixed seed on every rank: the replicated embedding is the same everywhere. Not with tied embeddings
    # (the draft presets): lm_head is the embedding there, and a draft's argmax need not be decisive
    if not kw.get("tie_word_embeddings"):
        plant_next_token_map(lm.model.embed_tokens.weight, lm.lm_head.weight,
                             plan.vrange if plan is not None else None)
    lm.eval()
    if not layerwise:  # (_build_layerwise quantized each layer as it built it)
        for module in (lm, *heads):
            quantize_like_releases(module, quant)
    embedding, refused = _place_embedding(lm, dev, bool(kw.get("tie_word_embeddings")), quant, group)
    fallbacks += [refused] if refused else []
    kinds = list(lcfg.layer_types)
    if group is not None:
        group.vocab_size = cfg.vocab_size
    trunk = Trunk(family, lcfg, lm, Rotary(lcfg, dev), dev, dt, select_backends(dev), kinds, layer_slots(kinds),
                  group=group)
    if embedding is not None:
        trunk.backends.choice["embedding"] = embedding
    if group is not None:
        group.plan = plan
    for h in heads:
        h.attach(trunk)
        h.eval()
    fallbacks.append(Fallback("weights", f"random weights in the {preset} shape"
                                         f"{' (FP8 linears)' if quant == 'fp8' else ' (4-bit linears)' if quant == 'int4' else ''}: output text is meaningless"))
    params = sum(p.numel() for p in lm.parameters())
    return Loaded(f"random:{preset}", f"random:{preset}", kw, trunk, head, len(heads),
                  params, fallbacks)


def _place_embedding(lm, dev: torch.device, tied: bool, quant: str, group):
    """--embed-on-host for a random model, as model.load decides it for a checkpoint (host_embedding.py): the
    bench's memory rows then measure what a user's load would hold."""
    from . import host_embedding
    from .int4 import packed_bytes

    if dev.type != "cuda":
        return None, None
    mode = host_embedding.check_mode(None)
    weights = sum(p.numel() * p.element_size() for p in lm.parameters()) + packed_bytes(lm)
    placement = host_embedding.resolve(mode, "cuda", tied, quant != "bf16", group is not None, weights,
                                       torch.cuda.get_device_properties(dev).total_memory)
    return host_embedding.settle(placement, lm.model.embed_tokens, dev, mode)


def random_draft(spec: str, target, layers: int | None = None):
    """--draft-model random:PRESET (a DRAFT_PRESETS shape) for `target` (an Engine): random weights with the
    target's vocabulary on its device and dtype, as a draft_model.DraftModelDrafter named draft:PRESET. Its
    acceptance is ~0 (random weights propose random tokens): what it measures is the draft's cost per cycle.
    Unlike a checkpoint draft it may be larger than the target (a real-shape draft beside a toy target)."""
    from .draft_model import DraftModelDrafter

    preset = spec[len(RANDOM_DRAFT):]
    if preset not in DRAFT_PRESETS:
        raise EngineError(f"--draft-model {spec!r}: random draft presets are "
                          f"{', '.join(RANDOM_DRAFT + p for p in DRAFT_PRESETS)}")
    if target.trunk.group is not None:
        raise EngineError("--draft-model: not with tensor parallelism (--tp) yet")
    t = target.trunk
    loaded = random_model(preset, layers, str(t.device), str(t.dtype).replace("torch.", ""), seed=1,
                          vocab_size=t.config.vocab_size)
    loaded.name = preset  # (the drafter's name: draft:PRESET)
    return DraftModelDrafter.for_target(loaded, target)


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
    from .int4 import packed_bytes

    return total + packed_bytes(trunk.lm)  # 4-bit linears: their packed tensors are buffers (int4.py)
