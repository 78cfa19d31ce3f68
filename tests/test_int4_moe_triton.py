"""The W4A16 routed-expert kernels (engine/int4_moe_triton.py) against moe_rowwise, whose 4-bit experts
(int4.Int4Experts) are dequantized exactly in float32: random Qwen3-Next MoE blocks whose experts are quantized
GPTQ-style (tests/int4_fixtures.py's quantizer and packers), over expert counts, top-k, group sizes 16 / 32 / 64 /
128 / -1, act-order on and off, sym and asym zeros, 1 to 5 rows; a row's result alone equals it in the batch.

GPU tests (test_moe_triton.py's pattern): CUDA with Triton, or the CPU through Triton's interpreter under
TRITON_INTERPRET=1 with Triton installed; else they skip."""

import pytest
import torch

from engine import int4
from engine.model import moe_rowwise
from int4_fixtures import gptq_config, pack_along_k, pack_along_n, quantize
from test_int4 import int4_ckpt, sources  # noqa: F401 (fixtures: the 4-bit MoE checkpoints)
from test_fp8_moe import assert_the_kernels_are_chosen_and_a_wrong_one_falls_back
from test_moe_triton import assert_captured_replays_follow_their_input, moe_block, rel_err, rows

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def int4_block(shape: dict, group_size: int, sym: bool, act: bool, device, dtype=torch.float32, seed: int = 0):
    """A random Qwen3-Next MoE block (test_moe_triton.moe_block, built in dtype on the CPU) whose experts are
    quantized per expert and projection, read as a GPTQ v2 checkpoint reads (int4.read_packed) and stacked into an
    Int4Experts; act: every expert's gate, up and down quantized in its own random row order (desc_act)."""
    block = moe_block(shape, dtype, torch.device("cpu"), seed)
    ex, inter = block.experts, shape["moe_intermediate_size"]
    sch = int4.scheme(gptq_config(group_size, sym=sym, desc_act=act, fmt="gptq_v2"))
    g = torch.Generator().manual_seed(seed)

    def packed(w):
        perm = torch.randperm(w.shape[1], generator=g) if act else None
        q, zeros, scales, g_idx = quantize(w, group_size, sym, perm)
        parts = {"qweight": pack_along_k(q), "qzeros": pack_along_n(zeros), "scales": scales, "g_idx": g_idx}
        return int4.read_packed(sch, "x", parts, lambda part: "f")

    with torch.no_grad():
        gates = [packed(ex.gate_up_proj[e, :inter]) for e in range(ex.gate_up_proj.shape[0])]
        ups = [packed(ex.gate_up_proj[e, inter:]) for e in range(ex.gate_up_proj.shape[0])]
        downs = [packed(ex.down_proj[e]) for e in range(ex.down_proj.shape[0])]
    block.experts = int4.Int4Experts.stack(ex.act_fn, gates, ups, downs)
    assert (block.experts.gate_up_perm is not None) == act
    return block.to(device)  # (no dtype cast after: it would cast the float16 scales)


def moe_shape(E, k, H, I):
    return dict(hidden_size=H, num_experts=E, moe_intermediate_size=I, num_experts_per_tok=k)


# (experts, top-k, H, I, group size, sym, act-order, rows): masked column tails (I = 48, H = 144 against 32-column
# blocks), a group's K-blocks partly past K (I = 96 in groups of 64), every expert routed (k = E), one group (-1)
CASES = [
    (16, 4, 160, 96, 32, False, True, 1),
    (16, 4, 160, 96, 32, False, True, 3),
    (8, 2, 144, 48, 16, True, False, 5),
    (8, 3, 192, 96, 64, False, False, 2),
    (4, 1, 256, 128, 128, True, True, 4),
    (6, 6, 128, 64, -1, False, False, 1),  # (act-order has nothing to sort in one group)
]


@gpu
@pytest.mark.parametrize("E, k, H, I, group, sym, act, n", CASES)
def test_the_kernels_equal_the_dequantized_reference(device, E, k, H, I, group, sym, act, n):
    """float32: the kernels' weights are the exact dequantization, so only the sums' order differs."""
    from engine.moe_triton import inline_shared, moe_triton, unreadable

    block = int4_block(moe_shape(E, k, H, I), group, sym, act, device)
    assert unreadable(block.experts) is None and not inline_shared(block)
    x = rows(block, n, seed=n)
    with torch.inference_mode():
        err = rel_err(moe_triton(block, x), moe_rowwise(block, x))
    assert err < 1e-5


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_match_rowwise(device, dtype):
    """As the engine installs them: 16-bit rows, against moe_rowwise's experts dequantized, then rounded."""
    from engine.moe_triton import moe_triton

    block = int4_block(moe_shape(8, 3, 256, 128), 128, False, True, device, dtype)
    x = rows(block, 3)
    with torch.inference_mode():
        y = moe_triton(block, x)
        assert y.dtype == dtype
        assert rel_err(y, moe_rowwise(block, x)) < 2e-2


@gpu
@pytest.mark.parametrize("act", [False, True])
def test_routed_rows_do_not_depend_on_the_batch(device, act):
    """Bit for bit: a verify pass's rows equal decoding them one at a time."""
    from engine.int4_moe_triton import routed

    block = int4_block(moe_shape(8, 2, 128, 64), 32, False, act, device, torch.bfloat16)
    h = rows(block, 5)[0]
    k = block.gate.top_k
    with torch.inference_mode():
        logits = torch.nn.functional.linear(h, block.gate.weight)
        whole = routed(h, logits, block.experts, k, True)
        for i in range(h.shape[0]):
            assert torch.equal(routed(h[i:i + 1], logits[i:i + 1], block.experts, k, True), whole[i:i + 1])


@gpu
def test_compiles_fullgraph(device):
    from engine.moe_triton import moe_triton

    block = int4_block(moe_shape(8, 2, 128, 64), 32, True, True, device, torch.bfloat16)
    x = rows(block, 2)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(lambda x: moe_triton(block, x), fullgraph=True, backend=backend)
    with torch.inference_mode():
        got, want = compiled(x), moe_triton(block, x)
    if backend == "aot_eager":
        assert torch.equal(got, want)
    else:  # inductor fuses the routing's softmax and renormalisation: bf16 rounding differs (H200: not bit-equal)
        assert rel_err(got, want) < 2e-2


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_capture_and_replay(device):
    assert_captured_replays_follow_their_input(int4_block(moe_shape(16, 4, 256, 128), 128, False, True, device,
                                                          torch.bfloat16))


def test_group_sizes_without_a_k_block_are_refused_with_the_reason():
    """Groups of 24 rows hold no 16..128 power-of-two K-block: moe_check's reason (no Triton needed to say so)."""
    from engine.moe_triton import unreadable

    block = int4_block(moe_shape(2, 1, 48, 48), 24, True, False, "cpu")
    assert unreadable(block.experts) == "triton: 4-bit experts' group sizes (24, 24) have no 16..128 power-of-two " \
                                        "K-block"


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_chooses_the_kernels_and_a_wrong_one_falls_back(int4_ckpt, monkeypatch):
    path, _ = int4_ckpt("q35_moe_act")
    assert_the_kernels_are_chosen_and_a_wrong_one_falls_back(path, "grouped_mm: 4-bit experts", monkeypatch)
