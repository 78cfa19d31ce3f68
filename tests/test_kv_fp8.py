"""--kv-cache-dtype fp8: the attention KV cache as e4m3 codes with a float32 scale per head and position
(cache.quantize_kv). Lossy against the model's dtype, so transformers is no oracle for it. What must hold is what
holds for every cache: speculation equals plain decoding at every depth (drafts accepted and rejected), graph
steps equal eager ones, a prompt prefilled in chunks equals one prefilled whole; the stored values stay within
e4m3's precision; and on these fixtures the greedy replies are the 16-bit cache's."""

from pathlib import Path

import pytest
import torch

import engine as engine_pkg
from engine import load_engine
from engine.cache import KVCache, dequantize_kv, kv_write, quantize_kv
from engine.context import KV_DTYPE_ENV
from fixtures import load_with_kv_cache, memo
from test_exactness import FAMILIES, PROMPTS, assert_mtp_drafts_accepted_and_rejected, assert_speculation_equals_plain
from test_exactness import decode

DEMO = str(Path(engine_pkg.__file__).parent / "assets" / "demo")


def load_fp8(path: str, **kw):
    engine = load_with_kv_cache("fp8", path, **{"device": "cpu", **kw})
    assert engine.caches.kv.fp8 and engine.caches.kv.k.element_size() == 1
    assert engine.trunk.backends.choice["kv_cache"][0] == "fp8"
    return engine


@pytest.fixture(scope="module")
def fp8_engines(ckpt):
    return memo(lambda name: load_fp8(str(ckpt(name))))


def test_quantize_kv_keeps_e4m3_precision_at_every_magnitude():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.logspace(-6, 4, 50)[None, :, None]
    x[0, 0] = 0.0
    codes, scale = quantize_kv(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1] and scale.dtype == torch.float32
    back = dequantize_kv((codes, scale), torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    # half a step of e4m3 (3 mantissa bits) above its smallest normal, half a subnormal step below it
    bound = torch.maximum(x.abs() * 2 ** -4, scale[..., None] * 2 ** -10) * 1.001
    assert ((back - x).abs() <= bound).all()
    live = x.abs().amax(-1) > 0  # each vector's largest magnitude takes the top code: nothing saturates
    assert (codes.float().abs().amax(-1)[live] == 448).all()


def test_an_fp8_cache_keeps_its_entries_as_it_grows():
    cache = KVCache(2, 2, 8, torch.float32, torch.device("cpu"), chunk=4, fp8=True)
    cache.reserve(3)
    k, v = torch.randn(2, 1, 2, 3, 8)
    keys, values = kv_write(*cache.layer(1), 0, k, v)  # the stored values, dequantized, in k's dtype
    assert keys.dtype == torch.float32 and keys.shape == (1, 2, 3, 8)
    assert (keys - k).abs().max() <= k.abs().max() * 2 ** -4
    cache.length, serial = 3, cache.serial
    cache.reserve(10)
    assert cache.capacity >= 13 and cache.serial != serial and cache.k.dtype == torch.uint8
    (kc, ks), (vc, vs) = cache.layer(1)
    assert torch.equal(dequantize_kv((kc[:, :3], ks[:, :3]), torch.float32), keys[0])
    assert torch.equal(dequantize_kv((vc[:, :3], vs[:, :3]), torch.float32), values[0])
    assert not kc[:, 3:].any() and not ks[:, 3:].any()  # the new room is zeros (graph attention reads it)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_speculation_over_an_fp8_cache_equals_plain(name, depth, fp8_engines):
    engine = fp8_engines(name)
    assert engine.mtp_drafter.cache.fp8  # the MTP head's own attention cache too
    assert_speculation_equals_plain(engine, depth)


@pytest.mark.parametrize("name", FAMILIES)
def test_an_fp8_cache_gives_these_fixtures_the_16_bit_replies(name, fp8_engines, engines):
    """e4m3 keeps 3 mantissa bits a value: on these fixtures no greedy choice moves over 40 tokens (measured).
    A cache that stored the wrong positions or scales would change them at once."""
    for messages in PROMPTS:
        prompt = engines(name).encode_chat(messages)
        ours, _, _ = decode(fp8_engines(name), prompt, depth=0, max_new_tokens=40)
        assert ours == decode(engines(name), prompt, depth=0, max_new_tokens=40)[0]


def test_chunked_prefill_and_graph_steps_over_an_fp8_cache_equal_whole_prefill_and_eager_steps():
    eager, graphs = load_fp8(DEMO), load_fp8(DEMO, cuda_graphs=True)
    prompt = eager.encode_chat(PROMPTS[0])
    whole, _, _ = decode(eager, prompt, depth=0, max_new_tokens=40)
    assert decode(eager, prompt, depth=0, max_new_tokens=40, prefill_chunk=5)[0] == whole
    for depth in (0, 3):
        tokens, _, fin = decode(graphs, prompt, depth=depth, max_new_tokens=40)
        assert tokens == whole
    assert_mtp_drafts_accepted_and_rejected(fin)
    report = graphs.diagnostics()["compile"]["cuda_graphs"]
    assert report["failure"] is None and report["decode"]["replays"]["1"] > 5 and report["cycle"]["replays"]["4"] > 5


def test_the_flag_reaches_every_load_and_the_diagnostics_say_so(ckpt, capsys, monkeypatch):
    import json

    from app.cli import main

    monkeypatch.setenv(KV_DTYPE_ENV, "auto")  # (main sets it for the loads: unset again after the test)
    code = main(["run", "--model", str(ckpt("next")), "--device", "cpu", "--kv-cache-dtype", "fp8", "--prompt", "hi",
                 "--max-new-tokens", "4", "--depth", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["diagnostics"]["backends"]["kv_cache"]["backend"] == "fp8"
    assert "lossy" in out["diagnostics"]["backends"]["kv_cache"]["reason"]


def test_a_bad_environment_value_is_refused_in_one_line(ckpt, monkeypatch):
    from engine import EngineError

    monkeypatch.setenv(KV_DTYPE_ENV, "int8")
    with pytest.raises(EngineError, match=f"^{KV_DTYPE_ENV} 'int8': expected one of auto, fp8$"):
        load_engine(str(ckpt("next")), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_over_an_fp8_cache_are_lossless_and_read_its_codes_in_the_kernel():
    """float32: the masked form over dequantized values, graphs against eager steps, exact. bf16 (compute
    capability 8.9 and up): the split-K kernel reads the codes at every capacity, and speculation in graphs
    gives plain decoding's tokens."""
    eager, graphs = (load_fp8(DEMO, device="cuda", dtype="float32", cuda_graphs=g) for g in (False, True))
    prompt = eager.encode_chat(PROMPTS[0])
    plain, _, _ = decode(eager, prompt, depth=0, max_new_tokens=40)
    for depth in (0, 3):
        assert decode(graphs, prompt, depth=depth, max_new_tokens=40)[0] == plain
    if torch.cuda.get_device_capability() < (8, 9):
        return
    bf16 = load_fp8(DEMO, device="cuda", dtype="bfloat16", cuda_graphs=True)
    assert bf16.trunk.backends.decode_attention == "triton", bf16.trunk.backends.choice["decode_attention"]
    plain, _, _ = decode(bf16, prompt, depth=0, max_new_tokens=40)
    spec, _, fin = decode(bf16, prompt, depth=3, max_new_tokens=40)
    assert spec == plain
    assert_mtp_drafts_accepted_and_rejected(fin)

