"""Qwen's block-128 FP8 checkpoints, weight-only on the CPU in float32: the engine's output equals transformers
running the exactly-dequantized twin, plain and speculative; bad FP8 input is refused in one line."""

import json

import pytest
import torch

from engine import fp8, load_engine
from engine.errors import EngineError
from engine.model import load
from fixtures import damaged_copy, memo, write_checkpoint, write_fp8_checkpoint
from test_exactness import PROMPTS, assert_greedy_equals_transformers, assert_speculation_equals_plain, decode

# hidden 128, every projection's N a multiple of 128: whole blocks, the fused FP8 projections concatenate; GDN
# heads of 128 as in the real 80B-A3B, so in_proj_qkvz's parts are whole blocks too (gdn.keep_constants)
BLOCKS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
              layer_types=["linear_attention", "full_attention"])
# name -> (family, options): the tiny fixtures' dims (16..96) are below 128: one partial block per matrix
FP8_FIXTURES = {
    "next": ("qwen3_next", {}),
    "blocks": ("qwen3_next", {**BLOCKS, "seed": 2}),  # (seed 0: every depth-2 draft accepted)
    "next_moe": ("qwen3_next", {"moe": True, "per_expert": True, "seed": 3}),
    "q35": ("qwen3_5", {}),
}


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """fp8_ckpt(name) -> (FP8 checkpoint, its dequantized float32 twin), written once per module."""
    def write(name):
        family, opts = FP8_FIXTURES[name]
        root = tmp_path_factory.mktemp(f"fp8_{name}")
        return write_fp8_checkpoint(write_checkpoint(root / "src", family, **opts), root / "fp8", root / "twin")

    return memo(write)


@pytest.fixture(scope="module")
def fp8_engine(fp8_ckpt):
    return memo(lambda name: load_engine(str(fp8_ckpt(name)[0]), device="cpu"))


def test_dequantize_is_blockwise_with_partial_edge_blocks():
    w = torch.randn(200, 300)
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    d = fp8.dequantize(q, s, torch.float32)
    # element (150, 290) is in block (1, 2): its value is the stored e4m3 value times that block's scale
    assert d[150, 290] == q[150, 290].float() * s[1, 2]
    assert (d - w).abs().max() <= w.abs().max() / 8  # e4m3 has 3 mantissa bits: within 1/16 of the block max


@pytest.mark.parametrize("name", list(FP8_FIXTURES))
def test_fp8_greedy_equals_transformers_on_the_dequantized_twin(name, fp8_ckpt, fp8_engine):
    assert_greedy_equals_transformers(fp8_engine(name), fp8_ckpt(name)[1])


@pytest.mark.parametrize("name", list(FP8_FIXTURES))
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_fp8_mtp_speculation_equals_plain(name, depth, fp8_engine):
    assert_speculation_equals_plain(fp8_engine(name), depth)


def _layer(engine, kind):
    trunk = engine.trunk
    return next(l for l, k in zip(trunk.layers, trunk.kinds) if k == kind)


def test_fp8_weights_stay_fp8_and_whole_blocks_fuse(fp8_engine):
    small, blocks = fp8_engine("next"), fp8_engine("blocks")
    for engine in (small, blocks):
        attn = _layer(engine, "full_attention").self_attn
        assert isinstance(attn.q_proj, fp8.FP8Linear) and attn.q_proj.weight.dtype == torch.float8_e4m3fn
        assert isinstance(engine.mtp_drafter.head.fc, fp8.FP8Linear)  # the MTP head's linears are FP8 too
        gdn = _layer(engine, "linear_attention").linear_attn
        assert type(gdn.in_proj_ba) is torch.nn.Linear and gdn.in_proj_ba.weight.dtype == torch.float32
        assert engine.trunk.lm.lm_head.weight.dtype == torch.float32
    # whole blocks: q / k / v (256 + 128 + 128 rows) and gate / up are one FP8 weight with its scale rows
    attn, mlp = _layer(blocks, "full_attention").self_attn, _layer(blocks, "full_attention").mlp
    assert attn.fused_weight.dtype == torch.float8_e4m3fn and attn.fused_scale_inv.shape == (4, 1)
    assert attn.k_proj.weight_scale_inv.data_ptr() == attn.fused_scale_inv[2:3].data_ptr()
    assert mlp.fused_weight.dtype == torch.float8_e4m3fn
    # the tiny dims (k_proj: 32 rows) are not whole blocks: not fused
    assert not hasattr(_layer(small, "full_attention").self_attn, "fused_weight")
    # in_proj_qkvz's rows put in [q | k | v | z] order at load where its parts are whole 128-row blocks (their
    # scale rows move with them); the tiny dims' parts are not: gathered at run time
    assert not hasattr(_layer(blocks, "linear_attention").linear_attn, "qkvz_order")
    assert hasattr(_layer(small, "linear_attention").linear_attn, "qkvz_order")


def test_fp8_experts_stay_fp8(fp8_engine):
    engine = fp8_engine("next_moe")
    moe = next(l.mlp for l in engine.trunk.layers if hasattr(l.mlp, "experts"))
    assert isinstance(moe.experts, fp8.FP8Experts)  # per-expert FP8 stacked as FP8 (tests/test_fp8_moe.py)
    assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(moe.shared_expert.gate_proj, fp8.FP8Linear)
    assert type(moe.gate) is not fp8.FP8Linear and moe.gate.weight.dtype == torch.float32


def test_discovery_reports_the_fp8_bytes(fp8_ckpt):
    from engine.discovery import inspect_model

    path, twin = fp8_ckpt("blocks")
    q, plain = inspect_model(path), inspect_model(twin)
    assert q.supported and q.quantization == "fp8" and q.reason == "", q.reason
    assert plain.quantization is None
    assert q.disk_bytes < 0.6 * plain.disk_bytes  # FP8 linears: 1 byte a weight instead of 4


# --- bad input -----------------------------------------------------------------------------------------------

def _damaged(fp8_ckpt, tmp_path, edit_tensors=None, edit_config=None):
    return damaged_copy(fp8_ckpt("next")[0], tmp_path / "bad", edit_tensors, edit_config)


Q_PROJ = "model.layers.1.self_attn.q_proj"


def _refusal(path) -> str:
    with pytest.raises(EngineError) as e:
        load(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.pop(Q_PROJ + ".weight_scale_inv"),
     f"model.safetensors: FP8 tensor '{Q_PROJ}.weight' has no '{Q_PROJ}.weight_scale_inv'"),
    (lambda t: t.__setitem__(Q_PROJ + ".weight_scale_inv", torch.ones(2, 1)),
     f"tensor '{Q_PROJ}.weight_scale_inv' has shape (2, 1); FP8 weight '{Q_PROJ}.weight' (128, 64) in 128x128 "
     f"blocks needs (1, 1)"),
    (lambda t: t.__setitem__(Q_PROJ + ".weight", t[Q_PROJ + ".weight"].float().to(torch.float8_e5m2)),
     f"tensor '{Q_PROJ}.weight' is F8_E5M2; config.json's fp8 quantization_config says e4m3"),
])
def test_bad_fp8_tensors_are_one_line(edit, says, fp8_ckpt, tmp_path):
    assert says in _refusal(_damaged(fp8_ckpt, tmp_path, edit_tensors=edit))


@pytest.mark.parametrize("edit, says", [
    (lambda q: q.__setitem__("fmt", "e5m2"), "quantization_config fp8 fmt 'e5m2' is not supported (only 'e4m3')"),
    (lambda q: q.__setitem__("weight_block_size", [64, 64]),
     "quantization_config fp8 weight_block_size [64, 64] is not supported (only [128, 128])"),
    (lambda q: q.pop("weight_block_size"), "quantization_config fp8 has no weight_block_size (per-tensor FP8)"),
    (lambda q: q.__setitem__("quant_method", "fp8_blockwise"),
     "quantization_config quant_method 'fp8_blockwise' is not supported yet"),
])
def test_bad_fp8_configs_are_one_line_for_load_and_discovery(edit, says, fp8_ckpt, tmp_path):
    from engine.discovery import inspect_model

    path = _damaged(fp8_ckpt, tmp_path, edit_config=edit)
    assert f"config.json: {says}" in _refusal(path)
    c = inspect_model(path)
    assert not c.supported and says in c.reason


def test_a_bad_mtp_scale_falls_back_to_plain_decoding(fp8_ckpt, tmp_path):
    path = _damaged(fp8_ckpt, tmp_path, edit_tensors=lambda t: t.__setitem__("mtp.fc.weight_scale_inv",
                                                                             torch.ones(3, 3)))
    loaded = load(str(path))
    assert loaded.mtp is None
    assert any("tensor 'mtp.fc.weight_scale_inv' has shape (3, 3)" in f.reason for f in loaded.fallbacks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bf16_the_fp8_kernel_serves_every_fp8_matmul_inside_the_graphs(fp8_ckpt):
    """The Triton W8A16 kernel is chosen after its self-check, serves the fused projections and the MTP head too,
    and gives the dequantizing path's logits; float32 keeps the exact dequantizing path (it equals the CPU)."""
    from engine import GenerationSettings
    from engine.events import Tokens

    path, _ = fp8_ckpt("blocks")
    bf16 = load_engine(str(path), device="cuda", dtype="bfloat16")
    assert bf16.trunk.backends.choice["fp8_linear"][0] == "triton", bf16.trunk.backends.choice["fp8_linear"]
    fused = [m for m in bf16.trunk.lm.modules() if getattr(m, "fused_scale_inv", None) is not None]
    assert fused and all(m.fp8_kernel is not None for m in fused)
    assert bf16.mtp_drafter.head.fc.fp8_kernel is not None
    prompt = bf16.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        kernel = bf16.trunk.lm(ids).logits.float()
        kernels = [(m, m.fp8_kernel) for m in bf16.trunk.lm.modules() if getattr(m, "fp8_kernel", None)]
        for m, _ in kernels:
            m.fp8_kernel = None
        reference = bf16.trunk.lm(ids).logits.float()
        for m, k in kernels:
            m.fp8_kernel = k
    assert ((kernel - reference).abs().max() / reference.abs().max()).item() < 2e-2
    s = GenerationSettings(max_new_tokens=24, depth=3, ignore_eos=True)
    assert sum(len(e.token_ids) for e in bf16.generate(prompt, s) if isinstance(e, Tokens)) == 24
    assert bf16.diagnostics()["compile"]["cuda_graphs"]["failure"] is None
    f32 = load_engine(str(path), device="cuda", dtype="float32")
    assert f32.trunk.backends.choice["fp8_linear"][0] == "dequantize"


# --- tensor parallelism over an FP8 checkpoint: each rank reads its rows / columns and their 128-block scales ---

TP_BLOCKS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                 linear_value_head_dim=128, layer_types=["linear_attention", "full_attention"])


def _tp_rank(args, group) -> int:
    """One rank of a --tp 2 world on the CPU: plain and MTP speculation over the sharded FP8 checkpoint."""
    import json as _json
    from pathlib import Path

    from engine import GenerationSettings
    from engine.events import Tokens

    engine = load_engine(args["path"], tp=group)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    out = {"fp8": sum(p.numel() for p in engine.trunk.lm.parameters() if p.dtype == torch.float8_e4m3fn)}
    for depth in (0, 2):
        s = GenerationSettings(max_new_tokens=16, depth=depth, ignore_eos=True, reuse=False)
        events = list(engine.generate(prompt, s))
        out[str(depth)] = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
        out[f"drafted{depth}"] = events[-1].stats["drafted"]
    Path(args["out"], f"rank{group.rank}.json").write_text(_json.dumps(out))
    return 0


def test_tp2_over_an_fp8_checkpoint_decodes_what_one_device_decodes(tmp_path):
    from engine import GenerationSettings
    from engine.events import Tokens
    from engine.tp import launch

    src = write_checkpoint(tmp_path / "src", "qwen3_next", seed=9, **TP_BLOCKS)
    path, _ = write_fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "twin")
    single = load_engine(str(path))
    prompt = single.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    want = [t for e in single.generate(prompt, GenerationSettings(max_new_tokens=16, depth=0, ignore_eos=True,
                                                                  reuse=False))
            if isinstance(e, Tokens) for t in e.token_ids]
    whole = sum(p.numel() for p in single.trunk.lm.parameters() if p.dtype == torch.float8_e4m3fn)
    assert launch(_tp_rank, {"path": str(path), "out": str(tmp_path)}, 2, "cpu", timeout_s=120) == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for got in ranks:
        assert got["0"] == want and got["2"] == want and got["drafted2"] > 0
        assert 0 < got["fp8"] < whole  # each rank holds a shard of the FP8 weights, still FP8


def test_tp_over_fp8_weights_whose_shards_split_a_block_is_one_line(fp8_ckpt):
    """The tiny fixtures' 16..96-row weights fit one 128-block: two ranks cannot each hold half a scale."""
    from engine.tp import launch

    with pytest.raises(EngineError, match="not whole 128-blocks"):
        launch(_tp_rank, {"path": str(fp8_ckpt("next")[0]), "out": "/nonexistent"}, 2, "cpu", timeout_s=120)


@pytest.mark.parametrize("name", ["next", "next_moe", "q35"])
def test_a_16_bit_checkpoint_quantized_at_load_decodes_as_its_fp8_release(name, fp8_ckpt, fp8_engine):
    """load(quantize="fp8") (bench --precision --quant fp8's twin) quantizes what Qwen's FP8 releases quantize,
    as they do: the engine decodes, plain and with its MTP head, exactly as it decodes the FP8 checkpoint written
    from the same 16-bit one (per-expert experts included)."""
    release = fp8_engine(name)
    twin = load_engine(str(fp8_ckpt(name)[0].parent / "src"), device="cpu", dtype="float32", quantize="fp8")
    assert twin.mtp_drafter is not None
    assert sum(isinstance(m, fp8.FP8Linear) for m in twin.trunk.lm.modules()) == \
        sum(isinstance(m, fp8.FP8Linear) for m in release.trunk.lm.modules()) > 0
    prompt = release.encode_chat(PROMPTS[0])
    for depth in (0, 3):
        assert decode(twin, prompt, depth=depth)[0] == decode(release, prompt, depth=depth)[0]


def test_quantizing_an_fp8_checkpoint_again_is_refused_in_one_line(fp8_ckpt):
    with pytest.raises(EngineError, match="takes a 16-bit checkpoint") as e:
        load(str(fp8_ckpt("next")[0]), device="cpu", quantize="fp8")
    assert "\n" not in str(e.value)


def test_bench_precision_sets_the_fp8_twin_beside_the_checkpoint(fp8_ckpt, capsys):
    from app.cli import main

    src = str(fp8_ckpt("next")[0].parent / "src")
    assert main(["bench", "--precision", "--quant", "fp8", "--model", src, "--depths", "3", "--max-new-tokens", "8",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["precision"]
    exact = report["float32"]
    assert exact["identical_share"] == 1.0 and exact["runs"] == 16  # the FP8 twin's speculation: lossless
    twin = exact["vs_checkpoint"]
    assert twin["speculative_identical_share"] == 1.0 and 0.0 <= twin["plain_identical_share"] <= 1.0
    assert 0.0 <= exact["mtp_acceptance"] <= 1.0 and 0.0 <= twin["mtp_acceptance"] <= 1.0
