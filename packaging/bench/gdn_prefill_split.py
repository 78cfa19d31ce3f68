"""FLA's chunked GDN kernel over one long prefill chunk at once, against the same chunk in slices (each slice
from the state the one before left): wall time per layer, eagerly as the long prefill launches it (the host's
share included), and the peak memory above the inputs. Issue #29: at a 32k prompt the chunked kernel's
intermediates were 0.49 GB of the 27B shape's Int4 peak at 2,048-token chunks; slices would cut them, at the
cost of more launches. The 27B shape: 16 key heads, 48 value heads, 128 x 128 states. Each way's output and final
state are checked against the whole chunk's. On the H200 (stop 56, gdn_prefill_split_h200.json) four slices took
4.2x the time for 79 MB of intermediates instead of 184, and the 32k peak did not move: the engine runs it whole.
`python3 packaging/bench/gdn_prefill_split.py [--tokens 2048] [--slices 1,2,4,8] [--json OUT]` (CUDA, FLA).
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from engine.kernels import fla_chunk

H, HV, K, V = 16, 48, 128, 128
LAYERS = 48  # each call reads another layer's inputs and state, as a prefill chunk's 48 GDN layers do


def inputs(T: int, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(1, T, H, K, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(1, T, HV, V, generator=gen).to("cuda", torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)).to("cuda")
    beta = torch.rand(1, T, HV, generator=gen).to("cuda", torch.bfloat16)
    state = (torch.randn(1, HV, K, V, generator=gen) * 0.1).to("cuda")
    return q, k, v, g, beta, state


def sliced(q, k, v, g, beta, state, n: int):
    """The chunk in n slices, each from the state the slice before left: (output, final state)."""
    T, outs = q.shape[1], []
    for s in range(0, T, T // n):
        e = s + T // n
        o, state = fla_chunk(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state)
        outs.append(o)
    return torch.cat(outs, 1), state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--slices", default="1,2,4,8")
    ap.add_argument("--json")
    a = ap.parse_args()
    layers = [inputs(a.tokens, i) for i in range(LAYERS)]
    ref = [sliced(*x, 1) for x in layers[:2]]
    rows = []
    for n in (int(s) for s in a.slices.split(",")):
        for x in layers:  # warm-up: FLA's autotuning and JIT at this slice length
            sliced(*x, n)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for x in layers:
            sliced(*x, n)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / LAYERS
        peak = torch.cuda.max_memory_allocated() - base
        err = max(max((o - ro).abs().max().item() / ro.abs().max().item(), (s - rs).abs().max().item() /
                       rs.abs().max().item()) for (o, s), (ro, rs) in zip((sliced(*x, n) for x in layers[:2]), ref))
        rows.append({"tokens": a.tokens, "slices": n, "ms_per_layer": ms, "peak_over_inputs_bytes": peak,
                     "max_rel_err_vs_whole": err})
        print(f"{a.tokens} tokens in {n} slice(s): {ms:.3f} ms a layer, {peak / 1e6:.1f} MB over the inputs, "
              f"rel err {err:.2g}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
