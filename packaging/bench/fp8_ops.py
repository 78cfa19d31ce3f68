"""GPU time per call of the 27B shape's FP8 linears at decode and verify widths, inside CUDA graphs: the Triton
W8A16 kernels (engine/fp8_triton.py, kernel and configuration timed as at load) against the same weight in bf16 through
F.linear (cuBLAS), dequantize-then-F.linear (the weight-only path) and torch._scaled_mm with the activation
quantized per row. Bandwidth counts the weight bytes each variant must read.

    python3 packaging/bench/fp8_ops.py [--json OUT]     (bash packaging/bench/h200.sh fp8)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from decode_ops import graph_ms  # noqa: E402

from engine import fp8, fp8_triton  # noqa: E402

# (name, N, K): Qwen3.5-27B's FP8 linears, fused where fusion.py fuses them (GDN's mixed group stays unfused)
SHAPES = [("attn qkv (fused)", 14336, 5120), ("attn o_proj", 5120, 6144), ("gdn in_proj_qkv", 10240, 5120),
          ("gdn in_proj_z", 6144, 5120), ("gdn out_proj", 5120, 6144), ("mlp gate_up (fused)", 34816, 5120),
          ("mlp down_proj", 5120, 17408)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--rows", default="1,2,5,16,64,200")
    a = p.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    out = []
    for name, n, k in SHAPES:
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = fp8.quantize(w16)
        for rows in (1, 4, 64):  # as install() does at load
            fp8_triton.tune(q, s, rows)
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "N": n, "K": k, "rows": m,
                   "config": fp8_triton._config(m, n, k, x.device)}
            row["triton_ms"] = graph_ms(lambda: fp8_triton.linear(x, q, s))
            row["bf16_ms"] = graph_ms(lambda: F.linear(x, w16))
            row["dequant_ms"] = graph_ms(lambda: F.linear(x, fp8.dequantize(q, s, torch.bfloat16)), reps=8)
            try:  # cuBLAS FP8 with per-row activation and per-output-row weight scales (not block scales)
                xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-6) / fp8.FP8_MAX
                xq = (x.float() / xs).to(torch.float8_e4m3fn)
                ws = torch.ones(1, n, device="cuda")
                row["scaled_mm_ms"] = graph_ms(lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=ws,
                                                                        out_dtype=torch.bfloat16))
            except Exception as e:
                row["scaled_mm"] = f"{type(e).__name__}: {str(e)[:120]}"
            ref = F.linear(x.float(), fp8.dequantize(q, s, torch.float32))
            row["triton_err"] = ((fp8_triton.linear(x, q, s).float() - ref).abs().max() / ref.abs().max()).item()
            for key, nbytes in (("triton", n * k), ("bf16", 2 * n * k), ("scaled_mm", n * k)):
                if f"{key}_ms" in row:
                    row[f"{key}_tb_s"] = nbytes / row[f"{key}_ms"] / 1e9
            print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()}))
            out.append(row)
    tri = sum(r["triton_ms"] for r in out if r["rows"] == 1)
    bf = sum(r["bf16_ms"] for r in out if r["rows"] == 1)
    print(f"one row, the 7 shapes: triton {tri:.3f} ms vs bf16 {bf:.3f} ms ({bf / tri:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
