"""`mtpchat doctor` and `mtpchat models`: their JSON, the pick, the fallbacks in force, and clean errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import to_hf_cache, write_checkpoint

import app.cmd_doctor as cmd_doctor
import app.cmd_models as cmd_models
import engine.environment as environment
from engine import discovery
from engine.environment import DeviceInfo

ROOT = Path(__file__).resolve().parents[1]
OPS = {"gdn_chunk", "gdn_recurrent", "conv1d", "gated_rmsnorm", "attention", "moe"}




@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    hub = root / "hub"
    snaps = {
        "next": to_hf_cache(write_checkpoint(root / "b1", "qwen3_next", mtp=True), hub, "tiny-org/next-mtp"),
        "q35": to_hf_cache(write_checkpoint(root / "b2", "qwen3_5", mtp=False, seed=1), hub, "tiny-org/q35-nomtp"),
    }
    llama = root / "b3"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    snaps["llama"] = to_hf_cache(llama, hub, "meta/tiny-llama")
    return hub, snaps


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("MTPCHAT_HOME", str(tmp_path / "home"))  # no user settings
    monkeypatch.delenv("MTPCHAT_MODELS", raising=False)
    monkeypatch.delenv("MTPCHAT_DISABLE_FLA", raising=False)
    monkeypatch.setattr(discovery, "EMBEDDED_DIR", tmp_path / "no-demo")
    return hub[1]


def parse(*argv: str) -> argparse.Namespace:
    """The way app/cli.py wires the commands: each module registers its subparser."""
    parser = argparse.ArgumentParser(prog="mtpchat")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd_models.add_parser(sub)
    cmd_doctor.add_parser(sub)
    return parser.parse_args(list(argv))


def call(capsys, *argv: str) -> tuple[int, str, str]:
    args = parse(*argv)
    rc = (cmd_doctor if args.command == "doctor" else cmd_models).run(args)
    out, err = capsys.readouterr()
    return rc, out, err


def feats(report: dict) -> dict[str, str]:
    return {f["feature"]: f["reason"] for f in report["fallbacks"]}


def test_doctor_json_fla_disabled(env, capsys, monkeypatch):
    monkeypatch.setenv("MTPCHAT_DISABLE_FLA", "1")
    rc, out, err = call(capsys, "doctor", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert {"device", "versions", "backends", "models", "choice", "fallbacks"} <= set(r)
    assert r["device"]["kind"] in ("cpu", "cuda") and r["device"]["total_bytes"] > 0
    assert r["versions"]["torch"] == torch.__version__ and "transformers" in r["versions"]
    assert OPS <= set(r["backends"])
    for op in ("gdn_chunk", "gdn_recurrent"):
        assert r["backends"][op]["backend"] == "torch" and "MTPCHAT_DISABLE_FLA" in r["backends"][op]["reason"]
    assert r["fla"] == {"usable": False, "reason": "disabled by MTPCHAT_DISABLE_FLA"}
    assert "disabled by MTPCHAT_DISABLE_FLA" in feats(r)["fla"]
    assert "torch_compile" in r["compile"] and "cuda_graphs" in r["compile"]

    names = {m["name"] for m in r["models"]}
    assert names == {"tiny-org/next-mtp", "tiny-org/q35-nomtp", "meta/tiny-llama"}
    assert r["choice"]["name"] == "tiny-org/next-mtp" and r["choice"]["path"] == str(env["next"])
    assert "MTP" in r["choice"]["reason"]
    assert "speculation" not in feats(r)
    if r["device"]["kind"] == "cpu":
        assert "CPU in float32" in feats(r)["cuda"]


def test_doctor_fla_import_failure(env, capsys, monkeypatch):
    """On a (pretend) CUDA device with FLA failing to import, the reason is the import error."""
    gpu = DeviceInfo(kind="cuda", name="pretend-gpu", total_bytes=80 << 30, free_bytes=80 << 30, index=0,
                     capability="9.0")
    monkeypatch.setattr(environment, "probe_device", lambda requested=None: gpu)
    for mod in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):  # the import fails, even where FLA is installed
        monkeypatch.setitem(sys.modules, mod, None)
    rc, out, err = call(capsys, "doctor", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["device"]["name"] == "pretend-gpu"
    assert not r["fla"]["usable"] and "not importable" in r["fla"]["reason"]
    assert "not importable" in feats(r)["fla"] and "torch reference kernels" in feats(r)["fla"]
    assert "cuda" not in feats(r)
    assert r["backends"]["gdn_recurrent"]["backend"] == "torch"
    next_model = next(m for m in r["models"] if m["name"] == "tiny-org/next-mtp")
    assert next_model["run_dtype"] == "bfloat16"


def test_doctor_pinned_no_mtp(env, capsys):
    rc, out, err = call(capsys, "doctor", "--json", "--model", "tiny-org/q35-nomtp")
    assert rc == 0, err
    r = json.loads(out)
    assert r["choice"]["name"] == "tiny-org/q35-nomtp" and "pinned" in r["choice"]["reason"]
    assert r["choice"]["pinned_from"] == "--model"
    reason = feats(r)["speculation"]
    assert "no MTP head" in reason and "plain decoding" in reason


def test_doctor_pinned_from_settings(env, capsys, tmp_path):
    from app.settings import Settings, save_settings

    save_settings(Settings(model="tiny-org/q35-nomtp"))
    rc, out, _ = call(capsys, "doctor", "--json")
    r = json.loads(out)
    assert rc == 0 and r["choice"]["name"] == "tiny-org/q35-nomtp" and r["choice"]["pinned_from"] == "settings"


def test_doctor_pinned_unusable(env, capsys):
    rc, out, err = call(capsys, "doctor", "--json", "--model", "meta/tiny-llama")
    assert rc == 1
    r = json.loads(out)
    assert "unsupported model_type 'llama'" in r["choice"]["pinned_error"]
    assert r["choice"]["name"] == "tiny-org/next-mtp"  # what would run instead

    rc, out, _ = call(capsys, "doctor", "--json", "--model", "nowhere/nothing")
    assert rc == 1 and "not found" in json.loads(out)["choice"]["pinned_error"]


def test_doctor_text(env, capsys):
    rc, out, err = call(capsys, "doctor")
    assert rc == 0 and not err
    for section in ("Devices", "Packages", "Kernels", "Compile / graphs", "Models (3 found)", "Choice",
                    "Fallbacks in force"):
        assert section in out
    assert "tiny-org/next-mtp" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_doctor_bad_device(env, capsys):
    rc, out, err = call(capsys, "doctor", "--device", "cuda")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "CUDA was requested" in err and "Traceback" not in err


def test_models_json(env, capsys, tmp_path):
    extra = write_checkpoint(tmp_path / "mine" / "moe", "qwen3_5_moe", mtp=True, seed=5)
    rc, out, err = call(capsys, "models", "--json", str(tmp_path / "mine"))
    assert rc == 0, err
    rows = json.loads(out)
    by = {r["name"]: r for r in rows}
    assert set(by) == {"moe", "tiny-org/next-mtp", "tiny-org/q35-nomtp", "meta/tiny-llama"}
    for r in rows:
        for key in ("name", "path", "family", "mtp_layers", "source", "params", "fits_device", "supported",
                    "reason", "dtype", "mem_bytes"):
            assert key in r
    assert (by["moe"]["family"], by["moe"]["mtp_layers"], by["moe"]["source"]) == ("qwen3_5_moe", 1, "folder")
    assert by["moe"]["path"] == str(extra) and by["moe"]["picked"]  # the largest MTP-capable model
    assert by["tiny-org/next-mtp"]["source"] == "hf-cache" and by["tiny-org/next-mtp"]["mtp_layers"] == 1
    assert not by["meta/tiny-llama"]["supported"] and "llama" in by["meta/tiny-llama"]["reason"]
    assert sum(r["picked"] for r in rows) == 1


def test_models_table_and_errors(env, capsys):
    rc, out, err = call(capsys, "models")
    assert rc == 0 and not err
    lines = out.splitlines()
    assert any(line.startswith("*") and "tiny-org/next-mtp" in line for line in lines)
    assert "unsupported: unsupported model_type 'llama'" in out
    assert "pick: tiny-org/next-mtp" in out

    rc, out, err = call(capsys, "models", "/no/such/folder")
    assert rc == 2 and out == "" and err.strip() == "mtpchat models: error: /no/such/folder: no such file or folder"


def test_models_internal_error_is_one_line(env, capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(discovery, "discover", boom)
    rc, out, err = call(capsys, "models")
    assert rc == 1 and err == "mtpchat models: error: disk on fire\n"


def test_cli_doctor_subprocess(env):
    e = dict(os.environ, MTPCHAT_DISABLE_FLA="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "app.cli", "doctor", "--json"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert "disabled by MTPCHAT_DISABLE_FLA" in feats(r)["fla"]
    assert {"tiny-org/next-mtp", "tiny-org/q35-nomtp"} <= {m["name"] for m in r["models"]}
