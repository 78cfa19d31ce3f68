"""16-bit linears through the streaming kernels where they beat cuBLAS (linear16_triton.py): the op runs the
choice timed for its width and cuBLAS for any other; the install is CUDA-only, all or none, undone for the
bench's transformers baseline; on a GPU the modules it serves equal F.linear within bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F

from engine import linear16_triton, stock_forward
from engine.splitk import bucket


@pytest.mark.parametrize("verify", [("dot", (16, 2, 2, 3)), ("rows", (16, 1, 4, 3)),  # (all are candidates)
                                    ("streamrows", (4, 1 << 20, 4, 2, 256))])
def test_the_op_runs_the_choice_of_its_width_and_cublas_for_any_other(triton_device, monkeypatch, verify):
    dtype = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(80, 256, generator=g) * 0.05).to(triton_device, dtype)
    chosen = {(80, 256, bucket(1), triton_device.index): ("rows", (32, 1, 4, 3)),
              (80, 256, bucket(4), triton_device.index): verify}
    assert verify in linear16_triton.CANDIDATES[4]
    monkeypatch.setattr(linear16_triton, "_chosen", chosen)
    for rows in (1, 3, 5, 12):  # the row kernel, the verify widths' choice, cuBLAS (no choice at 9-16 rows)
        x = torch.randn(2, rows, 256, generator=g).to(triton_device, dtype)[0]
        got = linear16_triton.matmul(x, w)
        ref = F.linear(x.float(), w.float())
        assert got.shape == (rows, 80) and got.dtype == dtype
        assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2, rows


def test_nothing_is_installed_off_cuda_and_the_stock_forward_comes_back():
    lin = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    assert linear16_triton.install([lin], "cpu", torch.bfloat16) is None and "forward" not in vars(lin)
    lin.forward = lambda x: x  # an instance forward, as install binds one
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with stock_forward([lin]):
        assert "forward" not in vars(lin) and torch.equal(lin(x), F.linear(x, lin.weight))
    assert lin.forward(3) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_an_installed_model_computes_its_linears_as_f_linear_and_the_opt_out_keeps_cublas(monkeypatch):
    from engine import random_model

    trunk = random_model("tiny", 2, "cuda", "bfloat16").trunk
    kind, why = trunk.backends.choice["linear16"]
    assert kind in ("triton", "cublas") and ("Triton" in why or "cuBLAS" in why), why
    served = [m for m in trunk.lm.modules() if "forward" in vars(m) and isinstance(m, torch.nn.Linear)]
    served += [m for m in trunk.lm.modules() if hasattr(m, "plain_kernel")]
    for m in served:
        w = m.weight if isinstance(m, torch.nn.Linear) else m.fused_weight
        for rows in (1, 4):
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            got = m(x) if isinstance(m, torch.nn.Linear) else m.plain_kernel(x, w)
            ref = F.linear(x.float(), w.float())
            assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    monkeypatch.setenv("MTPCHAT_LINEAR16", "cublas")
    lin = torch.nn.Linear(256, 96, bias=False, device="cuda", dtype=torch.bfloat16)
    assert linear16_triton.install([lin], "cuda", torch.bfloat16) == "cuBLAS (MTPCHAT_LINEAR16=cublas)"
    assert "forward" not in vars(lin)
