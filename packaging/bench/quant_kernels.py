"""Every kernel form and configuration of the quantized linears (engine/int4_triton.py, engine/fp8_triton.py) at
the 27B shape's projections, per call inside CUDA graphs, at decoding's 1 row and depth 3's 4 rows: the best
configuration of each form, its streamed bytes per second, and bf16 cuBLAS on the same shape. This is how a
new kernel form earns (or loses) its place in CONFIGS; install() then times the survivors per shape at load.
`--quant bf16`: the FP8 kernels streaming 16-bit weights (no scale) against cuBLAS at the 16-bit linears of a
model's decode step (`--shapes 80b`: the 80B-A3B's; `--shapes demo`: the demo model's, where a call is mostly its
latency; GDN's b + a and the 80B's router stay bf16 in FP8 releases, as does the lm_head), with a few narrow-tile
configurations for the tiny ones.

    python3 packaging/bench/quant_kernels.py [--quant int4,fp8,bf16] [--shapes 27b|80b|demo] [--rows 1,4] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from engine import fp8, fp8_triton, int4_triton  # noqa: E402
from engine.splitk import graph_ms  # noqa: E402

# (name, N, K): the 27B shape's quantized linears, fused where fusion.py fuses them (as fp8_ops.py's)
SHAPES = [("attn qkv (fused)", 14336, 5120), ("attn o_proj", 5120, 6144), ("gdn in_proj_qkv", 10240, 5120),
          ("gdn in_proj_z", 6144, 5120), ("gdn out_proj", 5120, 6144), ("mlp gate_up (fused)", 34816, 5120),
          ("mlp down_proj", 5120, 17408)]
# 16-bit weights at decode: the bf16 models' projections as fusion.py fuses them; the last two of each list (GDN's
# b + a, the MoE router + the shared expert's gate) stay bf16 in FP8 releases
BF16_SHAPES = {
    "27b": [("attn qkv (fused)", 14336, 5120), ("attn o_proj", 5120, 6144), ("gdn in_proj (fused)", 16480, 5120),
            ("gdn out_proj", 5120, 6144), ("mlp gate_up (fused)", 34816, 5120), ("mlp down_proj", 5120, 17408),
            ("gdn in_proj_ba (fused)", 96, 5120), ("lm_head", 248320, 5120)],
    "demo": [("gdn in_proj (fused)", 1552, 384), ("gdn out_proj", 384, 512), ("attn qkv (fused)", 1024, 384),
             ("attn o_proj", 384, 384), ("mlp gate_up (fused)", 1536, 384), ("mlp down_proj", 384, 768),
             ("lm_head", 8192, 384)],
    "80b": [("attn qkv (fused)", 9216, 2048), ("attn o_proj", 2048, 4096), ("gdn in_proj (fused)", 12352, 2048),
            ("gdn out_proj", 2048, 4096), ("gdn in_proj_ba (fused)", 64, 2048), ("router + shared gate", 513, 2048)],
}
NARROW = [(32, 1, 4, 3), (16, 1, 4, 3), (32, 2, 4, 3), (64, 1, 4, 3), (16, 2, 2, 3), (32, 1, 2, 4)]


def int4_case(n: int, k: int, group: int = 128):
    g = k // group
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
    zeros = torch.randint(0, 16, (g, n), device="cuda", dtype=torch.uint8)
    scales = (torch.rand(g, n, device="cuda") * 0.01).to(torch.bfloat16)
    nbytes = qweight.numel() * 4 + zeros.numel() + scales.numel() * 2
    return (lambda x, choice: int4_triton._launch(x, qweight, zeros, scales, group, choice)), int4_triton.CONFIGS, nbytes


def fp8_case(n: int, k: int):
    w, s = fp8.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    return (lambda x, choice: fp8_triton._launch(x, w, s, choice)), fp8_triton.CONFIGS, w.numel() + s.numel() * 4


def bf16_case(n: int, k: int):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    configs = {kind: c + (NARROW if kind != "stream" else []) for kind, c in fp8_triton.CONFIGS.items()}
    return (lambda x, choice: fp8_triton._launch(x, w, None, choice)), configs, w.numel() * 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quant", default="int4,fp8")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--shapes", default="27b", choices=sorted(BF16_SHAPES))
    p.add_argument("--json")
    a = p.parse_args()
    out = []
    for quant in a.quant.split(","):
        totals: dict[tuple, float] = {}
        shapes = BF16_SHAPES[a.shapes] if quant == "bf16" else SHAPES
        for name, n, k in shapes:
            run, configs, nbytes = {"int4": int4_case, "fp8": fp8_case, "bf16": bf16_case}[quant](n, k)
            w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for rows in (int(r) for r in a.rows.split(",")):
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                ref = run(x, next((kind, c[0]) for kind, c in configs.items() if kind == "dot")).float()
                row = {"quant": quant, "shape": name, "N": n, "K": k, "rows": rows,
                       "bf16_ms": graph_ms(lambda: F.linear(x, w16))}
                for kind, choices in configs.items():
                    if ((rows > 8 and not kind.startswith("dot")) or (kind in ("row", "stream", "streambits") and rows > 1)
                            or (kind in ("dotbits", "streambits") and quant == "bf16")):
                        continue
                    timed = {}
                    for c in choices:
                        try:
                            y = run(x, (kind, c)).float()
                            err = ((y - ref).abs().max() / ref.abs().max()).item()
                            timed[c] = (graph_ms(lambda: run(x, (kind, c))), err)
                        except Exception as e:  # noqa: BLE001 (a configuration this GPU cannot run)
                            timed[c] = (float("inf"), f"{type(e).__name__}: {str(e)[:80]}")
                    best = min(timed, key=lambda c: timed[c][0])
                    ms, err = timed[best]
                    row[kind] = {"best": best, "ms": ms, "tb_s": nbytes / ms / 1e9 if ms < float("inf") else 0,
                                 "err_vs_dot": err, "all_ms": {str(c): round(t[0], 4) for c, t in timed.items()}}
                    totals[(kind, rows)] = totals.get((kind, rows), 0.0) + ms
                totals[("bf16", rows)] = totals.get(("bf16", rows), 0.0) + row["bf16_ms"]
                print(json.dumps({key: (v if not isinstance(v, dict) else
                                        {kk: vv for kk, vv in v.items() if kk != "all_ms"}) for key, v in row.items()}),
                      flush=True)
                out.append(row)
        for (kind, rows), ms in sorted(totals.items(), key=lambda t: (t[0][1], t[1])):
            print(f"{quant} rows {rows}: {kind:8s} {ms:.3f} ms over the {len(shapes)} shapes", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
