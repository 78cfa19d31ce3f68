"""The decode-width MoE paths: row-wise (gathered expert weights; the CPU reference) and grouped GEMM over
expert-sorted rows (weights read in place; chosen on CUDA after a self-check at load). They compute the same
thing; the grouped one also runs through the whole speculative loop and compiles as one graph."""

import pytest
import torch

from engine.drafters import OracleDrafter
from engine.model import moe_check, moe_grouped, moe_rowwise
from test_exactness import PROMPTS, decode

MOE = ["next_moe", "q35_moe"]


def moe_layer(engine):
    return next(layer for layer in engine.trunk.layers if hasattr(layer.mlp, "experts"))


@pytest.mark.parametrize("name", MOE)
def test_grouped_equals_rowwise(name, engines):
    block = moe_layer(engines(name)).mlp
    gen = torch.Generator().manual_seed(0)
    for T in (1, 2, 5, 32):
        x = torch.randn(1, T, engines(name).trunk.config.hidden_size, generator=gen)
        with torch.inference_mode():
            torch.testing.assert_close(moe_grouped(block, x), moe_rowwise(block, x), rtol=1e-5, atol=1e-6)


def test_the_cpu_keeps_the_rowwise_reference(engines):
    trunk = engines("q35_moe").trunk
    assert moe_check(trunk)[0] == trunk.backends.moe == "rowwise"
    assert trunk.backends.choice["moe"][0] == "rowwise"


@pytest.mark.parametrize("name", MOE)
def test_speculation_through_grouped_moe_equals_plain(name, engines, monkeypatch):
    engine = engines(name)
    prompt = engine.encode_chat(PROMPTS[0])
    reference, _, _ = decode(engine, prompt, depth=0)
    monkeypatch.setattr(engine.trunk.backends, "moe", "grouped_mm")
    assert decode(engine, prompt, depth=0)[0] == reference
    vocab = engine.trunk.config.vocab_size
    for depth in (1, 3):
        assert decode(engine, prompt, depth=depth)[0] == reference
        spec, _, fin = decode(engine, prompt, OracleDrafter(reference, len(prompt), 0.3, vocab, seed=depth), depth=depth)
        assert spec == reference and fin.stats["accepted"] > 0


def test_grouped_moe_compiles_fullgraph(engines):
    """In bfloat16, the dtype it runs in on CUDA (the compiler's shape rule for _grouped_mm wants bf16)."""
    import copy

    block = copy.deepcopy(moe_layer(engines("q35_moe")).mlp).to(torch.bfloat16)
    x = torch.randn(1, 3, engines("q35_moe").trunk.config.hidden_size, dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: moe_grouped(block, x), fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), moe_grouped(block, x))
