"""Bad checkpoints: each gets one clear line naming the file (and the tensor), from loading and from discovery alike;
never a traceback, a hang or silent garbage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import to_hf_cache
from safetensors.torch import load_file, save_file

from engine import checkpoint
from engine.discovery import inspect_model
from engine.errors import EngineError
from engine.model import load

INDEX = "model.safetensors.index.json"
ROOT = Path(__file__).resolve().parent.parent


def damaged(ckpt, name: str, tmp_path: Path, damage) -> Path:
    """A copy of fixture `name` with `damage(folder)` applied."""
    path = shutil.copytree(ckpt(name), tmp_path / "model")
    damage(path)
    return path


def edit_config(change):
    def damage(path: Path) -> None:
        conf = json.loads((path / "config.json").read_text())
        change(conf)
        (path / "config.json").write_text(json.dumps(conf))
    return damage


def edit_tensors(change):
    def damage(path: Path) -> None:
        tensors = load_file(path / "model.safetensors")
        change(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return damage


def edit_index(change):
    def damage(path: Path) -> None:
        index = json.loads((path / INDEX).read_text())
        change(index["weight_map"])
        (path / INDEX).write_text(json.dumps(index))
    return damage


def replace_with(file: str, make):
    def damage(path: Path) -> None:
        (path / file).unlink()
        make(path / file)
    return damage


def folder(p: Path) -> None:
    p.mkdir()


def dev_zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def set_text(field, value):
    return edit_config(lambda c: c["text_config"].__setitem__(field, value))


def set_rope_type(kind):
    return edit_config(lambda c: c["text_config"]["rope_parameters"].__setitem__("rope_type", kind))


def to_fp8(tensors: dict, with_scales: bool = False) -> None:
    for k in [k for k in tensors if k.endswith("proj.weight") and not k.startswith("mtp.")]:
        tensors[k] = tensors[k].to(torch.float8_e4m3fn)
        if with_scales:
            tensors[k + "_scale_inv"] = torch.ones(1)


def int_q_proj(tensors: dict) -> None:
    k = next(k for k in tensors if k.endswith("self_attn.q_proj.weight") and not k.startswith("mtp."))
    tensors[k] = (tensors[k] * 100).to(torch.int32)


def poke(key: str, value: float):
    def change(tensors: dict) -> None:
        tensors[key].view(-1)[0] = value
    return change


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}

# name -> (fixture, damage, what the one line says after the file's path, what discovery's reason says or None
# where discovery reads no tensor data and no transformers config)
CASES = {
    "index_value_a_number": ("next_sharded_experts", edit_index(lambda m: m.__setitem__("lm_head.weight", 3)),
                             f"{INDEX}: weight_map entry 'lm_head.weight' is 3, not a file name", True),
    "index_value_a_list": ("next_sharded_experts", edit_index(lambda m: m.__setitem__("lm_head.weight", ["a"])),
                           f"{INDEX}: weight_map entry 'lm_head.weight' is ['a'], not a file name", True),
    "config_a_folder": ("next", replace_with("config.json", folder),
                        "config.json: config is a folder, not a regular file", True),
    "unknown_rope_type": ("next", edit_config(lambda c: c.__setitem__("rope_scaling", {"rope_type": "warp",
                                                                                         "factor": 2.0})),
                          "config.json: rope_type 'warp' is not supported (known: default, linear", False),
    "unknown_rope_type_qwen3_5": ("q35", set_rope_type("warp"), "config.json: rope_type 'warp' is not supported",
                                  False),
    "nan_rms_norm_eps": ("q35", set_text("rms_norm_eps", float("nan")),
                         "config.json: rms_norm_eps must be a small positive number, got nan", False),
    "zero_rms_norm_eps": ("next", edit_config(lambda c: c.__setitem__("rms_norm_eps", 0)),
                          "config.json: rms_norm_eps must be a small positive number, got 0", False),
    "negative_rms_norm_eps": ("next", edit_config(lambda c: c.__setitem__("rms_norm_eps", -1e-6)),
                              "config.json: rms_norm_eps must be a small positive number, got -1e-06", False),
    "nan_in_the_embedding": ("next", edit_tensors(poke("model.embed_tokens.weight", float("nan"))),
                             "model.safetensors: tensor 'model.embed_tokens.weight' holds NaN or infinite values",
                             False),
    "inf_in_a_norm": ("next", edit_tensors(poke("model.norm.weight", float("inf"))),
                      "model.safetensors: tensor 'model.norm.weight' holds NaN or infinite values", False),
    "nan_in_the_mtp_head": ("next", edit_tensors(poke("mtp.fc.weight", float("nan"))),
                            "model.safetensors: tensor 'mtp.fc.weight' holds NaN or infinite values", False),
    "int32_q_proj": ("next", edit_tensors(int_q_proj),
                     "model.safetensors: tensor 'model.layers.1.self_attn.q_proj.weight' is stored as I32; "
                     "weights must be floating point", True),
    "fp8_without_scales": ("next", edit_tensors(to_fp8), "without its scale", True),
    "fp8_with_scales_no_quantization_config": (
        "next", edit_tensors(lambda t: to_fp8(t, with_scales=True)),
        "is FP8 (F8_E4M3) but config.json has no fp8 quantization_config", True),
    # (discovery reads the headers' dtypes, not whether each scale's shape fits its weight: load says it)
    "fp8_checkpoint_with_scales_of_the_wrong_shape": (
        "next", lambda p: (edit_tensors(lambda t: to_fp8(t, with_scales=True))(p),
                           edit_config(lambda c: c.__setitem__("quantization_config", FP8))(p)),
        "model.safetensors: tensor 'model.layers.0.linear_attn.out_proj.weight_scale_inv' has shape (1,); FP8 "
        "weight", False),
    "fp8_tagged_bf16_weights": ("next", edit_config(lambda c: c.__setitem__("quantization_config", FP8)),
                                "config.json: quantization_config says fp8 but no tensor is FP8", True),
    "quantization_config_in_text_config": (
        "q35", set_text("quantization_config", {"quant_method": "exl2"}),
        "config.json: quantization_config quant_method 'exl2' is not supported yet (quantized weights need "
        "dequantizing kernels the engine does not have); use the bf16 release", True),
}


def one_line_error(path: Path, call) -> str:
    with pytest.raises(EngineError) as e:
        call(str(path))
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("case", list(CASES))
def test_load_refuses_with_one_line_naming_the_file(case, ckpt, tmp_path):
    fixture, damage, says, _ = CASES[case]
    path = damaged(ckpt, fixture, tmp_path, damage)
    message = one_line_error(path, load)
    assert message.startswith(f"{path}{os.sep}") and says in message, message


@pytest.mark.parametrize("case", [c for c, (*_, seen) in CASES.items() if seen])
def test_discovery_lists_it_unusable_in_loads_words(case, ckpt, tmp_path):
    fixture, damage, says, _ = CASES[case]
    path = damaged(ckpt, fixture, tmp_path, damage)
    cand = inspect_model(path)
    assert not cand.supported and says in cand.reason, cand.reason


def test_a_json_file_over_the_size_limit_is_not_read(ckpt, tmp_path, monkeypatch):
    path = damaged(ckpt, "next", tmp_path, lambda p: None)
    monkeypatch.setattr(checkpoint, "MAX_JSON_BYTES", 1 << 10)  # the tiny config is a few KiB
    assert "config.json: config is over 0.000976562 MiB: not a config file" in one_line_error(path, load)
    assert "config.json: config is over" in inspect_model(path).reason


def test_hugging_face_cache_symlinks_still_load(ckpt, tmp_path):
    """Only regular files are read, after following links: a cache snapshot is all links to blobs."""
    snap = to_hf_cache(shutil.copytree(ckpt("next"), tmp_path / "src"), tmp_path / "hub", "org/tiny")
    assert (snap / "config.json").is_symlink() and (snap / "model.safetensors").is_symlink()
    assert load(snap).mtp_layers == 1
    assert inspect_model(snap).supported


# A FIFO blocks a reader until some writer comes, /dev/zero never ends: a regression hangs, so these run in a child
# process with a deadline rather than in the test process.
HANGERS = {
    "config_fifo": ("next", replace_with("config.json", os.mkfifo), "config.json: config is a named pipe (FIFO)"),
    "config_dev_zero": ("next", replace_with("config.json", dev_zero),
                        "config.json: config is a character device (a link to /dev/zero), not a regular file"),
    "weights_fifo": ("next", replace_with("model.safetensors", os.mkfifo),
                     "model.safetensors: safetensors file is a named pipe (FIFO), not a regular file"),
    "weights_dev_zero": ("next", replace_with("model.safetensors", dev_zero),
                         "model.safetensors: safetensors file is a character device"),
    "index_fifo": ("next_sharded_experts", replace_with(INDEX, os.mkfifo),
                   f"{INDEX}: safetensors index is a named pipe (FIFO), not a regular file"),
    "index_dev_zero": ("next_sharded_experts", replace_with(INDEX, dev_zero), f"{INDEX}: safetensors index is a "
                       "character device"),
}

PROBE = """
import json, sys
from engine.discovery import discover, inspect_model
from engine.environment import DeviceInfo
from engine.errors import EngineError
from engine.model import load

out = {}
for path in sys.argv[1:]:
    try:
        load(path)
        out[path] = {"load": None}
    except EngineError as e:
        out[path] = {"load": str(e)}
    out[path]["inspect"] = inspect_model(path).reason
big = DeviceInfo(kind="cpu", name="roomy", total_bytes=1 << 40, free_bytes=1 << 40)
found = discover(sys.argv[1:], include_hf_cache=False, include_embedded=False, include_env=False, device=big)
out["discover"] = {c.path: c.reason for c in found}
print(json.dumps(out))
"""


def test_fifos_and_devices_are_refused_without_hanging(ckpt, tmp_path):
    paths = {}
    for case, (fixture, damage, _) in HANGERS.items():
        paths[case] = shutil.copytree(ckpt(fixture), tmp_path / case)
        damage(paths[case])
    proc = subprocess.run([sys.executable, "-c", PROBE, *map(str, paths.values())], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for case, path in paths.items():
        says = HANGERS[case][2]
        got = out[str(path)]
        assert got["load"] and got["load"].startswith(f"{path}{os.sep}") and says in got["load"], (case, got)
        assert "\n" not in got["load"]
        assert says in got["inspect"] and says in out["discover"][str(path.absolute())], (case, got)


@pytest.mark.parametrize("case,hanger", [("config_fifo", True), ("fp8_tagged_bf16_weights", False),
                                         ("index_value_a_list", False)])
def test_the_cli_prints_one_line_and_fails(case, hanger, ckpt, tmp_path):
    fixture, damage, says = (HANGERS[case] if hanger else CASES[case][:3])
    path = damaged(ckpt, fixture, tmp_path, damage)
    proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--model", str(path), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpchat: error: ") and says in lines[0], proc.stderr
