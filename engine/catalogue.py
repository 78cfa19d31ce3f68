"""The download catalogue: the released models this engine is for, kept as data (engine/assets/catalogue.json).

Each entry is sized against a device with discovery's own estimate (`assess`): the same weights-plus-margin rule
and the same KV-cache arithmetic `mtpchat models` applies to a model on disk, fed with the catalogue's numbers
instead of a checkpoint's headers. The numbers an entry marks `approximate` are estimates; `pull` checks the
repository's real config.json and safetensors headers before it downloads anything, so a rough number can only
change which variant is suggested, never what is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .context import ContextInfo, format_tokens
from .environment import DeviceInfo, format_bytes
from .errors import EngineError

CATALOGUE_FILE = Path(__file__).resolve().parent / "assets" / "catalogue.json"


@dataclass(frozen=True)
class Entry:
    name: str  # short name: qwen3.5-27b, qwen3.5-27b-fp8, qwen3-next-80b-a3b-instruct
    repo: str  # Hugging Face repo id
    series: str  # qwen3.5 | qwen3.6 | qwen3-next: what `pull SERIES` chooses among
    model_type: str
    format: str  # bf16 | fp8
    quant_method: str | None  # config.json's quantization_config quant_method; None for bf16
    params_b: float  # billions of parameters (the whole release, vision tower included)
    download_gb: float  # decimal GB on disk
    mtp: bool
    context: int  # max_position_embeddings
    attention_layers: int  # full-attention layers of the trunk (the MTP head's one is added when sizing)
    kv_heads: int
    head_dim: int
    approximate: tuple[str, ...]  # the fields above that are estimates
    notes: str = ""

    @property
    def download_bytes(self) -> int:
        return int(self.download_gb * 1e9)

    @property
    def params(self) -> int:
        return int(self.params_b * 1e9)

    def approx(self, field: str) -> str:
        """'~' before a number that is an estimate."""
        return "~" if field in self.approximate else ""

    def unsupported(self) -> str | None:
        """Why the engine cannot run this variant today (checkpoint's own rule on config.json), or None."""
        from .checkpoint import unsupported_quantization

        if self.quant_method in (None, "fp8"):  # the catalogue's FP8 entries are Qwen's block-128 releases
            return None
        return unsupported_quantization({"quantization_config": {"quant_method": self.quant_method}})


@dataclass(frozen=True)
class Fit:
    entry: Entry
    mem_bytes: int | None  # weights plus discovery's margin on the device
    context_fits: int | None  # KV-cache positions the memory left over holds (at most the model's context)
    fits: bool  # the weights fit and at least `useful_context` positions (or the whole context) fit beside them
    reason: str  # why not, or how it fits

    def to_json(self) -> dict:
        e = self.entry
        return {"name": e.name, "repo": e.repo, "series": e.series, "family": e.model_type, "format": e.format,
                "params_b": e.params_b, "download_bytes": e.download_bytes, "mtp": e.mtp, "context": e.context,
                "approximate": list(e.approximate), "mem_bytes": self.mem_bytes, "context_fits": self.context_fits,
                "fits": self.fits, "supported": e.unsupported() is None, "reason": self.reason}


@lru_cache(maxsize=1)
def _load() -> tuple[int, tuple[Entry, ...]]:
    try:
        data = json.loads(CATALOGUE_FILE.read_text())
        entries = tuple(Entry(**{**m, "approximate": tuple(m.get("approximate", ()))}) for m in data["models"])
        return int(data["useful_context"]), entries
    except (OSError, ValueError, KeyError, TypeError) as e:  # a broken install: say which file
        raise EngineError(f"{CATALOGUE_FILE}: the model catalogue cannot be read ({type(e).__name__}: {e})") from None


def entries() -> tuple[Entry, ...]:
    return _load()[1]


def useful_context() -> int:
    """Context a pick must leave room for: enough for a real conversation, well under the models' 262k."""
    return _load()[0]


def series_names() -> list[str]:
    return list(dict.fromkeys(e.series for e in entries()))


def find(name: str) -> Entry | list[Entry] | None:
    """A catalogue entry by short name, the entries of a series (`qwen3.5`), or None. Case-insensitive; a repo id
    of the catalogue finds its entry too."""
    want = name.strip().lower()
    for e in entries():
        if want in (e.name, e.repo.lower()):
            return e
    series = [e for e in entries() if e.series == want]
    return series or None


def fit(entry: Entry, device: DeviceInfo) -> Fit:
    """How `entry` fits `device`, by discovery's estimate: the weights in the dtype they would run in plus the
    runtime margin, then the KV cache for `useful_context` positions in what is left."""
    from .discovery import Candidate, assess

    info = ContextInfo(max_position_embeddings=entry.context, rope_type="default", rope_factor=None,
                       original_max_position_embeddings=None,
                       attention_layers=entry.attention_layers + (1 if entry.mtp else 0),
                       kv_heads=entry.kv_heads, head_dim=entry.head_dim)
    cand = Candidate(name=entry.name, path=entry.repo, family=entry.model_type, model_type=entry.model_type,
                     params=entry.params, dtype="bfloat16", quantization=entry.quant_method,
                     mtp_layers=1 if entry.mtp else 0, mem_bytes=None, fits_device=False, supported=True, reason="",
                     source="catalogue", disk_bytes=entry.download_bytes, context=info)
    c = assess(cand, device)
    want = min(useful_context(), entry.context)
    where = (f"{format_bytes(device.available_bytes)} available on {device.torch_device}"
             + (f" in {c.run_dtype}" if c.dtype_reason else ""))  # (the CPU, where float32 does not fit)
    if not c.fits_device:
        return Fit(entry, c.mem_bytes, c.context_fits, False,
                   f"needs {entry.approx('params_b')}{format_bytes(c.mem_bytes)} of {where}")
    if (c.context_fits or 0) < want:
        return Fit(entry, c.mem_bytes, c.context_fits, False,
                   f"the weights fit ({format_bytes(c.mem_bytes)} of {where}) but only "
                   f"{format_tokens(c.context_fits)} tokens of context beside them (under {format_tokens(want)})")
    return Fit(entry, c.mem_bytes, c.context_fits, True,
               f"needs {entry.approx('params_b')}{format_bytes(c.mem_bytes)} of {where}, with "
               f"{format_tokens(c.context_fits)} of {format_tokens(entry.context)} tokens of context")


def pick(series: list[Entry], device: DeviceInfo) -> tuple[Entry | None, str]:
    """The largest variant of `series` the engine runs that fits `device` with a useful context, and why."""
    fits = [fit(e, device) for e in series]
    # FP8 on the CPU would dequantize every weight at every step: there the bf16 releases are the pick
    slow = {"fp8"} if device.kind != "cuda" else set()
    runnable = [f for f in fits if f.entry.unsupported() is None and f.entry.format not in slow]
    usable = [f for f in runnable if f.fits]
    label = series[0].series
    if not usable:
        smallest = min(runnable, key=lambda f: f.mem_bytes or 0, default=None)
        why = f"no {label} variant the engine runs fits {device.describe()}"
        if smallest is not None:
            why += f"; the smallest, {smallest.entry.name}, {smallest.reason}"
        return None, why
    # ties: FP8 on CUDA (half the weight reads), the bf16 release on the CPU; then the first listed (Instruct
    # before Thinking)
    best = max(usable, key=lambda f: (f.entry.params_b, (f.entry.format == "fp8") == (device.kind == "cuda")))
    larger = [f for f in runnable if f.entry.params_b > best.entry.params_b]
    why = f"{best.entry.name} ({best.entry.repo}): the largest {label} variant that fits: {best.reason}"
    if larger:
        nxt = min(larger, key=lambda f: f.entry.params_b)
        why += f"; {nxt.entry.name} {nxt.reason}"
    skipped = sorted({f.entry.format for f in fits if f.entry.unsupported() is not None})
    if skipped:
        why += f"; {'/'.join(s.upper() for s in skipped)} variants skipped (not supported by the engine yet)"
    if slow & {f.entry.format for f in fits}:
        why += "; FP8 variants skipped on the CPU (each step would dequantize every weight)"
    return best.entry, why
