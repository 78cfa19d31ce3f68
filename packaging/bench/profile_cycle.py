"""Where a decoding cycle's time goes, per depth: wall time per token against the GPU's busy time (the union of
its kernels' intervals) and kernel launches per cycle. A cycle whose GPU is idle most of the time is bound by the
host (launches, Python, the one sync per cycle); one whose GPU is busy is bound by its kernels.

    python packaging/bench/profile_cycle.py --model engine/assets/demo [--compile] [--depths 0,1,3] [--json OUT]
    python packaging/bench/profile_cycle.py --random-weights qwen3-next-80b-a3b --layers 12 --compile
    python packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 --host  # what the GPU waits for

--host: per depth, the GPU's idle gaps between kernels with the host ops that ran meanwhile, and a cProfile of
the loop (the wait for the GPU shows up in the one sync per cycle; the rest is host time the GPU may wait for).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine import Cycle, Engine, GenerationSettings, load_engine, random_model


def generate(engine: Engine, depth: int, n: int) -> int:
    settings = GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True, reuse=False)
    cycles = 0
    for ev in engine.generate(list(range(1, 33)), settings):
        cycles += isinstance(ev, Cycle)
    return cycles


def busy_ms(events) -> tuple[float, int, dict, dict]:
    """GPU busy time (union of kernel intervals, ms), kernel count, ms per kernel family, (launches, ms) per name."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, end, fam, named = 0.0, -1.0, {}, {}
    for a, b, name in spans:
        if b > end:
            total += b - max(a, end)
            end = b
        key = name.split("<")[0][:60]
        fam[key] = fam.get(key, 0.0) + (b - a) / 1e3
        n, ms = named.get(name[:150], (0, 0.0))
        named[name[:150]] = (n + 1, ms + (b - a) / 1e3)
    return total / 1e3, len(spans), fam, named


def host_time(engine: Engine, depth: int, n: int) -> dict:
    """What the GPU waits for at this depth: its idle gaps with the host ops meanwhile, and the loop's cProfile."""
    import cProfile
    import io
    import pstats

    from profile_step import idle_gaps  # (this script's folder is on sys.path)

    gaps = idle_gaps(lambda tokens: generate(engine, depth, tokens), tokens=48)
    prof = cProfile.Profile()
    prof.enable()
    generate(engine, depth, n)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(28)
    print(text.getvalue()[-7000:])
    return {"idle_gaps": gaps, "cprofile_top": text.getvalue()[-7000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--random-weights")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--depths", default="0,1,2,3")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--json")
    ap.add_argument("--host", action="store_true")
    args = ap.parse_args(argv)
    if args.model:
        engine = load_engine(args.model, "cuda", "bfloat16", compile=args.compile)
    else:
        engine = Engine(random_model(args.random_weights, args.layers, "cuda", "bfloat16"), None, set(),
                        cuda_graphs=True, compile=args.compile)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        if depth and engine.mtp_drafter is None:
            continue
        for _ in range(2):
            generate(engine, depth, args.tokens)  # captures, autotuning
        torch.cuda.synchronize()
        t = time.perf_counter()
        cycles = generate(engine, depth, args.tokens)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            generate(engine, depth, args.tokens)
            torch.cuda.synchronize()
        busy, kernels, fam, named = busy_ms(prof.events())
        top = sorted(fam.items(), key=lambda kv: -kv[1])[:8]
        most = sorted(named.items(), key=lambda kv: -kv[1][0])[:40]  # which launches a cycle repeats: copies, wheres
        dearest = sorted(named.items(), key=lambda kv: -kv[1][1])[:40]  # where a cycle's kernel time goes, by name
        row = {"depth": depth, "tokens": args.tokens, "cycles": cycles, "wall_ms_per_token": wall / args.tokens,
               "wall_ms_per_cycle": wall / cycles, "gpu_busy_ms_per_cycle": busy / cycles,
               "gpu_busy_fraction": busy / wall, "kernels_per_cycle": kernels / cycles,
               "top_kernels_ms_per_cycle": {k: v / cycles for k, v in top},
               "launches_per_cycle_by_name": {k: n / cycles for k, (n, _) in most},
               "ms_per_cycle_by_name": {k: [round(ms / cycles, 5), round(n / cycles, 2)] for k, (n, ms) in dearest}}
        if args.host:
            row["host"] = host_time(engine, depth, args.tokens)
        rows.append(row)
        print(f"depth {depth}: {args.tokens / wall * 1e3:7.1f} tok/s, {cycles} cycles, {wall / cycles:.3f} ms a "
              f"cycle, GPU busy {busy / cycles:.3f} ms ({busy / wall:.0%}), {kernels / cycles:.0f} kernels a cycle")
        for k, v in top:
            print(f"     {v / cycles:7.3f} ms  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or f"random:{args.random_weights}", "compiled": args.compile,
                       "gpu": torch.cuda.get_device_name(), "command": "python " + " ".join(sys.argv),
                       "depths": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
