"""Programmatic dependent launch (splitk.pdl): a kernel whose blocks start while the previous kernel drains must
still read what that kernel wrote. A chain of the decode path's kernels, each reading the last one's output,
replayed from a CUDA graph with new inputs each time, gives bitwise what the same chain gives in stream order.
The launch options exist on CUDA only (Hopper and later launch that way)."""

import pytest
import torch

from engine import splitk
from engine.kernels import Backends
from engine.model import choose_launch


def test_kernels_off_cuda_launch_in_stream_order():
    assert splitk.pdl(torch.zeros(2)) == {}
    backends = Backends()
    choose_launch(backends, torch.device("cpu"))
    assert "launch" not in backends.choice  # (the diagnostics name it on CUDA only)


def _chain(x, norm_weight, w8, s8, w16, router):
    """rms_norm -> FP8 linear split over K (its last slice sums the partials) -> 16-bit linear -> 16-bit linear
    at four rows through the tensor-core form -> routing: each kernel reads the one before it."""
    from engine import fp8_triton, moe_triton, norm_triton

    h = norm_triton.launch(x, norm_weight, 1e-6)
    h = fp8_triton._launch(h, w8, s8, ("rows", (64, 2, 4, 4)))
    h = fp8_triton._launch(h, w16, None, ("rows", (64, fp8_triton.ALL, 4, 3)))
    logits = fp8_triton._launch(h.expand(4, -1).contiguous(), router, None, ("dot", (64, 4, 4, 3)))
    weights, idx = moe_triton.route(logits, router.shape[0], 4, True)
    return h, logits, weights, idx


@pytest.mark.gpu
def test_a_graph_of_pdl_kernels_reads_what_each_one_wrote(monkeypatch):
    if not torch.cuda.is_available() or splitk.triton is None:
        pytest.skip("needs CUDA and Triton")
    device = torch.device("cuda", torch.cuda.current_device())
    why = splitk.pdl_why_not(device)
    if why is not None:
        pytest.skip(f"no programmatic dependent launch here: {why}")
    backends = Backends()
    choose_launch(backends, device)
    assert backends.choice["launch"][0] == "pdl"

    from engine.fp8 import quantize

    g = torch.Generator().manual_seed(0)
    norm_weight = (torch.randn(1024, generator=g) * 0.1).to(device, torch.bfloat16)
    w8, s8 = (t.to(device) for t in quantize(torch.randn(2048, 1024, generator=g) * 0.05))
    w16 = (torch.randn(1024, 2048, generator=g) * 0.03).to(device, torch.bfloat16)
    router = (torch.randn(64, 1024, generator=g) * 0.05).to(device, torch.bfloat16)
    inputs = [torch.randn(1, 1024, generator=g).to(device, torch.bfloat16) for _ in range(4)]

    monkeypatch.setattr(splitk, "_pdl_devices", {device.index: False})
    expected = [[t.clone() for t in _chain(x, norm_weight, w8, s8, w16, router)] for x in inputs]

    monkeypatch.setattr(splitk, "_pdl_devices", {device.index: True})
    assert splitk.pdl(inputs[0]) == {"PDL": True, "launch_pdl": True}
    static = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(static, norm_weight, w8, s8, w16, router)  # compiles the PDL variants outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static, norm_weight, w8, s8, w16, router)
    for _ in range(3):  # replays back to back: a kernel reading too early sees the last replay's values
        for x, want in zip(inputs, expected):
            static.copy_(x)
            graph.replay()
            for got, ref in zip(out, want):
                assert torch.equal(got, ref)
