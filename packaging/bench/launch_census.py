"""Kernel launches per plain step and per depth-3 cycle on the demo model, counted on the CPU: every aten op that
computes (views and allocations excluded) plus one per Triton kernel call, which Triton's interpreter runs here.
The RMSNorm kernels are on in both arms (as on a GPU); `off` keeps the short conv, the residual adds, the rotary
embedding and SwiGLU's activation as torch ops (MTPCHAT_SHORT_CONV=torch, MTPCHAT_ADD_NORM=0, MTPCHAT_ROPE=torch,
MTPCHAT_SWIGLU=torch), `on` runs them as conv_triton's, norm_triton.add_then_norm's, rope_triton's and
swiglu_triton's kernels. Per cycle: the difference between a 16- and a 48-token reply, over their cycles'
difference (the prompt's prefill cancels). Eager steps in bf16: the GPU's graphs hold fewer kernels a step (no
host-side ops), the same differences between the arms. The GDN recurrence counts as one launch (kernels.run_gdn: FLA's fused recurrent
kernel on a GPU; here the torch reference, dozens of ops), so the counts approach a GPU's; the ops that launch
most per cycle follow each count.

    TRITON_INTERPRET=1 python packaging/bench/launch_census.py off|on [graphs]

`graphs`: the passes a GPU runs as CUDA graphs (graphs.Rerun re-runs them here: plain decoding's in-place step,
the cycle graphs), with the kernels a GPU picks at load where the CPU would keep a torch form: the split-K
attention (one launch, or two over a long cache), the cycle graphs' bookkeeping and the argmax kernel (cycle_triton).
Only with `on`.
"""

import os
import sys
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"
GRAPHS = sys.argv[2:] == ["graphs"]
if sys.argv[1:2] == ["off"]:
    os.environ.update(MTPCHAT_SHORT_CONV="torch", MTPCHAT_ADD_NORM="0", MTPCHAT_ROPE="torch", MTPCHAT_SWIGLU="torch")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from engine import (GenerationSettings, conv_triton, cycle_triton, gdn, kernels,  # noqa: E402
                    load_engine, mtp, norm_triton, rope_triton, swiglu_triton)
from engine.events import Cycle  # noqa: E402

NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "transpose", "t", "unsqueeze", "squeeze", "expand", "permute",
             "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "unfold", "reshape",
             "_reshape_alias", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "is_same_size",
             "sym_size", "sym_stride", "diagonal", "narrow", "chunk", "flatten", "view_as"}


def attention_launches(q, keys, *args) -> int:
    """The split-K attention's launches: its splits merged by their last program (short caches), else by a
    second kernel."""
    from engine import attention_triton

    _, _, split = attention_triton.plan(q.shape[1] // keys.shape[1] * q.shape[2], keys.shape[2], q.shape[3])
    return 1 if -(-keys.shape[2] // split) <= attention_triton.MERGE_IN_LAST else 2


CUSTOM = {"decode_attention": attention_launches}  # the engine's custom ops that launch Triton kernels


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launches, self.inside, self.ops = 0, 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in NO_KERNEL:
            n = CUSTOM[name](*args) if name in CUSTOM else 1
            self.launches += n
            self.ops[name] += n
        if name not in CUSTOM:
            return func(*args, **(kwargs or {}))
        self.inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.inside -= 1


census = None


def one_launch(kernel, name: str, maybe: bool = False):
    """A kernel's wrapper: one launch, whatever torch ops the interpreter (or the torch reference) runs inside.
    maybe: none where it returns None without launching (norm_triton.two_norms: the torch form's ops count)."""
    def run(*args, **kwargs):
        if census is not None:
            census.inside += 1
        out = None
        try:
            out = kernel(*args, **kwargs)
            return out
        finally:
            if census is not None:
                census.inside -= 1
                if out is not None or not maybe:
                    census.launches += 1
                    census.ops[name] += 1
    return run


conv_triton.supported = lambda device, dtype: None  # (the interpreter runs them on the CPU)
norm_triton._why_not = lambda device, dtype: None
rope_triton.supported = lambda device, dtype: None
swiglu_triton.supported = lambda device, dtype: None
gdn.conv_gates = one_launch(conv_triton.conv_gates, "conv_gates")
kernels.run_gdn = one_launch(kernels.run_gdn, "gdn_recurrent")
for name in ("launch_add", "rms_norm", "gated_rms_norm"):
    setattr(norm_triton, name, one_launch(getattr(norm_triton, name), name))
for name in ("table", "rotate"):
    setattr(rope_triton, name, one_launch(getattr(rope_triton, name), f"rope_{name}"))
swiglu_triton.swiglu = one_launch(swiglu_triton.swiglu, "swiglu")
rope_triton.rotate_and_store = one_launch(rope_triton.rotate_and_store, "rope_rotate_and_store")
mtp.two_norms = one_launch(mtp.two_norms, "two_norms", maybe=True)
cycle_triton._argmax_rows = one_launch(cycle_triton._argmax_rows, "argmax")
for name in ("first_rows_", "accept"):  # (the settle runs inside first_rows_ since stop 70)
    setattr(cycle_triton, name, one_launch(getattr(cycle_triton, name), name))

engine = load_engine("engine/assets/demo", device="cpu", dtype="bfloat16", cuda_graphs=GRAPHS)
if GRAPHS:  # (a GPU's choices at load; the CPU keeps the torch forms)
    engine.trunk.backends.decode_attention, engine.trunk.backends.cycle = "triton", "triton"
    engine.trunk.backends.argmax = "triton"  # (where it is timed faster than torch's: folded into other launches)
print("conv1d:", engine.trunk.backends.choice["conv1d"][1])
print("rmsnorm:", engine.trunk.backends.choice["rmsnorm"][1], "| MTPCHAT_ADD_NORM:", os.environ.get("MTPCHAT_ADD_NORM"))
print("rope:", engine.trunk.backends.choice["rope"][1], "| swiglu:", engine.trunk.backends.choice["swiglu"][1])
prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
for depth in (0, 3):
    list(engine.generate(prompt, GenerationSettings(max_new_tokens=8, depth=depth, ignore_eos=True)))  # (warm-up)
    runs = []
    for n in (16, 48):
        census = Census()
        with census:
            events = list(engine.generate(prompt, GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True)))
        runs.append((census.launches, sum(isinstance(e, Cycle) for e in events), census.ops))
        census = None
    (a, ca, ops_a), (b, cb, ops_b) = runs
    print(f"depth {depth}: {(b - a) / (cb - ca):.1f} launches a cycle (launches, cycles: {[r[:2] for r in runs]})")
    print("   " + ", ".join(f"{op} {n / (cb - ca):.1f}" for op, n in (ops_b - ops_a).most_common(16)))
