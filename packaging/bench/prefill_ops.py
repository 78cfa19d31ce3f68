"""Where prefill time goes on the GPU: causal attention variants at an offset, and the trunk's prefill per chunk size.

    python packaging/bench/prefill_ops.py [--preset qwen3.5-27b] [--layers N] [--json OUT]

1. Attention of T queries over S = pos + T keys (grouped-query, the preset's heads): SDPA with an explicit
   boolean mask (what eager prefill used), SDPA with a lower-right causal bias, and the fused flash kernel.
2. Time to first token of plain greedy decoding after prompts of several lengths, per prefill chunk size, and the
   GPU kernels of one prefill grouped by family.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
import torch.nn.functional as F


def timed(fn, n=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def attention_variants(cfg, shapes):
    from torch.nn.attention.bias import causal_lower_right

    from engine.model import causal_attention

    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = []
    for T, S in shapes:
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pos = S - T
        mask = torch.ones(T, S, dtype=torch.bool, device="cuda").tril(pos)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        row = {"T": T, "S": S}
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        variants = {
            "bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "lower_right": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S),
                                                                  enable_gqa=True),
            "flash_gqa": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
            "flash_rep": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, True)[0],
            "engine": lambda: causal_attention(q, k, v, S - T, D ** -0.5),  # what prefill runs (model.py)
        }
        for name, fn in variants.items():
            try:
                row[f"{name}_err"] = (fn() - ref).abs().max().item()
                row[f"{name}_ms"] = timed(fn)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row))
        rows.append(row)
    return rows


def family_of(name: str) -> str:
    return re.sub(r"_\d+$", "", re.sub(r"<.*", "", name))[:80]


def prefill_times(engine, lengths, chunks):
    from engine import GenerationSettings

    rows = []
    for n in lengths:
        for c in chunks:
            ids = [1 + (i * 7919) % 50000 for i in range(n)]
            s = GenerationSettings(max_new_tokens=1, depth=0, reuse=False, prefill_chunk=c, ignore_eos=True)
            best, stats = None, None
            for _ in range(3):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                for ev in engine.generate(ids, s):
                    if hasattr(ev, "stats") and ev.stats:
                        stats = ev.stats
                if best is None or stats["ttft_ms"] < best["ttft_ms"]:
                    best = dict(stats)
            row = {"tokens": n, "chunk": c, "ttft_ms": best["ttft_ms"], "prefill_tok_s": n / best["ttft_ms"] * 1e3,
                   "phase_ms": best["phase_ms"], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            print(json.dumps(row))
            rows.append(row)
    return rows


def kernel_profile(engine, n, chunk):
    from engine import GenerationSettings

    ids = [1 + (i * 7919) % 50000 for i in range(n)]
    s = GenerationSettings(max_new_tokens=1, depth=0, reuse=False, prefill_chunk=chunk, ignore_eos=True)
    for _ in engine.generate(ids, s):
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in engine.generate(ids, s):
            pass
        torch.cuda.synchronize()
    fam: dict[str, list] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0):
            f = fam.setdefault(family_of(e.key), [0, 0.0])
            f[0] += e.count
            f[1] += getattr(e, "self_device_time_total", 0) / 1e3
    top = sorted(fam.items(), key=lambda x: -x[1][1])[:25]
    total = sum(v[1] for v in fam.values())
    print(f"kernels of a {n}-token prefill at chunk {chunk}: {total:.1f} ms GPU")
    for name, (calls, ms) in top:
        print(f"  {ms:9.2f} ms {calls:6d}  {name}")
    return {"tokens": n, "chunk": chunk, "gpu_ms": total, "top": top}


def run(engine, ids, depth=0, new=1, reuse=False):
    from engine import GenerationSettings

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    s = GenerationSettings(max_new_tokens=new, depth=depth, reuse=reuse, ignore_eos=True)
    for ev in engine.generate(ids, s):
        stats = getattr(ev, "stats", None) or {}
    return {**{k: stats[k] for k in ("ttft_ms", "tokens_per_s", "prefilled_tokens", "phase_ms")},
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def decode_attention(cfg, lengths=(2048, 32768, 131072), T=4):
    """masked_decode_attention per call over a cache of N positions (the graph-mode attention of decoding)."""
    from engine.model import masked_decode_attention

    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = []
    for N in lengths:
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        future = torch.arange(N, device="cuda")[None, :] > (N - 1 - T + torch.arange(T, device="cuda"))[:, None]
        ms = timed(lambda: masked_decode_attention(q, k, v, future, 0.06), 20)
        rows.append({"N": N, "ms": ms, "kv_gb_s": 2 * k.numel() * 2 / ms / 1e6})
        try:
            from engine.attention_triton import attention

            positions = N - T + torch.arange(T, device="cuda")
            tri = timed(lambda: attention(q, k, v, positions, 0.06), 20)
            err = (attention(q, k, v, positions, 0.06).float()
                   - masked_decode_attention(q, k, v, future, 0.06).transpose(1, 2).float()).abs().max().item()
            half = timed(lambda: attention(q, k, v, positions - N // 2, 0.06), 20)  # half the capacity filled
            rows[-1].update(triton_ms=tri, triton_kv_gb_s=2 * k.numel() * 2 / tri / 1e6, triton_err=err,
                            triton_half_filled_ms=half)
        except Exception as e:
            rows[-1]["triton"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(rows[-1]))
    return rows


def ttft_kernels(engine, n=200):
    ids = [1 + (i * 7919) % 50000 for i in range(n)]
    run(engine, ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(engine, ids)
        torch.cuda.synchronize()
    fam: dict[str, list] = {}
    for e in prof.key_averages():
        f = fam.setdefault(family_of(e.key), [0, 0.0])
        f[0] += e.count
        f[1] += getattr(e, "self_device_time_total", 0) / 1e3
    top = sorted(fam.items(), key=lambda x: -x[1][1])[:14]
    print(f"{n}-token TTFT kernels: {sum(v[1] for v in fam.values()):.1f} ms GPU")
    for name, (calls, ms) in top:
        print(f"  {ms:8.2f} ms {calls:5d}  {name}")


def graphed(engine, long_lengths, quick=False):
    """With CUDA graphs: a 200-token first prompt, a 200-token turn after a 2,000-token history, and decoding
    after long prompts against after 32 tokens."""
    ids = lambda n, salt=0: [1 + (i * 7919 + salt) % 50000 for i in range(n)]
    out = {}
    print("decode attention:", engine.trunk.backends.choice.get("decode_attention"))
    if quick:  # each length twice, the second reported: the first captures the CUDA graphs for its capacity
        for n in [32] + long_lengths:
            run(engine, ids(n), new=128)
            out[f"decode_{n}"] = r = run(engine, ids(n), new=128)
            print(f"after {n}:", json.dumps(r))
        return out
    for _ in range(3):
        run(engine, ids(200), new=4)
    out["first_200"] = min((run(engine, ids(200), new=4) for _ in range(5)), key=lambda r: r["ttft_ms"])
    turns = []
    for t in range(6):
        history = ids(2000) if t == 0 else engine.turns.history
        r = run(engine, history + ids(200, salt=t + 1), new=8, reuse=t > 0)
        turns.append(r)
    out["turns_200_after_2000"] = turns
    print(json.dumps({k: out[k] for k in ("first_200",)}))
    print("turn TTFT ms:", [round(t["ttft_ms"], 1) for t in turns], "prefilled:", [t["prefilled_tokens"] for t in turns])
    ttft_kernels(engine)
    out["decode_32"] = run(engine, ids(32), new=128)
    print("decode after 32:", json.dumps(out["decode_32"]))
    for n in long_lengths:
        r = run(engine, ids(n), new=128)
        out[f"decode_{n}"] = r
        print(f"after {n}:", json.dumps(r))
    print("graphs:", json.dumps(engine.diagnostics()["compile"]["cuda_graphs"]["prefill"]))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--layers", type=int)
    p.add_argument("--lengths", default="200,2048,8192")
    p.add_argument("--chunks", default="512,2048,8192")
    p.add_argument("--profile", default="8192:2048")
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="with --graphs: only decoding after 32 tokens and after each")
    p.add_argument("--graphs", default="", help="with CUDA graphs: long prompt lengths to decode after (comma-separated)")
    p.add_argument("--splits", type=int, help="the split-K decode attention's splits (attn_splits.py's best)")
    p.add_argument("--stages", type=int, help="and its pipeline stages")
    a = p.parse_args()
    from engine import Engine, random_model

    from engine import attention_triton

    attention_triton.SPLITS = a.splits or attention_triton.SPLITS
    attention_triton.STAGES = a.stages or attention_triton.STAGES
    loaded = random_model(a.preset, a.layers, "cuda", "bfloat16")
    cfg = loaded.trunk.config
    if a.graphs:
        decode_attention(cfg)
        out = graphed(Engine(loaded, None), [int(x) for x in a.graphs.split(",")], a.quick)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    out = {"attention": attention_variants(cfg, [(200, 2200), (512, 2048), (2048, 8192), (8192, 8192),
                                                 (2048, 65536), (8192, 65536)])}
    engine = Engine(loaded, None, cuda_graphs=False)
    t = time.perf_counter()
    out["prefill"] = prefill_times(engine, [int(x) for x in a.lengths.split(",")],
                                   [int(x) for x in a.chunks.split(",")])
    n, c = (int(x) for x in a.profile.split(":"))
    out["profile"] = kernel_profile(engine, n, c)
    out["seconds"] = time.perf_counter() - t
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
