"""The Triton W8A16 kernel (fp8_triton.py) against dequantize-then-matmul: decode, verify and graph-prefill
widths, edge blocks, K split into slices, and rows that do not depend on the batch (speculation's verify pass
must give each row what decoding it alone gives). CUDA, or the CPU through Triton's interpreter
(TRITON_INTERPRET=1 with Triton installed); else skipped."""

import pytest
import torch
import torch.nn.functional as F

from engine.fp8 import FP8Linear, dequantize, quantize


def _fp8(n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, s = quantize(torch.randn(n, k, generator=g) * 0.05)
    return w.to(device), s.to(device)


@pytest.mark.parametrize("n,k,rows,config", [
    (256, 384, 1, ("rows", (64, 8, 4, 4))),  # decode: whole blocks
    (200, 300, 5, ("rows", (32, 8, 4, 4))),  # verify rows over partial edge blocks in N and K
    (256, 1024, 3, ("rows", (64, 2, 4, 4))),  # K in four slices of two blocks: the partial sums add up
    (256, 384, 1, ("dot", (64, 8, 4, 3))),
    (200, 300, 5, ("dot", (64, 8, 4, 3))),
    (256, 1024, 3, ("dot", (32, 2, 4, 4))),
    (136, 256, 40, ("dot", (64, 8, 4, 3))),  # a graph prefill's bucket (BLOCK_M 64)
    (128, 128, 130, ("dot", (128, 4, 4, 3))),  # two row blocks of 128
])
def test_the_kernel_equals_the_dequantized_matmul(triton_device, n, k, rows, config):
    from engine import fp8_triton

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(n, k, triton_device, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(triton_device, dtype)
    got = fp8_triton._launch(x, w, s, config)
    ref = F.linear(x.float(), dequantize(w, s, torch.float32))
    assert got.dtype == dtype and got.shape == (rows, n)
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_the_row_kernel_gives_a_row_what_it_gives_it_alone(triton_device):
    """Its rows are independent: the same multiply-adds in the same order whatever the width."""
    from engine import fp8_triton

    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    w, s = _fp8(384, 512, triton_device)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(triton_device, dtype)
    choice = ("rows", (64, 2, 4, 4))
    verify = fp8_triton._launch(x, w, s, choice)
    for i in range(5):
        assert torch.equal(fp8_triton._launch(x[i : i + 1], w, s, choice), verify[i : i + 1])


def test_install_swaps_the_forward_after_its_self_check(triton_device):
    from engine import fp8_triton

    if triton_device.type != "cuda":
        # the interpreter's CPU tensors take the dequantizing forward, with the reason
        lin = FP8Linear(256, 128)
        assert fp8_triton.install([lin], "cpu", torch.bfloat16).startswith("weight-only")
        assert lin.fp8_kernel is None
        return
    lin = FP8Linear(256, 128, device="cuda")
    lin.weight.data, lin.weight_scale_inv.data = _fp8(128, 256, "cuda")
    why = fp8_triton.install([lin], "cuda", torch.bfloat16)
    assert why.startswith("Triton"), why
    assert lin.fp8_kernel is fp8_triton.matmul
    x = torch.randn(2, 3, 256, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), dequantize(lin.weight, lin.weight_scale_inv, torch.float32))
    assert ((lin(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_without_cuda_the_forward_stays_the_exact_reference():
    from engine import fp8_triton

    lin = FP8Linear(256, 128)
    assert fp8_triton.install([lin], "cpu", torch.float32).startswith("weight-only")
    assert fp8_triton.install([torch.nn.Linear(4, 4)], "cpu", torch.float32) is None
