"""FP8 MoE experts (Qwen's per-expert block-128 layout) stay FP8 in memory (fp8.FP8Experts): on the CPU in float32
the engine decodes like transformers on the exactly-dequantized twin, at decode widths and through a long prefill,
and speculation equals plain decoding; the Triton FP8 expert kernels match moe_rowwise (Triton's interpreter on the
CPU under TRITON_INTERPRET=1, else CUDA); discovery sizes quantized MoE checkpoints as they load."""

from pathlib import Path

import pytest
import torch

from engine import fp8, int4, load_engine
from engine.discovery import SAFETENSORS_DTYPES, _numel, estimate_memory, inspect_model
from engine.environment import DeviceInfo
from engine.model import MOE_ROWWISE_MAX_TOKENS, load, moe_grouped, moe_rowwise
from fixtures import _split_experts, memo, write_checkpoint, write_fp8_checkpoint
from test_exactness import PROMPTS, assert_greedy_equals_transformers, assert_speculation_equals_plain, decode

# name -> (family, options). next_moe: I = 32, H = 64: one partial block per matrix, and gate / up keep a scale
# row each (their concatenation is not whole blocks). q35_moe: the wrapped Qwen3.5-MoE layout (vision tower) with
# I = 128 as Qwen's releases have it (512 / 768): gate / up concatenate in whole blocks, the shared expert too.
FIXTURES = {
    "next_moe": ("qwen3_next", {"moe": True, "per_expert": True, "seed": 3}),
    "q35_moe": ("qwen3_5_moe", {"per_expert": True, "seed": 5, "moe_intermediate_size": 128,
                                "shared_expert_intermediate_size": 128}),
}
BIG_CPU = DeviceInfo(kind="cpu", name="roomy", total_bytes=1 << 40, free_bytes=1 << 40)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """fp8_ckpt(name) -> (FP8 checkpoint, its dequantized float32 twin), written once per module."""
    def write(name):
        family, opts = FIXTURES[name]
        root = tmp_path_factory.mktemp(f"fp8_{name}")
        src = write_checkpoint(root / "src", family, **opts)
        _split_experts(src)  # the MTP head's experts too, one by one, as in Qwen's releases
        return write_fp8_checkpoint(src, root / "fp8", root / "twin")

    return memo(write)


@pytest.fixture(scope="module")
def fp8_engine(fp8_ckpt):
    return memo(lambda name: load_engine(str(fp8_ckpt(name)[0]), device="cpu"))


def moe_blocks(engine):
    """The MoE blocks of the trunk and of the MTP head."""
    layers = list(engine.trunk.layers) + list(engine.mtp_drafter.head.layers)
    return [l.mlp for l in layers if hasattr(l.mlp, "experts")]


@pytest.mark.parametrize("name", list(FIXTURES))
def test_fp8_moe_greedy_equals_transformers_on_the_dequantized_twin(name, fp8_ckpt, fp8_engine):
    assert_greedy_equals_transformers(fp8_engine(name), fp8_ckpt(name)[1])  # decode widths: moe_rowwise


@pytest.mark.parametrize("name", list(FIXTURES))
def test_a_long_prefill_through_the_fp8_experts_equals_the_twin(name, fp8_ckpt, fp8_engine):
    """Chunks wider than MOE_ROWWISE_MAX_TOKENS run the block's own forward, so FP8Experts.forward: it computes
    what transformers' experts loop computes on the dequantized weights, bit for bit, and the engine decodes
    what it decodes from the twin."""
    assert_experts_forward_equals_the_twin(fp8_engine(name), load_engine(str(fp8_ckpt(name)[1]), device="cpu"), fp8.FP8Experts)


def assert_experts_forward_equals_the_twin(engine, twin, kind) -> None:
    """The first MoE block's quantized experts (kind) against the twin's dequantized ones, bit for bit, on 40 rows
    routed to 2 experts each; then a prompt longer than the row-wise path's widest decodes as the twin's."""
    ours, plain = moe_blocks(engine)[0].experts, moe_blocks(twin)[0].experts
    assert isinstance(ours, kind) and type(plain) is not kind and plain.gate_up_proj.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, ours.hidden_dim, generator=g)
    idx = torch.stack([torch.randperm(ours.num_experts, generator=g)[:2] for _ in range(40)])
    w = torch.rand(40, 2, generator=g)
    assert torch.equal(ours(h, idx, w), plain(h, idx, w))
    long = [{"role": "user", "content": "Tell me a story about a cat who liked to sleep in the sun. " * 3}]
    prompt = engine.encode_chat(long)
    assert len(prompt) > MOE_ROWWISE_MAX_TOKENS
    assert decode(engine, prompt, depth=0, prefill_chunk=4096)[0] == decode(twin, prompt, depth=0,
                                                                              prefill_chunk=4096)[0]


@pytest.mark.parametrize("name", list(FIXTURES))
def test_fp8_experts_are_fp8_in_memory(name, fp8_ckpt, fp8_engine):
    engine = fp8_engine(name)
    blocks = moe_blocks(engine)
    assert len(blocks) > 1  # the trunk's and the MTP head's
    for block in blocks:
        ex = block.experts
        assert isinstance(ex, fp8.FP8Experts)
        E, I, H = ex.num_experts, ex.intermediate_dim, ex.hidden_dim
        rows, cols = -(-I // 128), -(-H // 128)
        assert ex.gate_up_proj.dtype == ex.down_proj.dtype == torch.float8_e4m3fn
        assert ex.gate_up_proj.nbytes == E * 2 * I * H and ex.down_proj.nbytes == E * H * I  # 1 byte a weight
        assert ex.gate_up_proj_scale_inv.dtype == ex.down_proj_scale_inv.dtype == torch.float32
        assert ex.gate_up_proj_scale_inv.shape == (E, 2 * rows, cols)  # gate's block rows, then up's
        assert ex.down_proj_scale_inv.shape == (E, cols, rows)
        held = sum(t.nbytes for t in ex.state_dict().values())  # nothing else: no dequantized copy
        assert held == 3 * E * I * H + 4 * E * 3 * rows * cols
        assert isinstance(block.shared_expert.down_proj, fp8.FP8Linear)
    # the same parameters as the dequantized model (FP8 weights count as weights; scales do not)
    assert engine.loaded.params == load(str(fp8_ckpt(name)[1])).params


def test_the_shared_expert_fuses_in_whole_blocks(fp8_engine):
    """I = 128: the FP8 shared expert's gate / up are one weight, whose scale layout is FP8Experts' (moe_triton
    then runs it inside its kernels)."""
    from engine.moe_triton import inline_shared

    block = moe_blocks(fp8_engine("q35_moe"))[0]
    assert block.shared_expert.fused_weight.dtype == torch.float8_e4m3fn
    assert inline_shared(block)
    assert not inline_shared(moe_blocks(fp8_engine("next_moe"))[0])  # 48 shared rows: not whole blocks


@pytest.mark.parametrize("name", list(FIXTURES))
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_fp8_moe_speculation_equals_plain(name, depth, fp8_engine):
    assert_speculation_equals_plain(fp8_engine(name), depth)


def test_rowwise_dequantizes_exactly_and_grouped_refuses_fp8(fp8_engine):
    """moe_rowwise dequantizes only the routed experts, exactly: FP8Experts.dense equals the whole stack
    dequantized one matrix at a time (gate and up with their own scale rows); grouped GEMMs do not read FP8."""
    ex = moe_blocks(fp8_engine("next_moe"))[0].experts
    ids = torch.tensor([2, 0, 2])
    gate_up, down = ex.dense(ids, torch.float32)
    I, rows = ex.intermediate_dim, ex.gate_up_proj_scale_inv.shape[1] // 2
    for p, e in enumerate(ids.tolist()):
        w, s = ex.gate_up_proj[e], ex.gate_up_proj_scale_inv[e]
        assert torch.equal(gate_up[p, :I], fp8.dequantize(w[:I], s[:rows], torch.float32))
        assert torch.equal(gate_up[p, I:], fp8.dequantize(w[I:], s[rows:], torch.float32))
        assert torch.equal(down[p], fp8.dequantize(ex.down_proj[e], ex.down_proj_scale_inv[e], torch.float32))
    block = moe_blocks(fp8_engine("next_moe"))[0]
    with pytest.raises(ValueError, match="FP8"):
        moe_grouped(block, torch.randn(1, 2, ex.hidden_dim))


@pytest.mark.parametrize("edit, says", [
    (lambda t, k: t.pop(k + ".weight_scale_inv"), "FP8 tensor '{k}.weight' has no '{k}.weight_scale_inv'"),
    (lambda t, k: t.__setitem__(k + ".weight_scale_inv", torch.ones(1, 2)),
     "tensor '{k}.weight_scale_inv' has shape (1, 2); FP8 weight '{k}.weight' (64, 32) in 128x128 blocks needs (1, 1)"),
])
def test_a_bad_expert_scale_is_one_line(edit, says, fp8_ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.errors import EngineError

    path = tmp_path / "bad"
    shutil.copytree(fp8_ckpt("next_moe")[0], path)
    key = "model.layers.1.mlp.experts.2.down_proj"
    f = next(f for f in path.glob("*.safetensors") if key + ".weight" in load_file(f))
    tensors = load_file(f)
    edit(tensors, key)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(EngineError) as e:
        load(str(path))
    assert says.format(k=key) in str(e.value) and "\n" not in str(e.value)


# --- the Triton FP8 expert kernels ---------------------------------------------------------------------------

SMALL = dict(hidden_size=200, num_experts=16, moe_intermediate_size=96, num_experts_per_tok=4)  # partial blocks
BLOCKS = dict(hidden_size=256, num_experts=8, moe_intermediate_size=256, num_experts_per_tok=3)  # whole blocks


def fp8_block(shape: dict, dtype, device, inline: bool, seed: int = 0):
    """A random Qwen3-Next MoE block whose experts are FP8Experts; inline: the shared expert FP8 too, its gate /
    up fused (fusion.py), so that it runs inside the kernels."""
    from engine.fusion import fuse_layer
    from test_moe_triton import moe_block

    block = moe_block(shape, dtype, device, seed)
    assert fp8.quantize_experts(block) == 1
    layer = torch.nn.Module()
    layer.mlp = block  # (so that the router and the shared gate keep their names: not quantized)
    if inline:
        fp8.quantize_linears(layer)
        fuse_layer(layer)
    return block


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("shape, inline, dtype, tol", [
    (SMALL, False, torch.float32, 1e-5),
    (BLOCKS, True, torch.float32, 1e-5),
    (BLOCKS, True, torch.bfloat16, 2e-2),
])
@pytest.mark.parametrize("n", [1, 3])
def test_fp8_expert_kernels_match_rowwise(device, shape, inline, dtype, tol, n):
    from engine.moe_triton import inline_shared, moe_triton

    block = fp8_block(shape, dtype, device, inline)
    assert isinstance(block.experts, fp8.FP8Experts) and inline_shared(block) == inline
    x = torch.randn(1, n, shape["hidden_size"], generator=torch.Generator(device).manual_seed(n), device=device)
    x = x.to(dtype)
    with torch.inference_mode():
        err = rel_err(moe_triton(block, x), moe_rowwise(block, x))
    assert err < tol


@pytest.mark.gpu
@pytest.mark.parametrize("down", [None, ("split", 16, 512, 2)])
def test_fp8_expert_rows_do_not_depend_on_the_batch(device, down, monkeypatch):
    """Bit for bit: a verify pass's rows equal decoding them one at a time (the shared expert inside), in the
    down kernel's form the tuner picks and in the split form (a program per pair, block scales per pair)."""
    import engine.moe_triton as moe_triton_module
    from engine.moe_triton import moe_experts

    if down:
        monkeypatch.setattr(moe_triton_module, "_chosen", {})
        monkeypatch.setattr(moe_triton_module, "DOWN_CONFIGS", [down])
    block = fp8_block(BLOCKS, torch.float32, device, inline=True)
    ex, shared = block.experts, block.shared_expert
    h = torch.randn(4, BLOCKS["hidden_size"], generator=torch.Generator(device).manual_seed(1), device=device)
    args = (ex.gate_up_proj, ex.down_proj, BLOCKS["num_experts_per_tok"], True, shared.fused_weight,
            shared.down_proj.weight, ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv, shared.fused_scale_inv,
            shared.down_proj.weight_scale_inv)
    with torch.inference_mode():
        logits = torch.nn.functional.linear(h, block.fused_weight)
        whole = moe_experts(h, logits, *args)
        assert rel_err(whole[None], moe_rowwise(block, h[None])) < 1e-5
        for i in range(h.shape[0]):
            assert torch.equal(moe_experts(h[i:i + 1], logits[i:i + 1], *args), whole[i:i + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_fp8_expert_kernels_pass_the_self_check_and_a_wrong_one_falls_back(fp8_ckpt, monkeypatch):
    path, _ = fp8_ckpt("q35_moe")
    assert_the_kernels_are_chosen_and_a_wrong_one_falls_back(path, "grouped_mm: FP8 experts", monkeypatch)


def assert_the_kernels_are_chosen_and_a_wrong_one_falls_back(path, grouped_reason: str, monkeypatch):
    """model.moe_check installs the Triton experts kernels for the quantized MoE checkpoint at `path` in bf16
    (after its self-check against moe_rowwise), speculation decodes through them inside CUDA graphs; a kernel that
    computes wrongly leaves moe_rowwise, with the reasons in the diagnostics."""
    from engine import GenerationSettings, model
    from engine.events import Tokens

    bf16 = load_engine(str(path), device="cuda", dtype="bfloat16")
    assert bf16.trunk.backends.moe == "triton", bf16.trunk.backends.choice.get("moe")
    prompt = bf16.encode_chat(PROMPTS[0])
    s = GenerationSettings(max_new_tokens=24, depth=3, ignore_eos=True)
    assert sum(len(e.token_ids) for e in bf16.generate(prompt, s) if isinstance(e, Tokens)) == 24
    assert bf16.diagnostics()["compile"]["cuda_graphs"]["failure"] is None
    monkeypatch.setitem(model.MOE_PATHS, "triton", lambda block, x: 2 * moe_rowwise(block, x))
    path_name, why = model.moe_check(bf16.trunk)
    assert path_name == "rowwise" and "triton self-check mismatch" in why and grouped_reason in why


# --- discovery sizes quantized MoE checkpoints as they load ----------------------------------------------------

def loaded_bytes(loaded) -> int:
    """Bytes the loaded model's tensors cover, overlaps once (fused weights and their parts' views share memory;
    on the CPU tensors may be slices of one mapped file, so storages are no measure)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for module in (loaded.trunk.lm, loaded.mtp)
                   for t in list(module.parameters()) + list(module.buffers()))
    total, end = 0, 0
    for a, b in spans:
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total


@pytest.fixture(scope="module")
def int4_moe(tmp_path_factory):
    """A GPTQ checkpoint of the Qwen3.5 MoE fixture, its experts quantized one by one (as Qwen3.5's MoE GPTQ
    releases): int4.py keeps them 4-bit (int4.Int4Experts)."""
    from int4_fixtures import gptq_config, write_int4_checkpoint

    root = tmp_path_factory.mktemp("int4_moe")
    src = write_checkpoint(root / "src", "qwen3_5_moe", per_expert=True, seed=3)
    _split_experts(src)  # the MTP head's experts too
    config = gptq_config(32, fmt="gptq_v2", dynamic={"-:.*attn.*": {}, "-:.*shared_expert.*": {}, "-:.*visual.*": {}})
    return write_int4_checkpoint(src, root / "q", root / "twin", config, ("attn", "shared_expert"))[0]


def not_loaded_bytes(path) -> int:
    """Bytes on disk of what the engine does not load (the vision tower) and the files' headers."""
    from engine.checkpoint import read_header

    total = 0
    for f in Path(path).glob("*.safetensors"):
        tensors, size = read_header(f)
        held = sum(_numel(shape) * SAFETENSORS_DTYPES[dt][1] for k, (dt, shape) in tensors.items() if "visual" not in k)
        total += size - held
    return total


def test_discovery_sizes_quantized_experts_as_they_load(int4_moe, fp8_ckpt, fp8_engine):
    """The estimate's weights (mem_bytes without the margin) are the loaded model's bytes plus what load leaves
    on disk (the vision tower, headers): for a 4-bit MoE (experts kept 4-bit: as on disk) and an FP8 one (experts
    FP8: as on disk)."""
    def weights(cand):
        _, mem = estimate_memory(cand, BIG_CPU)
        return (mem - 256 * 2 ** 20) / 1.10  # discovery's CPU margin taken off

    q = inspect_model(int4_moe)
    assert q.supported and q.quantization == "gptq", q.reason
    loaded = load(str(int4_moe))
    blocks = [l.mlp for layers in (loaded.trunk.layers, loaded.mtp.layers) for l in layers if hasattr(l.mlp, "experts")]
    assert all(isinstance(b.experts, int4.Int4Experts) for b in blocks)  # (int4.py: kept 4-bit)
    assert q.dequantized_params == 0
    truth = loaded_bytes(loaded) + not_loaded_bytes(int4_moe)
    assert abs(weights(q) - truth) < 0.01 * truth

    path = fp8_ckpt("q35_moe")[0]
    f = inspect_model(path)
    assert f.quantization == "fp8" and f.dequantized_params == 0
    truth = loaded_bytes(fp8_engine("q35_moe").loaded) + not_loaded_bytes(path)
    assert abs(weights(f) - truth) < 0.01 * truth
