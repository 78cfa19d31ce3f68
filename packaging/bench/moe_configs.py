"""The routed-expert kernels (engine/moe_triton.py) per call at the 80B-A3B and 35B-A3B shapes, one H200: every
launch configuration of the gate / up and the down kernel timed alone inside a CUDA graph, the routing kernel at
1-8 warps, and the down kernel split over the token's pairs (each program one pair's rows, the last to finish
sums the pairs in routing order). Prints the fastest per kernel and writes them all to --json."""
import argparse
import itertools
import json
import sys

sys.path.insert(0, "tests")  # run from the repository root: python3 packaging/bench/moe_configs.py
import torch
import triton

from engine import fp8, moe_triton as mt
from engine.fusion import fuse_layer
from engine.splitk import graph_ms, output
from test_moe_triton import moe_block

SHAPES = {"80B-A3B": dict(hidden_size=2048, num_experts=512, moe_intermediate_size=512, num_experts_per_tok=10),
          "35B-A3B": dict(hidden_size=2048, num_experts=256, moe_intermediate_size=512, num_experts_per_tok=8)}
GATE_UP = [(bi, bh, w) for bi, bh, w in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8))
           if 2048 <= bi * bh <= 16384]
DOWN = [(bh, bi, w) for bh, bi, w in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512), (2, 4, 8))
        if 512 <= bh * bi <= 8192 and bh * bi >= 128 * w]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--shapes", default="80B-A3B")
    args = parser.parse_args()
    dev = torch.device("cuda")
    results = []
    for (name, shape), quant in itertools.product([(s, SHAPES[s]) for s in args.shapes.split(",")], ("bf16", "fp8")):
        block = moe_block(shape, torch.bfloat16, dev)
        layer = torch.nn.Module()
        layer.mlp = block
        if quant == "fp8":
            fp8.quantize_experts(block)
            fp8.quantize_linears(layer)
        fuse_layer(layer)
        experts, shared = block.experts, block.shared_expert
        H, I, k = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts_per_tok"]
        scaled = quant == "fp8"
        gu, dn = experts.gate_up_proj, experts.down_proj
        sgu, sdn = shared.fused_weight, shared.down_proj.weight
        gs, ds = (experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv) if scaled else (gu, dn)
        sgs, sds = (shared.fused_scale_inv, shared.down_proj.weight_scale_inv) if scaled else (sgu, sdn)
        per_elt = 1 if scaled else 2
        for n in (1, 4):
            x = torch.randn(n, H, device=dev, dtype=torch.bfloat16)
            logits = torch.nn.functional.linear(x, block.fused_weight)
            weights, idx = mt.route(logits, shape["num_experts"], k, True, True)
            h, idx, weights, act, out = mt.buffers(x, idx, weights, I)
            K = idx.shape[1]
            read = (idx.unique().numel()) * 3 * I * H * per_elt  # distinct experts (the shared one is id -1)
            row = dict(shape=name, quant=quant, rows=n, experts_read=idx.unique().numel())

            def gate_up(c, act=act):
                bi, bh, w = c
                mt._gate_up_kernel[(n * K, triton.cdiv(I, bi))](
                    h, idx, gu, sgu, gs, sgs, act, h.stride(0), gu.stride(0), gu.stride(1),
                    gs.stride(0) if scaled else 0, gs.stride(1) if scaled else 0, K=K, H=H, I=I, SCALED=scaled,
                    BLOCK_I=bi, BLOCK_H=bh, num_warps=w)

            def down(c, out=out):
                bh, bi, w = c
                mt._down_kernel[(n, triton.cdiv(H, bh))](
                    act, idx, weights, dn, sdn, ds, sds, out, dn.stride(0), dn.stride(1),
                    ds.stride(0) if scaled else 0, ds.stride(1) if scaled else 0, out.stride(0), K=K, H=H, I=I,
                    SCALED=scaled, BLOCK_H=bh, BLOCK_I=bi, num_warps=w)

            split_out, split_part, split_locks = output(n, H, K, n * triton.cdiv(H, 8), x)

            def down_split(c, out=split_out):
                bh, bi, w = c
                mt._down_split_kernel[(n * triton.cdiv(H, bh), K)](
                    act, idx, weights, dn, sdn, ds, sds, out, split_part, split_locks, n, dn.stride(0),
                    dn.stride(1), ds.stride(0) if scaled else 0, ds.stride(1) if scaled else 0, K=K, H=H, I=I,
                    SCALED=scaled, BLOCK_H=bh, BLOCK_I=bi, num_warps=w)

            ref_act = torch.empty_like(act)
            default = {"gate_up": (16, 256, 4), "down": (8, 512, 4), "down_split": (8, 512, 4)}  # the fixed ones before
            gate_up(default["gate_up"], ref_act)
            act.copy_(ref_act)
            ref_out = torch.empty_like(out)
            down(default["down"], ref_out)
            for kernel, configs, run, ref, res, frac in (
                    ("gate_up", GATE_UP, gate_up, ref_act, act, 2 / 3), ("down", DOWN, down, ref_out, out, 1 / 3),
                    ("down_split", [c for c in DOWN if c[0] >= 8], down_split, ref_out, split_out, 1 / 3)):
                timed = {}
                for c in configs:
                    try:
                        ms = graph_ms(lambda: run(c))
                    except Exception as e:  # too many registers / shared memory
                        continue
                    err = ((res.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    timed[str(c)] = dict(us=round(ms * 1000, 2), tb_s=round(read * frac / ms / 1e9, 2),
                                         err=float(f"{err:.1e}"))
                best = sorted(timed.items(), key=lambda kv: kv[1]["us"])
                row[kernel] = dict(default=timed.get(str(default[kernel])), best=best[:6])
                if not best:
                    print(f"{name} {quant} rows={n} {kernel}: nothing ran", flush=True)
                    continue
                print(f"{name} {quant} rows={n} {kernel}: default {row[kernel]['default']}  best {best[:3]}",
                      flush=True)
            routes = {}
            for w in (1, 2, 4, 8):
                def route(w=w):
                    mt._route_kernel[(n,)](logits, weights, idx, logits.stride(0), E=shape["num_experts"], K=k,
                                           BLOCK_E=triton.next_power_of_2(shape["num_experts"]),
                                           BLOCK_K=triton.next_power_of_2(k), NORM=True, SHARED=True,
                                           num_warps=w)
                routes[w] = round(graph_ms(route) * 1000, 2)
            row["route_us_by_warps"] = routes
            print(f"{name} {quant} rows={n} route us by warps {routes}", flush=True)
            whole = graph_ms(lambda: mt.moe_triton(block, x[None]))
            row["moe_triton_us"] = round(whole * 1000, 2)
            print(f"{name} {quant} rows={n} moe_triton whole block {whole * 1000:.1f} us", flush=True)
            results.append(row)
        del block, layer, experts, shared
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
