"""random_model with --quant fp8 / int4 builds one decoder layer at a time (presets._build_layerwise): the same
modules as building the whole model and then quantizing it, initialised as post_init initialises them, nothing
left on meta, decoding exactly, and never the whole model in the model dtype at once (what lets the 80B-A3B FP8
model be built on one H200: ~160 GB in bf16, ~80 GB in FP8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import Engine, fp8, presets
from engine.drafters import OracleDrafter
from engine.fp8 import FP8Experts, FP8Linear
from engine.int4 import Int4Linear
from engine.presets import planted_next, random_model
from test_exactness import decode

ROOT = Path(__file__).resolve().parent.parent

# Toy shapes of the released families (the real presets are GBs even at one layer). Hidden and intermediate sizes
# are multiples of 128, so int4.quantize_linears (groups of 128 input rows) quantizes the same linears as at scale.
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
TOYS = {
    "toy-qwen3.5": ("qwen3_5_text", SMALL),
    "toy-qwen3-next-moe": ("qwen3_next", dict(SMALL, **MOE, decoder_sparse_step=1, mlp_only_layers=[])),
    "toy-qwen3.5-moe": ("qwen3_5_moe_text", dict(SMALL, **MOE)),
    "toy-qwen3.5-tied": ("qwen3_5_text", dict(SMALL, tie_word_embeddings=True)),
    # for the memory test: 16 layers of ~10.5M parameters (42 MB each in float32), small embeddings
    "wide": ("qwen3_next", dict(SMALL, num_experts=0, hidden_size=1024, intermediate_size=2048, num_hidden_layers=16,
                                num_attention_heads=8, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                                linear_key_head_dim=128, linear_value_head_dim=128)),
}


@pytest.fixture(autouse=True)
def toy_presets(monkeypatch):
    for name, preset in TOYS.items():
        monkeypatch.setitem(presets.PRESETS, name, preset)


def whole_model(monkeypatch, *args, **kw):
    """random_model through the path every quantized build took before: the whole model in the model dtype,
    then quantized (the path tensor parallelism still takes)."""
    with monkeypatch.context() as m:
        m.setattr(presets, "_builds_layerwise", lambda quant, group: False)
        return random_model(*args, **kw)


def tensors(loaded) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the trunk and the MTP head, by name (the head's as mtp.*)."""
    return {prefix + n: t for prefix, m in (("", loaded.trunk.lm), ("mtp.", loaded.mtp)) if m is not None
            for n, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]}


def module_types(loaded) -> set[tuple[str, str]]:
    return {(prefix + n, type(x).__name__) for prefix, m in (("", loaded.trunk.lm), ("mtp.", loaded.mtp))
            if m is not None for n, x in m.named_modules()}


def weights(lm) -> dict[str, torch.Tensor]:
    """lm's floating tensors by name in float32, the quantized modules' weights dequantized (their codes mean
    nothing without their scales; the fused copies of the projections are skipped)."""
    out = {}
    for name, m in lm.named_modules():
        at = name + "." if name else ""
        if isinstance(m, FP8Linear):
            out[at + "weight"] = fp8.dequantize(m.weight, m.weight_scale_inv, torch.float32)
        elif isinstance(m, FP8Experts):
            out[at + "gate_up_proj"], out[at + "down_proj"] = m.dense(torch.arange(m.num_experts), torch.float32)
        elif isinstance(m, Int4Linear):
            out[at + "weight"] = m.dequantized()
        elif "fused" not in name:
            out.update({at + n: t.float() for n, t in [*m.named_parameters(recurse=False),
                                                       *m.named_buffers(recurse=False)]
                        if t.is_floating_point() and t.numel() > 1 and "fused" not in n})
    return out


@pytest.mark.parametrize("quant", ["fp8", "int4"])
@pytest.mark.parametrize("preset", ["toy-qwen3.5", "toy-qwen3-next-moe", "toy-qwen3.5-moe"])
def test_layerwise_build_is_the_whole_model_build_and_decodes_exactly(preset, quant, monkeypatch):
    new = random_model(preset, None, "cpu", "float32", quant=quant)
    old = whole_model(monkeypatch, preset, None, "cpu", "float32", quant=quant)
    got, want = tensors(new), tensors(old)
    # nothing left on meta: no parameter or buffer, nor a tensor a module keeps as a plain attribute
    assert [n for n, t in got.items() if t.is_meta] == []
    assert [(n, a) for m in (new.trunk.lm, new.mtp) for n, x in m.named_modules() for a, v in vars(x).items()
            if isinstance(v, torch.Tensor) and v.is_meta] == []
    # the same quantized modules in the same places, and every tensor with the same name, dtype and shape
    assert module_types(new) == module_types(old)
    quantized = {t for _, t in module_types(new)} & {"FP8Linear", "FP8Experts", "Int4Linear"}
    assert quantized == ({"FP8Linear", "FP8Experts"} if quant == "fp8" and "moe" in preset else
                         {"FP8Linear"} if quant == "fp8" else {"Int4Linear"})
    assert {(n, t.dtype, tuple(t.shape)) for n, t in got.items()} == {
        (n, t.dtype, tuple(t.shape)) for n, t in want.items()}
    # initialised as post_init initialises the whole model: the planted embedding and lm_head, the rotary
    # frequencies, the constant norms and dt_bias exactly; random tensors, the quantized ones dequantized, with the
    # same spread (other draws). The trunk only: the whole-model path leaves the MTP head at torch's defaults (its
    # routed experts uninitialised, torch.empty)
    got, want = weights(new.trunk.lm), weights(old.trunk.lm)
    assert got.keys() == want.keys()
    for name, t in got.items():
        ref = want[name]
        if "embed_tokens" in name or "lm_head" in name or "inv_freq" in name or ref.std() == 0:
            assert torch.equal(t, ref), name
        elif t.numel() >= 1024:
            assert abs(t.std() / ref.std() - 1) < 0.05, name
    # the MTP head is initialised as the trunk's layers are: its linears (quantized too) at initializer_range
    head = weights(new.mtp)
    assert all(t.isfinite().all() for t in head.values())
    assert abs(head["fc.weight"].std() / new.trunk.config.initializer_range - 1) < 0.05
    assert abs(head["layers.0.self_attn.o_proj.weight"].std() / new.trunk.config.initializer_range - 1) < 0.05
    # greedy decoding follows the planted map, and speculation at depth 2 gives the same tokens
    engine = Engine(new, None, set())
    prompt = list(range(1, 33))
    plain, _, _ = decode(engine, prompt, depth=0, max_new_tokens=12)
    vocab = engine.trunk.config.vocab_size
    assert plain == [planted_next(t, vocab) for t in ([prompt[-1]] + plain)[:-1]]
    spec, sources, fin = decode(engine, prompt, OracleDrafter(plain, len(prompt), 0.0, vocab), depth=2,
                                max_new_tokens=12)
    assert spec == plain and fin.stats["acceptance_rate"] == 1.0 and sources.count("draft") > 0
    spec, _, fin = decode(engine, prompt, depth=2, max_new_tokens=12)  # the (random, quantized) MTP head drafts
    assert spec == plain and fin.stats["drafter"] == "mtp" and fin.stats["drafted"] > 0


def test_a_tied_preset_stays_tied():
    """to_empty gives the embedding and lm_head separate tensors; the build ties them again, as post_init does."""
    lm = random_model("toy-qwen3.5-tied", 1, "cpu", "float32", quant="fp8").trunk.lm
    assert lm.lm_head.weight is lm.model.embed_tokens.weight and not lm.lm_head.weight.is_meta
    assert isinstance(lm.model.layers[0].mlp.down_proj, FP8Linear)


# Run in a fresh process: glibc's malloc keeps freed blocks below its (self-raising) mmap threshold in the heap,
# so the resident set of a process that freed 16 layers of float32 measures fragmentation, not what is alive.
# A fixed 1 MiB threshold maps every tensor on its own and unmaps it when freed; writing 5 to /proc/self/clear_refs
# resets the peak (VmHWM) before each build (Linux).
PEAK_RSS = """
import json, re, sys
import torch
from engine import presets
torch.set_num_threads(1)
presets.PRESETS["wide"] = tuple(json.loads(sys.argv[1]))
quant = sys.argv[2]

def peak(whole_model):
    if whole_model:  # (the old path: quantize after building it all)
        presets._builds_layerwise = lambda q, g: False
    kib = lambda field: int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
    open("/proc/self/clear_refs", "w").write("5")
    start = kib("VmRSS")
    loaded = presets.random_model("wide", None, "cpu", "float32", quant=quant)
    return (kib("VmHWM") - start) * 1024

presets.random_model("wide", 1, "cpu", "float32", quant=quant)  # (imports and one-time allocations first)
print(json.dumps([peak(False), peak(True)]))
"""


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_the_quantized_build_never_holds_the_whole_model_in_the_model_dtype(quant):
    """The peak resident memory of building "wide" (16 layers of 42 MB in float32, 0.7 GB whole) stays under
    half the model's float32 bytes: one float32 layer, the embeddings and the already quantized layers (1 byte a
    weight in FP8, ~0.5 in int4) fit there; the whole float32 model cannot. The same measurement of the
    whole-model path (the old build, which quantizes afterwards) shows that it does see a whole model: its peak is
    at least the model's float32 bytes. Measured through the OS's peak RSS of a real build: nothing is mocked."""
    fam, cfg, _ = presets.preset_config("wide", None)
    with torch.device("meta"):
        whole = 4 * sum(p.numel() for p in fam.causal_lm_class()(cfg).parameters())
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    run = subprocess.run([sys.executable, "-c", PEAK_RSS, json.dumps(TOYS["wide"]), quant], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    peak, old_peak = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\n{quant}: model {whole / 2**20:.0f} MiB in float32; build peak {peak / 2**20:.0f} MiB layer by layer, "
          f"{old_peak / 2**20:.0f} MiB whole")
    assert old_peak >= whole, (old_peak, whole)
    assert peak < whole / 2, (peak, whole)
