"""Where one decode step's GPU time goes: the CUDA kernels of plain decoding's step (trunk and lm_head, the GDN
state written in place: GraphRunner.decode), grouped by name.

    python packaging/bench/profile_step.py --random-weights qwen3.5-27b [--layers N] [--compile] [--quant fp8|int4]
        [--json OUT]

With --host N: also N greedy plain tokens through Engine.generate (the whole decode loop), their wall time per
token against the replay's (what the host adds while the GPU waits), and a cProfile of that loop.

Times the step eagerly and as a CUDA graph replay (with --compile: the compiled layers inside the graph, what
`--compile` decoding runs), and profiles the replay with torch.profiler: kernel count and GPU time per kernel
family, the kernels inside the graph included. The gap between the replay and the sum of its kernel times is
what launching and waiting still cost; the gap between the eager step and the replay is what the graph removes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

from engine import Engine, random_model, weight_bytes_per_token
from prefill_ops import timed  # (packaging/bench: the scripts run from their folder)


def family_of(name: str) -> str:
    """Collapse template arguments and Triton suffixes so that kernels of one kind add up."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"_\d+$", "", name)
    return name[:90]


# cuBLAS / cuBLASLt GEMM kernels (H100 / H200 "nvjet", older "gemm" / "cutlass" / "xmma"), split-K's reduction,
# and our FP8 / 4-bit Triton matmuls
MATMUL = re.compile(r"nvjet|gemm|cutlass|xmma|splitKreduce|_fp8_rows|_fp8_dot|_sum_slices|_w4a16", re.IGNORECASE)


def matmul_share(kernels: dict[str, list[float]]) -> tuple[float, float]:
    """(GPU ms in matmul kernels, in everything else) over kernels {family: [calls, ms]}."""
    mm = sum(ms for name, (_, ms) in kernels.items() if MATMUL.search(name))
    return mm, sum(ms for _, ms in kernels.values()) - mm


def host_profile(engine, n: int, replay_ms: float) -> dict:
    """Wall time per token of plain greedy decoding through Engine.generate, and the loop's cProfile (the wait
    for the GPU shows up in the one host sync; everything else is host time the GPU may wait for)."""
    import cProfile
    import io
    import pstats

    from engine import GenerationSettings

    def run(tokens=n):
        settings = GenerationSettings(max_new_tokens=tokens, depth=0, ignore_eos=True, reuse=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in engine.generate(list(range(1, 33)), settings):
            pass
        return time.perf_counter() - t

    run()  # captures
    # the slope between a long and a short request: per token, without the prefill and the first token
    per_token = (run(n) - run(n // 4)) / (n - n // 4) * 1e3
    sync = synced_replays(engine)
    gaps = idle_gaps(run)
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(f"generate: {per_token:.3f} ms per token, replay {replay_ms:.3f} ms: the decode loop adds "
          f"{per_token - replay_ms:.3f} ms")
    print(text.getvalue()[-6000:])
    return {"generate_ms_per_token": per_token, "tokens": n, "synced_replay_ms": sync, "idle_gaps": gaps,
            "cprofile_top": text.getvalue()[-6000:]}


def synced_replays(engine, n: int = 64) -> dict:
    """ms per decode-graph replay followed by a host sync: the launch the GPU waits for once per token."""
    runner, caches = engine.graph_runner, engine.caches
    tok = torch.tensor([[7]], device="cuda")
    out = {}
    with torch.inference_mode():
        for name, wait in (("synchronize", torch.cuda.synchronize),
                           ("tolist", lambda: runner.decodes.graphs[1][2][2].tolist())):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                runner.decode(tok, caches.processed, caches)
                wait()
            out[name] = (time.perf_counter() - t) / n * 1e3
            print(f"replay + {name}: {out[name]:.3f} ms")
    return out


def idle_gaps(run, tokens: int = 24) -> list:
    """The GPU's idle gaps between decode steps in a short request, each with the host-side ops (aten ops, CUDA
    runtime calls) that ran while it waited: what the decode loop's overhead is made of."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(tokens)
    events = prof.events()
    busy = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    gaps, end = [], busy[0][1]
    for a, b in busy[1:]:
        if a - end > 20:  # us
            gaps.append((end, a))
        end = max(end, b)
    gaps = sorted(gaps[-(tokens // 2):], key=lambda g: g[1] - g[0])  # steady state: the later tokens
    host = [e for e in events if e.device_type == cpu and e.cpu_parent is None]
    out = []
    for a, b in gaps[len(gaps) // 2:][:3]:  # the median gap and the two after it
        ops = [(round(e.time_range.start - a), round(e.time_range.end - e.time_range.start), e.name)
               for e in host if e.time_range.end > a and e.time_range.start < b]
        out.append({"gap_us": round(b - a), "host_ops": ops})
        print(f"GPU idle {b - a:.0f} us between steps; host ops (start us, dur us, name):")
        for op in ops:
            print(f"   {op[0]:6d} {op[1]:6d}  {op[2][:80]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-weights", default="qwen3.5-27b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--host", type=int, default=0, metavar="N")
    ap.add_argument("--quant", choices=["bf16", "fp8", "int4"], default="bf16")
    args = ap.parse_args(argv)
    engine = Engine(random_model(args.random_weights, args.layers, "cuda", "bfloat16", quant=args.quant), None, set(),
                    cuda_graphs=True, compile=args.compile)
    trunk, caches, runner = engine.trunk, engine.caches, engine.graph_runner
    caches.reset()
    caches.kv.reserve(64)
    with torch.inference_mode():
        trunk.forward(torch.arange(1, 33, device="cuda")[None], 0, caches, verify=False)
        caches.processed = 32
        tok = torch.tensor([[7]], device="cuda")

        # both advance the state in place at a fixed position (random weights: only the time matters)
        def eager():
            return trunk.logits(trunk.forward(tok, caches.processed, caches, verify=False)[0])

        def replay():
            return runner.decode(tok, caches.processed, caches)

        eager_ms = timed(eager, args.steps)
        replay_ms = timed(replay, args.steps * 4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                replay()
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(family_of(ev.name), [0, 0.0])
            k[0] += 1
            k[1] += ev.device_time_total / 1e3
    total_ms = sum(v[1] for v in kernels.values()) / args.steps
    count = sum(v[0] for v in kernels.values()) / args.steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    wbytes = weight_bytes_per_token(trunk)
    matmul_ms, other_ms = (x / args.steps for x in matmul_share(kernels))
    res = {
        "model": f"random:{args.random_weights}" + (f" ({args.layers} layers)" if args.layers else ""),
        "gpu": torch.cuda.get_device_name(), "compiled": trunk.compiled_block is not None,
        "eager_step_ms": eager_ms, "graph_replay_ms": replay_ms, "kernel_ms_per_step": total_ms,
        "kernels_per_step": count, "weight_bytes_per_token": wbytes,
        "matmul_ms_per_step": matmul_ms, "other_kernel_ms_per_step": other_ms,
        "matmul_bytes_per_s": wbytes / (matmul_ms / 1e3) if matmul_ms else None,
        "replay_fraction_of_4_8TBps": wbytes / (replay_ms / 1e3) / 4.8e12,
        "profiled": "decode graph replay", "graphs": runner.report(),
        "top_kernels": [{"kernel": k, "calls_per_step": v[0] / args.steps, "ms_per_step": v[1] / args.steps}
                        for k, v in top],
    }
    print(f"eager step {eager_ms:.2f} ms, graph replay {replay_ms:.2f} ms, kernels {total_ms:.2f} ms in "
          f"{count:.0f} launches; replay reaches {res['replay_fraction_of_4_8TBps']:.1%} of 4.8 TB/s")
    print(f"matmuls {matmul_ms:.2f} ms ({wbytes / max(matmul_ms, 1e-9) / 1e9:.2f} TB/s), other kernels "
          f"{other_ms:.2f} ms, launch gaps {replay_ms - total_ms:.2f} ms")
    for row in res["top_kernels"]:
        print(f"  {row['ms_per_step']:8.3f} ms  {row['calls_per_step']:6.1f}x  {row['kernel']}")
    if args.host:
        res["host"] = host_profile(engine, args.host, replay_ms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
