"""Finding candidate models, sizing them against the device, and picking one.

Sources, in listing order: folders passed by the caller, folders in ``$MTPCHAT_MODELS`` (os.pathsep-separated;
each a model folder or a folder of model folders, two levels deep), the Hugging Face cache (``HF_HUB_CACHE``,
else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), and the embedded demo model in ``engine/assets/demo``.

Everything here reads config.json, the safetensors index and the safetensors *headers* only, through the functions
loading uses (engine.checkpoint): never tensor data, never pickle, never the network. A candidate that cannot be
used is still listed, with ``supported=False`` and the reason, so `mtpchat models` can say why.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .checkpoint import (fp8_checkpoint, fp8_without_fp8_weights, int4_scheme, int4_without_int4_weights,
                         quant_method, read_header, read_json, unloadable_dtype, unsupported_quantization,
                         weight_files)
from .context import ContextInfo, context_info, kv_cache_dtype, text_part, tokens_that_fit
from .environment import (DeviceInfo, cuda_unavailable_reason, fla_status, format_bytes, probe_device,
                          run_dtype)
from .errors import EngineError
from .families import SUPPORTED, mtp_layers_declared

log = logging.getLogger(__name__)

MODELS_ENV = "MTPCHAT_MODELS"
EMBEDDED_DIR = Path(__file__).resolve().parent / "assets" / "demo"
EMBEDDED_NAME = "mtpchat-demo"

SUPPORTED_MODEL_TYPES = tuple(SUPPORTED)  # qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text

# Memory beyond the weights: activations, KV / GDN caches, the CUDA context and allocator slack.
MARGIN_FRACTION = 0.10
MARGIN_BYTES = {"cuda": 768 << 20, "cpu": 256 << 20}

SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
    "F4": ("float4_e2m1fn_x2", 1), "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2),
    "I8": ("int8", 1), "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_DTYPE_BYTES = {name: size for name, size in SAFETENSORS_DTYPES.values()}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def supported_types_text() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES)


@dataclass
class Candidate:
    name: str
    path: str
    family: str | None  # qwen3_next | qwen3_5 | qwen3_5_moe; the raw model_type when unsupported
    model_type: str | None
    params: int | None  # every tensor in the checkpoint (trunk, MTP head, vision tower when wrapped)
    dtype: str | None  # dominant dtype on disk, torch spelling
    quantization: str | None  # quant_method of config's quantization_config
    mtp_layers: int  # usable MTP layers found in the tensors (0: plain decoding only)
    mem_bytes: int | None  # estimated memory to run on the assessed device
    fits_device: bool
    supported: bool
    reason: str  # why unsupported; "" when supported
    source: str  # "embedded" | "hf-cache" | "folder"
    run_dtype: str | None = None  # the dtype mem_bytes assumes
    dtype_reason: str | None = None  # why run_dtype is not the device's default (half_precision_note)
    disk_bytes: int | None = None
    # quantized tensors that load dequantizes to the run dtype (4-bit experts mixed with plain ones in one experts
    # module: dequantized_at_load): their bytes on disk, weights
    dequantized_disk_bytes: int = 0
    dequantized_params: int = 0
    # the input embedding table's weights where the lm_head has its own (0 when tied): what --embed-on-host's
    # auto keeps off the GPU (host_embedding.py), so off the estimate
    embedding_params: int = 0
    has_tokenizer: bool = False
    mtp_layers_declared: int | None = None  # what config.json says, if anything
    notes: list[str] = field(default_factory=list)
    context: ContextInfo | None = None  # what config.json says of the context (limit, YaRN, attention layers)
    kv_bytes_per_token: int | None = None  # KV cache per position at run_dtype
    context_fits: int | None = None  # positions of KV cache free memory holds beside the model (<= its context)
    vocabulary: str | None = None  # digest of the tokenizer's token -> id map and the vocab size (draft pairing)
    drafts: list[str] = field(default_factory=list)  # paths of discovered models that can draft for it (pair_drafts)

    @property
    def context_limit(self) -> int | None:
        return self.context.max_position_embeddings if self.context is not None else None

    @property
    def has_mtp(self) -> bool:
        return self.mtp_layers > 0

    def to_json(self) -> dict:
        return {**asdict(self), "context_limit": self.context_limit}


@dataclass
class Choice:
    candidate: Candidate | None
    reason: str
    rejected: list[tuple[str, str]] = field(default_factory=list)
    pinned_error: str | None = None  # set when a pinned model was asked for and cannot be used

    def to_json(self) -> dict:
        c = self.candidate
        return {
            "name": c.name if c else None,
            "path": c.path if c else None,
            "reason": self.reason,
            "pinned_error": self.pinned_error,
            "rejected": [{"name": n, "reason": r} for n, r in self.rejected],
        }


# ---------------------------------------------------------------------------------------------------------------
# Reading one model folder


def _relative(message: str, root: Path) -> str:
    """An EngineError's message with the model folder left out: a candidate's reason is shown beside its path."""
    for prefix in (f"{root}{os.sep}", f"{root}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def _config_dtype(cfg: dict) -> str | None:
    for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        d = c.get("dtype") or c.get("torch_dtype")
        if isinstance(d, str):
            return d
    return None


def inspect_model(path: str | os.PathLike, source: str = "folder", name: str | None = None,
                  device: DeviceInfo | None = None) -> Candidate:
    """Everything discovery knows about one model folder. Never raises for a bad checkpoint: the problem becomes
    the candidate's `reason`."""
    root = Path(path).expanduser()
    if root.is_file() and (root.name == "config.json" or root.suffix == ".safetensors"):
        root = root.parent
    cand = Candidate(name=name or _default_name(root), path=str(root.absolute()), family=None, model_type=None,
                     params=None, dtype=None, quantization=None, mtp_layers=0, mem_bytes=None,
                     fits_device=False, supported=False, reason="", source=source)
    problems: list[str] = []
    if not root.is_dir():
        cand.reason = "no such folder" if not root.exists() else "not a folder"
        return cand
    try:
        cfg = read_json(root / "config.json", "config")
    except EngineError as e:
        cand.reason = _relative(str(e), root)
        return cand

    model_type = cfg.get("model_type")
    cand.model_type = model_type if isinstance(model_type, str) else None
    fam = SUPPORTED.get(model_type) if isinstance(model_type, str) else None
    cand.family = fam.name if fam else cand.model_type
    if fam is None:
        shown = repr(model_type) if model_type is not None else "missing"
        problems.append(f"unsupported model_type {shown} (supported: {supported_types_text()})")
    cand.quantization = quant_method(cfg)
    cand.mtp_layers_declared = mtp_layers_declared(cfg)
    cand.has_tokenizer = any((root / f).is_file() for f in _TOKENIZER_FILES)  # a FIFO or a device is not one
    if not cand.has_tokenizer:
        cand.notes.append("no tokenizer files: usable for benchmarks, not for chat")

    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    file_of: dict[str, str] = {}
    disk = 0
    try:
        for fname in weight_files(root):
            t, size = read_header(root / fname)
            tensors.update(t)
            file_of.update(dict.fromkeys(t, fname))
            disk += size
    except EngineError as e:
        problems.append(_relative(str(e), root))
        tensors = {}
    if tensors:
        cand.disk_bytes = disk
        cand.params, top = weights_and_dtype(tensors)
        cand.dtype = SAFETENSORS_DTYPES.get(top, (top.lower(), 0))[0]
        if cand.quantization is None and top.startswith("F8"):
            cand.quantization = "fp8"
        cand.mtp_layers = count_mtp_layers(tensors, cand)
        cand.dequantized_disk_bytes, cand.dequantized_params = dequantized_at_load(tensors)
        cand.embedding_params = untied_embedding_params(tensors, fam) if fam is not None else 0
    else:
        cand.dtype = _config_dtype(cfg)
    cand.context = context_info(text_part(cfg), cand.mtp_layers)

    # what load refuses from config.json and the headers, in load's words
    quantized = unsupported_quantization(cfg) or (tensors and (fp8_without_fp8_weights(
        cfg, {k: d for k, (d, _) in tensors.items()}) or int4_without_int4_weights(cfg, tensors)))
    if quantized:
        problems.append(f"config.json: {quantized}")
    if fam is not None:
        problems += unloadable_tensors(tensors, file_of, fam, fp8_checkpoint(cfg), int4_scheme(cfg) is not None)[:1]
    if cand.mtp_layers_declared and not cand.mtp_layers and tensors:
        cand.notes.append(f"config declares {cand.mtp_layers_declared} MTP layer(s) but the checkpoint has no "
                          f"usable mtp.* tensors: plain decoding")
    cand.supported = not problems
    cand.reason = problems[0] if problems else ""
    if cand.supported:
        cand.vocabulary = vocabulary_digest(root, text_part(cfg).get("vocab_size"))
    return assess(cand, device) if device is not None else cand


def vocabulary_digest(root: Path, vocab_size) -> str | None:
    """A digest of tokenizer.json's token -> id map (the BPE vocabulary and the added tokens) with the config's
    vocab_size: two models with the same digest read each other's token ids as the same tokens (what a draft
    model needs: draft_model.check_pair checks it again at load). None without a readable tokenizer.json."""
    import hashlib

    try:
        data = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = dict(data.get("model", {}).get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not vocab:
        return None
    text = json.dumps([vocab_size, sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))], ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


DRAFT_FRACTION = 0.25  # a draft has at most this share of the target's parameters (else it saves little)


def pair_drafts(candidates: list[Candidate]) -> None:
    """Fill each usable model's `drafts` (smallest first) with the other usable models of its tokenizer, at most
    DRAFT_FRACTION of its size (e.g. Qwen3-0.6B for Qwen3-Next-80B: the same tokenizer), and note the pairing."""
    usable = [c for c in candidates if c.supported and c.vocabulary and c.params]
    for target in usable:
        drafts = sorted((d for d in usable if d is not target and d.vocabulary == target.vocabulary
                         and d.params <= DRAFT_FRACTION * target.params), key=lambda d: d.params)
        target.drafts = [d.path for d in drafts]
        if drafts:
            target.notes.append(f"draft models (--draft-model): {', '.join(d.name for d in drafts[:3])}"
                                + (f" and {len(drafts) - 3} more" if len(drafts) > 3 else ""))


_INT4_AUX = (".qzeros", ".scales", ".g_idx", ".weight_scale_inv")  # (and FP8's block scales)


def weights_and_dtype(tensors: dict) -> tuple[int, str]:
    """(how many weights the tensors {name: (dtype, shape)} hold, the safetensors dtype most of the float ones
    have). A packed 4-bit qweight (int32) holds 8 weights an element; its qzeros / scales / g_idx (and FP8's
    weight_scale_inv) are not weights, and the run dtype is the float tensors'."""
    params = sum(_numel(shape) * (8 if k.endswith(".qweight") else 0 if k.endswith(_INT4_AUX) else 1)
                 for k, (_, shape) in tensors.items())
    by_dtype: dict[str, int] = {}
    for dt, shape in tensors.values():
        if not dt.startswith("I"):
            by_dtype[dt] = by_dtype.get(dt, 0) + _numel(shape)
    return params, max(by_dtype, key=by_dtype.get) if by_dtype else next(iter(tensors.values()))[0]


def unloadable_tensors(tensors: dict, file_of: dict[str, str], fam, fp8: bool = False, int4: bool = False) -> list[str]:
    """Why each tensor that load would read (trunk and MTP head, not a vision tower) cannot be loaded."""
    out = []
    for name, (dtype, _) in tensors.items():
        if fam.trunk_key(name) is not None or name.startswith("mtp."):
            why = unloadable_dtype(name, dtype, tensors, fp8, int4)
            if why:
                out.append(f"{file_of[name]}: {why}")
    return out


def count_mtp_layers(tensors: dict, cand: Candidate) -> int:
    layers = {int(m.group(1)) for k in tensors if (m := _MTP_LAYER.match(k))}
    if not layers:
        return 0
    if "mtp.fc.weight" not in tensors:
        cand.notes.append("mtp.layers.* present without mtp.fc.weight: MTP head incomplete, plain decoding")
        return 0
    return len(layers)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _default_name(root: Path) -> str:
    if root.resolve() == EMBEDDED_DIR:  # the same name in the picker, `models` and the loaded engine's info
        return EMBEDDED_NAME
    parts = root.absolute().parts
    # .../models--org--name/snapshots/<rev>: name it like the Hub does
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return root.name or str(root)


# Per-expert 4-bit MoE weights stay 4-bit (int4.Int4Experts): their size on disk is their memory, as FP8 experts'
# (fp8.FP8Experts). Only an experts module mixing plain and 4-bit experts is dequantized at load (int4.py's
# _install_experts), to the run dtype.
_INT4_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)\.(qweight|qzeros|scales|g_idx)$")
_PLAIN_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)\.weight$")


def dequantized_at_load(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[int, int]:
    """(bytes on disk, weights) of the quantized tensors (safetensors headers: name -> (dtype, shape)) that load
    dequantizes to the run dtype: the 4-bit experts of experts modules that also hold plain experts."""
    mixed = {m.group(1) for k in tensors if (m := _PLAIN_EXPERT.match(k))}
    disk = weights = 0
    for k, (dt, shape) in tensors.items():
        m = _INT4_EXPERT.match(k)
        if m and m.group(1) in mixed:
            disk += _numel(shape) * SAFETENSORS_DTYPES.get(dt, (None, 4))[1]
            weights += _numel(shape) * 8 if m.group(2) == "qweight" else 0  # 8 nibbles an int32
    return disk, weights


def untied_embedding_params(tensors: dict, fam) -> int:
    """The input embedding table's weights when the checkpoint has an lm_head of its own, else 0 (tied: the table
    is the lm_head's and stays on the GPU)."""
    from .host_embedding import untied_table_key

    key = untied_table_key(tensors, fam)
    return _numel(tensors[key][1]) if key is not None else 0


def estimate_memory(cand: Candidate, device: DeviceInfo, dtype: str | None = None) -> tuple[str | None, int | None]:
    """(run dtype, bytes) to run `cand` on `device` in `dtype` (default: run_dtype's): weights in the run dtype
    (quantized ones as stored, but those load dequantizes at the run dtype), less an embedding table auto keeps in
    host memory, plus a margin for activations, caches and the runtime."""
    from .host_embedding import check_mode, resolve

    dtype = dtype or run_dtype(device, cand.dtype)
    if cand.quantization and cand.disk_bytes:
        weights = (cand.disk_bytes - cand.dequantized_disk_bytes
                   + cand.dequantized_params * _DTYPE_BYTES.get(dtype, 4))
    elif cand.params is not None:
        weights = cand.params * _DTYPE_BYTES.get(dtype, 4)
    else:
        return dtype, None
    try:
        mode = check_mode(None)
    except EngineError:  # (load_engine says so; an estimate never raises)
        mode = "auto"
    # (one GPU: under tensor parallelism the table stays on the GPUs, which this estimate then undercounts)
    if cand.embedding_params and resolve(mode, device.kind, False, bool(cand.quantization), False, weights,
                                         device.total_bytes).host:
        weights -= cand.embedding_params * _DTYPE_BYTES.get(dtype, 4)
    margin = int(weights * MARGIN_FRACTION) + MARGIN_BYTES.get(device.kind, MARGIN_BYTES["cpu"])
    return dtype, weights + margin


def assess(cand: Candidate, device: DeviceInfo) -> Candidate:
    """A copy of `cand` with run_dtype, mem_bytes and fits_device for `device`. On the CPU a model that does not
    fit in float32 runs in bfloat16 (half_precision_note says so; model.load does the same)."""
    dtype, mem = estimate_memory(cand, device)
    why = None
    if device.kind == "cpu" and mem is not None and mem > device.available_bytes:  # (fitting or not: its best chance)
        why = half_precision_note(mem, device.available_bytes)
        dtype, mem = estimate_memory(cand, device, "bfloat16")
    fits = mem is not None and mem <= device.available_bytes
    kv = cand.context.kv_bytes_per_token(dtype, kv_cache_dtype()) if cand.context is not None else None
    context = tokens_that_fit(device.available_bytes, mem, kv or 0, cand.context_limit)
    return replace(cand, run_dtype=dtype, dtype_reason=why, mem_bytes=mem, fits_device=fits,
                   notes=list(cand.notes) + ([why] if why else []), kv_bytes_per_token=kv, context_fits=context)


def half_precision_note(need: int, available: int) -> str:
    """Why a model runs in bfloat16 on the CPU. In bfloat16 a verify pass's rows may round apart from one-row steps,
    so speculation's text is not guaranteed to be plain decoding's, as on a GPU in 16-bit."""
    return (f"float32 needs {format_bytes(need)} of {format_bytes(available)} available: running in bfloat16 on "
            f"the CPU (half the memory; --dtype float32 insists)")


# ---------------------------------------------------------------------------------------------------------------
# Sources


def hf_cache_dir() -> Path:
    """The Hub cache folder as huggingface_hub resolves it, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _hf_snapshots(cache: Path) -> list[tuple[str, Path]]:
    """(repo_id, snapshot folder) for each model repo in the cache: the revision `main` points to, else the most
    recently modified one."""
    if not cache.is_dir():
        return []
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        return _hf_snapshots_by_hand(cache)
    try:
        info = scan_cache_dir(cache)
    except Exception as e:  # CacheNotFound, permissions: no cache is not an error
        log.debug("HF cache scan of %s failed: %s", cache, e)
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        out.append((repo.repo_id, Path(revs[0].snapshot_path)))
    # scan_cache_dir drops a repo it finds corrupted (a dangling link after an interrupted download). List those
    # too, so the user sees why they cannot be used.
    scanned = {repo_id for repo_id, _ in out}
    out += [(repo_id, snap) for repo_id, snap in _hf_snapshots_by_hand(cache) if repo_id not in scanned]
    return sorted(out, key=lambda item: item[0].lower())


def _hf_snapshots_by_hand(cache: Path) -> list[tuple[str, Path]]:
    out = []
    for repo_dir in sorted(cache.glob("models--*")):
        snaps = repo_dir / "snapshots"
        main = repo_dir / "refs" / "main"
        snap = None
        if main.is_file():
            snap = snaps / main.read_text().strip()
        if snap is None or not snap.is_dir():
            revs = sorted((p for p in snaps.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
            snap = revs[0] if revs else None
        if snap is not None:
            out.append((repo_dir.name[len("models--"):].replace("--", "/"), snap))
    return out


def _model_dirs(root: Path, depth: int = 2) -> list[Path]:
    """`root` when it is a model folder, else the model folders below it, up to `depth` levels."""
    if (root / "config.json").exists():
        return [root]
    if depth == 0 or not root.is_dir():
        return []
    found = []
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    for child in children:
        found.extend(_model_dirs(child, depth - 1))
    return found


def env_model_paths() -> list[str]:
    return [p for p in os.environ.get(MODELS_ENV, "").split(os.pathsep) if p.strip()]


def discover(extra_paths=(), include_hf_cache: bool = True, include_embedded: bool = True, *,
             device: DeviceInfo | None = None, include_env: bool = True) -> list[Candidate]:
    """Every candidate checkpoint, sized against `device` (probed when not given). Unusable ones are included
    with their reason. A caller-given path that holds no model folder is listed as unusable too."""
    if device is None:
        device = probe_device(None)
    found: list[Candidate] = []
    seen: set[str] = set()

    def add(path: Path, source: str, name: str | None = None) -> None:
        key = os.path.realpath(path)
        if key in seen:
            return
        seen.add(key)
        found.append(inspect_model(path, source=source, name=name, device=device))

    for p in extra_paths:
        root = Path(p).expanduser()
        dirs = _model_dirs(root)
        if dirs:
            for d in dirs:
                add(d, "folder")
        else:  # explicit: say why nothing is there
            cand = inspect_model(root, source="folder", device=device)
            if root.is_dir():
                cand.reason = "no config.json here or in the folders below it"
            found.append(cand)
    if include_env:
        for p in env_model_paths():
            root = Path(p).expanduser()
            dirs = _model_dirs(root)
            if not dirs:
                log.info("%s entry %s holds no model folder", MODELS_ENV, root)
            for d in dirs:
                add(d, "folder")
    if include_hf_cache:
        for repo_id, snap in _hf_snapshots(hf_cache_dir()):
            if (snap / "config.json").exists() or (snap / "config.json").is_symlink():
                add(snap, "hf-cache", name=repo_id)
    if include_embedded and (EMBEDDED_DIR / "config.json").exists():
        add(EMBEDDED_DIR, "embedded", name=EMBEDDED_NAME)
    pair_drafts(found)
    return found


# ---------------------------------------------------------------------------------------------------------------
# Choosing


def _rank(c: Candidate, device: DeviceInfo) -> tuple:
    # A real checkpoint beats the embedded demo; then an MTP head; then a tokenizer (chat needs one); then size;
    # then, between releases of one size, the faster one here: FP8 on CUDA (its kernels read half bf16's bytes),
    # the unquantized one on the CPU (FP8 there dequantizes every weight at every step).
    return (c.source != "embedded", c.has_mtp, c.has_tokenizer, c.params or 0, _faster_here(c, device))


def _faster_here(c: Candidate, device: DeviceInfo) -> bool:
    return c.quantization == "fp8" if device.kind == "cuda" else not c.quantization


def _match_pinned(pinned: str, candidates: list[Candidate]) -> Candidate | None:
    want = pinned.strip()
    tests = [
        lambda c: c.name == want,
        lambda c: c.name.lower() == want.lower(),
        lambda c: os.path.realpath(os.path.expanduser(want)) == os.path.realpath(c.path),
        lambda c: c.name.rsplit("/", 1)[-1].lower() == want.rsplit("/", 1)[-1].lower(),
    ]
    for test in tests:
        for c in candidates:
            if test(c):
                return c
    return None


def _size_text(c: Candidate, device: DeviceInfo) -> str:
    return f"needs {format_bytes(c.mem_bytes)} of {format_bytes(device.available_bytes)} available on " \
           f"{device.torch_device}"


def tp_degree(c: Candidate, gpus: list[DeviceInfo]) -> int | None:
    """The smallest tensor-parallel degree (2, 4 or 8, at most the GPUs visible) at which each rank's share fits
    its GPU: weights and their margin split N ways (each rank reads only its slices), plus a runtime margin."""
    if not c.supported or c.mem_bytes is None:
        return None
    for n in (2, 4, 8):
        if n > len(gpus):
            break
        if c.mem_bytes / n + MARGIN_BYTES["cuda"] <= min(g.available_bytes for g in gpus[:n]):
            return n
    return None


def _tp_hint(c: Candidate, gpus: list[DeviceInfo]) -> str:
    n = tp_degree(c, gpus)
    return f"; fits across {n} of the {len(gpus)} GPUs: run it with --tp {n}" if n else ""


def _why_not(c: Candidate, device: DeviceInfo, gpus: list[DeviceInfo] = ()) -> str:
    if not c.supported:
        return c.reason
    if c.mem_bytes is None:
        return "size unknown"
    return f"does not fit: {_size_text(c, device)}{_tp_hint(c, list(gpus))}"


def choose(candidates: list[Candidate], device: DeviceInfo, pinned: str | None = None,
           gpus: list[DeviceInfo] = ()) -> Choice:
    """The best supported model that fits `device`: a real checkpoint over the embedded demo, MTP-capable over
    plain, then the larger. A pinned model (name or path) wins when it is supported, even if it may not fit;
    otherwise the automatic pick is made and `pinned_error` says why the pin was not honoured. gpus: every
    visible GPU; a model too large for `device` alone is then shown with the --tp degree that would fit it."""
    gpus = list(gpus)
    cands = [assess(c, device) for c in candidates]
    pinned_error = None
    if pinned:
        hit = _match_pinned(pinned, cands)
        if hit is None and Path(pinned).expanduser().exists():
            hit = inspect_model(pinned, source="folder", device=device)
            cands.append(hit)
        if hit is None:
            names = ", ".join(c.name for c in cands) or "none"
            pinned_error = f"pinned model {pinned!r} was not found (discovered: {names})"
        elif not hit.supported:
            pinned_error = f"pinned model {hit.name} cannot be used: {hit.reason}"
        else:
            reason = f"{hit.name}: pinned"
            reason += f"; {_describe(hit)}"
            if not hit.fits_device:
                reason += f"; warning: may not fit ({_size_text(hit, device)}){_tp_hint(hit, gpus)}"
            rejected = [(c.name, "a model is pinned") for c in cands if c is not hit]
            return Choice(hit, reason, rejected)

    usable = sorted((c for c in cands if c.supported and c.fits_device), key=lambda c: _rank(c, device), reverse=True)
    if not usable:
        rejected = [(c.name, _why_not(c, device, gpus)) for c in cands]
        if not cands:
            reason = "no models were found (searched the given folders, $MTPCHAT_MODELS, the Hugging Face cache " \
                     "and the embedded demo model)"
        elif not any(c.supported for c in cands):
            reason = f"none of the {len(cands)} discovered model(s) is supported (supported model types: " \
                     f"{supported_types_text()})"
        else:
            smallest = min((c for c in cands if c.supported and c.mem_bytes), key=lambda c: c.mem_bytes,
                           default=None)
            reason = f"no supported model fits {device.describe()}"
            if smallest is not None:
                reason += f"; the smallest, {smallest.name}, needs {format_bytes(smallest.mem_bytes)}"
                reason += _tp_hint(smallest, gpus)
        if pinned_error:
            reason = f"{pinned_error}; {reason}"
        return Choice(None, reason, rejected, pinned_error)

    best = usable[0]
    if best.source == "embedded":
        why = "the embedded demo model (no other supported model fits)"
    elif len(usable) == 1:
        why = "the only supported model that fits"
    elif best.has_mtp:
        why = "the largest supported model with an MTP head that fits"
    else:
        why = "the largest supported model that fits (none with an MTP head fits)"
    reason = f"{best.name}: {why}; {_describe(best)}; {_size_text(best, device)}"
    if pinned_error:
        reason = f"{pinned_error}; picked automatically: {reason}"
    rejected = []
    for c in cands:
        if c is best:
            continue
        if c.supported and c.fits_device:
            if c.source == "embedded" and best.source != "embedded":
                r = "the embedded demo model is used only when nothing else fits"
            elif best.has_mtp and not c.has_mtp:
                r = "no MTP head"
            elif best.has_tokenizer and not c.has_tokenizer:
                r = "no tokenizer"
            elif (c.params or 0) == (best.params or 0) and _faster_here(best, device) != _faster_here(c, device):
                r = f"{best.name} is the same size and faster on {device.torch_device}" \
                    f" ({'FP8 kernels' if best.quantization == 'fp8' else 'no per-step dequantizing'})"
            else:
                r = f"smaller than {best.name}"
            rejected.append((c.name, r))
        else:
            rejected.append((c.name, _why_not(c, device, gpus)))
    return Choice(best, reason, rejected, pinned_error)


def _describe(c: Candidate) -> str:
    mtp = f"MTP head with {c.mtp_layers} layer(s)" if c.has_mtp else "no MTP head (plain decoding)"
    return f"{c.family}, {format_params(c.params)} params, {mtp}"


def format_params(n: int | None) -> str:
    if n is None:
        return "?"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------------------------
# Fallbacks


def _cpu_reason() -> str:
    why = cuda_unavailable_reason()
    return f"no CUDA device ({why})" if why else "CPU selected although CUDA is available"


def fallbacks_for(device: DeviceInfo, candidate: Candidate | None) -> list[dict]:
    """Every fallback in force for running `candidate` on `device`, each {"feature", "reason"}."""
    out = []
    if device.kind != "cuda":
        dtype = (candidate.run_dtype if candidate is not None else None) or "float32"
        out.append({"feature": "cuda", "reason": f"{_cpu_reason()}: running on CPU in {dtype} with torch kernels"})
    usable, why = fla_status(device)
    if not usable:
        out.append({"feature": "fla", "reason": f"{why}: torch reference kernels for the GDN ops"})
    if candidate is not None:
        if not candidate.supported:
            out.append({"feature": "model", "reason": f"{candidate.name} cannot be used: {candidate.reason}"
                        + ("" if "supported:" in candidate.reason else
                           f" (supported model types: {supported_types_text()})")})
        if candidate.dtype_reason:
            out.append({"feature": "dtype", "reason": candidate.dtype_reason})
        if candidate.supported and not candidate.has_mtp:
            out.append({"feature": "speculation",
                        "reason": f"no MTP head in {candidate.name}: plain decoding"})
    return out
