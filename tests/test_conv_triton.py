"""GDN's short conv and gates as one Triton kernel (engine/conv_triton.py) against gdn.kernel_inputs' torch form:
one token and verify widths, the conv cache updated in place (plain decoding) or the window stashed (a verify
pass), a chained pass whose cache is the window's own first columns; then the engine decoding with it: greedy
equals transformers, speculation equals plain with drafts accepted and rejected.

They run on CUDA with Triton, or on the CPU through Triton's interpreter under TRITON_INTERPRET=1 (whose float32
-> bf16 conversion truncates where the GPU rounds to nearest: bf16 comparisons allow two ulps)."""

import pytest
import torch

from engine import conv_triton, gdn
from engine.gdn import heads, kernel_inputs
from engine.kernels import split_qkv
from test_exactness import PROMPTS, assert_exact_with_kernel, decode


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def mixer(device, dtype, bias: bool):
    """A Qwen3-Next GDN mixer (transformers' module) with the engine's kept constants; C = 2 x 2 x 16 + 4 x 16 =
    128 channels, so a block of channels spans q, k and v."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    m = Qwen3NextGatedDeltaNet(config, 0)
    if bias:
        m.conv1d.bias = torch.nn.Parameter(torch.randn(m.conv1d.weight.shape[0]) * 0.5)
    with torch.no_grad():
        m.A_log.normal_()
        m.dt_bias.normal_(0, 4)  # softplus's far tails too: a + dt_bias past +-20
    m = m.to(device=device, dtype=dtype)
    gdn.keep_constants([type("Layer", (), {"linear_attn": m})()])
    return m


def tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 * 2**-7, atol=2 * 2**-7)


def inputs(m, T, device, dtype):
    gen = torch.Generator(device=device).manual_seed(T)
    C, K1, hv = m.conv1d.weight.shape[0], m.conv1d.weight.shape[-1] - 1, m.num_v_heads
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen, device=device) * s).to(dtype)  # noqa: E731
    return rand(C, T), rand(C, K1), rand(T, hv, s=3.0), rand(T, hv, s=8.0)


def run(m, x, state, b, a, window=None, store_state=False):
    T, hv = x.shape[1], m.num_v_heads
    qkv = torch.empty(1, T, x.shape[0], device=x.device, dtype=x.dtype)
    g, beta = torch.empty(T, hv, device=x.device), torch.empty(T, hv, device=x.device, dtype=x.dtype)
    conv_triton.conv_gates(m, x, state, b, a, *(t[0] for t in split_qkv(qkv, heads(m))), g, beta, window=window,
                           store_state=store_state)
    return qkv[0], g, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_the_torch_forms_values(device, dtype, T, bias):
    m = mixer(device, dtype, bias)
    x, state, b, a = inputs(m, T, device, dtype)
    want_window = torch.cat([state, x], -1)
    want = kernel_inputs(m, want_window.unsqueeze(0), T, b.unsqueeze(0), a.unsqueeze(0))

    window = torch.full((x.shape[0], state.shape[1] + T + 3), float("nan"), device=device, dtype=dtype)[:, : -3]
    cache = state.clone()
    for got, ref in zip(run(m, x.t().contiguous().t(), cache, b, a, window=window), want):  # (x: [C, T] strided)
        torch.testing.assert_close(got, ref[0], **tolerance(dtype))
    assert torch.equal(window, want_window) and torch.equal(cache, state)  # a verify pass leaves the cache alone

    for got, ref in zip(run(m, x, cache, b, a, store_state=True), want):
        torch.testing.assert_close(got, ref[0], **tolerance(dtype))
    assert torch.equal(cache, want_window[:, T:])  # plain decoding: the cache is the window's last K - 1 columns


def test_a_chained_pass_reads_its_cache_from_the_window_it_writes(device):
    """A draft model's chained verify step (model.chained): its conv cache is the stash window's columns at ..
    at + K - 1, and its own window starts there: the kernel writes those columns back with what it read."""
    m = mixer(device, torch.float32, False)
    x, state, b, a = inputs(m, 3, device, torch.float32)
    at, K1 = 2, state.shape[1]
    stash = torch.randn(x.shape[0], at + K1 + 3, device=device)
    stash[:, at : at + K1] = state
    before = stash.clone()
    got = run(m, x, stash[:, at : at + K1], b, a, window=stash[:, at:])
    want = kernel_inputs(m, torch.cat([state, x], -1).unsqueeze(0), 3, b.unsqueeze(0), a.unsqueeze(0))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(stash[:, :at], before[:, :at]) and torch.equal(stash[:, at + K1 :], x)


def test_install_keeps_the_torch_form_off_cuda_in_float32_and_when_asked(device, monkeypatch):
    from engine.kernels import Backends

    b = Backends()
    conv_triton.install(b, [], torch.device("cpu"), torch.bfloat16)
    assert b.short_conv == "torch"
    assert conv_triton.supported(torch.device("cpu"), torch.bfloat16) in ("not CUDA", "triton not installed")
    assert conv_triton.supported(torch.device("cuda"), torch.float32) in ("float32: the exact reference path",
                                                                          "triton not installed")
    monkeypatch.setattr(conv_triton, "supported", lambda device, dtype: None)
    layers = [type("Layer", (), {"linear_attn": mixer(device, torch.float32, False)})()]
    conv_triton.install(b, layers, device, torch.float32)
    assert b.short_conv == "triton" and b.choice["conv1d"][0] == "triton"
    monkeypatch.setenv("MTPCHAT_SHORT_CONV", "torch")
    b = Backends()
    conv_triton.install(b, layers, device, torch.float32)
    assert b.short_conv == "torch" and "MTPCHAT_SHORT_CONV=torch" in b.choice["conv1d"][1]


@pytest.mark.parametrize("name", ["next", "q35"])  # the interleaved [q | k | v | z] layout and the split one
def test_the_engine_decodes_exactly_with_the_kernel(name, ckpt, device, monkeypatch):
    """Loaded with the kernel allowed (on the CPU the interpreter runs it, in float32): the diagnostics name it,
    greedy decoding equals transformers (CPU) and speculation at depths 1-4 equals plain decoding, with drafts
    accepted and rejected, through the CUDA graphs and cycle graphs (graphs.Rerun on the CPU)."""
    from engine import load_engine

    monkeypatch.setattr(conv_triton, "supported", lambda device, dtype: None)
    engine = load_engine(str(ckpt(name)), device=str(device), dtype="float32", cuda_graphs=True)
    assert engine.trunk.backends.short_conv == "triton", engine.trunk.backends.choice["conv1d"]
    assert_exact_with_kernel(engine, ckpt(name), device)


def test_a_hybrid_draft_models_chained_passes_are_exact_with_the_kernel(tmp_path, device, monkeypatch):
    """A text-only Qwen3.5 draft model drafts by chained verify passes, each reading its conv cache from the
    stash window the one before wrote (model.chained): with the kernel in both models, speculation at depths 1-4
    equals plain decoding, with drafts accepted and rejected."""
    from draft_fixtures import write_qwen35_pair
    from engine import load_engine

    target, draft = write_qwen35_pair(tmp_path, 0.1)
    monkeypatch.setattr(conv_triton, "supported", lambda device, dtype: None)
    chained = []

    def counting(mixer, x, state, *args, window=None, **kw):
        chained.append(window is not None and window.data_ptr() == state.data_ptr())
        return conv_triton.conv_gates(mixer, x, state, *args, window=window, **kw)

    monkeypatch.setattr(gdn, "conv_gates", counting)
    engine = load_engine(str(target), device=str(device), dtype="float32", draft_model=str(draft), drafter="draft")
    assert engine.trunk.backends.short_conv == "triton"
    assert engine.draft_drafter.trunk.backends.short_conv == "triton"
    prompt = engine.encode_chat(PROMPTS[0])
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=40)
    for depth in (1, 2, 3, 4):
        spec, _, fin = decode(engine, prompt, depth=depth, max_new_tokens=40)
        assert spec == plain, depth
        assert fin.stats["drafter"].startswith("draft:") and 0 < fin.stats["accepted"] < fin.stats["drafted"]
    assert any(chained) and not all(chained)  # chained passes among the kernel's calls


@pytest.mark.parametrize("window, store_state, bias", [(True, False, False), (False, True, True)])
def test_the_kernel_compiles_for_a_gpu(window, store_state, bias):
    """The interpreter never type-checks as the compiler does (a name made loop-carried with a new type ran there
    and failed on the H100 in stop 60): it compiles for sm_90 in both of the engine's uses."""
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    pointers = ["x_ptr", "state_ptr", "w_ptr", "bias_ptr", "window_ptr", "q_ptr", "k_ptr", "v_ptr", "b_ptr", "a_ptr"]
    types = {p: "*bf16" for p in pointers} | {p: "*fp32" for p in ("decay_ptr", "dt_bias_ptr", "g_ptr", "beta_ptr")}
    compile_for_gpu("engine.conv_triton", "_conv_gates_kernel", types,
                    {"K1": 3, "KP": 4, "HAS_BIAS": bias, "WINDOW": window, "STORE_STATE": store_state,
                     "BLOCK": conv_triton.BLOCK_C, "GATES": conv_triton.BLOCK_G, "PDL": True}, num_warps=1)
