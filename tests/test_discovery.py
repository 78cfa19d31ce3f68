"""Discovery, sizing, the automatic choice and the fallback chain, over real tiny checkpoints laid out like a real
Hugging Face cache (blobs + symlinked snapshots) and like user model folders."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from fixtures import to_hf_cache, write_checkpoint
from safetensors import safe_open

from engine import discovery
from engine.discovery import Candidate, assess, choose, discover, estimate_memory, fallbacks_for, inspect_model
from engine.environment import (DeviceInfo, DeviceUnavailable, fla_status, package_versions, probe_device,
                                run_dtype)

BIG = DeviceInfo(kind="cpu", name="roomy", total_bytes=1 << 40, free_bytes=1 << 40)
TINY = DeviceInfo(kind="cpu", name="tiny", total_bytes=1 << 20, free_bytes=1 << 20)




def tensor_count(folder: Path) -> int:
    """Parameters in a folder, counted with the safetensors library (independently of discovery's reader)."""
    n = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                n += torch.Size(st.get_slice(k).get_shape()).numel()
    return n


def write_llama(path: Path) -> Path:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    hub = root / "hub"
    hub.mkdir()
    build = root / "build"
    z = {"hub": hub}

    # Hugging Face cache
    src = write_checkpoint(build / "next", "qwen3_next", mtp=True)
    z["next_params"] = tensor_count(src)
    z["next"] = to_hf_cache(src, hub, "tiny-org/next-mtp")
    src = write_checkpoint(build / "q35", "qwen3_5", mtp=False, shards=True, seed=1)  # wrapped, sharded
    z["q35_params"] = tensor_count(src)
    z["q35"] = to_hf_cache(src, hub, "tiny-org/q35-nomtp")
    z["llama"] = to_hf_cache(write_llama(build / "llama"), hub, "meta/tiny-llama")
    bad = build / "badjson"
    bad.mkdir(parents=True)
    (bad / "config.json").write_text('{"model_type": "qwen3_next", "hidden_size": ')
    z["badjson"] = to_hf_cache(bad, hub, "broken/bad-json")
    trunc = write_checkpoint(build / "trunc", "qwen3_next", mtp=False)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])  # header intact, tensor data cut
    z["trunc"] = to_hf_cache(trunc, hub, "broken/truncated")
    part = write_checkpoint(build / "part", "qwen3_5", mtp=False, shards=True, seed=2)
    z["part"] = to_hf_cache(part, hub, "broken/partial")
    (z["part"] / "model-00002-of-00035.safetensors").resolve().unlink()  # dangling link: an interrupted download

    # $MTPCHAT_MODELS: a folder of model folders
    shelf = root / "shelf"
    z["shelf"] = shelf
    z["text"] = write_checkpoint(shelf / "q35-text-mtp", "qwen3_5", wrapped=False, mtp=True, seed=3)
    z["text_params"] = tensor_count(z["text"])
    pick = shelf / "pickle-only"
    pick.mkdir(parents=True)
    (pick / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_nextn_predict_layers": 1}))
    (pick / "pytorch_model.bin").write_bytes(b"never unpickled")
    (shelf / "not-a-model").mkdir()
    (shelf / "not-a-model" / "README.md").write_text("nothing here")

    # a folder the caller passes
    z["moe"] = write_checkpoint(root / "extra" / "moe", "qwen3_5_moe", mtp=True, seed=4)
    z["moe_params"] = tensor_count(z["moe"])
    return z


@pytest.fixture
def env(zoo, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(zoo["hub"]))
    monkeypatch.delenv("MTPCHAT_MODELS", raising=False)
    monkeypatch.delenv("MTPCHAT_DISABLE_FLA", raising=False)
    monkeypatch.setattr(discovery, "EMBEDDED_DIR", tmp_path / "no-demo-here")
    return zoo


def by_name(cands: list[Candidate]) -> dict[str, Candidate]:
    return {c.name: c for c in cands}


# ---------------------------------------------------------------------------------------------------------------
# discovery


def test_hf_cache_candidates(env):
    assert (env["next"] / "config.json").is_symlink()  # the layout is the real one
    found = by_name(discover(device=BIG))
    assert set(found) == {"tiny-org/next-mtp", "tiny-org/q35-nomtp", "meta/tiny-llama", "broken/bad-json",
                          "broken/truncated", "broken/partial"}
    assert all(c.source == "hf-cache" for c in found.values())

    nxt = found["tiny-org/next-mtp"]
    assert (nxt.family, nxt.model_type, nxt.mtp_layers, nxt.mtp_layers_declared) == ("qwen3_next", "qwen3_next", 1, 1)
    assert nxt.path == str(env["next"].absolute())
    assert nxt.params == env["next_params"]
    assert (nxt.dtype, nxt.quantization, nxt.supported, nxt.reason) == ("float32", None, True, "")
    assert nxt.has_tokenizer and nxt.fits_device

    q35 = found["tiny-org/q35-nomtp"]  # wrapped vision-language layout, sharded with an index
    assert (q35.family, q35.model_type, q35.mtp_layers, q35.supported) == ("qwen3_5", "qwen3_5", 0, True)
    assert q35.params == env["q35_params"]

    js = nxt.to_json()
    json.dumps(js)
    for key in ("name", "path", "family", "mtp_layers", "source", "params", "fits_device", "supported", "reason",
                "dtype", "mem_bytes"):
        assert key in js


def test_unsupported_reasons(env, monkeypatch):
    monkeypatch.setenv("MTPCHAT_MODELS", str(env["shelf"]))
    found = by_name(discover(device=BIG))
    llama = found["meta/tiny-llama"]
    assert not llama.supported and llama.family == "llama" and llama.params and llama.params > 0
    assert "unsupported model_type 'llama'" in llama.reason
    for t in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        assert t in llama.reason

    bad = found["broken/bad-json"]
    assert not bad.supported and "config.json: config is not valid JSON" in bad.reason and bad.family is None

    trunc = found["broken/truncated"]
    assert not trunc.supported and "truncated" in trunc.reason and "model.safetensors" in trunc.reason

    part = found["broken/partial"]
    assert not part.supported and "model-00002-of-00035.safetensors: safetensors file is missing" in part.reason

    pick = found["pickle-only"]
    assert not pick.supported and "pickle" in pick.reason and pick.source == "folder"
    assert "not-a-model" not in found


def test_models_env_and_extra_paths(env, monkeypatch, tmp_path):
    monkeypatch.setenv("MTPCHAT_MODELS", f"{env['shelf']}{os.pathsep}{tmp_path / 'missing'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    cands = discover([str(env["moe"]), str(empty)], include_hf_cache=False, include_embedded=False, device=BIG)
    found = by_name(cands)
    assert list(found)[:2] == ["moe", "empty"]  # caller's folders first
    assert set(found) == {"moe", "empty", "q35-text-mtp", "pickle-only"}

    text = found["q35-text-mtp"]
    assert (text.family, text.model_type, text.mtp_layers, text.source) == ("qwen3_5", "qwen3_5_text", 1, "folder")
    assert text.params == env["text_params"] and text.supported

    moe = found["moe"]
    assert (moe.family, moe.model_type, moe.mtp_layers, moe.supported) == ("qwen3_5_moe", "qwen3_5_moe", 1, True)
    assert moe.params == env["moe_params"]

    assert not found["empty"].supported and "no config.json" in found["empty"].reason

    # the same folder twice is listed once
    again = discover([str(env["moe"]), str(env["moe"])], include_hf_cache=False, include_embedded=False,
                     include_env=False, device=BIG)
    assert len(again) == 1


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=False)
    return dst


def test_mtp_layers_from_tensors_and_config(env, tmp_path):
    # config silent: counted from the mtp.layers.N. prefixes
    silent = _copy(env["next"], tmp_path / "silent")
    cfg = json.loads((silent / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (silent / "config.json").write_text(json.dumps(cfg))
    c = inspect_model(silent)
    assert c.mtp_layers == 1 and c.mtp_layers_declared is None

    # config declares an MTP layer the tensors do not have (a re-saved checkpoint): no MTP, with a note
    declared = _copy(env["q35"], tmp_path / "declared")
    cfg = json.loads((declared / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (declared / "config.json").write_text(json.dumps(cfg))
    c = inspect_model(declared)
    assert c.mtp_layers_declared == 1 and c.mtp_layers == 0 and c.supported
    assert any("no usable mtp.* tensors" in n for n in c.notes)


def test_quantized_is_reported_unsupported(env, tmp_path):
    q = _copy(env["next"], tmp_path / "fp8")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    (q / "config.json").write_text(json.dumps(cfg))
    c = inspect_model(q, device=BIG)
    assert c.quantization == "fp8" and not c.supported
    assert c.reason.startswith("config.json: quantization_config fp8 weight_block_size [128, 64] is not supported")


def test_headers_only_never_tensor_data(tmp_path):
    """A 'model' whose single tensor is 1 GiB of sparse file: sizing it reads 8 bytes + the JSON header."""
    root = tmp_path / "huge"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    shape = [1 << 18, 1 << 11]  # 2**29 bf16 = 1 GiB
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "model.embed_tokens.weight": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 1 << 30]},
                         "mtp.fc.weight": {"dtype": "BF16", "shape": [0, 0], "data_offsets": [1 << 30, 1 << 30]},
                         "mtp.layers.0.input_layernorm.weight": {"dtype": "BF16", "shape": [0],
                                                                 "data_offsets": [1 << 30, 1 << 30]}}).encode()
    with open(root / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + (1 << 30))
    c = inspect_model(root, device=BIG)
    assert c.params == 1 << 29 and c.dtype == "bfloat16" and c.mtp_layers == 1 and c.supported
    assert c.run_dtype == "float32" and c.mem_bytes > 4 * (1 << 29)  # CPU runs float32

    small = DeviceInfo(kind="cpu", name="small", total_bytes=1 << 31, free_bytes=1 << 31)
    half = assess(c, small)  # float32 does not fit in 2 GiB, bfloat16 does: it runs so, and says why
    assert half.fits_device and half.run_dtype == "bfloat16"
    assert half.dtype_reason.startswith("float32 needs 2.4 GiB of 2.0 GiB")
    tiny = DeviceInfo(kind="cpu", name="tiny", total_bytes=1 << 30, free_bytes=1 << 30)
    assert not assess(c, tiny).fits_device and assess(c, tiny).run_dtype == "bfloat16"  # (its best chance)

    gpu = DeviceInfo(kind="cuda", name="fake-gpu", total_bytes=8 << 30, free_bytes=8 << 30, index=0)
    g = assess(c, gpu)
    assert g.run_dtype == "bfloat16" and g.fits_device
    weights = 2 * (1 << 29)
    assert g.mem_bytes == weights + int(weights * discovery.MARGIN_FRACTION) + discovery.MARGIN_BYTES["cuda"]


def test_embedded_demo_source(env, monkeypatch, tmp_path):
    assert all(c.source != "embedded" for c in discover(device=BIG))  # absent: skipped quietly
    demo = _copy(env["next"], tmp_path / "demo")
    monkeypatch.setattr(discovery, "EMBEDDED_DIR", demo)
    cands = discover(include_hf_cache=False, include_env=False, device=BIG)
    assert [(c.name, c.source, c.mtp_layers) for c in cands] == [(discovery.EMBEDDED_NAME, "embedded", 1)]
    assert discover(include_hf_cache=False, include_embedded=False, include_env=False, device=BIG) == []


# ---------------------------------------------------------------------------------------------------------------
# choice


def test_choice_prefers_mtp_over_size(env):
    cands = discover(device=BIG)
    assert by_name(cands)["tiny-org/q35-nomtp"].params > by_name(cands)["tiny-org/next-mtp"].params
    ch = choose(cands, BIG)
    assert ch.candidate.name == "tiny-org/next-mtp"
    assert "MTP" in ch.reason and ch.pinned_error is None
    rejected = dict(ch.rejected)
    assert rejected["tiny-org/q35-nomtp"] == "no MTP head"
    assert "unsupported model_type" in rejected["meta/tiny-llama"]
    assert set(rejected) == {c.name for c in cands} - {"tiny-org/next-mtp"}
    assert ch.to_json()["name"] == "tiny-org/next-mtp"


def test_choice_larger_wins_among_mtp_and_memory_limits(env, monkeypatch):
    monkeypatch.setenv("MTPCHAT_MODELS", str(env["shelf"]))
    cands = discover([str(env["moe"])], device=BIG)
    assert choose(cands, BIG).candidate.name == "moe"  # the largest MTP-capable model

    moe = by_name(cands)["moe"]
    half = estimate_memory(moe, BIG, "bfloat16")[1]
    roomy = DeviceInfo(kind="cpu", name="roomy", total_bytes=half, free_bytes=half)  # moe fits in bfloat16 only
    ch = choose(cands, roomy)
    assert ch.candidate.name == "moe" and ch.candidate.run_dtype == "bfloat16" and ch.candidate.dtype_reason
    tight = DeviceInfo(kind="cpu", name="tight", total_bytes=half - 1, free_bytes=half - 1)
    ch = choose(cands, tight)
    assert ch.candidate.name in ("tiny-org/next-mtp", "q35-text-mtp") and ch.candidate.fits_device
    assert "does not fit" in dict(ch.rejected)["moe"]


def test_nothing_fits(env):
    cands = discover(device=TINY)
    assert not any(c.fits_device for c in cands)
    ch = choose(cands, TINY)
    assert ch.candidate is None
    assert "no supported model fits" in ch.reason and "smallest" in ch.reason
    assert all("does not fit" in r or "unsupported" in r or "JSON" in r or "truncated" in r or "missing" in r
               for _, r in ch.rejected)


def test_nothing_found_and_nothing_supported(env):
    assert "no models were found" in choose([], BIG).reason
    llama = [c for c in discover(device=BIG) if c.name == "meta/tiny-llama"]
    ch = choose(llama, BIG)
    assert ch.candidate is None and "supported model types" in ch.reason


def test_pinned(env):
    cands = discover(device=BIG)
    for pin in ("tiny-org/q35-nomtp", "q35-nomtp", str(env["q35"])):
        ch = choose(cands, BIG, pinned=pin)
        assert ch.candidate.name == "tiny-org/q35-nomtp" and "pinned" in ch.reason and ch.pinned_error is None

    ch = choose(cands, BIG, pinned="meta/tiny-llama")  # unsupported: automatic pick, and why
    assert ch.candidate.name == "tiny-org/next-mtp"
    assert "cannot be used" in ch.pinned_error and "unsupported model_type 'llama'" in ch.pinned_error

    ch = choose(cands, BIG, pinned="no-such-model")
    assert ch.candidate.name == "tiny-org/next-mtp" and "not found" in ch.pinned_error

    # a path that discovery did not list is inspected on the spot
    ch = choose([], BIG, pinned=str(env["moe"]))
    assert ch.candidate.name == "moe" and ch.candidate.source == "folder"

    # pinned wins even when it may not fit, with a warning
    ch = choose(cands, TINY, pinned="tiny-org/next-mtp")
    assert ch.candidate.name == "tiny-org/next-mtp" and "may not fit" in ch.reason


def test_embedded_only_when_nothing_better(env, monkeypatch, tmp_path):
    demo = _copy(env["next"], tmp_path / "demo")
    monkeypatch.setattr(discovery, "EMBEDDED_DIR", demo)
    cands = discover(device=BIG)
    q35 = [c for c in cands if c.name == "tiny-org/q35-nomtp"]
    emb = [c for c in cands if c.source == "embedded"]
    ch = choose(q35 + emb, BIG)  # a real model without MTP still beats the toy demo
    assert ch.candidate.name == "tiny-org/q35-nomtp"
    ch = choose(emb, BIG)
    assert ch.candidate.source == "embedded" and "embedded demo" in ch.reason


# ---------------------------------------------------------------------------------------------------------------
# environment and fallbacks


def test_fallbacks(env, monkeypatch):
    cands = by_name(discover(device=BIG))
    feats = {f["feature"]: f["reason"] for f in fallbacks_for(BIG, cands["tiny-org/next-mtp"])}
    assert "CPU in float32 with torch kernels" in feats["cuda"]
    assert "no CUDA device" in feats["fla"] and "torch reference kernels" in feats["fla"]
    assert "speculation" not in feats

    feats = {f["feature"]: f["reason"] for f in fallbacks_for(BIG, cands["tiny-org/q35-nomtp"])}
    assert "no MTP head" in feats["speculation"] and "plain decoding" in feats["speculation"]

    feats = {f["feature"]: f["reason"] for f in fallbacks_for(BIG, cands["meta/tiny-llama"])}
    assert "llama" in feats["model"] and "qwen3_next" in feats["model"]

    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "1")
    feats = {f["feature"]: f["reason"] for f in fallbacks_for(BIG, None)}
    assert "disabled by MTPCHAT_DISABLE_FLA" in feats["fla"]


def test_fla_status(monkeypatch):
    monkeypatch.delenv("MTPCHAT_DISABLE_FLA", raising=False)
    gpu = DeviceInfo(kind="cuda", name="fake-gpu", total_bytes=1 << 34, free_bytes=1 << 34, index=0)
    assert fla_status(BIG) == (False, "no CUDA device")
    assert fla_status(None) == (False, "no CUDA device")
    for mod in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):  # the import fails, even where FLA is installed
        monkeypatch.setitem(sys.modules, mod, None)
    ok, why = fla_status(gpu)
    assert not ok and "not importable" in why and "Error" in why
    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "1")
    assert fla_status(gpu) == (False, "disabled by MTPCHAT_DISABLE_FLA")
    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "0")
    assert fla_status(gpu)[1] != "disabled by MTPCHAT_DISABLE_FLA"


def test_probe_device_and_versions():
    cpu = probe_device("cpu")
    assert cpu.kind == "cpu" and cpu.total_bytes > 0 and 0 < cpu.available_bytes <= cpu.total_bytes
    auto = probe_device(None)
    assert auto.kind == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match="CUDA was requested"):
            probe_device("cuda")
    with pytest.raises(DeviceUnavailable, match="bad device"):
        probe_device("tpu")
    v = package_versions()
    assert {"python", "torch", "cuda", "transformers", "fla", "triton", "textual"} <= set(v)
    assert v["torch"] == torch.__version__
    assert run_dtype(cpu, "bfloat16") == "float32"


def test_a_model_too_large_for_one_gpu_is_shown_with_the_tp_degree_that_fits(env):
    """Discovery counts every visible GPU: a model that does not fit one says which --tp would fit it."""
    import dataclasses

    from engine.discovery import tp_degree

    moe = dataclasses.replace(by_name(discover([str(env["moe"])], device=BIG))["moe"], params=80 * 10**9)  # ~160 GB bf16

    def gpus(n, gib):
        return [DeviceInfo(kind="cuda", name=f"gpu{gib}", total_bytes=gib << 30, free_bytes=gib << 30, index=i)
                for i in range(n)]

    h200s, a100s = gpus(8, 141), gpus(4, 80)
    assert tp_degree(assess(moe, h200s[0]), h200s) == 2
    assert tp_degree(assess(moe, a100s[0]), a100s) == 4
    assert tp_degree(assess(moe, a100s[0]), a100s[:2]) is None
    ch = choose([moe], h200s[0], gpus=h200s)
    assert ch.candidate is None and "fits across 2 of the 8 GPUs: run it with --tp 2" in ch.reason
    assert "run it with --tp 2" in dict(ch.rejected)["moe"]
    assert "--tp" not in choose([moe], h200s[0]).reason  # no other GPU visible: no suggestion


def test_between_bf16_and_fp8_releases_of_one_model_a_gpu_takes_fp8_and_the_cpu_bf16(tmp_path):
    from fixtures import write_fp8_checkpoint

    src = write_checkpoint(tmp_path / "src", "qwen3_next", seed=5)
    fp8, _ = write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "twin")
    gpu = DeviceInfo(kind="cuda", name="test", total_bytes=1 << 40, free_bytes=1 << 40, index=0)
    cands = [inspect_model(str(p), source="folder", device=gpu) for p in (src, fp8)]
    assert cands[0].params == cands[1].params and cands[1].quantization == "fp8"  # scales are not parameters
    on_gpu = choose(cands, gpu)
    assert on_gpu.candidate.path == cands[1].path
    assert "same size and faster" in dict(on_gpu.rejected)[cands[0].name]
    assert choose(cands, BIG).candidate.path == cands[0].path
