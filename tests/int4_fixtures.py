"""Tiny 4-bit checkpoints in the released GPTQ and AWQ layouts, with their exactly dequantized twins (the oracle).

A round-to-nearest quantizer per group (GPTQ's grid: sym zero 8 and scale 2 * amax / 15, asym over [min(w, 0),
max(w, 0)]), float16 scales, and packers written here from the formats' descriptions (AutoGPTQ's pack loop, AutoAWQ's
interleaved order), independently of engine/int4.py's unpackers, so that a nibble-order mistake in either shows.
Source checkpoints come from tests/fixtures.py's write_checkpoint (transformers' save_pretrained, trained MTP heads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fixtures import _files, rewrite_index

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column AWQ_PACK_ORDER[i] of its 8
# What the community Qwen3.5 GPTQ / AWQ releases leave in bf16 (their model cards and dynamic rules): embeddings,
# lm_head, norms, GDN in_proj_a / in_proj_b, the router and the shared-expert gate, the vision tower.
KEPT = ["embed_tokens", "lm_head", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba",
        "mlp.gate", "mlp.shared_expert_gate", "visual"]


def quantize(w: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None = None, min_zero: int = 0):
    """w [N, K] -> (q [N, K] 0..15, zeros [G, N], scales [G, N] float16, g_idx [K]). perm: act-order, the order
    in which the K input rows are grouped (g_idx[perm[i]] = i // group_size), as GPTQ with desc_act does."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    groups = -(-k // gs)
    q = torch.empty(n, k, dtype=torch.int64)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols].float()
        lo, hi = part.min(1).values.clamp(max=0), part.max(1).values.clamp(min=0)
        if sym:
            amax = torch.maximum(lo.abs(), hi)
            scale, zero = (2 * amax / 15).clamp(min=1e-8), torch.full((n,), 8)
        else:
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            zero = torch.round(-lo / scale).long().clamp(min_zero, 15)
        s16 = scale.half()
        scales[g], zeros[g] = s16, zero
        q[:, cols] = (torch.round(part / s16.float()[:, None]) + zero[:, None]).clamp(0, 15).long()
    return q, zeros, scales, g_idx


def dequantize(q, zeros, scales, g_idx) -> torch.Tensor:
    """The exact float32 weight [N, K]: (q - zero) * scale of each input row's group."""
    g = g_idx.long()
    return (q.float() - zeros.T.float()[:, g]) * scales.T.float()[:, g]


def _word(values) -> int:
    """Eight 4-bit values, value i in bits 4i..4i+3, as a signed int32."""
    word = 0
    for i, v in enumerate(values):
        word |= (int(v) & 0xF) << (4 * i)
    return word - (1 << 32) if word >= 1 << 31 else word


def pack_along_k(q_nk: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [K/8, N]: word (i, n) holds input rows 8i..8i+7 of column n (AutoGPTQ's pack loop)."""
    qt = q_nk.T  # [K, N]
    k, n = qt.shape
    return torch.tensor([[_word(qt[8 * i: 8 * i + 8, c]) for c in range(n)] for i in range(k // 8)],
                        dtype=torch.int32)


def pack_along_n(rows: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """[R, N] -> [R, N/8]: word (r, c) holds columns 8c..8c+7 (GPTQ's qzeros), or them in AWQ's pack order."""
    r, n = rows.shape
    order = AWQ_PACK_ORDER if awq else list(range(8))
    return torch.tensor([[_word([rows[i, 8 * c + o] for o in order]) for c in range(n // 8)] for i in range(r)],
                        dtype=torch.int32)


def gptq_config(group_size=128, sym=True, desc_act=False, fmt=None, dynamic=None, **extra) -> dict:
    """quantization_config as the releases write it: Qwen's -GPTQ-Int4 (AutoGPTQ / optimum fields, no
    checkpoint_format: v1), or GPTQModel's (checkpoint_format, dynamic, meta)."""
    conf = {"batch_size": 1, "bits": 4, "block_name_to_quantize": None, "cache_block_outputs": True,
            "damp_percent": 0.01, "dataset": None, "desc_act": desc_act, "exllama_config": {"version": 1},
            "group_size": group_size, "max_input_length": None, "model_seqlen": None,
            "module_name_preceding_first_block": None, "modules_in_block_to_quantize": None, "pad_token_id": None,
            "quant_method": "gptq", "sym": sym, "tokenizer": None, "true_sequential": True,
            "use_cuda_fp16": False, "use_exllama": True}
    if fmt is not None:  # GPTQModel
        conf.update(checkpoint_format=fmt, lm_head=False, static_groups=False,
                    meta={"quantizer": ["gptqmodel:5.7.1"], "damp_auto_increment": 0.01})
    if dynamic is not None:
        conf["dynamic"] = dynamic
    conf.update(extra)
    return conf


def awq_config(group_size=128, not_converted=None, **extra) -> dict:
    """transformers' AwqConfig as AutoAWQ releases write it."""
    conf = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": not_converted}
    conf.update(extra)
    return conf


def quantizable(key: str, t: torch.Tensor, skip: tuple[str, ...] = ()) -> bool:
    """A 2-D linear weight a release quantizes; skip: more module-name substrings left in bf16."""
    if not key.endswith(".weight") or t.dim() != 2 or t.shape[0] % 8 or t.shape[1] % 8:
        return False
    module = key.removesuffix(".weight")
    return not any(module.endswith(s) or s + "." in module for s in KEPT + list(skip))


def write_int4_checkpoint(src: Path, dst: Path, twin: Path, config: dict, skip: tuple[str, ...] = (),
                          mtp: str = "int4", seed: int = 0) -> tuple[Path, Path]:
    """Quantize the checkpoint at src into config's layout (gptq or awq) at dst, and write at twin the same model
    with those weights exactly dequantized (float32). mtp: "int4" (the head quantized like the trunk), "bf16"
    (left as it was: add its exclusion to config / skip), "none" (mtp.* tensors stripped in both, as some
    community releases ship; the config still declares the head)."""
    method, gs = config["quant_method"], config["group_size"]
    sym, desc_act = config.get("sym", False) if method == "gptq" else False, config.get("desc_act", False)
    v1 = method == "gptq" and config.get("checkpoint_format", "gptq") == "gptq"
    g = torch.Generator().manual_seed(seed)
    skip = tuple(skip) + (("mtp",) if mtp == "bf16" else ())
    for out in (dst, twin):
        shutil.copytree(src, out)
    for f in _files(src):
        packed, plain = {}, {}
        for k, v in load_file(f).items():
            if mtp == "none" and k.startswith("mtp."):
                continue
            if not quantizable(k, v, skip):
                packed[k] = plain[k] = v
                continue
            base = k.removesuffix(".weight")
            perm = torch.randperm(v.shape[1], generator=g) if desc_act else None
            q, zeros, scales, g_idx = quantize(v, gs, sym, perm, min_zero=1 if v1 else 0)
            plain[k] = dequantize(q, zeros, scales, g_idx)
            if method == "gptq":
                packed[base + ".qweight"] = pack_along_k(q)
                packed[base + ".qzeros"] = pack_along_n(zeros - 1 if v1 else zeros)  # v1 stores zero - 1
                packed[base + ".g_idx"] = g_idx
            else:
                packed[base + ".qweight"] = pack_along_n(q.T, awq=True)  # [K, N/8]
                packed[base + ".qzeros"] = pack_along_n(zeros, awq=True)
            packed[base + ".scales"] = scales
        save_file(packed, dst / f.name, metadata={"format": "pt"})
        save_file(plain, twin / f.name, metadata={"format": "pt"})
    for out in (dst, twin):
        rewrite_index(out)
    conf = json.loads((dst / "config.json").read_text())
    conf["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    return dst, twin
