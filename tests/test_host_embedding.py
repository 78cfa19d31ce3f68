"""The input embedding table in page-locked host memory (engine/host_embedding.py, issue #29): where auto / on /
off put it, the flag and its refusals, bench's loaded_memory_bytes; on CUDA (gpu-marked) the same tokens and logits
bit for bit as with the table on the GPU, inside CUDA graphs too, with the table's bytes off the GPU."""

from __future__ import annotations

import json

import pytest
import torch

from app.cli import build_parser, main
from engine import EngineError, load_engine
from engine.host_embedding import ENV, check_mode, resolve

GiB = 1 << 30


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.setenv(ENV, "auto")  # (so that teardown restores it: main() sets it for the flag)
    monkeypatch.delenv(ENV)


# --- where the table goes -----------------------------------------------------------------------------------------

SMALL, BIG = 4 * GiB, 20 * GiB  # weights against a 24 GiB GPU: 17% and 83%


@pytest.mark.parametrize("mode, device, tied, quantized, tp, weights, host", [
    ("auto", "cuda", False, True, False, SMALL, True),  # quantized: memory is what the user is short of
    ("auto", "cuda", False, False, False, BIG, True),  # over 60% of the GPU
    ("auto", "cuda", False, False, False, SMALL, False),  # fits with room to spare: no PCIe reads
    ("auto", "cuda", True, True, False, BIG, False),  # tied: the lm_head reads the table every step
    ("auto", "cuda", False, True, True, BIG, False),  # tensor parallelism
    ("auto", "cpu", False, True, False, BIG, False),  # the CPU: a no-op
    ("on", "cuda", False, False, False, SMALL, True),  # forced
    ("on", "cuda", True, False, False, SMALL, False),  # forced, still refused when tied...
    ("on", "cuda", False, False, True, SMALL, False),  # ... or under tensor parallelism
    ("on", "cpu", False, False, False, SMALL, False),
    ("off", "cuda", False, True, False, BIG, False),
])
def test_resolve(mode, device, tied, quantized, tp, weights, host):
    p = resolve(mode, device, tied, quantized, tp, weights, 24 * GiB)
    assert p.host is host and p.reason


def test_refusals_say_why():
    assert "tied" in resolve("on", "cuda", True, False, False, 0, GiB).reason
    assert "tensor parallelism" in resolve("on", "cuda", False, False, True, 0, GiB).reason
    assert "83%" in resolve("auto", "cuda", False, False, False, BIG, 24 * GiB).reason


def test_mode_from_the_argument_then_the_environment(monkeypatch):
    assert check_mode(None) == "auto"
    monkeypatch.setenv(ENV, "off")
    assert check_mode(None) == "off" and check_mode("on") == "on"
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(EngineError, match=f"^{ENV} 'sometimes': expected one of auto, on, off$"):
        check_mode(None)
    with pytest.raises(EngineError, match="^--embed-on-host 'yes': expected one of auto, on, off$"):
        check_mode("yes")


# --- the flag -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["chat"], ["run", "--prompt", "hi"], ["bench"]])
def test_flag_on_the_loading_commands(command):
    args = build_parser().parse_args([command[0], "--embed-on-host", "off", *command[1:]])
    assert args.embed_on_host == "off"
    assert build_parser().parse_args(command).embed_on_host is None  # unset: MTPCHAT_EMBED_ON_HOST, else auto


def test_bad_flag_value_is_one_line(capsys):
    code = main(["run", "--embed-on-host", "maybe", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--embed-on-host" in err[0] and "'maybe'" in err[0], err


def test_flag_reaches_the_load(ckpt, capsys):
    """run --embed-on-host off: the engine's load reads it from MTPCHAT_EMBED_ON_HOST (as --mtp-from's)."""
    import os

    code = main(["run", "--model", str(ckpt("next")), "--device", "cpu", "--embed-on-host", "off", "--prompt", "hi",
                 "--max-new-tokens", "1", "--depth", "0"])
    assert code == 0 and os.environ[ENV] == "off" and check_mode(None) == "off"


def test_bad_environment_value_refused_before_the_load(ckpt, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(EngineError, match=f"^{ENV} '1': expected one of auto, on, off$"):
        load_engine(str(ckpt("next")), device="cpu")


def test_on_the_cpu_a_no_op(ckpt):
    engine = load_engine(str(ckpt("next")), device="cpu", embed_on_host="on")
    assert engine.trunk.embed.weight.device.type == "cpu"
    assert "embedding" not in engine.trunk.backends.choice  # nothing placed, nothing to report
    assert not [f for f in engine.loaded.fallbacks if f.feature == "embed_on_host"]


# --- what bench and the estimates report ------------------------------------------------------------------------

def test_bench_reports_memory_after_load(ckpt, capsys):
    code = main(["bench", "--model", str(ckpt("next")), "--device", "cpu", "--depths", "0", "--drafter", "mtp",
                 "--max-new-tokens", "2", "--repeat", "1", "--no-hf", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["loaded_memory_bytes"] > 0 and out["loaded_memory_of"] == "process max rss"
    assert out["loaded_memory_bytes"] <= out["results"][0]["peak_memory_bytes"]  # the rows' peaks come after


def test_estimate_leaves_out_a_table_auto_keeps_on_the_host(ckpt, monkeypatch):
    from engine.discovery import MARGIN_FRACTION, assess, inspect_model
    from engine.environment import DeviceInfo

    cand = inspect_model(ckpt("next"))
    table, weights = cand.embedding_params * 2, cand.params * 2  # (bfloat16 on CUDA)
    assert table > 0  # the fixture's lm_head is its own

    def mem(total: int, mode: str) -> int:
        monkeypatch.setenv(ENV, mode)
        gpu = DeviceInfo(kind="cuda", name="fake", total_bytes=total, free_bytes=total, index=0)
        return assess(cand, gpu).mem_bytes

    tight, roomy = int(weights * 1.2), weights * 100  # the weights take 83% / 1% of the GPU
    assert abs(mem(tight, "off") - mem(tight, "auto") - table * (1 + MARGIN_FRACTION)) <= 1  # (and its margin)
    assert mem(roomy, "off") == mem(roomy, "auto")  # auto leaves an unquantized model that fits on the GPU
    assert mem(roomy, "off") - mem(roomy, "on") > table


# --- on CUDA --------------------------------------------------------------------------------------------------------

def greedy(engine, prompt, depth, n=24):
    from engine import GenerationSettings
    from engine.events import Tokens

    s = GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True, reuse=False)
    return [t for e in engine.generate(prompt, s) if isinstance(e, Tokens) for t in e.token_ids]


def prefill_logits(engine, prompt) -> torch.Tensor:
    trunk, caches = engine.trunk, engine.caches
    with torch.inference_mode():
        caches.reset()
        caches.kv.reserve(len(prompt) + 1)
        return trunk.logits(trunk.forward(torch.tensor([prompt], device=trunk.device), 0, caches, verify=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_host_table_exact_in_graphs_and_off_the_gpu(ckpt, dtype):
    path = str(ckpt("next"))  # its lm_head is its own: the table may leave the GPU
    warm = load_engine(path, device="cuda", dtype=dtype, cuda_graphs=True, embed_on_host="off")  # noqa: F841
    torch.cuda.synchronize()  # (the first load's one-off allocations, e.g. cuBLAS's workspace, before measuring)
    base = torch.cuda.memory_allocated()
    on_gpu = load_engine(path, device="cuda", dtype=dtype, cuda_graphs=True, embed_on_host="off")
    mid = torch.cuda.memory_allocated()
    on_host = load_engine(path, device="cuda", dtype=dtype, cuda_graphs=True, embed_on_host="on")
    end = torch.cuda.memory_allocated()

    kind, why = on_host.trunk.backends.choice["embedding"]
    assert kind == "host" and "off the GPU" in why, why
    assert on_gpu.trunk.backends.choice["embedding"] == ("gpu", "--embed-on-host off")
    weight = on_host.trunk.embed.weight
    assert weight.is_cuda and torch.equal(weight.cpu(), on_gpu.trunk.embed.weight.cpu())
    table = weight.numel() * weight.element_size()
    assert abs((mid - base) - (end - mid) - table) < 1 << 16, (mid - base, end - mid, table)

    prompt = on_gpu.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    for depth in (0, 3):  # plain decoding's graph, verify and cycle graphs with the MTP head's refresh (it embeds too)
        assert greedy(on_host, prompt, depth) == greedy(on_gpu, prompt, depth)
    report = on_host.diagnostics()["compile"]["cuda_graphs"]
    assert report["failure"] is None and int(report["decode"]["replays"]["1"]) > 5  # replayed, not eager
    assert int(report["cycle"]["replays"]["4"]) > 1
    assert torch.equal(prefill_logits(on_host, prompt), prefill_logits(on_gpu, prompt))  # (eager: the prefill)

