"""The Triton decode-width MoE (engine/moe_triton.py) against the row-wise reference, on a random
Qwen3NextSparseMoeBlock: bf16 at the Qwen3-Next-80B shape, float32 at a small one, the routed part's
batch invariance, torch.compile (fullgraph) and CUDA-graph capture.

GPU tests: they skip without CUDA and Triton. With TRITON_INTERPRET=1 and Triton importable they run on the CPU
through Triton's interpreter instead (slow: the 80B shape only at one row)."""


import pytest
import torch

import engine.moe_triton as moe_triton_module
from engine.model import moe_rowwise, route
from engine.moe_triton import moe_triton

gpu = pytest.mark.gpu

SHAPE_80B = dict(hidden_size=2048, num_experts=512, moe_intermediate_size=512, num_experts_per_tok=10)
SMALL = dict(hidden_size=200, num_experts=16, moe_intermediate_size=96, num_experts_per_tok=4)  # masked tails


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def moe_block(shape: dict, dtype, device, seed: int = 0):
    """transformers' Qwen3-Next MoE block with random weights, made directly in dtype on device."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    config = Qwen3NextConfig(shared_expert_intermediate_size=shape["moe_intermediate_size"], **shape)
    with torch.device("meta"):
        block = Qwen3NextSparseMoeBlock(config)
    block = block.to(dtype).to_empty(device=device).eval()  # no float32 copy of the 80B shape's 3 GiB of experts
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # unit-scale activations; router logits ~ N(0, 1): distinct top-k
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return block


def fused(block):
    """The block as the engine runs it: fusion.py's router + shared gate and shared gate / up concatenations
    (fuse_layer takes a decoder layer: a module whose `mlp` is the block)."""
    from engine.fusion import fuse_layer

    layer = torch.nn.Module()
    layer.mlp = block
    fuse_layer(layer)
    assert moe_triton_module.inline_shared(block)
    return block


def rows(block, n: int, seed: int = 1):
    gen = torch.Generator(device=block.gate.weight.device).manual_seed(seed)
    h = block.gate.weight.shape[1]
    return torch.randn(1, n, h, generator=gen, device=gen.device).to(block.gate.weight.dtype)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def test_the_module_imports_and_reports_availability():
    """CPU-only installs (no Triton) import it too; available() is what the engine asks before using it."""
    assert moe_triton_module.available() == (moe_triton_module.triton is not None and torch.cuda.is_available())


@pytest.fixture(scope="module")
def block_80b(device):
    return moe_block(SHAPE_80B, torch.bfloat16, device)


@gpu
@pytest.mark.parametrize("n", [1, 2, 4])
def test_bf16_matches_rowwise_at_the_80b_shape(block_80b, device, n):
    if device.type == "cpu" and n > 1:
        pytest.skip("interpreter: one row is enough (about 20 s)")
    x = rows(block_80b, n)
    with torch.inference_mode():
        err = rel_err(moe_triton(block_80b, x), moe_rowwise(block_80b, x))
    assert err < 2e-2


@gpu
@pytest.mark.parametrize("n", [1, 4])
def test_the_shared_expert_inside_the_kernels_matches_rowwise(device, n):
    """fusion.py's router + shared-gate matmul: the shared expert becomes one more pair in the kernels (id -1,
    weight sigmoid(gate logit)); the row-wise reference still computes it on its own."""
    block = fused(moe_block(SMALL, torch.float32, device))
    x = rows(block, n)
    with torch.inference_mode():
        assert rel_err(moe_triton(block, x), moe_rowwise(block, x)) < 1e-5
        h = x[0]
        logits = torch.nn.functional.linear(h, block.fused_weight)
        weights, idx = moe_triton_module.route(logits, block.experts.gate_up_proj.shape[0], block.gate.top_k, True,
                                               shared=True)
    assert (idx[:, -1] == -1).all() and (idx[:, :-1] >= 0).all()
    torch.testing.assert_close(weights[:, -1], torch.sigmoid(logits[:, -1]))


@gpu
def test_bf16_shared_expert_inside_the_kernels_at_the_80b_shape(device):
    block = fused(moe_block(SHAPE_80B, torch.bfloat16, device, seed=3))
    x = rows(block, 1 if device.type == "cpu" else 3)
    with torch.inference_mode():
        assert rel_err(moe_triton(block, x), moe_rowwise(block, x)) < 2e-2


@gpu
@pytest.mark.parametrize("n", [1, 3, 8])
def test_float32_matches_rowwise(device, n):
    block = moe_block(SMALL, torch.float32, device)
    x = rows(block, n)
    with torch.inference_mode():
        err = rel_err(moe_triton(block, x), moe_rowwise(block, x))
    assert err < 1e-5


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inline", [False, True])
def test_routed_rows_do_not_depend_on_the_batch(device, dtype, inline):
    """Bit for bit: a verify pass's rows equal decoding them one at a time (the routed experts, and the shared
    expert when it runs inside the kernels; torch's matmul for the logits is given the same rows)."""
    block = moe_block(SMALL, dtype, device)
    block = fused(block) if inline else block
    h = rows(block, 5)[0]
    experts, shared = block.experts, block.shared_expert
    extra = (shared.fused_weight, shared.down_proj.weight) if inline else ()
    with torch.inference_mode():
        logits = torch.nn.functional.linear(h, block.fused_weight if inline else block.gate.weight)
        k = block.gate.top_k
        whole = moe_triton_module.moe_experts(h, logits, experts.gate_up_proj, experts.down_proj, k, True, *extra)
        for i in range(h.shape[0]):
            one = moe_triton_module.moe_experts(h[i:i + 1], logits[i:i + 1], experts.gate_up_proj,
                                                experts.down_proj, k, True, *extra)
            assert torch.equal(one, whole[i:i + 1])


@gpu
@pytest.mark.parametrize("n", [1, 3])
def test_routing_kernel_picks_what_softmax_and_topk_pick(block_80b, device, n):
    block = block_80b
    h = rows(block, n)[0]
    with torch.inference_mode():
        weights, idx = route(block, h)
        logits = torch.nn.functional.linear(h, block.gate.weight)
        got_w, got_idx = moe_triton_module.route(logits, logits.shape[1], block.gate.top_k, True)
    order, got_order = idx.sort(-1), got_idx.sort(-1)
    assert torch.equal(order.values, got_order.values)  # the same experts (the kernel's order: by weight too)
    torch.testing.assert_close(got_w.gather(-1, got_order.indices), weights.gather(-1, order.indices),
                               rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("inline", [False, True])
def test_compiles_fullgraph(device, inline):
    block = moe_block(SMALL, torch.bfloat16, device)
    block = fused(block) if inline else block
    x = rows(block, 3)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(lambda x: moe_triton(block, x), fullgraph=True, backend=backend)
    with torch.inference_mode():
        assert rel_err(compiled(x), moe_triton(block, x)) < 2e-2


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_capture_and_replay(device):
    assert_captured_replays_follow_their_input(moe_block(SMALL, torch.bfloat16, device))


def assert_captured_replays_follow_their_input(block):
    """moe_triton(block, x) captured in a CUDA graph (its kernels compiled and autotuned before), replayed on new
    rows: the eager result for those rows."""
    x = rows(block, 4)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and autotune the kernels before capture
            moe_triton(block, x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe_triton(block, x)
        x.copy_(rows(block, 4, seed=2))
        graph.replay()
        torch.testing.assert_close(y, moe_triton(block, x))


@gpu
@pytest.mark.parametrize("form", [("split", 16, 512, 2), ("split", 32, 128, 2), ("rows", 16, 128, 8)])
def test_every_down_form_matches_and_keeps_rows_batch_invariant(device, form, monkeypatch):
    """Each down configuration the tuner may pick (the split form: a program per pair, the last of a token's
    pairs summing them in routing order) gives the first configuration's result, and a verify pass's rows bit
    for bit what decoding them one at a time gives. Tails masked: 200 hidden rows, 96 intermediate columns."""
    block = fused(moe_block(SMALL, torch.float32, device))
    h = rows(block, 5)[0]
    experts, shared = block.experts, block.shared_expert
    args = (experts.gate_up_proj, experts.down_proj, block.gate.top_k, True, shared.fused_weight,
            shared.down_proj.weight)
    with torch.inference_mode():
        logits = torch.nn.functional.linear(h, block.fused_weight)
        monkeypatch.setattr(moe_triton_module, "_chosen", {})
        reference = moe_triton_module.moe_experts(h, logits, *args)
        monkeypatch.setattr(moe_triton_module, "_chosen", {})
        monkeypatch.setattr(moe_triton_module, "DOWN_CONFIGS", [form])  # the tuner's only choice
        whole = moe_triton_module.moe_experts(h, logits, *args)
        assert moe_triton_module._chosen and all(c[1] == form for c in moe_triton_module._chosen.values())
        assert rel_err(whole, reference) < 1e-5
        for i in range(h.shape[0]):
            assert torch.equal(moe_triton_module.moe_experts(h[i:i + 1], logits[i:i + 1], *args), whole[i:i + 1])


_MOE = {"x_ptr": "*bf16", "idx_ptr": "*i64", "act_ptr": "*fp32", "weights_ptr": "*fp32", "s_ptr": "*fp32",
        "shared_s_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "locks_ptr": "*i32", "logits_ptr": "*bf16"}
_SHAPE = {"K": 10, "H": 2048, "I": 512}  # (the 80B-A3B's routed experts a token, hidden and intermediate sizes)


@pytest.mark.parametrize("module, kernel, types, constants, warps", [
    ("moe_triton", "_gate_up_kernel", {"w_ptr": "*bf16", "shared_ptr": "*bf16"},
     _SHAPE | {"SCALED": False, "BLOCK_I": 16, "BLOCK_H": 256}, 4),
    ("moe_triton", "_gate_up_kernel", {"w_ptr": "*fp8e4nv", "shared_ptr": "*fp8e4nv"},
     _SHAPE | {"SCALED": True, "BLOCK_I": 16, "BLOCK_H": 256}, 4),
    ("moe_triton", "_down_kernel", {"w_ptr": "*fp8e4nv", "shared_ptr": "*fp8e4nv"},
     _SHAPE | {"SCALED": True, "BLOCK_H": 8, "BLOCK_I": 512}, 4),
    ("moe_triton", "_down_split_kernel", {"w_ptr": "*bf16", "shared_ptr": "*bf16"},
     _SHAPE | {"SCALED": False, "BLOCK_H": 16, "BLOCK_I": 128}, 8),
    ("moe_triton", "_route_kernel", {}, {"E": 512, "K": 10, "BLOCK_E": 512, "BLOCK_K": 16, "NORM": True,
                                         "SHARED": True}, 1),
    ("int4_moe_triton", "_gate_up_kernel", {"qw_ptr": "*i32", "z_ptr": "*u8", "s_ptr": "*fp16", "perm_ptr": "*i32"},
     _SHAPE | {"GROUP": 128, "PERM": True, "BLOCK_K": 128, "BLOCK_N": 32}, 4),
    ("int4_moe_triton", "_down_kernel", {"qw_ptr": "*i32", "z_ptr": "*u8", "s_ptr": "*fp16", "perm_ptr": "*i32"},
     _SHAPE | {"GROUP": 128, "PERM": False, "BLOCK_K": 128, "BLOCK_N": 32}, 4),
])
def test_the_kernels_compile_for_a_gpu(module, kernel, types, constants, warps):
    """Triton's interpreter never type-checks or lowers a kernel as the compiler does (tests/triton_front.py):
    the routing and expert kernels (16-bit, FP8 and 4-bit experts) compile for sm_90 without a GPU."""
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    pdl = {"PDL": True} if module == "moe_triton" else {}
    compile_for_gpu(f"engine.{module}", kernel, _MOE | types, constants | pdl, num_warps=warps)
