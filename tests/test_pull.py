"""`mtpchat pull` against a local stand-in for the Hub (tests/hub_server.py) with the real huggingface_hub client:
HF_ENDPOINT points at it, HF_HOME is a temporary folder. The CLI runs as a subprocess, as users run it.

What must hold: a pull fetches exactly the files the engine reads into the ordinary cache, where `models` finds
them; a dropped connection and an interrupted pull both continue; every refusal is decided from metadata and
small files, before a weight file is fetched, and leaves nothing in the cache; offline and unreachable hubs are
one line, quickly; the catalogue's facts and picks follow REFERENCES.md and the device.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_server import HubServer, Repo

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"}
DECOYS = {"pytorch_model.bin": b"\x80\x02pickle" * 500, "model.gguf": b"GGUF" * 100,
          "original__consolidated.safetensors": b"not for the engine", "README.md": b"# a model card",
          "flax_model.msgpack": b"\x00" * 64}


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture
def env(tmp_path, hub):
    e = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"),
             MTPCHAT_HOME=str(tmp_path / "h"), MTPCHAT_DISABLE_FLA="1", HF_HUB_ETAG_TIMEOUT="5",
             HF_HUB_DOWNLOAD_TIMEOUT="5", HF_HUB_DISABLE_TELEMETRY="1")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN",
                "MTPCHAT_MODELS", "MTPCHAT_DEBUG"):
        e.pop(var, None)
    return e


def cli(env, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line(p) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0, p.stderr
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    assert lines[0].startswith("mtpchat pull: error: "), lines
    return lines[0]


def snapshot(env, repo="org/model", sha=Repo.__dataclass_fields__["sha"].default) -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / sha


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- a pull --------------------------------------------------------------------------------------------------


def test_pull_fetches_exactly_the_engine_files_and_models_lists_it(hub, env, ckpt):
    src = ckpt("next")
    hub.repos["org/model"] = Repo.from_folder(src, **DECOYS)
    p = cli(env, "pull", "org/model")
    assert p.returncode == 0, p.stderr
    snap = snapshot(env)
    assert p.stdout.strip() == str(snap)
    assert {f.name for f in snap.iterdir()} == ENGINE_FILES  # the decoys stayed on the hub
    for name in ENGINE_FILES:
        assert sha256(snap / name) == sha256(src / name), name
    asked = {r.path for r in hub.requests if not r.path.startswith("/api/")}
    assert asked == ENGINE_FILES, asked  # not even a HEAD for a pickle, a GGUF or a file in a subfolder
    assert (snap.parents[1] / "refs" / "main").read_text() == snap.name  # the cache knows `main` is this commit
    assert "MTP head" in p.stderr and "Fetching" in p.stderr  # the findings, and the library's progress bars

    listed = cli(env, "models", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["name"] == "org/model")
    assert row["source"] == "hf-cache" and row["supported"] and row["mtp_layers"] == 1, row
    assert Path(row["path"]) == snap


def test_a_dropped_connection_resumes_from_the_byte_it_stopped_at(hub, env, ckpt, tmp_path):
    """huggingface_hub writes in 10 MiB chunks, so the weights here are larger than that (a 24 MiB random tensor
    added to the tiny checkpoint: random, so bytes resumed at a wrong offset would not match): the retry must ask
    for the rest of the file (Range), not the whole file again."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "big"
    src.mkdir()
    for f in ckpt("next").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.padding"] = torch.randn(6 << 20, generator=torch.Generator().manual_seed(3))
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    size = (src / "model.safetensors").stat().st_size
    assert size > 20 << 20
    repo = Repo.from_folder(src)
    repo.drop_once.add("model.safetensors")
    hub.repos["org/model"] = repo
    p = cli(env, "pull", "-q", "org/model")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # --quiet: no bars, no retry chatter
    assert sha256(snapshot(env) / "model.safetensors") == sha256(src / "model.safetensors")
    gets = [r for r in hub.file_requests("model.safetensors") if r.range != "bytes=0-100000"]  # not the header read
    assert len(gets) == 2, gets
    first, resumed = gets
    assert first.range is None and first.sent == size // 2
    start = int(resumed.range.removeprefix("bytes=").split("-")[0])
    assert 0 < start <= first.sent and resumed.sent == size - start, resumed


def test_an_interrupted_pull_run_again_fetches_only_what_is_missing(hub, env, ckpt):
    src = ckpt("next")
    repo = Repo.from_folder(src)
    repo.fail_gets.add("model.safetensors")
    hub.repos["org/model"] = repo
    failed = cli(env, "pull", "-q", "org/model")
    line = one_line(failed)
    assert "HTTP 500" in line, line
    done_before = {r.path for r in hub.requests if r.method == "GET" and r.range is None and r.sent}

    repo.fail_gets.clear()
    hub.requests.clear()
    p = cli(env, "pull", "-q", "org/model")
    assert p.returncode == 0, p.stderr
    fetched = {r.path for r in hub.requests if r.method == "GET" and r.range is None and r.sent}
    # the checks read config.json again (into a scratch folder); every other completed file came from the cache
    assert fetched == {"model.safetensors", "config.json"}, fetched
    assert {"tokenizer.json", "generation_config.json"} <= done_before
    assert {f.name for f in snapshot(env).iterdir()} == ENGINE_FILES


def test_a_revision_is_pinned_and_named(hub, env, ckpt):
    hub.repos["org/model"] = Repo.from_folder(ckpt("next"))
    sha = hub.repos["org/model"].sha
    p = cli(env, "pull", "-q", f"org/model@{sha}")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(snapshot(env))
    bad = one_line(cli(env, "pull", "org/model@nope"))
    assert "revision 'nope' not found" in bad and "Invalid rev id" in bad, bad


# --- refusals, before any weight is fetched -------------------------------------------------------------------


def _with_config(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _pickle_only(src: Path, dst: Path) -> Path:
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    (dst / "pytorch_model.bin").write_bytes(b"\x80\x02" + b"\x00" * 4096)
    return dst


REFUSALS = {
    "no MTP head": (lambda ckpt, tmp: ckpt("next_nomtp"), None,
                    ["org/model has no mtp.* tensors", "plain decoding", "--yes downloads it anyway"]),
    "pickle only": (lambda ckpt, tmp: _pickle_only(ckpt("next"), tmp / "pickle"), None,
                    ["no .safetensors weights", "pytorch_model.bin", "never loaded"]),
    "FP8": (lambda ckpt, tmp: _with_config(ckpt("next"), tmp / "fp8", lambda c: c.update(
        quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})), None,
        ["config.json: quantization_config fp8 fmt 'e5m2' is not supported (only 'e4m3')"]),
    "family": (lambda ckpt, tmp: _with_config(ckpt("next"), tmp / "llama", lambda c: c.update(model_type="llama")),
               None, ["unsupported model_type 'llama'", "qwen3_next"]),
    "disk": (lambda ckpt, tmp: ckpt("next"), {"model.safetensors": 1 << 60},
             ["needs 1048576.0 TiB of disk", "free at", "HF_HOME"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_before_any_weight_is_fetched(hub, env, ckpt, tmp_path, case):
    make, sizes, says = REFUSALS[case]
    repo = Repo.from_folder(make(ckpt, tmp_path))
    repo.sizes.update(sizes or {})
    hub.repos["org/model"] = repo
    line = one_line(cli(env, "pull", "org/model"))
    for words in says:
        assert words in line, line
    weights = {f for f in repo.files if f.endswith((".safetensors", ".bin"))}
    assert not hub.full_downloads() & weights, hub.requests  # at most the header's first 100 kB, ranged
    assert all(r.sent <= 100_001 for r in hub.requests if r.path in weights)
    assert not (Path(env["HF_HOME"]) / "hub").exists() or not any((Path(env["HF_HOME"]) / "hub").iterdir())


def test_yes_accepts_a_model_without_mtp_head(hub, env, ckpt):
    hub.repos["org/model"] = Repo.from_folder(ckpt("next_nomtp"))
    p = cli(env, "pull", "--yes", "org/model")
    assert p.returncode == 0, p.stderr
    assert "warning: org/model has no mtp.* tensors" in p.stderr
    assert (snapshot(env) / "model.safetensors").is_file()


def test_dry_run_checks_and_downloads_nothing(hub, env, ckpt):
    hub.repos["org/model"] = Repo.from_folder(ckpt("q35"))
    p = cli(env, "pull", "--dry-run", "org/model")
    assert p.returncode == 0, p.stderr
    assert "qwen3_5" in p.stderr and "MTP head (1 layer)" in p.stderr and "nothing downloaded" in p.stderr
    assert p.stdout == "" and not hub.full_downloads() - {"config.json"}


# --- the hub unavailable, or saying no -------------------------------------------------------------------------


def test_missing_repo_is_the_hubs_reason_in_one_line(hub, env):
    line = one_line(cli(env, "pull", "org/absent"))
    assert "org/absent: repository not found" in line and "Repository not found" in line, line
    assert "HF_TOKEN" in line


def test_offline_mode_is_one_line_without_a_request(hub, env, ckpt):
    hub.repos["org/model"] = Repo.from_folder(ckpt("next"))
    env["HF_HUB_OFFLINE"] = "1"
    line = one_line(cli(env, "pull", "org/model"))
    assert "HF_HUB_OFFLINE is set" in line
    assert hub.requests == []


def test_unreachable_endpoint_is_one_line_and_quick(env):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    line = one_line(cli(env, "pull", "org/model"))
    assert f"cannot reach http://127.0.0.1:{port}" in line and "HF_ENDPOINT" in line, line
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("ref, says", [
    ("not a repo", "is not a repository id"),
    ("org/model@", "empty revision"),
])
def test_bad_names_are_one_line_without_a_request(hub, env, ref, says):
    line = one_line(cli(env, "pull", ref))
    assert says in line, line
    assert hub.requests == []


# --- the catalogue ---------------------------------------------------------------------------------------------


def _device(kind: str, gib: float):
    from engine.environment import DeviceInfo

    return DeviceInfo(kind=kind, name="test", total_bytes=int(gib * 2**30), free_bytes=int(gib * 2**30),
                      index=0 if kind == "cuda" else None)


def test_catalogue_holds_the_references_facts():
    from engine import catalogue

    by_name = {e.name: e for e in catalogue.entries()}
    assert {e.series for e in by_name.values()} == {"qwen3.5", "qwen3.6", "qwen3-next"}
    for size in ("0.8b", "2b", "4b", "9b", "27b", "35b-a3b", "122b-a10b"):
        assert {f"qwen3.5-{size}", f"qwen3.5-{size}-fp8"} <= set(by_name)
    assert {"qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b-instruct", "qwen3-next-80b-a3b-thinking"} <= \
        set(by_name)
    assert len({e.repo for e in by_name.values()}) == len(by_name)
    assert by_name["qwen3.5-27b"].download_gb == 55.6 and "download_gb" not in by_name["qwen3.5-27b"].approximate
    assert by_name["qwen3.5-35b-a3b-fp8"].download_gb == 37.5
    assert all(e.mtp for e in by_name.values())
    assert all(e.context == 262144 for e in by_name.values() if e.series != "qwen3-next")
    fields = set(catalogue.Entry.__dataclass_fields__)
    assert all(set(e.approximate) <= fields for e in by_name.values())
    assert by_name["qwen3.5-27b-fp8"].unsupported() is None and by_name["qwen3.5-27b"].unsupported() is None


@pytest.mark.parametrize("kind, gib, series, picked", [
    ("cuda", 140, "qwen3.5", "qwen3.5-122b-a10b-fp8"),  # 127 GB of FP8 fits an H200; 250 GB of bf16 does not
    ("cuda", 24, "qwen3.5", "qwen3.5-9b-fp8"),  # 9B in FP8 and bf16 both fit: FP8 reads half the bytes
    ("cpu", 8, "qwen3.5", "qwen3.5-2b"),  # on the CPU float32 where it fits, else bfloat16 (2B: 5.0 GiB; 4B: 9.9
    ("cpu", 16, "qwen3.5", "qwen3.5-4b"),  # in bfloat16, 19.5 in float32). FP8 would dequantize every step
    ("cuda", 140, "qwen3.6", "qwen3.6-35b-a3b-fp8"),
    ("cuda", 24, "qwen3-next", None),
])
def test_series_pick_is_the_largest_that_fits_with_a_useful_context(kind, gib, series, picked):
    from engine import catalogue

    entry, why = catalogue.pick(catalogue.find(series), _device(kind, gib))
    assert (entry.name if entry else None) == picked, why
    if entry:
        assert why.startswith(f"{picked} ({entry.repo}): the largest {series} variant that fits")
        assert ("FP8 variants skipped on the CPU" in why) == (kind == "cpu")
        assert ("available on cpu in bfloat16, with" in why) == (kind == "cpu")  # (float32 fits neither)
    else:
        assert why.startswith(f"no {series} variant the engine runs fits")


def test_a_pick_leaves_room_for_context():
    """Weights that only just fit are not a pick: the KV cache for a useful context must fit beside them."""
    from engine import catalogue

    e = catalogue.find("qwen3.5-9b")
    f = catalogue.fit(e, _device("cuda", 1))
    need = f.mem_bytes / 2**30
    tight = catalogue.fit(e, _device("cuda", need + 0.01))
    assert not tight.fits and "tokens of context beside them" in tight.reason, tight.reason
    roomy = catalogue.fit(e, _device("cuda", need + 4))
    assert roomy.fits and roomy.context_fits >= catalogue.useful_context()


def test_models_available_lists_the_catalogue_with_fits(env):
    p = cli(env, "models", "--available", "--json", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    from engine import catalogue

    assert [r["name"] for r in rows] == [e.name for e in catalogue.entries()]
    assert all(isinstance(r["fits"], bool) and r["mem_bytes"] > 0 for r in rows)
    assert not any(r["fits"] for r in rows if r["name"].startswith("qwen3-next"))  # 80B in float32: no CPU here
    assert sum(r["picked"] for r in rows) <= 3
    table = cli(env, "models", "--available", "--device", "cpu")
    assert table.returncode == 0 and "qwen3.5-27b" in table.stdout and "mtpchat pull qwen3.5:" in table.stdout
