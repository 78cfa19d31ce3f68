"""The rotary embedding as two Triton kernels (engine/rope_triton.py) against the torch form (model.Rotary and
model.apply_rope): the cos / sin table of int and device positions, near 0 and far out, partial and whole rotary
dims, an attention factor; the rotation of strided queries and keys at decode, verify and prefill widths; then the
engine decoding with it: greedy equals transformers, speculation equals plain with drafts accepted and rejected.

They run on CUDA with Triton, or on the CPU through Triton's interpreter under TRITON_INTERPRET=1 (whose float32
-> bf16 conversion truncates where the GPU rounds to nearest, and whose sin / cos are numpy's: bf16 comparisons
allow two ulps, float32 ones a few ulps of the table)."""

import pytest
import torch

from engine import rope_triton
from engine.model import Rotary, apply_rope
from test_exactness import assert_exact_with_kernel


@pytest.fixture(scope="module")
def device(triton_device):  # conftest.py: CUDA, or the interpreter on the CPU
    return triton_device


def rotary(device, factor: float = 0.25, kind: str = "default"):
    from transformers import Qwen3NextConfig

    rope = {"rope_type": kind, "rope_theta": 10000000.0, "partial_rotary_factor": factor}
    if kind == "yarn":  # (its attention factor scales cos and sin: Rotary.scaling != 1)
        rope |= {"factor": 4.0, "original_max_position_embeddings": 32768}
    config = Qwen3NextConfig(head_dim=64, num_attention_heads=6, num_key_value_heads=2, rope_parameters=rope)
    return Rotary(config, device), config


def assert_matches(got, want, device, scale: float = 1.0):
    """Equal on CUDA (the same operations, rounded where torch rounds); in the interpreter within its rounding:
    a few ulps of the largest operand (scale), since truncated products can cancel in a rotation's sum."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if device.type == "cuda":
        assert torch.equal(got, want)
    else:
        tol = 1e-5 if got.dtype == torch.float32 else 4 * 2**-8 * scale
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor, kind", [(0.25, "default"), (1.0, "default"), (0.25, "yarn")])
@pytest.mark.parametrize("T, start", [(1, 0), (4, 4093), (9, 131_000)])
def test_the_table_is_the_torch_forms(device, dtype, factor, kind, T, start):
    rot, _ = rotary(device, factor, kind)
    ids = torch.arange(start, start + T, device=device)
    want = rot(ids.unsqueeze(0), dtype)
    for pos in (start, ids):  # eager steps' int position, graph passes' positions on the device
        for got, ref in zip(rope_triton.table(rot, pos, T, dtype, device), want):
            assert_matches(got, ref, device)
    if kind == "yarn":
        assert rot.scaling != 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [0.25, 1.0])
@pytest.mark.parametrize("T", [1, 4, 33])
def test_the_rotation_is_apply_ropes(device, dtype, factor, T):
    """Queries strided as attention makes them (half of q_proj's rows, heads before tokens), keys contiguous in
    [T, heads]: both rotated as apply_rope does, the pass-through dims copied, in one [heads, T, D] output."""
    rot, config = rotary(device, factor)
    gen = torch.Generator(device=device).manual_seed(T)
    cos, sin = rot(torch.arange(50, 50 + T, device=device).unsqueeze(0), dtype)
    qg = (torch.randn(1, T, 6, 128, generator=gen, device=device) * 3).to(dtype)
    q = qg[..., :64].transpose(1, 2)
    k = (torch.randn(1, T, 2, 64, generator=gen, device=device) * 3).to(dtype).transpose(1, 2)
    assert rope_triton.rotatable(q, k, cos)
    got, want = rope_triton.rotate(q, k, cos, sin), apply_rope(q, k, cos, sin)
    for g, w in zip(got, want):
        assert_matches(g, w, device, scale=max(q.abs().max().item(), k.abs().max().item()))
    rd = cos.shape[-1]
    assert torch.equal(got[0][..., rd:], q[..., rd:])  # (the pass-through dims: copies)
    assert got[0].data_ptr() + 6 * T * 64 * got[0].element_size() == got[1].data_ptr()  # (one output)
    assert not rope_triton.rotatable(q.expand(2, -1, -1, -1), k, cos)  # (batch 2: the torch form)


def store_inputs(device, dtype, T: int):
    """rotate_and_store's inputs at T tokens: (generator, positions, cos, sin, q strided as attention makes it, k, v,
    a layer's cache keys and values of 64 positions)."""
    rot, _ = rotary(device)
    gen = torch.Generator(device=device).manual_seed(T)
    positions = torch.arange(37, 37 + T, device=device)
    cos, sin = rot(positions.unsqueeze(0), dtype)
    qg = (torch.randn(1, T, 6, 128, generator=gen, device=device) * 3).to(dtype)
    q = qg[..., :64].transpose(1, 2)
    k, v = ((torch.randn(1, T, 2, 64, generator=gen, device=device) * 3).to(dtype).transpose(1, 2) for _ in range(2))
    keys, values = (torch.randn(2, 64, 64, generator=gen, device=device).to(dtype) for _ in range(2))
    return gen, positions, cos, sin, q, k, v, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
def test_rotate_and_store_is_the_rotation_and_the_cache_writes(device, dtype, T):
    """Graph mode's one launch: the queries as rotate() gives them, the rotated keys and the values in one layer's
    cache at the positions (as cache.kv_write_at's index_put puts them), every other position untouched."""
    from engine.cache import kv_write_at

    gen, positions, cos, sin, q, k, v, keys, values = store_inputs(device, dtype, T)
    want_keys, want_values = keys.clone(), values.clone()
    assert rope_triton.storable(q, k, v, cos, keys, values)
    q_got = rope_triton.rotate_and_store(q, k, v, cos, sin, keys, values, positions)
    q_want, k_want = rope_triton.rotate(q, k, cos, sin)
    kv_write_at(want_keys, want_values, positions, k_want, v)
    assert torch.equal(q_got, q_want) and torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert not rope_triton.storable(q, k, v, cos, (keys, keys[..., 0]), values)  # (an fp8 cache: the torch form)


def test_install_keeps_the_torch_form_off_cuda_in_float32_and_when_asked(device, monkeypatch):
    from engine.kernels import Backends

    rot, config = rotary(device)
    b = Backends()
    rope_triton.install(b, rot, config, torch.device("cpu"), torch.bfloat16)
    assert b.rope == "torch" and b.choice["rope"][0] == "torch"
    assert rope_triton.supported(torch.device("cpu"), torch.bfloat16) in ("not CUDA", "triton not installed")
    assert rope_triton.supported(torch.device("cuda"), torch.float32) in ("float32: the exact reference path",
                                                                          "triton not installed")
    monkeypatch.setattr(rope_triton, "supported", lambda device, dtype: None)
    rope_triton.install(b, rot, config, device, torch.float32)
    assert b.rope == "triton" and b.choice["rope"][0] == "triton", b.choice["rope"]
    monkeypatch.setenv("MTPCHAT_ROPE", "torch")
    b = Backends()
    rope_triton.install(b, rot, config, device, torch.float32)
    assert b.rope == "torch" and "MTPCHAT_ROPE=torch" in b.choice["rope"][1]


@pytest.mark.parametrize("name", ["next", "q35"])
def test_the_engine_decodes_exactly_with_the_kernels(name, ckpt, device, monkeypatch):
    """Loaded with the kernels allowed (on the CPU the interpreter runs them, in float32): the diagnostics name
    them, they run, greedy decoding equals transformers (CPU) and speculation at depths 1-4 equals plain
    decoding, with drafts accepted and rejected, through the CUDA graphs and cycle graphs (graphs.Rerun on the
    CPU), whose passes take the positions on the device."""
    from engine import load_engine

    monkeypatch.setattr(rope_triton, "supported", lambda device, dtype: None)
    calls = {"table": 0, "rotate": 0, "rotate_and_store": 0}

    def counted(name):
        run = getattr(rope_triton, name)

        def counting(*args, **kw):
            calls[name] += 1
            return run(*args, **kw)
        return counting

    for fn in calls:
        monkeypatch.setattr(rope_triton, fn, counted(fn))
    engine = load_engine(str(ckpt(name)), device=str(device), dtype="float32", cuda_graphs=True)
    assert engine.trunk.backends.rope == "triton", engine.trunk.backends.choice["rope"]
    def ran():
        assert calls["table"] > 0 and calls["rotate"] > 0 and calls["rotate_and_store"] > 0  # (eager, graphs)

    assert_exact_with_kernel(engine, ckpt(name), device, ran)


@pytest.mark.parametrize("on_device", [True, False])
def test_the_table_kernel_compiles_for_a_gpu(on_device):
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    compile_for_gpu("engine.rope_triton", "_table_kernel",
                    {"pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "scaling": "fp32"},
                    {"HALF": 32, "BLOCK": 32, "ON_DEVICE": on_device, "PDL": True}, num_warps=1)


@pytest.mark.parametrize("rd, store, norm", [(64, False, False), (256, False, False), (64, True, False),
                                             (64, True, True)])
def test_the_rotation_kernel_compiles_for_a_gpu(rd, store, norm):
    pytest.importorskip("triton")
    from triton_front import compile_for_gpu

    pointers = ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "out_ptr", "v_ptr", "kc_ptr", "vc_ptr", "wq_ptr", "wk_ptr")
    compile_for_gpu("engine.rope_triton", "_rotate_kernel",
                    {p: "*bf16" for p in pointers} | {"pos_ptr": "*i64", "eps": "fp32", "shift": "fp32"},
                    {"D": 256, "RD": rd, "BLOCK": 256, "STORE": store, "NORM": norm, "PDL": True}, num_warps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shift", [1.0, 0.0])
def test_rotate_and_store_with_the_qk_norms_is_the_norm_kernel_then_the_rotation(device, dtype, T, shift):
    """q_norm and k_norm in the rotation's launch (qk_norms: two launches fewer per attention layer and pass):
    what norm_triton's kernel then rotate_and_store give, queries strided as attention makes them (before the
    norm: half of q_proj's rows), zero-centred weights and plain ones."""
    from engine import norm_triton

    gen, positions, cos, sin, q, k, v, keys, values = store_inputs(device, dtype, T)
    wq, wk = ((torch.randn(64, generator=gen, device=device) * 0.2 + 1 - shift).to(dtype) for _ in range(2))
    want_keys, want_values = keys.clone(), values.clone()
    q_got = rope_triton.rotate_and_store(q, k, v, cos, sin, keys, values, positions, (wq, wk, 1e-6, shift))
    q_normed, k_normed = (norm_triton.rms_norm(x, w, 1e-6, shift).transpose(1, 2)
                          for x, w in ((q.transpose(1, 2), wq), (k.transpose(1, 2), wk)))
    q_want = rope_triton.rotate_and_store(q_normed, k_normed, v, cos, sin, want_keys, want_values, positions)
    for got, want in ((q_got, q_want), (keys, want_keys), (values, want_values)):
        if device.type == "cuda":  # (the norm kernel may fuse products into FMAs that this launch leaves apart)
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
        else:
            assert torch.equal(got, want)
    assert not torch.equal(q_got, rope_triton.rotate_and_store(q, k, v, cos, sin, keys, values, positions))


def test_the_engine_decodes_exactly_with_the_qk_norms_in_the_rotation(ckpt, device, monkeypatch):
    """The same with norm_triton's kernel allowed too: every graph-mode attention layer (the trunk's and the MTP
    head's) normalises its queries and keys inside the rotation's launch, the MTP head's input is one launch
    (norm_triton.two_norms), and decoding stays exact."""
    from engine import load_engine, mtp, norm_triton

    monkeypatch.setattr(rope_triton, "supported", lambda device, dtype: None)
    monkeypatch.setattr(norm_triton, "_why_not", lambda device, dtype: None)  # (float32: the exact path otherwise)
    fused = []
    store = rope_triton.rotate_and_store
    monkeypatch.setattr(rope_triton, "rotate_and_store",
                        lambda *a, **kw: fused.append(a[8] if len(a) > 8 else kw.get("norms")) or store(*a, **kw))
    inputs = []
    two_norms = mtp.two_norms
    monkeypatch.setattr(mtp, "two_norms", lambda *a: inputs.append(two_norms(*a)) or inputs[-1])
    engine = load_engine(str(ckpt("next")), device=str(device), dtype="float32", cuda_graphs=True)
    assert engine.trunk.backends.rope == "triton" and engine.trunk.backends.choice["rmsnorm"][0] == "triton"
    fused.clear()  # (the self-check's calls at load: without norms too)

    def ran():
        assert fused and all(n is not None for n in fused), fused[:4]
        assert inputs and all(x is not None for x in inputs)

    assert_exact_with_kernel(engine, ckpt("next"), device, ran)
