"""Reading an HF-format model folder: config.json and safetensors (never pickle), single file or sharded.

Every failure names the file and, where it applies, the tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import EngineError

INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise EngineError(f"{path}: missing {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: {what} does not parse ({e})") from None
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


@dataclass
class TensorFiles:
    """Where each tensor lives. Only names and shapes are read until `load` is called."""

    root: Path
    file_of: dict[str, str] = field(default_factory=dict)
    shape_of: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtype_of: dict[str, str] = field(default_factory=dict)
    # tensor parallelism: (name, full shape) -> tp.Selection of the rows / columns to read, or None for all of it
    slicer: object | None = None

    @classmethod
    def open(cls, root: Path) -> "TensorFiles":
        index = root / INDEX_FILE
        if index.exists():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise EngineError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in root.glob("*.bin")] + [p.name for p in root.glob("*.pt")]
            hint = f" (found {', '.join(pickles)}: pickle weights are never loaded; convert to safetensors)" if pickles else ""
            raise EngineError(f"{root}: no .safetensors weights{hint}")
        tf = cls(root)
        for name in files:
            path = root / name
            if not path.exists():
                raise EngineError(f"{path}: listed in {INDEX_FILE} but missing")
            try:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        tf.file_of[key] = name
                        tf.shape_of[key] = tuple(sl.get_shape())
                        tf.dtype_of[key] = sl.get_dtype()
            except EngineError:
                raise
            except Exception as e:  # safetensors raises its own error types for truncation / bad headers
                raise EngineError(f"{path}: corrupt or truncated safetensors file ({_short(e)})") from None
        return tf

    def keys(self) -> list[str]:
        return list(self.file_of)

    def load(self, names: list[str], device: str = "cpu") -> dict[str, torch.Tensor]:
        """Read the named tensors, grouped per file. Errors name the file and tensor."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        for fname, keys in by_file.items():
            path = self.root / fname
            try:
                with safe_open(path, framework="pt", device=device) as f:
                    for k in keys:
                        current = k
                        sel = self.slicer(k, self.shape_of[k]) if self.slicer is not None else None
                        if sel is None:
                            out[k] = f.get_tensor(k)
                        else:  # only this rank's slice is read
                            out[k] = sel.read(f.get_slice(k), self.shape_of[k]).to(device)
            except Exception as e:
                raise EngineError(f"{path}: tensor {current!r} cannot be read ({_short(e)})") from None
        return out


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]
