"""The Triton RMSNorm (engine/norm_triton.py) against transformers' Qwen3-Next RMSNorm math: shapes of the hidden,
q / k (per head) norms, strided inputs, D not a power of 2 or over one block; install() on a real module;
torch.compile (fullgraph) over an installed module; CUDA-graph capture.

GPU tests: they skip without CUDA and Triton. With TRITON_INTERPRET=1 and Triton importable they run on the CPU
through Triton's interpreter instead (install() itself wants CUDA: there its CUDA check is patched out)."""

import copy

import pytest
import torch

import engine.norm_triton as norm_triton
from engine.norm_triton import install, is_rms_norm, rms_norm

gpu = pytest.mark.gpu

EPS = 1e-6


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def reference(x, weight, eps=EPS):
    """transformers' Qwen3NextRMSNorm.forward."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def randn(*shape, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=device) * 3).to(dtype)


def qwen3_next_norm(dim, dtype, device):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    norm = Qwen3NextRMSNorm(dim, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(dim, dtype=torch.float32, device=device, seed=7) * 0.1)  # stored as weight - 1
    return norm


def assert_matches(got, x, weight):
    want = reference(x, weight)
    assert got.shape == want.shape and got.dtype == want.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp: rsqrt and the sum's order may round the last float32 bit the other way
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


def test_the_module_imports_and_reports_availability():
    """CPU-only installs (no Triton) import it too; available() is what the engine asks before using it."""
    assert norm_triton.available() == (norm_triton.triton is not None and torch.cuda.is_available())


def test_install_says_why_it_keeps_the_torch_ops():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    norm = Qwen3NextRMSNorm(64)
    if norm_triton.triton is None:
        assert install([norm], "cuda", torch.bfloat16) == "torch ops (triton not installed)"
    else:
        assert install([norm], "cpu", torch.bfloat16) == "torch ops (CPU)"
        if norm_triton.available():
            assert install([norm], "cuda", torch.float32) == "torch ops (float32: the exact reference path)"
    assert "forward" not in vars(norm)


def test_is_rms_norm_picks_the_plain_norms_only():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    assert is_rms_norm(Qwen3NextRMSNorm(64))
    assert not is_rms_norm(Qwen3NextRMSNormGated(64))  # forward(x, gate)
    assert not is_rms_norm(torch.nn.LayerNorm(64))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 384), (5, 7, 64), (2, 5120), (3, 320), (2, 9000)],
                         ids=["decode-row", "per-head", "hidden-5120", "d320", "d9000-two-blocks"])
def test_op_matches_the_reference(device, dtype, shape):
    x = randn(*shape, dtype=dtype, device=device)
    weight = randn(shape[-1], dtype=dtype, device=device, seed=1) * 0.1
    assert_matches(rms_norm(x, weight, EPS), x, weight)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_inputs(device, dtype):
    weight = randn(64, dtype=torch.float32, device=device, seed=1) * 0.1  # float32 weight, bf16 x: loads both
    # the query half of a projection laid out [B, T, H, 2 * Dh] (Qwen3-Next's q and gate): rows 128 apart, no copy
    qg = randn(5, 7, 4, 128, dtype=dtype, device=device)
    q = qg[..., :64]
    assert_matches(rms_norm(q, weight, EPS), q, weight)
    # a transpose: the last dim is not contiguous
    xt = randn(64, 6, dtype=dtype, device=device).t()
    assert xt.stride(-1) != 1
    assert_matches(rms_norm(xt, weight, EPS), xt, weight)
    # empty
    assert rms_norm(q[:0], weight, EPS).shape == (0, 7, 4, 64)


@pytest.fixture
def installable(device, monkeypatch):
    """install(modules, dtype) on the test device. On the interpreter (CPU) install() would keep the torch ops:
    its device check is patched out, the self-check and the forward then run through the interpreter."""
    if device.type == "cpu":
        monkeypatch.setattr(norm_triton, "_why_not", lambda device, dtype: None)
    return lambda modules, dtype: install(modules, device, dtype)


@gpu
@pytest.mark.parametrize("dim", [2048, 256])
def test_install_on_a_transformers_module(device, installable, dim):
    norm = qwen3_next_norm(dim, torch.bfloat16, device)
    other = copy.deepcopy(norm)
    reason = installable([norm, torch.nn.Linear(4, 4)], torch.bfloat16)
    assert reason.startswith("Triton fused RMSNorm (self-check "), reason
    assert "forward" in vars(norm)
    x = randn(2, 3, dim, dtype=torch.bfloat16, device=device)
    with torch.inference_mode():
        got, want = norm(x), other(x)
    assert_matches(got, x, norm.weight)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2
    # a deepcopy keeps the fused forward, bound to the copy's own weight
    twin = copy.deepcopy(norm)
    with torch.no_grad():
        twin.weight.zero_()
    with torch.inference_mode():
        assert_matches(twin(x), x, twin.weight)


@gpu
@pytest.mark.parametrize("dim", [384, 5120])
def test_the_residual_add_and_norm_in_one_kernel_equal_the_two_ops_bit_for_bit(device, installable, dim):
    """add_then_norm (model.block's residual adds): with the kernel installed, the sum and the norm are the add's
    and the installed norm's own values exactly; without it (an uninstalled norm) the two ops run."""
    from engine.norm_triton import add_then_norm

    norm = qwen3_next_norm(dim, torch.bfloat16, device)
    plain = copy.deepcopy(norm)
    assert "; residual adds fused with their norms (self-check " in installable([norm], torch.bfloat16)
    assert norm.add_kernel and not getattr(plain, "add_kernel", False)
    h, d = randn(1, 4, dim, dtype=torch.bfloat16, device=device), randn(1, 4, dim, dtype=torch.bfloat16,
                                                                        device=device, seed=3)
    with torch.inference_mode():
        total, out = add_then_norm(norm, h, d)
        assert torch.equal(out, norm(total)) and out.shape == h.shape and not torch.equal(out, total)
        if device.type == "cuda":
            assert torch.equal(total, h + d)
        else:  # Triton's interpreter truncates float32 -> bf16 where torch rounds to nearest: one ulp
            torch.testing.assert_close(total, h + d, rtol=2**-7, atol=0)
        total, out = add_then_norm(plain, h[:, 1:], d[:, 1:])  # (strided rows: a view)
        assert torch.equal(total, h[:, 1:] + d[:, 1:]) and torch.equal(out, plain(h[:, 1:] + d[:, 1:]))


@gpu
def test_install_tells_dense_qwen3s_plain_weight_from_the_zero_centred_one(device, installable):
    """Qwen3RMSNorm multiplies by its weight as stored (about 1), Qwen3-Next's by 1 + weight: each module gets the
    kernel with its own convention, found by the self-check."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    plain = Qwen3RMSNorm(256).to(device, torch.bfloat16)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    centred = qwen3_next_norm(256, torch.bfloat16, device)
    want = [copy.deepcopy(m) for m in (plain, centred)]
    assert installable([plain, centred], torch.bfloat16).startswith("Triton fused RMSNorm"), "self-check"
    assert (plain.norm_shift, centred.norm_shift) == (0.0, 1.0)
    x = randn(3, 256, dtype=torch.bfloat16, device=device)
    with torch.inference_mode():
        for got, ref in zip((plain, centred), want):
            assert ((got(x).float() - ref(x).float()).abs().max() / ref(x).float().abs().max()).item() < 2e-2


@gpu
def test_installed_module_compiles_fullgraph(device, installable):
    norm = qwen3_next_norm(256, torch.bfloat16, device)
    installable([norm], torch.bfloat16)
    x = randn(3, 256, dtype=torch.bfloat16, device=device)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(norm, fullgraph=True, backend=recording)(x)
    assert graphs and "rms_norm" not in graphs[0]  # the module's own math, for inductor to fuse
    backend = "inductor" if device.type == "cuda" else "aot_eager"  # inductor on CPU wants a C++ compiler
    compiled = torch.compile(norm, fullgraph=True, backend=backend)
    with torch.inference_mode():
        assert_matches(compiled(x), x, norm.weight)


@gpu
def test_op_compiles_fullgraph(device):
    """The op itself traces (fake tensor: the register_fake output)."""
    weight = randn(320, dtype=torch.bfloat16, device=device, seed=1) * 0.1
    x = randn(4, 320, dtype=torch.bfloat16, device=device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(lambda x: rms_norm(x * 2, weight, EPS) + 1, fullgraph=True, backend=backend)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), rms_norm(x * 2, weight, EPS) + 1, rtol=1.6e-2, atol=1e-5)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_capture_and_replay(device):
    weight = randn(2048, dtype=torch.bfloat16, device=device, seed=1) * 0.1
    x = randn(1, 1, 2048, dtype=torch.bfloat16, device=device)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile the kernel before capture
            rms_norm(x, weight, EPS)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = rms_norm(x, weight, EPS)
        x.copy_(randn(1, 1, 2048, dtype=torch.bfloat16, device=device, seed=2))
        graph.replay()
        assert_matches(y, x, weight)


def qwen3_next_gated_norm(dim, dtype, device):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    norm = Qwen3NextRMSNormGated(dim, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(dim, dtype=torch.float32, device=device, seed=9) * 0.1)
    return norm


def test_is_gated_rms_norm_picks_gdns_output_norm_only():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    assert norm_triton.is_gated_rms_norm(Qwen3NextRMSNormGated(128))
    assert not norm_triton.is_gated_rms_norm(Qwen3NextRMSNorm(128))
    assert not norm_triton.is_gated_rms_norm(torch.nn.LayerNorm(128))


def half(device) -> torch.dtype:
    """bf16 on CUDA; fp16 through the interpreter, whose float32 -> bf16 conversion truncates (the gated norm
    rounds three times: up to three ulps from torch's round-to-nearest)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float16


@gpu
@pytest.mark.parametrize("sixteen", [True, False], ids=["16-bit", "float32"])
def test_gated_op_matches_the_transformers_module(device, sixteen):
    """GDN's output norm: rows of [tokens x value heads, head dim], the gate a strided view (z's columns of the
    fused projection's output), a 16-bit weight (its product rounded as torch rounds it) and a float32 one."""
    dtype = half(device) if sixteen else torch.float32
    for wdtype in {dtype, torch.float32}:
        norm = qwen3_next_gated_norm(64, wdtype, device)
        x = randn(4 * 6, 64, dtype=dtype, device=device)
        zs = randn(4, 6 * 64 + 40, dtype=dtype, device=device, seed=3)[:, 40:].reshape(4, 6, 64)  # strided rows
        gate = zs.reshape(-1, 64)
        with torch.no_grad():
            want = type(norm).forward(norm, x, gate)
        got = norm_triton.gated_rms_norm(x, gate, norm.weight, EPS)
        assert got.shape == want.shape and got.dtype == want.dtype
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # one bf16 ulp (rsqrt, exp and the sum's order)
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-5)


@gpu
def test_install_gives_the_gated_norm_its_kernel(device, installable):
    dtype = half(device)
    norm = qwen3_next_gated_norm(128, dtype, device)
    other = copy.deepcopy(norm)
    reason = installable([norm, qwen3_next_norm(256, dtype, device)], dtype)
    assert reason.startswith("Triton fused RMSNorm and gated RMSNorm (self-check "), reason
    assert "forward" in vars(norm)
    x, gate = (randn(2, 3, 128, dtype=dtype, device=device, seed=s) for s in (1, 2))
    with torch.inference_mode():
        got, want = norm(x, gate), other(x, gate)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)
    with norm_triton.stock_forward([norm]):
        assert "forward" not in vars(norm)
    assert "forward" in vars(norm)


@gpu
def test_the_diagnostics_name_the_gated_norms_kernel(device, installable):  # (installable: the device check)
    from engine.kernels import Backends
    from engine.model import choose_norm

    backends, dtype = Backends(), half(device)
    backends.choice["gated_rmsnorm"] = ("torch", "module's own gated RMSNorm")  # (select_backends' default)
    choose_norm(backends, [qwen3_next_gated_norm(128, dtype, device)], device, dtype)
    assert backends.choice["gated_rmsnorm"][0] == "triton", backends.choice


@pytest.mark.parametrize("kernel, pointers, constants", [
    ("_rms_norm_kernel", ("x_ptr", "w_ptr", "out_ptr"), {"D": 5120, "BLOCK": 4096}),  # (two passes over the row)
    ("_rms_norm_kernel", ("x_ptr", "w_ptr", "out_ptr"), {"D": 128, "BLOCK": 128}),
    ("_add_rms_norm_kernel", ("h_ptr", "d_ptr", "w_ptr", "sum_ptr", "out_ptr"), {"D": 5120, "BLOCK": 8192}),
    ("_gated_rms_norm_kernel", ("x_ptr", "g_ptr", "w_ptr", "out_ptr"), {"D": 128, "BLOCK": 128, "ROUND": True}),
    ("_two_norms_kernel", ("table_ptr", "h_ptr", "we_ptr", "wh_ptr", "out_ptr", "x_ptr"), {"D": 5120, "BLOCK": 8192}),
    ("_two_norms_kernel", ("table_ptr", "h_ptr", "we_ptr", "wh_ptr", "out_ptr", "x_ptr"),
     {"D": 5120, "BLOCK": 8192, "ARGMAX": True, "ABLOCK": 8192}),  # (the ids from the logits' argmax, in the same launch)
])
def test_the_kernels_compile_for_a_gpu(kernel, pointers, constants):
    """Triton's interpreter never type-checks as the compiler does (tests/triton_front.py): each norm kernel
    compiles for sm_90, on this machine without a GPU."""
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    compile_for_gpu("engine.norm_triton", kernel, {p: "*bf16" for p in pointers}
                    | {"eps": "fp32", "eps_e": "fp32", "eps_h": "fp32", "shift": "fp32", "ids_ptr": "*i64"},
                    constants | {"PDL": True}, num_warps=norm_triton._num_warps(constants["BLOCK"]))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_norms_is_the_mtp_heads_gather_norms_and_cat_in_one_launch(device, installable, dtype, monkeypatch):
    """The MTP head's input [norm_e(embed(ids)), norm_h(hidden)]: one launch equal to the installed norms' kernels
    and the cat, bit for bit, with the ids given or the argmax of given logits; it does not fit (two_norms_fit) where a norm does not run the kernel or the embedding
    is not a plain table."""
    from engine.norm_triton import two_norms, two_norms_check, two_norms_fit

    embed = torch.nn.Embedding(100, 256).to(device=device, dtype=dtype)
    norm_e, norm_h = qwen3_next_norm(256, dtype, device), qwen3_next_norm(256, dtype, device)
    with torch.no_grad():
        norm_h.weight.mul_(-2)  # (two different weights)
    ids = torch.tensor([[3, 99, 0, 3]], device=device)
    hidden = randn(1, 4, 256, dtype=dtype, device=device)
    assert not two_norms_fit(embed, norm_e, norm_h) and not two_norms_check(embed, norm_e, norm_h)  # (not installed)
    # (install keeps float32's torch ops on CUDA, the exact reference path; the kernels are compared all the same)
    monkeypatch.setattr(norm_triton, "_why_not", lambda device, dtype: None)
    installable([norm_e, norm_h], dtype)
    assert two_norms_check(embed, norm_e, norm_h)
    with torch.inference_mode():
        got = two_norms(embed, norm_e, norm_h, ids, hidden)
        want = torch.cat([norm_e(embed(ids)), norm_h(hidden)], -1)
        assert got is not None and got.dtype == dtype and torch.equal(got, want)
        one = two_norms(embed, norm_e, norm_h, ids[:, 1:2], hidden[:, 1:2])  # (a draft step's one row)
        assert torch.equal(one, want[:, 1:2])
        # the ids as the argmax of logits, written into their place by the same launch (a greedy chain's step)
        logits = randn(4, 100, dtype=dtype, device=device)
        logits[2, 70] = logits[2, 10] = logits.max() + 1  # (a tie: the first column, as torch.argmax)
        slot = torch.full((1, 4), -1, dtype=torch.long, device=device)
        chosen = two_norms(embed, norm_e, norm_h, slot, hidden, argmax_of=logits)
        assert torch.equal(slot[0], logits.argmax(-1)) and slot[0, 2] == 10
        assert torch.equal(chosen, torch.cat([norm_e(embed(slot)), norm_h(hidden)], -1))
        wrapped = torch.nn.Sequential(embed)  # (a host or vocab-parallel embedding: not a plain table)
        assert not two_norms_fit(wrapped, norm_e, norm_h)
        assert two_norms(embed, norm_e, norm_h, ids, hidden.float() if dtype != torch.float32 else hidden.half()) is None
