"""The SwiGLU activation as one Triton kernel (engine/swiglu_triton.py) against the torch form (silu, then the
product): the two halves of a fused gate / up output at decode, verify and prefill widths, widths that fill whole
blocks and widths that do not; install on real MLP modules; then the engine decoding with it: greedy equals
transformers, speculation equals plain with drafts accepted and rejected.

They run on CUDA with Triton, or on the CPU through Triton's interpreter under TRITON_INTERPRET=1 (whose float32
-> bf16 conversion truncates where the GPU rounds to nearest: bf16 comparisons allow two ulps)."""

import pytest
import torch

from engine import swiglu_triton
from test_exactness import assert_exact_with_kernel


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 * 2**-7, atol=2 * 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 768), (4, 1000), (33, 2048)])
def test_the_kernel_is_the_torch_form(device, dtype, rows, width):
    gen = torch.Generator(device=device).manual_seed(rows)
    y = (torch.randn(1, rows, 2 * width, generator=gen, device=device) * 4).to(dtype)
    gate, up = y.split(width, -1)  # (a fused projection's halves: rows strided by 2 * width)
    assert swiglu_triton.takes(gate, up)
    got = swiglu_triton.swiglu(gate, up)
    assert got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, **tolerance(dtype))


def mlps(device, dtype):
    """A Qwen3-Next MLP (transformers' module) and a non-SwiGLU one (gelu)."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextMLP

    swiglu = Qwen3NextMLP(Qwen3NextConfig(hidden_size=64, intermediate_size=96)).to(device=device, dtype=dtype)
    gelu = Qwen3NextMLP(Qwen3NextConfig(hidden_size=64, intermediate_size=96, hidden_act="gelu"))
    return swiglu, gelu


def test_install_marks_swiglu_mlps_where_the_kernel_may_run(device, monkeypatch):
    from engine.fusion import dense_mlp
    from engine.kernels import Backends

    swiglu, gelu = mlps(device, torch.float32)
    b = Backends()
    swiglu_triton.install(b, [swiglu, gelu], torch.device("cpu"), torch.bfloat16)
    assert b.choice["swiglu"][0] == "torch" and not swiglu.swiglu and not hasattr(gelu, "swiglu")
    assert swiglu_triton.supported(torch.device("cuda"), torch.float32) in ("float32: the exact reference path",
                                                                            "triton not installed")
    monkeypatch.setattr(swiglu_triton, "supported", lambda device, dtype: None)
    swiglu_triton.install(b, [swiglu, gelu], device, torch.float32)
    assert b.choice["swiglu"][0] == "triton" and swiglu.swiglu and not hasattr(gelu, "swiglu")
    x = torch.randn(1, 3, 64, device=device)
    calls = []
    monkeypatch.setattr(swiglu_triton, "swiglu", lambda g, u: calls.append(1) or torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(dense_mlp(swiglu, x), swiglu(x))
    assert calls
    monkeypatch.setenv("MTPCHAT_SWIGLU", "torch")
    b = Backends()
    swiglu_triton.install(b, [swiglu], device, torch.float32)
    assert not swiglu.swiglu and "MTPCHAT_SWIGLU=torch" in b.choice["swiglu"][1]
    b = Backends()
    swiglu_triton.install(b, [gelu], device, torch.float32)
    assert "swiglu" not in b.choice  # (no SwiGLU MLP: nothing to say)


@pytest.mark.parametrize("name", ["next", "q35"])
def test_the_engine_decodes_exactly_with_the_kernel(name, ckpt, device, monkeypatch):
    """Loaded with the kernel allowed (on the CPU the interpreter runs it, in float32): the diagnostics name it, the
    trunk's and the MTP head's MLPs take it, greedy decoding equals transformers (CPU) and speculation at depths 1-4
    equals plain decoding, with drafts accepted and rejected, through the CUDA graphs and cycle graphs
    (graphs.Rerun on the CPU)."""
    from engine import load_engine

    monkeypatch.setattr(swiglu_triton, "supported", lambda device, dtype: None)
    calls = []
    run = swiglu_triton.swiglu
    monkeypatch.setattr(swiglu_triton, "swiglu", lambda g, u: calls.append(g.shape) or run(g, u))
    engine = load_engine(str(ckpt(name)), device=str(device), dtype="float32", cuda_graphs=True)
    assert engine.trunk.backends.choice["swiglu"][0] == "triton", engine.trunk.backends.choice["swiglu"]
    assert all(m.swiglu for m in engine.mtp_drafter.head.modules() if swiglu_triton.is_swiglu_mlp(m))
    def ran():
        assert calls

    assert_exact_with_kernel(engine, ckpt(name), device, ran)


def test_the_kernel_compiles_for_a_gpu():
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    compile_for_gpu("engine.swiglu_triton", "_swiglu_kernel", {p: "*bf16" for p in ("g_ptr", "u_ptr", "out_ptr")},
                    {"BLOCK": swiglu_triton.BLOCK, "PDL": True}, num_warps=4)
