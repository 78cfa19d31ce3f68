"""`--mtp-from PATH`: the MTP head's tensors from another release of the same model, for a checkpoint shipped
without them (some community quantizations strip mtp.*). The other release's bf16, FP8 or 4-bit mtp.* tensors
load as its own config.json says; MTPHead.build then checks every shape against this model's head."""

from __future__ import annotations

from .checkpoint import TensorFiles, fp8_checkpoint, int4_scheme, model_dir, read_json, unsupported_quantization
from .errors import EngineError
from .families import family_for, mtp_layers_declared


def head_source(path, family) -> tuple[TensorFiles, int | None]:
    """(the tensors of the release at `path`, its declared MTP layer count); EngineError, one line, when it is
    not a release of `family` with mtp.* tensors the engine can read."""
    root = model_dir(path)
    where = root / "config.json"
    raw = read_json(where, "config")
    other = family_for(raw, str(where))
    if other.name != family.name:
        raise EngineError(f"--mtp-from {root}: a {other.name} model; this model is {family.name}")
    quantized = unsupported_quantization(raw)
    if quantized:
        raise EngineError(f"--mtp-from {where}: {quantized}")
    files = TensorFiles.open(root)
    files.fp8, files.int4 = fp8_checkpoint(raw), int4_scheme(raw)
    if not any(k.startswith("mtp.") for k in files.keys()):
        raise EngineError(f"--mtp-from {root}: no mtp.* tensors there (that release has no MTP head either)")
    return files, mtp_layers_declared(raw)
