"""Reading an HF-format model folder: config.json and safetensors (never pickle), single file or sharded.

Every failure names the file and, where it applies, the tensor. Loading and discovery (`mtpchat models`, the
chat's picker) read folders through the same functions here, so they agree on what is wrong with one.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import EngineError

INDEX_FILE = "model.safetensors.index.json"
# A config or an index is kilobytes (a 1T-parameter index is a few MiB): a JSON file bigger than this is not one,
# and reading it whole would only exhaust memory.
MAX_JSON_BYTES = 64 << 20
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path: Path, what: str) -> int:
    """The size of `path` when it is a regular file; EngineError otherwise. Symlinks are followed (Hugging Face
    cache snapshots link to blobs), but a FIFO or a device such as /dev/zero would block a read forever or never
    end, so only regular files are ever opened."""
    try:
        st = path.stat()
    except FileNotFoundError:
        hint = " (a dangling link: incomplete download?)" if path.is_symlink() else ""
        raise EngineError(f"{path}: {what} is missing{hint}") from None
    except OSError as e:
        raise EngineError(f"{path}: {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "a special file")
        link = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise EngineError(f"{path}: {what} is {kind}{link}, not a regular file")
    return st.st_size


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a regular file of at most MAX_JSON_BYTES."""
    regular_file(path, what)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)  # bounded even if the file grows after the check
    except OSError as e:
        raise EngineError(f"{path}: {what} cannot be read ({e.strerror})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise EngineError(f"{path}: {what} is over {MAX_JSON_BYTES / (1 << 20):g} MiB: not a {what} file")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: {what} is not valid JSON ({_short(e)})") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path}: {what} is not a JSON object")
    return data


def model_dir(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise EngineError(f"{p}: no such model folder")
    if not p.is_dir():
        raise EngineError(f"{p}: not a folder (give the model folder that holds config.json)")
    if not (p / "config.json").exists():
        raise EngineError(f"{p}: no config.json here; not a Hugging Face model folder")
    return p


def quantization_config(cfg: dict) -> dict | None:
    """config.json's quantization_config: at the top level (Qwen3.5's wrapped FP8 releases keep it there, and it
    covers the text model) or in text_config; None when absent, {} when it is not an object."""
    text = cfg.get("text_config")
    for c in (cfg, text if isinstance(text, dict) else {}):
        q = c.get("quantization_config")
        if isinstance(q, dict):
            return q
        if q:
            return {}
    return None


def quant_method(cfg: dict) -> str | None:
    """The quant_method of config.json's quantization_config; None when absent."""
    q = quantization_config(cfg)
    if q is None:
        return None
    return str(q.get("quant_method") or q.get("quant_type") or "unknown")


def fp8_checkpoint(cfg: dict) -> bool:
    """config.json declares the block-128 FP8 layout engine/fp8.py reads."""
    return quant_method(cfg) == "fp8" and unsupported_quantization(cfg) is None


def fp8_without_fp8_weights(cfg: dict, dtype_of: dict[str, str]) -> str | None:
    """config.json declares FP8 but no tensor is FP8: a mislabelled (or badly converted) checkpoint, refused
    rather than guessed at."""
    if fp8_checkpoint(cfg) and not any(d.startswith("F8") for d in dtype_of.values()):
        return "quantization_config says fp8 but no tensor is FP8 (a mislabelled checkpoint)"
    return None


def int4_scheme(cfg: dict):
    """config.json's GPTQ / AWQ 4-bit layout as an int4.Scheme (what engine/int4.py reads); None for any other."""
    from . import int4

    if str(quant_method(cfg)).lower() in int4.METHODS and unsupported_quantization(cfg) is None:
        return int4.scheme(quantization_config(cfg))
    return None


def int4_without_int4_weights(cfg: dict, names) -> str | None:
    """config.json declares GPTQ / AWQ but no tensor is packed (no `.qweight`): mislabelled, refused."""
    if int4_scheme(cfg) is not None and not any(k.endswith(".qweight") for k in names):
        return f"quantization_config says {quant_method(cfg)} but no tensor is 4-bit (no .qweight: a mislabelled " \
               f"checkpoint)"
    return None


def unsupported_quantization(cfg: dict) -> str | None:
    """Why config.json's quantization cannot be run, or None. A quantization_config is never ignored: loading
    quantized weights as plain ones gives garbage."""
    from . import int4
    from .fp8 import config_problem

    method = quant_method(cfg)
    if method is None:
        return None
    if method == "fp8":
        return config_problem(quantization_config(cfg))
    if method.lower() in int4.METHODS:
        return int4.config_problem(quantization_config(cfg))
    why = ("other FP8 layouts need their own loaders" if method.startswith("fp8") else
           "quantized weights need dequantizing kernels")
    return f"quantization_config quant_method {method!r} is not supported yet ({why} the engine does not have); " \
           f"use the bf16 release"


def weight_files(root: Path) -> list[str]:
    """The safetensors files of the checkpoint: those the index names, else every *.safetensors in the folder."""
    index = root / INDEX_FILE
    if index.exists() or index.is_symlink():  # a dangling index link is an incomplete download, not "no index"
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EngineError(f"{index}: no weight_map")
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or not file:
                raise EngineError(f"{index}: weight_map entry {tensor!r} is {file!r}, not a file name")
        return sorted(set(weight_map.values()))
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{root}: no .safetensors weights{_other_weights_hint(root)}")
    return files


def _other_weights_hint(root: Path) -> str:
    names = sorted(p.name for p in root.iterdir())
    pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
    if pickles:
        return f" (found {', '.join(pickles[:3])}: pickle weights are never loaded; convert to safetensors)"
    ggufs = [n for n in names if n.endswith(".gguf")]
    if ggufs:
        return f" (found {', '.join(ggufs[:3])}: GGUF files are not loaded; use the Hugging Face safetensors release)"
    return ""


def read_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    """Tensor name -> (safetensors dtype such as 'BF16', shape) from the file's header, and the file's size. No
    tensor data is read: safe_open maps the file and checks that the header's offsets cover it exactly, which is
    what catches a truncated download (or trailing junk) before any tensor is used."""
    size = regular_file(path, "safetensors file")
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {}
            for key in f.keys():
                sl = f.get_slice(key)
                tensors[key] = (sl.get_dtype(), tuple(sl.get_shape()))
    except Exception as e:  # safetensors raises its own error types for truncation / bad headers
        raise EngineError(f"{path}: corrupt or truncated safetensors file ({_short(e)})") from None
    return tensors, size


@dataclass
class TensorFiles:
    """Where each tensor lives. Only names and shapes are read until `load` is called."""

    root: Path
    file_of: dict[str, str] = field(default_factory=dict)
    shape_of: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtype_of: dict[str, str] = field(default_factory=dict)
    # tensor parallelism: (name, full shape) -> tp.Selection of the rows / columns to read, or None for all of it
    slicer: object | None = None
    # config.json declares block-128 FP8 (checkpoint.fp8_checkpoint): F8_E4M3 weights with their scales load
    fp8: bool = False
    # config.json declares GPTQ / AWQ (checkpoint.int4_scheme): its int4.Scheme; int32 packed tensors load
    int4: object | None = None

    @classmethod
    def open(cls, root: Path) -> "TensorFiles":
        tf = cls(root)
        for name in weight_files(root):
            tensors, _ = read_header(root / name)
            for key, (dtype, shape) in tensors.items():
                tf.file_of[key], tf.dtype_of[key], tf.shape_of[key] = name, dtype, shape
        return tf

    def keys(self) -> list[str]:
        return list(self.file_of)

    def load(self, names: list[str], device: str = "cpu") -> dict[str, torch.Tensor]:
        """Read the named tensors, grouped per file. Errors name the file and tensor. Every tensor must be floating
        point and finite: a NaN weight or an integer one would load silently and decode garbage."""
        for n in names:  # from the headers: refuse before reading any data
            self._check_dtype(n)
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        for fname, keys in by_file.items():
            path = self.root / fname
            current = keys[0]
            try:
                with safe_open(path, framework="pt", device=device) as f:
                    for current in keys:
                        sel = self.slicer(current, self.shape_of[current]) if self.slicer is not None else None
                        if sel is None:
                            t = f.get_tensor(current)
                        else:  # only this rank's slice is read
                            t = sel.read(f.get_slice(current), self.shape_of[current]).to(device)
                        _check_finite(path, current, t)
                        out[current] = t
            except EngineError:
                raise
            except Exception as e:
                raise EngineError(f"{path}: tensor {current!r} cannot be read ({_short(e)})") from None
        return out

    def _check_dtype(self, name: str) -> None:
        why = unloadable_dtype(name, self.dtype_of[name], self.file_of, self.fp8, self.int4 is not None)
        if why:
            raise EngineError(f"{self.root / self.file_of[name]}: {why}")


def unloadable_dtype(name: str, dtype: str, names, fp8: bool = False, int4: bool = False) -> str | None:
    """Why tensor `name`, stored as `dtype` (the header's spelling), cannot be loaded as a weight; None when it
    can. names: every tensor in the checkpoint, where an FP8 weight's scale would be; fp8: config.json declares
    block-128 FP8 (without it FP8 tensors are refused: their scales' layout is unknown); int4: config.json
    declares GPTQ / AWQ (int32 qweight / qzeros / g_idx load; engine/int4.py checks them)."""
    if dtype in _FLOAT_DTYPES:
        return None
    packed = name.rpartition(".")[2] in ("qweight", "qzeros", "g_idx")
    if packed and int4 and (dtype == "I32" or (dtype == "I64" and name.endswith(".g_idx"))):
        return None
    if packed and dtype == "I32":
        return f"tensor {name!r} is a packed 4-bit tensor (GPTQ / AWQ) but config.json has no gptq or awq " \
               f"quantization_config"
    if dtype.startswith("F8"):
        scale = name.removesuffix(".weight") + ".weight_scale_inv"
        if fp8 and dtype == "F8_E4M3" and scale in names:
            return None
        if fp8 and dtype == "F8_E4M3":
            return f"FP8 tensor {name!r} has no {scale!r} (every FP8 weight needs its float32 block scale)"
        if fp8:
            return f"tensor {name!r} is {dtype}; config.json's fp8 quantization_config says e4m3 (F8_E4M3)"
        unscaled = "" if scale in names else f" without its scale {scale!r}"
        return f"tensor {name!r} is FP8 ({dtype}){unscaled} but config.json has no fp8 quantization_config " \
               f"(block-128 FP8 needs quant_method 'fp8', weight_block_size [128, 128])"
    return f"tensor {name!r} is stored as {dtype}; weights must be floating point ({', '.join(_FLOAT_DTYPES[:3])})"


def _check_finite(path: Path, name: str, t: torch.Tensor) -> None:
    # The sum is one pass without a tensor-sized temporary, and it is non-finite whenever any element is. A finite
    # tensor whose sum overflows float32 is then told apart by the exact (and costlier) element test.
    if t.dtype == torch.float8_e4m3fn:  # no inf in e4m3fn; NaN is every bit of exponent and mantissa set
        if ((t.view(torch.uint8) & 0x7F) == 0x7F).any():
            raise EngineError(f"{path}: tensor {name!r} holds NaN values (a corrupt or badly converted checkpoint)")
        return
    if not torch.isfinite(t.sum(dtype=torch.float32)) and not torch.isfinite(t).all():
        raise EngineError(f"{path}: tensor {name!r} holds NaN or infinite values (a corrupt or badly converted "
                          f"checkpoint)")


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]
