"""The split-K decode attention (engine/attention_triton.py) per call inside a CUDA graph, at the 27B shape (24
query heads, 4 kv heads, head_dim 256), over a 135,168-position capacity (131,072 filled + the 4,096 reserved
ahead) and less filled, for each (splits, pipeline stages): which one streams the KV cache fastest. Host-timed
loops (prefill_ops.py's decode_attention) measure the launch, ~0.2 ms, not the kernel.

    python3 packaging/bench/attn_splits.py [--json OUT]     (prints "best SPLITS STAGES" last)
"""

import argparse
import json

import torch

from engine import attention_triton as at
from engine.splitk import graph_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    cap, D = 131072 + 4096, 256
    k, v = (torch.randn(1, 4, cap, D, device=dev, dtype=dt) for _ in range(2))
    rows, best = [], None
    for splits in (64, 128, 256, 512):
        for stages in (2, 3):
            at.SPLITS, at.STAGES = splits, stages
            row = {"splits": splits, "stages": stages}
            for filled in (2048, 32768, 131072):
                for T in (1, 4):
                    q = torch.randn(1, 24, T, D, device=dev, dtype=dt)
                    pos = torch.arange(filled - T, filled, device=dev)
                    ms = graph_ms(lambda: at.attention(q, k, v, pos, 0.06), reps=16)
                    row[f"{filled}x{T}"] = ms
            row["kv_tb_s_131072x1"] = 2 * 4 * 131072 * D * 2 / row["131072x1"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
            score = row["131072x1"] + row["131072x4"] + row["2048x1"]
            if best is None or score < best[0]:
                best = (score, splits, stages)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"best {best[1]} {best[2]}")


if __name__ == "__main__":
    main()
