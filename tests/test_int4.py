"""4-bit GPTQ / AWQ checkpoints on the CPU in float32: the engine's output equals transformers running the
exactly-dequantized twin, plain and speculative; a missing MTP head decodes plainly or comes from another release
(--mtp-from); bad 4-bit input is refused in one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import int4, load_engine
from engine.errors import EngineError
from engine.model import load
from fixtures import _split_experts, damaged_copy, memo, write_checkpoint, write_fp8_checkpoint
from int4_fixtures import (awq_config, dequantize, gptq_config, pack_along_k, pack_along_n, quantize,
                           write_int4_checkpoint)
from test_exactness import PROMPTS, assert_greedy_equals_transformers, assert_speculation_equals_plain, decode
from test_fp8_moe import assert_experts_forward_equals_the_twin, moe_blocks

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"q35": ("qwen3_5", {}), "next": ("qwen3_next", {}),
           "q35_moe": ("qwen3_5_moe", {"per_expert": True, "seed": 3})}
# name -> (source, quantization_config, module substrings left in bf16, MTP head: int4 | bf16 | none)
INT4_FIXTURES = {
    # Qwen's -GPTQ-Int4 config (v1 zeros), one group per row at these dims (K < 128), the MTP head quantized
    "q35": ("q35", gptq_config(128), (), "int4"),
    # GPTQModel: gptq_v2, asym, act-order, group 32, the head left bf16 by a dynamic exclusion
    "q35_act": ("q35", gptq_config(32, sym=False, desc_act=True, fmt="gptq_v2",
                                   dynamic={"-:.*mtp.*": {}, "-:.*visual.*": {}}), (), "bf16"),
    "next": ("next", gptq_config(-1, desc_act=True), (), "int4"),
    # AutoAWQ (GEMM), the head in modules_to_not_convert
    "next_awq": ("next", awq_config(32, not_converted=["visual", "mtp"]), (), "bf16"),
    # MoE as Qwen3.5's MoE GPTQ releases: attention and the shared expert bf16, experts quantized one by one (the
    # MTP head's too); they stay 4-bit (int4.Int4Experts)
    "q35_moe": ("q35_moe", gptq_config(32, fmt="gptq_v2", dynamic={"-:.*attn.*": {}, "-:.*shared_expert.*": {},
                                                                   "-:.*visual.*": {}}),
                ("attn", "shared_expert"), "int4"),
    # the same with act-order: every expert's gate, up and down has its own row order
    "q35_moe_act": ("q35_moe", gptq_config(32, sym=False, desc_act=True, fmt="gptq_v2",
                                           dynamic={"-:.*attn.*": {}, "-:.*shared_expert.*": {}, "-:.*visual.*": {}}),
                    ("attn", "shared_expert"), "int4"),
    # a community AWQ release with the MTP head stripped
    "q35_awq_nomtp": ("q35", awq_config(64, not_converted=["visual"]), (), "none"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            family, opts = SOURCES[name]
            made[name] = write_checkpoint(tmp_path_factory.mktemp(f"src_{name}") / "src", family, **opts)
            if opts.get("per_expert"):
                _split_experts(made[name])  # the MTP head's experts too, one by one, as in Qwen's releases
        return made[name]

    return get


@pytest.fixture(scope="module")
def int4_ckpt(tmp_path_factory, sources):
    """int4_ckpt(name) -> (4-bit checkpoint, its dequantized float32 twin), written once per module."""
    def write(name):
        src, config, skip, mtp = INT4_FIXTURES[name]
        root = tmp_path_factory.mktemp(f"int4_{name}")
        return write_int4_checkpoint(sources(src), root / "q", root / "twin", json.loads(json.dumps(config)),
                                     skip=skip, mtp=mtp)

    return memo(write)


@pytest.fixture(scope="module")
def int4_engine(int4_ckpt):
    return memo(lambda name: load_engine(str(int4_ckpt(name)[0]), device="cpu"))


# --- the layouts -------------------------------------------------------------------------------------------------

def test_packed_words_follow_the_published_nibble_orders():
    # GPTQ v1, sym: zero 8 stored as 7 in every nibble: 0x77777777, the constant AutoGPTQ checkpoints carry
    assert pack_along_n(torch.full((1, 8), 7))[0, 0].item() == 0x77777777
    # AWQ: columns 1..8 of a word sit in nibbles [0, 2, 4, 6, 1, 3, 5, 7] order: nibbles hold 1 3 5 7 2 4 6 8
    word = pack_along_n(torch.arange(1, 9)[None], awq=True)[0, 0].item()
    assert word & 0xFFFFFFFF == 0x86427531
    assert int4.unpack_columns(torch.tensor([[word]], dtype=torch.int32), awq=True).tolist() == [list(range(1, 9))]
    # GPTQ qweight: input row 8i+j in bits 4j.. of word i
    q = torch.randint(0, 16, (24, 16))  # [N, K]
    assert torch.equal(int4.unpack_rows(pack_along_k(q)).long(), q.T)


@pytest.mark.parametrize("method, group_size, sym, act", [("gptq", 32, False, True), ("gptq", -1, True, False),
                                                          ("gptq", 48, True, True), ("awq", 32, False, False)])
def test_engine_dequantizes_the_packed_tensors_exactly(method, group_size, sym, act):
    w = torch.randn(40, 96)
    perm = torch.randperm(96) if act else None
    q, zeros, scales, g_idx = quantize(w, group_size, sym, perm, min_zero=1)
    ref = dequantize(q, zeros, scales, g_idx)
    assert (ref - w).abs().max() < 0.3 * w.abs().max()  # a 4-bit grid: coarse, not garbage
    if method == "gptq":
        conf = gptq_config(group_size, sym=sym, desc_act=act)  # v1: zeros stored minus 1
        parts = {"qweight": pack_along_k(q), "qzeros": pack_along_n(zeros - 1), "scales": scales, "g_idx": g_idx}
    else:
        conf = awq_config(group_size)
        parts = {"qweight": pack_along_n(q.T, awq=True), "qzeros": pack_along_n(zeros, awq=True), "scales": scales}
    packed = int4.read_packed(int4.scheme(conf), "x", parts, lambda part: "f.safetensors")
    assert (packed.perm is not None) == act
    assert torch.equal(packed.dequantized(torch.float32), ref)
    x = torch.randn(3, 96)
    lin = int4.Int4Linear(96, 40, packed.qweight, packed.zeros, packed.scales, packed.group_size, packed.perm)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, ref))


# --- the oracle --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(INT4_FIXTURES))
def test_int4_greedy_equals_transformers_on_the_dequantized_twin(name, int4_ckpt, int4_engine):
    assert_greedy_equals_transformers(int4_engine(name), int4_ckpt(name)[1])


@pytest.mark.parametrize("name, depth", [("q35_act", 1), ("q35_act", 2), ("q35_act", 3), ("q35_moe", 1),
                                         ("q35_moe", 2), ("q35_moe", 3), ("q35_moe", 4), ("q35_moe_act", 2),
                                         ("q35", 2), ("next", 2), ("next_awq", 3)])
def test_int4_mtp_speculation_equals_plain(name, depth, int4_engine):
    assert_speculation_equals_plain(int4_engine(name), depth)


def _layer(engine, kind):
    return next(l for l, k in zip(engine.trunk.layers, engine.trunk.kinds) if k == kind)


def test_packed_weights_stay_4_bit_where_the_checkpoint_has_them(int4_engine):
    q35, act, moe = int4_engine("q35"), int4_engine("q35_act"), int4_engine("q35_moe")
    for engine in (q35, act):
        attn, gdn = _layer(engine, "full_attention").self_attn, _layer(engine, "linear_attention").linear_attn
        assert isinstance(attn.q_proj, int4.Int4Linear) and attn.q_proj.qweight.dtype == torch.int32
        assert isinstance(gdn.in_proj_qkv, int4.Int4Linear)
        assert type(gdn.in_proj_b) is torch.nn.Linear  # left bf16 by the release: stays a plain Linear
        assert engine.trunk.lm.lm_head.weight.dtype == torch.float32
    assert act.trunk.lm.model.layers[0].mlp.down_proj.perm is not None  # act-order: rows sorted by group at load
    assert q35.trunk.lm.model.layers[0].mlp.down_proj.perm is None
    assert isinstance(q35.mtp_drafter.head.fc, int4.Int4Linear)  # the head quantized like the trunk
    assert type(act.mtp_drafter.head.fc) is torch.nn.Linear  # the head excluded: bf16 as stored
    block = next(l.mlp for l in moe.trunk.layers if hasattr(l.mlp, "experts"))
    assert type(block.shared_expert.gate_proj) is torch.nn.Linear
    # parameters count the 4-bit weights too: the same count as the dequantized model's
    assert q35.loaded.params == load(str(q35.loaded.path).replace("/q", "/twin")).params


@pytest.mark.parametrize("name", ["q35_moe", "q35_moe_act"])
def test_4_bit_experts_stay_4_bit_in_memory(name, int4_ckpt, int4_engine):
    engine, twin = int4_engine(name), load(str(int4_ckpt(name)[1]))
    blocks = moe_blocks(engine)
    assert len(blocks) > 1  # the trunk's and the MTP head's
    for block in blocks:
        ex = block.experts
        assert isinstance(ex, int4.Int4Experts)
        E, I, H = ex.num_experts, ex.intermediate_dim, ex.hidden_dim
        assert (E, I, H) == (4, 32, 64) and ex.group_sizes == (32, 32)
        assert ex.gate_up_qweight.dtype == ex.down_qweight.dtype == torch.int32
        assert ex.gate_up_zeros.dtype == ex.down_zeros.dtype == torch.uint8
        assert ex.gate_up_qweight.shape == (E, H // 8, 2 * I) and ex.down_qweight.shape == (E, I // 8, H)
        assert ex.gate_up_scales.shape == (E, H // 32, 2 * I) and ex.down_scales.shape == (E, I // 32, H)
        assert ex.gate_up_scales.dtype == torch.float16
        # half a byte a weight, plus a zero (1 byte) and a float16 scale per group of 32 and column
        assert ex.packed_bytes() == 3 * E * I * H // 2 + (1 + 2) * E * (H // 32 * 2 * I + I // 32 * H)
        assert ex.packed_bytes() == sum(t.nbytes for n, t in ex.named_buffers() if not n.endswith("perm"))
        assert (ex.gate_up_perm is not None) == name.endswith("_act")
        assert ex.down_perm is None  # K = I = 32, one group: any act-order sorts back to the input order
        assert not any(True for _ in ex.parameters())  # no dequantized copy
    # parameters count the 4-bit experts' weights too: the same count as the dequantized model's
    assert engine.loaded.params == twin.params
    # what dequantize-at-load held instead (float32 here): 8 bytes a weight against ~0.75
    plain = sum(b.experts.gate_up_proj.nbytes + b.experts.down_proj.nbytes for layers in (twin.trunk.layers,
                twin.mtp.layers) for b in (l.mlp for l in layers) if hasattr(b, "experts"))
    packed = sum(b.experts.packed_bytes() for b in blocks)
    assert int4.packed_bytes(engine.trunk.lm) + int4.packed_bytes(engine.mtp_drafter.head) >= packed
    assert packed < plain / 5


def _random_experts(E=3, I=32, H=48, gs=16):
    """An Int4Experts of random act-order experts (expert 1 in the input order) and each one's Packed."""
    g = torch.Generator().manual_seed(1)
    sch = int4.scheme(gptq_config(gs, sym=False, desc_act=True, fmt="gptq_v2"))
    packed = {}
    for e in range(E):
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            perm = torch.randperm(k, generator=g) if e != 1 else None  # expert 1 keeps the input order
            q, zeros, scales, g_idx = quantize(torch.randn(n, k, generator=g), gs, False, perm)
            parts = {"qweight": pack_along_k(q), "qzeros": pack_along_n(zeros), "scales": scales, "g_idx": g_idx}
            packed[e, proj] = int4.read_packed(sch, "x", parts, lambda part: "f")
            assert torch.equal(packed[e, proj].dequantized(torch.float32), dequantize(q, zeros, scales, g_idx))
    ex = int4.Int4Experts.stack(torch.nn.SiLU(), *([packed[e, p] for e in range(E)]
                                                   for p in ("gate_proj", "up_proj", "down_proj")))
    return ex, packed


def test_int4_experts_dense_equals_each_experts_dequantized_weight():
    """dense() gives each expert's gate / up / down exactly as read_packed's Packed.dequantized gives them, with
    act-order rows restored per expert and projection (gate and up in different orders)."""
    E, I, H = 3, 32, 48  # gate / up: 3 groups of 16 over H; down: 2 over I
    ex, packed = _random_experts(E, I, H, 16)
    assert ex.gate_up_perm.shape == (E, 2, H) and ex.down_perm.shape == (E, I)
    ids = torch.tensor([2, 0, 1, 2])
    gate_up, down = ex.dense(ids, torch.float32)
    assert gate_up.shape == (4, 2 * I, H) and down.shape == (4, H, I)
    for row, e in enumerate(ids.tolist()):
        want = torch.cat([packed[e, "gate_proj"].dequantized(torch.float32),
                          packed[e, "up_proj"].dequantized(torch.float32)])
        assert torch.equal(gate_up[row], want)
        assert torch.equal(down[row], packed[e, "down_proj"].dequantized(torch.float32))
    half = ex.dense(ids, torch.bfloat16)
    assert half[0].dtype == torch.bfloat16 and torch.equal(half[0], gate_up.to(torch.bfloat16))


def test_the_experts_dequantizing_kernel_equals_the_float32_path(triton_device):
    """On CUDA in 16-bit, dense() runs int4_triton's dequantizing kernel per routed expert (after choose()'s
    self-check): the same float32 products rounded once, so the same 16-bit weights as the CPU's path."""
    dev = triton_device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    ex, _ = _random_experts(4, 64, 128, 32)
    ids = torch.tensor([3, 1, 1, 0])
    want = ex.dense(ids, torch.float32)
    ex.to(dev)
    why = int4._choose_experts([ex], dev, dtype)
    assert why.startswith("Triton") and ex.kernel is not None, why
    got = ex.dense(ids.to(dev), dtype)
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.equal(g.cpu(), w.to(dtype))


def test_a_long_prefill_through_the_4_bit_experts_equals_the_twin(int4_ckpt, int4_engine):
    """Chunks wider than MOE_ROWWISE_MAX_TOKENS run the block's own forward, so Int4Experts.forward: what
    transformers' experts loop computes on the dequantized weights, bit for bit."""
    twin = load_engine(str(int4_ckpt("q35_moe_act")[1]), device="cpu")
    assert_experts_forward_equals_the_twin(int4_engine("q35_moe_act"), twin, int4.Int4Experts)


def test_4_bit_experts_take_the_row_wise_path_with_the_reason(int4_engine):
    from engine.model import moe_grouped
    from engine.moe_triton import unreadable

    engine = int4_engine("q35_moe")
    block = moe_blocks(engine)[0]
    assert unreadable(block.experts) is None  # int4_moe_triton.py's kernels read them (CUDA only: not here)
    with pytest.raises(ValueError, match="grouped_mm does not read 4-bit experts"):
        moe_grouped(block, torch.randn(1, 2, 64))
    assert engine.trunk.backends.moe == "rowwise"
    assert engine.trunk.backends.choice["int4_experts"][0] == "dequantize"  # (the CPU: no kernel)


def test_discovery_reports_the_packed_size(int4_ckpt):
    from engine.discovery import inspect_model

    path, twin = int4_ckpt("q35")
    q, plain = inspect_model(path), inspect_model(twin)
    assert q.supported and q.quantization == "gptq" and q.reason == "", q.reason
    assert q.dtype == "float32"  # the float tensors' dtype, not the int32 packing's
    assert q.params == plain.params  # a qweight element holds 8 weights; zeros / scales / g_idx are not weights
    assert q.disk_bytes < 0.75 * plain.disk_bytes  # the embeddings / lm_head stay float32 at these tiny dims


def test_discovery_sizes_4_bit_experts_as_packed(int4_ckpt):
    """The estimate's weights (mem_bytes without the margin) are the loaded model's bytes plus what load leaves on
    disk (the vision tower, headers): the experts stay 4-bit, so nothing is sized at the run dtype."""
    from engine.discovery import estimate_memory, inspect_model
    from test_fp8_moe import BIG_CPU, loaded_bytes, not_loaded_bytes

    path, twin = int4_ckpt("q35_moe")
    q = inspect_model(path)
    assert q.supported and q.quantization == "gptq", q.reason
    assert q.dequantized_params == 0 and q.dequantized_disk_bytes == 0
    # only an experts module mixing plain and 4-bit experts still loads dequantized (int4._install_experts)
    from engine.discovery import dequantized_at_load

    mixed = {"m.mlp.experts.0.gate_proj.qweight": ("I32", (8, 32)),
             "m.mlp.experts.0.gate_proj.scales": ("F16", (2, 32)),
             "m.mlp.experts.1.gate_proj.weight": ("F32", (32, 64)),  # (module m mixes; n is all 4-bit)
             "n.mlp.experts.0.up_proj.qweight": ("I32", (8, 32))}
    assert dequantized_at_load(mixed) == (8 * 32 * 4 + 2 * 32 * 2, 8 * 32 * 8)
    assert q.params == inspect_model(twin).params
    loaded = load(str(path), "cpu")
    truth = loaded_bytes(loaded) + not_loaded_bytes(path)
    _, mem = estimate_memory(q, BIG_CPU)
    weights = (mem - 256 * 2 ** 20) / 1.10  # discovery's CPU margin taken off
    assert abs(weights - truth) < 0.01 * truth


# --- a missing MTP head ------------------------------------------------------------------------------------------

def test_a_stripped_mtp_head_decodes_plainly_with_the_reason(int4_engine):
    engine = int4_engine("q35_awq_nomtp")
    assert engine.loaded.mtp is None
    reasons = [f.reason for f in engine.loaded.fallbacks if f.feature == "speculation"]
    assert any("no mtp.* tensors" in r and "--mtp-from" in r and "plain decoding" in r for r in reasons), reasons
    tokens, sources, fin = decode(engine, engine.encode_chat(PROMPTS[0]), depth=2, max_new_tokens=8)
    assert len(tokens) == 8 and "draft" not in sources
    assert any("--mtp-from" in f.reason for f in fin.fallbacks)


@pytest.mark.parametrize("release", ["bf16", "fp8"])
def test_mtp_from_another_release_drafts_and_speculation_equals_plain(release, int4_ckpt, sources, tmp_path):
    head = sources("q35")
    if release == "fp8":
        head = write_fp8_checkpoint(head, tmp_path / "fp8", tmp_path / "fp8_twin")[0]
    engine = load_engine(str(int4_ckpt("q35_awq_nomtp")[0]), mtp_from=str(head))
    assert engine.loaded.mtp is not None
    assert engine.trunk.backends.choice["mtp_head"][0] == "--mtp-from"
    assert not any(f.feature == "speculation" for f in engine.loaded.fallbacks)
    assert_speculation_equals_plain(engine, 2)


def test_mtp_from_a_release_that_does_not_fit_is_refused(int4_ckpt, sources, tmp_path):
    path = str(int4_ckpt("q35_awq_nomtp")[0])
    other = write_checkpoint(tmp_path / "wide", "qwen3_5", hidden_size=96, seed=5)
    with pytest.raises(EngineError) as e:
        load(path, mtp_from=str(other))
    assert "\n" not in str(e.value)
    assert f"--mtp-from {other}: MTP tensor 'mtp." in str(e.value) and "has shape" in str(e.value)
    with pytest.raises(EngineError, match="a qwen3_next model; this model is qwen3_5"):
        load(path, mtp_from=str(sources("next")))
    with pytest.raises(EngineError, match="no mtp.\\* tensors there"):
        load(path, mtp_from=path)


def test_mtp_from_on_the_command_line(int4_ckpt, sources, tmp_path):
    path, head = str(int4_ckpt("q35_awq_nomtp")[0]), str(sources("q35"))
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(tmp_path / "hub"), "MTPCHAT_HOME": str(tmp_path / "h"),
           "MTPCHAT_DISABLE_FLA": "1", "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "app.cli", "run", "--model", path, "--device", "cpu", "--prompt", "Tell me a story",
           "--max-new-tokens", "12", "--ignore-eos", "--depth", "2", "--json"]
    p = subprocess.run(run + ["--mtp-from", head], cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    out = json.loads(p.stdout)
    assert out["stats"]["drafter"] == "mtp" and out["stats"]["drafted"] > 0
    assert out["diagnostics"]["backends"]["mtp_head"]["backend"] == "--mtp-from"
    from app.cli import build_parser, check_model_folder  # what run / bench check before loading anything

    args = build_parser().parse_args(["run", "--model", path, "--prompt", "hi", "--mtp-from", str(tmp_path / "no")])
    with pytest.raises(EngineError, match=f"^--mtp-from {tmp_path / 'no'}: no such model folder$"):
        check_model_folder(args)


# --- bad input ---------------------------------------------------------------------------------------------------

def _damaged(int4_ckpt, tmp_path, name="q35", edit_tensors=None, edit_config=None):
    return damaged_copy(int4_ckpt(name)[0], tmp_path / "bad", edit_tensors, edit_config)


Q = "model.language_model.layers.1.self_attn.q_proj"  # q35: K 64, N 128 (query and gate), one group
DOWN = "model.language_model.layers.0.mlp.down_proj"  # q35_act: K 96 in groups of 32
EXPERT = "model.language_model.layers.0.mlp.experts.1.gate_proj"  # q35_moe: K 64 in groups of 32, N 32


def _refusal(path) -> str:
    with pytest.raises(EngineError) as e:
        load(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def _set(key, value):
    return lambda t: t.__setitem__(key, value(t) if callable(value) else value)


@pytest.mark.parametrize("name, edit, says", [
    ("q35", lambda t: t.pop(Q + ".qzeros"), f"4-bit tensor '{Q}.qweight' has no '{Q}.qzeros' beside it"),
    ("q35", _set(Q + ".scales", torch.ones(2, 128, dtype=torch.float16)),
     f"tensor '{Q}.scales' has shape (2, 128); qweight [K/8, N] = (8, 128) with group_size 128 needs (1, 128)"),
    ("q35", _set(Q + ".qzeros", torch.zeros(1, 15, dtype=torch.int32)), f"tensor '{Q}.qzeros' has shape (1, 15)"),
    ("q35", _set(Q + ".qweight", lambda t: t[Q + ".qweight"].float()),
     f"tensor '{Q}.qweight' is torch.float32; a packed 4-bit tensor is int32"),
    ("q35", _set(Q + ".qweight", lambda t: t[Q + ".qweight"][:, :120].contiguous()),
     f"tensor '{Q}.scales' has shape (1, 128); qweight [K/8, N] = (8, 120) with group_size 128 needs (1, 120)"),
    ("q35", lambda t: t.pop(Q + ".qweight"), f"tensor '{Q}.g_idx' has no '{Q}.qweight' beside it"),
    ("q35_act", _set(DOWN + ".g_idx", lambda t: torch.zeros(96, dtype=torch.int32)),
     f"tensor '{DOWN}.g_idx' does not split the 96 input rows into groups of 32"),
    ("q35_act", _set(DOWN + ".g_idx", lambda t: torch.full((96,), 7, dtype=torch.int32)),
     f"tensor '{DOWN}.g_idx' names groups outside 0..2"),
    ("q35_moe", _set(EXPERT + ".scales", torch.ones(3, 32, dtype=torch.float16)),
     f"tensor '{EXPERT}.scales' has shape (3, 32); qweight [K/8, N] = (8, 32) with group_size 32 needs (2, 32)"),
    ("q35_moe", lambda t: t.pop(EXPERT + ".qzeros"),
     f"4-bit tensor '{EXPERT}.qweight' has no '{EXPERT}.qzeros' beside it"),
    ("q35_moe", lambda t: [t.pop(EXPERT + "." + p) for p in ("qweight", "qzeros", "scales", "g_idx")],
     "layers.0.mlp.experts: expert 1 is incomplete in the checkpoint"),  # (fuse_experts: the model's name)
    ("q35_act", _set("mtp.fc.qweight", torch.zeros(32, 64, dtype=torch.int32)),
     "tensor 'mtp.fc.qweight' is 4-bit but config.json's dynamic '-:.*mtp.*' says the module is not quantized"),
])
def test_bad_int4_tensors_are_one_line(name, edit, says, int4_ckpt, tmp_path):
    assert says in _refusal(_damaged(int4_ckpt, tmp_path, name, edit_tensors=edit))


@pytest.mark.parametrize("edit, says", [
    (lambda q: q.__setitem__("bits", 8), "quantization_config gptq bits 8 is not supported (only 4-bit)"),
    (lambda q: q.__setitem__("group_size", 100), "quantization_config gptq group_size 100 is not supported"),
    (lambda q: q.__setitem__("checkpoint_format", "marlin"),
     "quantization_config gptq checkpoint_format 'marlin' is not supported (only 'gptq' or 'gptq_v2')"),
    (lambda q: q.__setitem__("desc_act", "yes"), "quantization_config gptq desc_act 'yes' is not true/false"),
    (lambda q: q.__setitem__("dynamic", {"+:.*mlp.*": {"bits": 8}}),
     "quantization_config gptq dynamic '+:.*mlp.*' sets bits 8 (only 4-bit)"),
    (lambda q: q.update(quant_method="awq", version="gemv"),
     "quantization_config awq version 'gemv' is not supported (only the GEMM layout)"),
    (lambda q: q.update(quant_method="awq", zero_point=False), "quantization_config awq zero_point false is not"),
    (lambda q: q.__setitem__("quant_method", "exl2"), "quantization_config quant_method 'exl2' is not supported yet"),
])
def test_bad_int4_configs_are_one_line_for_load_and_discovery(edit, says, int4_ckpt, tmp_path):
    from engine.discovery import inspect_model

    path = _damaged(int4_ckpt, tmp_path, edit_config=edit)
    assert f"config.json: {says}" in _refusal(path)
    c = inspect_model(path)
    assert not c.supported and says in c.reason


def test_mislabelled_and_unlabelled_4_bit_checkpoints_are_refused(int4_ckpt, tmp_path):
    from engine.discovery import inspect_model

    twin = tmp_path / "twin"
    shutil.copytree(int4_ckpt("q35")[1], twin)
    conf = json.loads((twin / "config.json").read_text())
    conf["quantization_config"] = gptq_config(128)
    (twin / "config.json").write_text(json.dumps(conf))
    says = "quantization_config says gptq but no tensor is 4-bit (no .qweight: a mislabelled checkpoint)"
    assert says in _refusal(twin) and says in inspect_model(twin).reason
    path = _damaged(int4_ckpt, tmp_path, edit_config=lambda q: q.clear())
    conf = json.loads((path / "config.json").read_text())
    del conf["quantization_config"]
    (path / "config.json").write_text(json.dumps(conf))
    says = "is a packed 4-bit tensor (GPTQ / AWQ) but config.json has no gptq or awq quantization_config"
    assert says in _refusal(path) and says in inspect_model(path).reason


def test_a_bad_mtp_tensor_falls_back_to_plain_decoding(int4_ckpt, tmp_path):
    path = _damaged(int4_ckpt, tmp_path, edit_tensors=_set("mtp.fc.scales", torch.ones(3, 64, dtype=torch.float16)))
    loaded = load(str(path))
    assert loaded.mtp is None
    assert any("tensor 'mtp.fc.scales' has shape (3, 64)" in f.reason and "plain decoding" in f.reason
               for f in loaded.fallbacks)


# --- the W4A16 Triton kernel (CUDA, or the CPU through Triton's interpreter; else skipped) -----------------------

@pytest.mark.parametrize("k, n, group_size, act, rows", [(256, 96, 32, False, 1), (256, 72, 128, True, 4),
                                                         (384, 64, -1, False, 16), (192, 40, 64, True, 5),
                                                         (256, 48, 64, False, 40), (128, 40, 128, True, 260),
                                                         (384, 48, -1, True, 1), (128, 264, 32, True, 260)])
def test_w4a16_kernel_equals_the_dequantized_reference(triton_device, k, n, group_size, act, rows, monkeypatch):
    from engine import int4_triton, splitk

    monkeypatch.setattr(splitk, "DEQUANTIZED_BYTES", 1)  # a long prefill's weight dequantized 128 columns at a time

    dev = triton_device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen)
    q, zeros, scales, g_idx = quantize(w, group_size, False, torch.randperm(k, generator=gen) if act else None)
    parts = {"qweight": pack_along_k(q), "qzeros": pack_along_n(zeros), "scales": scales, "g_idx": g_idx}
    p = int4.read_packed(int4.scheme(gptq_config(group_size, sym=False, desc_act=act, fmt="gptq_v2")), "x", parts,
                         lambda part: "f")
    lin = int4.Int4Linear(k, n, *(t.to(dev) if t is not None else None
                                  for t in (p.qweight, p.zeros, p.scales)), p.group_size,
                          p.perm.to(dev) if p.perm is not None else None)
    x = torch.randn(1, rows, k, generator=gen).to(dev, dtype)
    ref = x.float() @ dequantize(q, zeros, scales, g_idx).to(dev).T
    out = int4_triton.forward(lin, x)
    assert out.dtype == dtype and out.shape == (1, rows, n)
    assert (out.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    if rows <= int4_triton.MAX_ROWS:
        # rows do not depend on each other: under one configuration (each width bucket has its own, timed at
        # load) the first row alone rounds as it does in the batch, split into K slices or not
        xs = x[0] if lin.perm is None else x[0].index_select(1, lin.perm)
        kinds = ["dot"] + ["dot8"] * (int4_triton.block_k(group_size, k) == 128)  # (dot8: 128-row blocks)
        kinds += ["row"] * (rows == 1)
        choices = [(kind, c) for kind in kinds
                   for c in (int4_triton.CONFIGS[kind][0], (32, 1, 4, 2), (64, int4_triton.ALL, 4, 2))]
        for choice in choices:
            batch = int4_triton._launch(xs, lin.qweight, lin.zeros, lin.scales, lin.group_size, choice)
            alone = int4_triton._launch(xs[:1], lin.qweight, lin.zeros, lin.scales, lin.group_size, choice)
            assert torch.equal(alone, batch[:1]), choice
            assert (batch.float() - ref[0]).abs().max().item() < 2e-2 * ref.abs().max().item(), choice


def test_wide_inputs_meet_the_weight_a_block_of_columns_at_a_time(monkeypatch):
    from engine import splitk

    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen)
    asked = []

    def columns(start, end):
        asked.append((start, end))
        return w[start:end]

    assert torch.equal(splitk.linear_by_columns(x, 300, 64, columns), torch.nn.functional.linear(x, w))
    assert asked == [(0, 300)]  # under the byte budget: whole
    monkeypatch.setattr(splitk, "DEQUANTIZED_BYTES", 129 * 64 * 4)  # room for 129 columns: blocks of 128
    asked.clear()
    got = splitk.linear_by_columns(x, 300, 64, columns)
    assert asked == [(0, 128), (128, 256), (256, 300)]
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-6, atol=1e-5)


def test_4_bit_projections_that_read_one_input_are_fused(int4_engine):
    attn = _layer(int4_engine("q35_act"), "full_attention").self_attn  # act-order: q / k / v share no perm here
    assert not hasattr(attn, "int4_fused")
    attn = _layer(int4_engine("q35"), "full_attention").self_attn
    fused = attn.int4_fused
    assert attn.int4_fused_names == ("q_proj", "k_proj", "v_proj") and fused.out_features == 128 + 32 + 32
    assert attn.k_proj.qweight.data_ptr() == fused.qweight[:, 128:].data_ptr()  # the parts are views of it
    x = torch.randn(1, 3, 64)
    assert torch.equal(torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1), fused(x))


def test_a_gdn_mixing_4_bit_and_bf16_projections_fuses_each_kind(int4_engine):
    from engine.fusion import linears

    gdn = _layer(int4_engine("q35"), "linear_attention").linear_attn
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    assert gdn.int4_fused_names == names[:2] and gdn.fused_names == names[2:]  # two matmuls, not four
    assert gdn.in_proj_a.weight.data_ptr() == gdn.fused_weight[gdn.in_proj_b.out_features :].data_ptr()
    x = torch.randn(1, 3, gdn.in_proj_qkv.in_features)
    for got, want in zip(linears(gdn, names, x), [getattr(gdn, n)(x) for n in names], strict=True):
        assert torch.equal(got, want)


def test_quantize_linears_rounds_to_the_symmetric_grid():
    lin = torch.nn.Linear(256, 48, bias=False)
    model = torch.nn.Sequential(lin)
    assert int4.quantize_linears(model, 128) == 1
    q = model[0]
    assert isinstance(q, int4.Int4Linear) and q.qweight.shape == (32, 48) and q.scales.shape == (2, 48)
    err = (q.dequantized() - lin.weight).abs().view(48, 2, 128)
    # within half a step of the grid (a hair more where the float16 scale rounded down and the max clips at 7)
    assert (err <= q.scales.float().T[:, :, None] * 0.505).all()  # 7.5 steps * (1 + 2**-11) - 7


def test_bench_random_weights_int4(capsys):
    from app.cli import main

    code = main(["bench", "--random-weights", "tiny", "--quant", "int4", "--device", "cpu", "--depths", "0,2",
                 "--drafter", "oracle", "--acceptance", "1.0", "--max-new-tokens", "6", "--repeat", "1", "--no-hf",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    rows = {(r["depth"], r["drafter"]): r for r in out["results"]}
    assert rows[2, "oracle@1"]["identical_to_plain"] is True and rows[2, "oracle@1"]["acceptance_rate"] == 1.0
    assert out["backends"]["int4_linear"] == "dequantize"  # (the CPU: no kernel)
    bf16 = json.loads(_bench_json(capsys, "bf16"))
    # the 4-bit linears' packed bytes count: fewer bytes a token than the same preset's plain weights
    assert 0 < out["weight_bytes_per_token"] < bf16["weight_bytes_per_token"]


def _bench_json(capsys, quant):
    from app.cli import main

    main(["bench", "--random-weights", "tiny", "--quant", quant, "--device", "cpu", "--depths", "0",
          "--max-new-tokens", "2", "--repeat", "1", "--no-hf", "--json"])
    return capsys.readouterr().out


_PACKED = {"X": "*bf16", "QW": "*i32", "Z": "*u8", "S": "*bf16", "Y": "*bf16", "P": "*fp32", "LOCKS": "*i32"}


@pytest.mark.parametrize("kernel, constants, options", [
    ("_w4a16_row", {"KS": 4, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN": True, "STAGES": 1}, (2, 1)),
    ("_w4a16_row", {"KS": 16, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN": True, "STAGES": 3}, (2, 3)),  # (cp.async)
    ("_w4a16_row", {"KS": 8, "BLOCK_N": 32, "BLOCK_K": 32, "EVEN": False, "STAGES": 1}, (1, 1)),
    ("_w4a16_dot8", {"KS": 8, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "MAGIC": 0x4300, "BASE": 128.0}, (4, 3)),
    ("_w4a16", {"KS": 8, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, (4, 3)),
    ("_dequantize", {"BLOCK_N": 64, "BLOCK_K": 128}, (4, 3)),
])
def test_the_kernels_compile_for_a_gpu(kernel, constants, options):
    """Triton's interpreter never type-checks or lowers a kernel as the compiler does (tests/triton_front.py):
    each W4A16 form compiles for sm_90, PDL on where it takes it, without a GPU."""
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    pdl = {} if kernel == "_dequantize" else {"PDL": True}
    compile_for_gpu("engine.int4_triton", kernel, _PACKED | {"W": "*bf16"}, constants | pdl, num_warps=options[0],
                    num_stages=options[1])
