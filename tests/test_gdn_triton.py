"""Our gated-delta-rule kernel for a few tokens (engine/gdn_triton.py) against the torch reference
(kernels.torch_recurrent): every width a call may have, grouped value heads, inputs read through the stash's
strides (commit's replay), the final state written over the initial one; its install (self-check, the timed choice
per width, the opt-out); then the engine decoding with it: greedy equals transformers, speculation equals plain
with drafts accepted and rejected.

They run on CUDA with Triton, or on the CPU through Triton's interpreter under TRITON_INTERPRET=1."""

import pytest
import torch

from engine import gdn_triton
from engine.kernels import Backends, Kernel, run_gdn, torch_recurrent
from test_exactness import assert_exact_with_kernel
from test_swiglu_triton import tolerance
from triton_front import compile_for_gpu


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 4, 5, 8])
def test_the_kernel_computes_the_reference_recurrence(device, dtype, T):
    """Two key heads serving four value heads, Dk 24 (not a power of two: masked columns), a batch of three."""
    q, k, v, g, beta, state = gdn_triton._inputs((2, 4, 24, 16), T, 3, device, dtype, seed=T)
    ref, ref_state = torch_recurrent(q, k, v, g, beta, state)
    final = torch.full_like(state, float("nan"))
    out = gdn_triton.recurrent_into(q, k, v, g, beta, state, final, (8, 1))
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))
    torch.testing.assert_close(final, ref_state, rtol=1e-4, atol=1e-4)
    assert not final.equal(state)  # (the initial state is read, not written: final is another tensor here)


def test_the_replay_reads_the_stash_rows_through_their_strides_and_writes_the_state_in_place(device):
    """commit's replay: the first n of a stash's rows ([layers, width, ...] sliced to n: not contiguous), the
    layers as the batch, the final state over the initial one; rows past n untouched by construction."""
    dtype = torch.bfloat16
    q, k, v, g, beta, state = gdn_triton._inputs((2, 4, 16, 32), 5, 3, device, dtype, seed=3)
    n = 3
    rows = tuple(x[:, :n] for x in (q, k, v, g, beta))
    assert not rows[0].is_contiguous()
    ref, ref_state = torch_recurrent(*rows, state)
    out = gdn_triton.recurrent_into(*rows, state, state, (16, 1))
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


def test_run_gdn_takes_the_kernel_at_the_widths_chosen_for_the_shape(device, monkeypatch):
    """The width buckets' choices route run_gdn (kernels.Kernel's calls): a width whose choice is the kernel runs
    it, another FLA's / the reference's path; prefill's chunked form never comes here."""
    dtype = torch.float32
    shape = (2, 4, 16, 16)
    calls = []
    real = gdn_triton.recurrent_into
    monkeypatch.setattr(gdn_triton, "recurrent_into", lambda *a: calls.append(a[0].shape[1]) or real(*a))
    for T in (1, 4):
        q, k, v, g, beta, state = gdn_triton._inputs(shape, T, 1, device, dtype, seed=T)
        monkeypatch.setattr(gdn_triton, "_chosen", {(4, 16, 16, 8, v.device.index): (16, 1)})
        ref, ref_state = torch_recurrent(q, k, v, g, beta, state)
        final = torch.empty_like(state)
        out = run_gdn(q, k, v, g, beta, state, final, "torch", False, False)
        torch.testing.assert_close(out, ref, **tolerance(dtype))
        torch.testing.assert_close(final, ref_state, rtol=1e-4, atol=1e-4)
    assert calls == [4]


def test_install_checks_times_and_records_the_choice_and_keeps_the_reference_when_asked(device, monkeypatch):
    layers = [type("Layer", (), {"linear_attn": type("Mixer", (), dict(num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                                                        head_v_dim=16))()})()]
    b = Backends()
    b.choice["gdn_recurrent"] = ("torch", "recurrent torch reference")
    gdn_triton.install(b, layers, torch.device("cpu"), torch.bfloat16)  # not CUDA: nothing chosen
    assert b.choice["gdn_recurrent"][0] == "torch"
    monkeypatch.setattr(gdn_triton, "_chosen", {})
    monkeypatch.setattr(gdn_triton, "supported", lambda device, dtype: None)
    gdn_triton.install(b, layers, device, torch.float32)
    assert b.choice["gdn_recurrent"][0] == "triton", b.choice["gdn_recurrent"]
    index = torch.empty(0, device=device).device.index  # (cuda: cuda:N, whatever `device` says)
    assert set(gdn_triton._chosen) == {(4, 16, 16, 1, index), (4, 16, 16, 8, index)}
    # where FLA cannot run, the kernel wins at every width
    assert all(c in gdn_triton.CONFIGS for c in gdn_triton._chosen.values())
    # a second load in the process reuses the timings (the bench and the app load engines again)
    monkeypatch.setattr(gdn_triton, "_timed", lambda *a: pytest.fail("timed again"))
    b = Backends()
    gdn_triton.install(b, layers, device, torch.float32)
    assert b.choice["gdn_recurrent"][0] == "triton", b.choice["gdn_recurrent"]
    monkeypatch.setattr(gdn_triton, "_chosen", {})
    monkeypatch.setenv("MTPCHAT_GDN_RECURRENT", "torch")
    b = Backends()
    b.choice["gdn_recurrent"] = ("torch", "recurrent torch reference")
    gdn_triton.install(b, layers, device, torch.float32)
    assert b.choice["gdn_recurrent"][0] == "torch" and "MTPCHAT_GDN_RECURRENT=torch" in b.choice["gdn_recurrent"][1]
    assert gdn_triton._chosen == {}
    assert isinstance(b.gdn_recurrent, Kernel)


@pytest.mark.parametrize("name", ["next", "q35"])
def test_the_engine_decodes_exactly_with_the_kernel(name, ckpt, device, monkeypatch):
    """Loaded with the kernel allowed (on the CPU the interpreter runs it, in float32): the diagnostics name it,
    greedy decoding equals transformers (CPU) and speculation at depths 1-4 equals plain decoding (verify passes
    and commit's replay through the kernel), with drafts accepted and rejected, through the CUDA graphs and cycle
    graphs (graphs.Rerun on the CPU)."""
    from engine import load_engine

    monkeypatch.setattr(gdn_triton, "_chosen", {})
    monkeypatch.setattr(gdn_triton, "supported", lambda device, dtype: None)
    widths = []
    real = gdn_triton.recurrent_into
    monkeypatch.setattr(gdn_triton, "recurrent_into", lambda q, *a: widths.append(q.shape[1]) or real(q, *a))
    engine = load_engine(str(ckpt(name)), device=str(device), dtype="float32", cuda_graphs=True)
    assert engine.trunk.backends.choice["gdn_recurrent"][0] == "triton", engine.trunk.backends.choice
    widths.clear()
    assert_exact_with_kernel(engine, ckpt(name), device)
    assert 1 in widths and max(widths) >= 4


def test_the_kernel_compiles_for_an_sm90_gpu():
    """Triton's whole pipeline for sm_90 (tests/triton_front.py) at a verify width with grouped heads."""
    compile_for_gpu("engine.gdn_triton", "_gdn_rows_kernel",
                    {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
                     "h0_ptr": "*fp32", "ht_ptr": "*fp32", "o_ptr": "*bf16", "scale": "fp32"},
                    {"T": 4, "BT": 4, "H": 4, "HV": 8, "DK": 64, "DV": 64, "BK": 64, "BV": 16, "PDL": True},
                    num_warps=1)
