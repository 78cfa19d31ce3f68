"""The CPU's verify widths through oneDNN over reordered weights (engine/cpu_linear.py)."""

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_linear, load_engine
from engine.kernels import relative_error
from test_exactness import FAMILIES, PROMPTS, assert_speculation_equals_plain, decode
from fixtures import greedy_reference

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("n,k", [(96, 64), (200, 300), (8192, 384)])
def test_the_matmul_is_f_linear_at_one_row_and_prefills_and_close_between(n, k):
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g), torch.randn(1, 12, k, generator=g)
    packed = cpu_linear.reordered(w)
    for rows in (1, 9, 12):  # decoding's row and prefills: F.linear itself
        assert torch.equal(cpu_linear.matmul(x[:, :rows], w, packed), F.linear(x[:, :rows], w))
    for rows in range(2, cpu_linear.ROWS_MAX + 1):
        got = cpu_linear.matmul(x[:, :rows], w, packed)
        assert got.shape == (1, rows, n)
        assert relative_error(got, F.linear(x[:, :rows], w)) < 1e-5  # (float32 rounding)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """A verify pass's row gives the same bits at any width from 2 to ROWS_MAX (one reordered layout)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(384, 256, generator=g), torch.randn(cpu_linear.ROWS_MAX, 256, generator=g)
    packed = cpu_linear.reordered(w)
    full = cpu_linear.matmul(x, w, packed)
    for rows in range(2, cpu_linear.ROWS_MAX):
        assert torch.equal(cpu_linear.matmul(x[:rows], w, packed), full[:rows]), rows


def test_install_says_why_not(monkeypatch):
    lin = torch.nn.Linear(64, 32, bias=False)
    assert cpu_linear.install([lin], "cuda", torch.float32) is None  # (linear16_triton's, there)
    assert cpu_linear.install([lin.to(torch.bfloat16)], "cpu", torch.bfloat16).startswith("MKL (bfloat16")
    lin.float()
    monkeypatch.setattr(cpu_linear, "cpu_memory", lambda: (1 << 30, 4 * 64 * 32 * 4 - 1))
    assert "would take over a quarter" in cpu_linear.install([lin], "cpu", torch.float32)
    monkeypatch.setenv("MTPCHAT_CPU_LINEAR", "mkl")
    assert cpu_linear.install([lin], "cpu", torch.float32) == "MKL (MTPCHAT_CPU_LINEAR=mkl)"
    assert "forward" not in vars(lin)


@pytest.fixture(scope="module")
def onednn_engines(ckpt):
    """The fixtures with every float32 linear on oneDNN at verify widths (untimed: every shape served)."""
    made = {}

    def get(name):
        if name not in made:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MTPCHAT_CPU_LINEAR", "onednn")
                made[name] = load_engine(str(ckpt(name)), device="cpu")
        return made[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_with_onednn_verify_passes_speculation_equals_plain(name, onednn_engines):
    engine = onednn_engines(name)
    kind, why = engine.trunk.backends.choice["cpu_linear"]
    assert kind == "onednn" and why.startswith("oneDNN"), why
    served = [m for m in engine.trunk.lm.modules() if "forward" in vars(m) or hasattr(m, "plain_kernel")]
    assert served and engine.trunk.lm.lm_head.forward.__func__ is cpu_linear._forward
    for depth in (1, 2, 3, 4):
        assert_speculation_equals_plain(engine, depth)


@pytest.mark.parametrize("name", ["next", "q35_moe"])
def test_with_onednn_prefill_chunks_greedy_equals_transformers(name, onednn_engines, ckpt):
    """7-token prefill chunks run the oneDNN matmul too: the greedy reply is still transformers'."""
    import transformers as tf

    engine = onednn_engines(name)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(ckpt(name)), dtype=torch.float32).eval()
    for messages in PROMPTS:
        prompt = engine.encode_chat(messages)
        ours, _, _ = decode(engine, prompt, depth=0, prefill_chunk=7)
        assert ours == greedy_reference(hf, prompt, 24)
