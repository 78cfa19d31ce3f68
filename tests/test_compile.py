"""Compile boundaries: with GPU-only kernels replaced by compiler-disabled stand-ins (what FLA's entry points
are), the verify and prefill steps still compile with fullgraph=True through the custom ops, compute the same
thing, and the in-place conv-cache mutation happens."""

import os
import shutil

import pytest
import torch

from engine import kernels
from fixtures import load_with_kv_cache

standin_recurrent = torch.compiler.disable(kernels.torch_recurrent)
standin_chunk = torch.compiler.disable(kernels.torch_chunk)


@pytest.fixture(params=["next", "next_moe", "next:fp8"])
def engine(ckpt, monkeypatch, request):
    """A fixture's engine with the GDN kernels replaced by stand-ins; "name:fp8": over an fp8 KV cache (its
    quantizing writes, byte views and dequantization inside the compiled graphs too)."""
    name, _, kv = request.param.partition(":")
    monkeypatch.setitem(kernels.IMPLEMENTATIONS, "standin", (standin_recurrent, standin_chunk))
    eng = load_with_kv_cache(kv or "auto", str(ckpt(name)), device="cpu")
    assert eng.caches.kv.fp8 == (kv == "fp8")
    eng.trunk.backends.gdn_recurrent = kernels.Kernel("standin", False)
    eng.trunk.backends.gdn_chunk = kernels.Kernel("standin", True)
    return eng


def test_standin_breaks_fullgraph_without_the_boundary(monkeypatch):
    monkeypatch.setitem(kernels.IMPLEMENTATIONS, "standin", (standin_recurrent, standin_chunk))
    q = k = torch.randn(1, 2, 2, 8)
    v = torch.randn(1, 2, 2, 8)
    g, beta, s = -torch.rand(1, 2, 2), torch.rand(1, 2, 2), torch.zeros(1, 2, 8, 8)
    with pytest.raises(Exception):
        torch.compile(lambda *a: standin_recurrent(*a)[0], fullgraph=True, backend="aot_eager")(q, k, v, g, beta, s)
    final = torch.empty_like(s)
    out = torch.compile(lambda *a: kernels.gdn_op(*a, "standin", False, False), fullgraph=True,
                        backend="aot_eager")(q, k, v, g, beta, s, final)
    ref_out, ref_final = kernels.torch_recurrent(q, k, v, g, beta, s)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(final, ref_final)  # the final state went where it was asked to
    assert not s.any()  # and the state it started from was left alone


@pytest.mark.parametrize("chunked", [False, True])
def test_gdn_op_fake_matches_the_kernel_on_strided_inputs(chunked):
    """Compiled code trusts the fake's output strides. q / k / v arrive as views of the conv output
    ([1, C, T] transposed, split, reshaped: not contiguous once T > 1); the outputs must not follow them."""
    T, H, D = 3, 2, 8
    conv = torch.randn(1, 3 * H * D, T)
    q, k, v = (t.reshape(1, T, H, D) for t in torch.split(conv.transpose(1, 2), H * D, dim=-1))
    assert not v.is_contiguous()
    g, beta, s = -torch.rand(1, T, H), torch.rand(1, T, H), torch.zeros(1, H, D, D)
    torch.library.opcheck(kernels.gdn_op, (q, k, v, g, beta, s, torch.empty_like(s), "torch", chunked, False),
                          test_utils=("test_schema", "test_faketensor"))
    # the in-place form (prefill, plain decoding, commit's replay): declared mutation of the state, fresh output
    torch.library.opcheck(kernels.gdn_update_op, (conv.transpose(1, 2), g, beta, s, [H, D, H, D], "torch",
                                                  chunked, False), test_utils=("test_schema", "test_faketensor"))


# inductor as well as aot_eager: the in-place writes the compiled steps make (the conv cache, the verify stash's
# final states) are inductor's to schedule on the GPU; its C++ backend on the CPU schedules them the same way
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor's CPU backend needs a C++ compiler"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_and_prefill_compile_fullgraph(engine, backend):
    trunk, caches = engine.trunk, engine.caches
    prompt = torch.tensor(engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}]))

    def prefill_step(tokens, pos):
        return trunk.forward(tokens, pos, caches, verify=False)

    def verify_step(tokens, pos):
        return trunk.logits(trunk.forward(tokens, pos, caches, verify=True)[0])

    with torch.inference_mode():
        caches.reset()
        caches.kv.reserve(prompt.shape[0] + 16)
        caches.stash_for(8, trunk)
        eager_h = prefill_step(prompt[None], torch.tensor(0))
        eager_conv, eager_rec = caches.gdn.conv.clone(), caches.gdn.recurrent.clone()
        caches.reset()
        assert not caches.gdn.conv.any()
        compiled_prefill = torch.compile(prefill_step, fullgraph=True, backend=backend)
        h = compiled_prefill(prompt[None], torch.tensor(0))
        torch.testing.assert_close(h, eager_h)
        # the conv cache was mutated in place by the compiled graph
        torch.testing.assert_close(caches.gdn.conv, eager_conv)
        torch.testing.assert_close(caches.gdn.recurrent, eager_rec)
        caches.processed = prompt.shape[0]

        tokens = torch.tensor([[5, 6, 7]])
        pos = torch.tensor(caches.processed)
        eager = verify_step(tokens, pos)
        eager_final = caches.stash.final.clone()
        caches.stash.final.zero_()
        compiled = torch.compile(verify_step, fullgraph=True, backend=backend)
        torch.testing.assert_close(compiled(tokens, pos), eager)
        # each GDN layer's final state went into the stash, through the custom op
        torch.testing.assert_close(caches.stash.final, eager_final)
        # a later cycle at another position re-uses the compiled graph (position is a tensor, not a constant)
        torch.testing.assert_close(compiled(tokens, pos + 1), verify_step(tokens, pos + 1))


def test_one_compiled_region_per_layer_kind_and_width(engine):
    """Regional compilation (graphs.compile_block): the decoder layer compiles once per (layer kind, verify width)
    and every layer of that kind reuses it — not once per layer, and not one unrolled graph per width."""
    from torch._dynamo.utils import counters

    from engine.graphs import compile_block

    trunk, caches = engine.trunk, engine.caches
    prompt = torch.tensor(engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}]))
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        caches.reset()
        caches.kv.reserve(prompt.shape[0] + 16)
        caches.stash_for(8, trunk)
        trunk.forward(prompt[None], 0, caches, verify=False)
        caches.processed = prompt.shape[0]
        pos = torch.tensor(caches.processed)
        widths = (1, 2, 4)
        eager = {T: trunk.forward(torch.arange(5, 5 + T)[None], pos, caches, verify=True).clone() for T in widths}
        trunk.compiled_block = compile_block("aot_eager")
        try:
            for T in widths + widths:  # the second round re-uses every compiled region
                out = trunk.forward(torch.arange(5, 5 + T)[None], pos, caches, verify=True)
                torch.testing.assert_close(out, eager[T])
        finally:
            trunk.compiled_block = None
    # (a layer kind with both dense and MoE layers compiles once for each: their modules differ)
    kinds = len({(kind, type(layer.mlp)) for kind, layer in zip(trunk.kinds, trunk.layers)})
    assert len(trunk.kinds) > kinds  # several layers share each kind
    assert counters["stats"]["unique_graphs"] == kinds * len(widths)
