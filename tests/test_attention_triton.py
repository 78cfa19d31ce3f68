"""The split-K graph-mode attention kernel (attention_triton.py) against model.masked_decode_attention: decode and
verify widths, grouped-query heads, queries at the start, middle and end of a capacity that is mostly empty.
CUDA, or the CPU through Triton's interpreter (TRITON_INTERPRET=1 with Triton installed); else skipped."""

import pytest
import torch

from engine.model import masked_decode_attention


@pytest.mark.parametrize("heads,kv_heads,head_dim,T,capacity,first", [
    (6, 2, 64, 4, 512, 100),  # a verify width at an offset
    (8, 2, 128, 1, 2048, 1500),  # plain decoding's one query, far into the cache
    (6, 2, 64, 17, 1024, 0),  # a wide verify from position 0: several row blocks
    (4, 4, 64, 3, 256, 253),  # the last positions of the capacity
    (24, 4, 256, 4, 4096, 3000),  # the 27B shape's heads
    (8, 2, 64, 2, 65536, 40000),  # more live splits than the merge reads at once (40 of 256)
    (6, 2, 64, 4, 8192, 7000),  # the most splits merged by the last split program to finish (28 live of 32)
])
def test_split_k_attention_equals_the_masked_form(triton_device, heads, kv_heads, head_dim, T, capacity, first):
    from engine import attention_triton

    dev = triton_device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    g = torch.Generator(device=dev).manual_seed(first)
    # (as the engine's queries come: [1, T, H, D] transposed, read through their strides)
    q = torch.randn(1, T, heads, head_dim, device=dev, dtype=dtype, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, kv_heads, capacity, head_dim, device=dev, dtype=dtype, generator=g) for _ in range(2))
    k[:, :, first + T :] = float("nan")  # past the filled length: never read (NaN would show)
    v[:, :, first + T :] = float("nan")
    positions = torch.arange(first, first + T, device=dev)
    future = torch.arange(capacity, device=dev)[None, :] > positions[:, None]
    out = attention_triton.attention(q, k, v, positions, head_dim ** -0.5)
    ref = masked_decode_attention(q.float(), k.float().nan_to_num(), v.float().nan_to_num(), future,
                                  head_dim ** -0.5).transpose(1, 2)  # (the output comes as o_proj reads it)
    assert out.dtype == dtype and out.shape == (1, T, heads, head_dim) and out.is_contiguous()
    assert (out.float() - ref).abs().max().item() < 2e-2
    # with the gated attention's output gate: a strided view of q_proj's output, as model.attention passes it
    gate = torch.randn(1, T, heads, 2 * head_dim, device=dev, dtype=dtype, generator=g)[..., head_dim:] * 3
    gated = attention_triton.attention(q, k, v, positions, head_dim ** -0.5, gate=gate)
    want = torch.sigmoid(gate) * out  # (the torch form: both rounded to the dtype, the product rounded)
    assert gated.shape == out.shape and (gated.float() - want.float()).abs().max().item() <= 2 * 2 ** -7


@pytest.mark.parametrize("heads,kv_heads,head_dim,T,capacity,first", [
    (6, 2, 64, 4, 512, 100),  # a verify width at an offset
    (24, 4, 256, 1, 4096, 3000),  # the 27B shape's heads, plain decoding
])
def test_split_k_attention_over_an_fp8_cache_equals_the_masked_form_over_its_values(triton_device, heads, kv_heads,
                                                                                    head_dim, T, capacity, first):
    """An fp8 cache (--kv-cache-dtype fp8): e4m3 codes and their scales in, against the masked form over the
    dequantized values. Scales span four orders of magnitude across positions, so a scale applied to the wrong
    position would show."""
    from engine import attention_triton
    from engine.cache import dequantize_kv, quantize_kv

    dev = triton_device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    g = torch.Generator(device=dev).manual_seed(first)
    q = torch.randn(1, heads, T, head_dim, device=dev, dtype=dtype, generator=g)
    order = torch.randperm(capacity, generator=torch.Generator().manual_seed(0)).to(dev)
    size = torch.logspace(-2, 2, capacity, device=dev)[order]
    k, v = (torch.randn(1, kv_heads, capacity, head_dim, device=dev, generator=g) * size[:, None] for _ in range(2))
    k = k / size[:, None] ** 0.9  # keys near unit size (as after k_norm), values across the whole range
    (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
    positions = torch.arange(first, first + T, device=dev)
    future = torch.arange(capacity, device=dev)[None, :] > positions[:, None]
    out = attention_triton.attention(q, kc, vc, positions, head_dim ** -0.5, ks, vs)
    ref = masked_decode_attention(q.float(), dequantize_kv((kc, ks), torch.float32),
                                  dequantize_kv((vc, vs), torch.float32), future, head_dim ** -0.5).transpose(1, 2)
    assert out.dtype == dtype and out.shape == (1, T, heads, head_dim)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.parametrize("fp8", [False, True])
def test_the_kernel_compiles_for_a_gpu(fp8):
    """Triton's interpreter never type-checks or lowers a kernel as the compiler does (tests/triton_front.py):
    the split-K decode attention compiles for sm_90 over a 16-bit cache and over an fp8 one, its splits merged by
    their last program (gated or not) or by the merge kernel, without a GPU."""
    pytest.importorskip("triton")
    from engine import attention_triton
    from triton_front import compile_for_gpu

    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {"Q": "*bf16", "K": cache, "V": cache, "KS": "*fp32", "VS": "*fp32", "POS": "*i64", "M": "*fp32",
             "L": "*fp32", "ACC": "*fp32", "scale": "fp32", "LOCKS": "*i32", "OUT": "*bf16", "GATE": "*bf16"}
    for merge, gated in ((False, False), (True, False), (True, True)):  # (the merge in the last split program)
        compile_for_gpu("engine.attention_triton", "_splits", types,
                        {"BLOCK_R": 32, "BLOCK_N": 64, "D": 256, "FP8": fp8, "MERGE": merge, "GATED": gated,
                         "PDL": True}, num_warps=4, num_stages=attention_triton.STAGES)
    if not fp8:  # float32 (the tests' engines on CUDA): full-precision dots
        compile_for_gpu("engine.attention_triton", "_splits", types | {p: "*fp32" for p in ("Q", "K", "V", "OUT", "GATE")},
                        {"BLOCK_R": 32, "BLOCK_N": 64, "D": 64, "MERGE": True, "GATED": True, "DOT": "ieee",
                         "PDL": True}, num_warps=4, num_stages=attention_triton.STAGES)
    if not fp8:  # (the merge reads float32 partials whatever the cache holds)
        merge = {"M": "*fp32", "L": "*fp32", "ACC": "*fp32", "POS": "*i64", "OUT": "*bf16", "GATE": "*bf16"}
        for gated in (False, True):
            compile_for_gpu("engine.attention_triton", "_merge", merge,
                            {"BLOCK_S": attention_triton.MERGE_SPLITS, "D": 256, "GATED": gated, "PDL": True},
                            num_warps=2)


def test_graph_passes_with_the_kernel_decode_as_eager(triton_device, monkeypatch):
    """model.attention's graph-mode branch with the kernel (its output gated and laid out as o_proj reads it):
    the demo model's graph passes (on the CPU, graphs.Rerun's re-runs in float32) give eager plain decoding's
    tokens, plain and at depth 3 with drafts accepted and rejected."""
    from engine import load_engine
    from test_exactness import decode
    from test_graphs import DEMO

    # (float32 on CUDA too: in 16 bits eager passes and graph steps run other kernels and round apart)
    eager = load_engine(DEMO, device=str(triton_device), dtype="float32")
    graphs = load_engine(DEMO, device=str(triton_device), dtype="float32", cuda_graphs=True)
    graphs.trunk.backends.decode_attention = "triton"
    prompt = graphs.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    plain = decode(eager, prompt, None, depth=0, max_new_tokens=32)[0]
    calls, real = [], torch.ops.mtpchat.decode_attention
    monkeypatch.setattr(torch.ops.mtpchat, "decode_attention", lambda *a: calls.append(a[-1] is not None) or real(*a))
    for depth in (0, 3):
        tokens, _, fin = decode(graphs, prompt, None, depth=depth, max_new_tokens=32)
        assert tokens == plain
        if depth:
            assert fin.stats["drafted"] > fin.stats["accepted"] > 0
    assert calls and all(calls)  # the kernel ran, with the output gate
