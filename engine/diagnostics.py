"""One snapshot of what runs and why: device, dtype, backend per op, versions, fallbacks."""

from __future__ import annotations

import platform
from importlib import metadata

import torch

from .context import tokens_that_fit
from .reuse import MAX_SNAPSHOTS


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "flash-linear-attention": _version("flash-linear-attention"),
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
    }


def snapshot(engine) -> dict:
    t = engine.trunk
    dev = {"type": t.device.type}
    if t.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(t.device)
        dev.update(name=torch.cuda.get_device_name(t.device), memory_total=total, memory_free=free,
                   memory_allocated=torch.cuda.memory_allocated(t.device))
    else:
        dev.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return {
        "model": {"name": engine.info.name, "path": engine.info.path, "family": engine.info.family,
                  "model_type": engine.info.model_type, "params": engine.info.params,
                  "mtp_layers": engine.info.mtp_layers,
                  "layers": {"gdn": t.kinds.count("linear_attention"), "attention": t.kinds.count("full_attention"),
                             "sliding_attention": t.kinds.count("sliding_attention")}},
        "drafter": _drafter_report(engine),
        "device": dev,
        "dtype": engine.info.dtype,
        "backends": {op: {"backend": b, "reason": why} for op, (b, why) in t.backends.choice.items()},
        "versions": versions(),
        "compile": {"mode": _compile_mode(engine),
                    "cuda_graphs": engine.graph_runner.report() if engine.graph_runner else
                    {"enabled": False, "reason": "needs CUDA" if t.device.type != "cuda" else "disabled"},
                    **_mtp_graphs(engine)},
        "fallbacks": [{"feature": f.feature, "reason": f.reason} for f in engine.loaded.fallbacks],
        "reuse": {"history_tokens": len(engine.turns.history), "snapshots": len(engine.turns.snapshots),
                  "snapshot_bytes": engine.turns.nbytes, "max_snapshots": MAX_SNAPSHOTS},
        "context": context_report(engine, dev.get("memory_free")),
    }


def context_report(engine, free_bytes: int | None) -> dict:
    """The context a request may use and where that comes from; under YaRN also the pretrained context and the
    factor (max_position_embeddings already includes the stretch: it is the limit). On CUDA, how many more
    positions of KV cache the free memory holds."""
    c = engine.context
    out = {"limit": engine.context_limit, "max_position_embeddings": c.max_position_embeddings,
           "max_context": engine.max_context}
    if c.rope_type != "default":
        out.update(rope_type=c.rope_type, rope_factor=c.rope_factor,
                   original_max_position_embeddings=c.original_max_position_embeddings)
    out["kv_bytes_per_token"] = engine.kv_bytes_per_token
    if free_bytes is not None:
        out["fits_in_free_memory"] = tokens_that_fit(free_bytes, 0, engine.kv_bytes_per_token, None)
    return out


def _compile_mode(engine) -> str:
    runner = engine.graph_runner
    if runner is None:
        return "eager kernels"
    layers = "torch.compile per layer kind" if engine.trunk.compiled_block is not None else "eager kernels"
    return f"{layers}, CUDA graphs for verify, draft and refresh steps"


def _mtp_graphs(engine) -> dict:
    """{"mtp_cuda_graphs": report} when the MTP head's steps are graphs (or were meant to be); else nothing."""
    graphs, chains = (getattr(engine.mtp_drafter, name, None) for name in ("graphs", "chains"))
    out = {} if graphs is None else {"mtp_cuda_graphs": graphs.report()}
    return out if chains is None else {**out, "mtp_draft_chain_graphs": chains.report()}


def _drafter_report(engine) -> dict:
    """What drafts when a request names no drafter: the MTP head, a draft model (name, path, parameters) or none."""
    d = engine.default_drafter()
    out = {"name": getattr(d, "name", None), "choice": engine.drafter_choice}
    if engine.draft_drafter is not None:
        dl = engine.draft_drafter.loaded
        graphs = engine.draft_drafter.graphs
        out["draft_model"] = {"name": dl.name, "path": dl.path, "params": dl.params,
                              "family": dl.trunk.family.name,
                              "cuda_graphs": graphs.report() if graphs is not None else None}
    return out
