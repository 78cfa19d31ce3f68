"""mtpchat's inference engine: hybrid Gated-DeltaNet models decoded with their own MTP head as a lossless
self-speculative drafter. No Textual import here.

This is the engine's public API: the app imports only names listed here (`from engine import X`). Importing the
package itself is light (no torch): each name is looked up in its module when it is first asked for, and looked
up again on every access (so a test that patches `engine.discovery.discover` patches `engine.discover` too).
"""

from __future__ import annotations

import importlib

# name -> (module, attribute in it)
_EXPORTS = {
    # loading and decoding
    "DecodeControl": ("api", "DecodeControl"),
    "Engine": ("api", "Engine"),
    "GenerationSettings": ("api", "GenerationSettings"),
    "ModelInfo": ("api", "ModelInfo"),
    "load_engine": ("api", "load_engine"),
    "default_model_path": ("api", "default_model_path"),
    "model_dir": ("checkpoint", "model_dir"),
    "MAX_DEPTH": ("limits", "MAX_DEPTH"),
    "AUTO": ("limits", "AUTO"),
    "AUTO_MAX_DEPTH": ("limits", "AUTO_MAX_DEPTH"),
    "MAX_NEW_TOKENS": ("limits", "MAX_NEW_TOKENS"),
    "SEED_MIN": ("limits", "SEED_MIN"),
    "SEED_MAX": ("limits", "SEED_MAX"),
    "MIN_CONTEXT": ("limits", "MIN_CONTEXT"),
    # the context: its limit, what a token of it costs, how much fits
    "context_info": ("context", "context_info"),
    "fit_text": ("context", "fit_text"),
    "format_tokens": ("context", "format_tokens"),
    "tokens_that_fit": ("context", "tokens_that_fit"),
    # what generate() yields, and the one user-facing error type
    "Cycle": ("events", "Cycle"),
    "DRAFT": ("events", "DRAFT"),
    "TARGET": ("events", "TARGET"),
    "FORCED": ("events", "FORCED"),
    "REASONING": ("reasoning", "REASONING"),
    "ANSWER": ("reasoning", "ANSWER"),
    "ThinkingInfo": ("reasoning", "ThinkingInfo"),
    "Fallback": ("events", "Fallback"),
    "Finished": ("events", "Finished"),
    "Started": ("events", "Started"),
    "Tokens": ("events", "Tokens"),
    "EngineError": ("errors", "EngineError"),
    "PHASES": ("timing", "PHASES"),
    # discovery: which models there are, which one is picked and why
    "EMBEDDED_DIR": ("discovery", "EMBEDDED_DIR"),
    "choose": ("discovery", "choose"),
    "discover": ("discovery", "discover"),
    "fallbacks_for": ("discovery", "fallbacks_for"),
    "format_params": ("discovery", "format_params"),
    # the machine
    "OPS": ("environment", "OPS"),
    "DeviceInfo": ("environment", "DeviceInfo"),
    "DeviceUnavailable": ("environment", "DeviceUnavailable"),
    "backend_plan": ("environment", "backend_plan"),
    "compile_capability": ("environment", "compile_capability"),
    "fla_status": ("environment", "fla_status"),
    "format_bytes": ("environment", "format_bytes"),
    "list_devices": ("environment", "list_devices"),
    "nvidia_driver": ("environment", "nvidia_driver"),
    "package_versions": ("environment", "package_versions"),
    "probe_device": ("environment", "probe_device"),
    "visible_gpus": ("environment", "visible_gpus"),
    "select_backends": ("kernels", "select_backends"),
    "versions": ("diagnostics", "versions"),
    # benchmarks
    "OracleDrafter": ("drafters", "OracleDrafter"),
    "PRESETS": ("presets", "PRESETS"),
    "DRAFT_PRESETS": ("presets", "DRAFT_PRESETS"),
    "RANDOM_DRAFT": ("presets", "RANDOM_DRAFT"),
    "random_model": ("presets", "random_model"),
    "random_draft": ("presets", "random_draft"),
    "expected_tokens": ("autodepth", "expected_tokens"),
    "weight_bytes_per_token": ("presets", "weight_bytes_per_token"),
    "stock_forward": ("norm_triton", "stock_forward"),
    # tensor parallelism
    "TPError": ("tp", "TPError"),
    "check_tp": ("tp", "check_tp"),
    "launch_tp": ("tp", "launch"),
    "under_torchrun": ("tp", "under_torchrun"),
    "tp_loader": ("tp_session", "loader"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        # not an export: a submodule (`from engine import discovery`) is then imported by the import system
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return getattr(importlib.import_module(f".{module}", __name__), attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
