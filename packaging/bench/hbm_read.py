"""The GPU's achievable read bandwidth: the ceiling that a weight-streaming decode step can approach, measured
rather than taken from the data sheet (the H200's 4.8 TB/s is the interface's peak, not what a kernel reads).

A Triton kernel sums a 4 GB buffer, each program a contiguous chunk, over a sweep of programs, tile sizes and
warps, inside a CUDA graph (splitk.graph_ms); torch's own sum and a device-to-device copy beside it.

    python3 packaging/bench/hbm_read.py [--gb 4] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from engine.splitk import graph_ms  # noqa: E402


@triton.jit
def _read(X, Y, per_program, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, per_program, BLOCK):
        acc += tl.load(X + start + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Y + tl.program_id(0), tl.sum(acc, 0))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--json")
    a = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = int(a.gb * 1e9 / 2) // (1 << 20) * (1 << 20)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    nbytes = n * 2
    rows = []
    for programs in (sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms):
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                per = n // programs // block * block
                y = torch.empty(programs, device="cuda", dtype=torch.float32)
                try:
                    ms = graph_ms(lambda: _read[(programs,)](x, y, per, BLOCK=block, num_warps=warps), reps=4)
                except Exception as e:  # noqa: BLE001 (too many registers, say)
                    print(f"programs {programs} block {block} warps {warps}: {type(e).__name__}")
                    continue
                rows.append({"kind": "triton read", "programs": programs, "block": block, "warps": warps,
                             "tb_s": programs * per * 2 / ms / 1e9})
    rows.append({"kind": "torch sum", "tb_s": nbytes / graph_ms(lambda: x.sum(), reps=4) / 1e9})
    half = x[: n // 2]
    out = torch.empty_like(half)
    rows.append({"kind": "copy (read + write)", "tb_s": 2 * half.numel() * 2 / graph_ms(lambda: out.copy_(half), reps=4)
                 / 1e9})
    best = max((r for r in rows if r["kind"] == "triton read"), key=lambda r: r["tb_s"])
    for r in sorted(rows, key=lambda r: -r["tb_s"])[:8] + rows[-2:]:
        print(json.dumps(r))
    print(f"{torch.cuda.get_device_name(0)}: best read {best['tb_s']:.2f} TB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "bytes": nbytes, "rows": rows, "best": best}, f,
                      indent=1)


if __name__ == "__main__":
    main()
