"""`--depth auto` against fixed depths in expectation, and how far one bench run strays from it: the engine's
DepthChooser (autodepth.py) driven by simulated cycles whose costs are the 27B shape's on the H200 (--compile,
auto27b_v2_h200.json: ms per cycle, verify + draft + commit) and whose acceptance follows the bench's oracle
profiles, drawn as the bench's OracleDrafter draws them: one seed for every row and repeat of a run, each draw
keyed by (token index, position), so rows share their luck. A run here is one bench run; runs differ by seed.
`python3 packaging/bench/auto_sim.py [--known-costs]` (CPU, seconds); `--trace PROFILE`: for each run below
0.97, auto's depths over the reply and its estimates at each move off or onto depth 4. `--costs cpu-demo`: the demo
model's on the 2-core CPU instead (`cpu-demo-now`: the same CPU as measured in stop 42; `cpu-demo-onednn`: with
the verify widths on oneDNN, stop 46). A drafting cycle after
plain ones also pays the head's catch-up over their tokens (`--catch-up`, ms a token) and `--switch-ms` once;
`--noise F`: each cycle's cost off by up to +-F of it, uniformly (a shared CPU). Profile `demo`: the demo model's
MTP head on the bench prompt. `--resume PROFILE`: each auto reply starts from the estimates a reply of PROFILE left.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's engine, not an installed one's
from engine.autodepth import DepthChooser  # noqa: E402
from engine.drafters import uniform  # noqa: E402

COST_MS = {0: 14.86, 1: 16.2, 2: 16.4, 3: 16.35, 4: 16.8}  # (depth 1: not in that run; between 0 and 2)
# the demo model on the 2-core CPU (README: plain 8.2 ms, depth 1 14.0, depth 3 18.7; 2 and 4 in between)
CPU_MS = {0: 8.2, 1: 14.0, 2: 16.4, 3: 18.7, 4: 21.0}
# per plain token, what the next drafting cycle pays running the drafter over it (its catch-up): the 27B H200 runs
# drafted with the oracle (no head). The demo's MTP head on this CPU ran over 16 rows in 0.2-1.5 ms more than over
# the 1-4 rows every drafting cycle's catch-up covers anyway, at a 16 ms plain step: about 0.05 ms a token at 8.2
# the same CPU in stop 42 (slower than it was: a VM's), from the bench's demo rows (tokens a cycle / tok/s), the
# catch-up scaled with the plain step; there a drafting cycle after plain ones also took 3.8 ms more than one after
# drafting ones (2.75 of it in its verify pass, 0.7 in the head's catch-up: --switch-ms 3.8)
CPU_MS_NOW = {0: 15.2, 1: 25.7, 2: 31.0, 3: 35.5, 4: 41.0}
# the same model with the verify widths on oneDNN (stop 46, cpu_linear.py): ms a cycle from the bench's rows (tokens a
# cycle / tok/s), the mean of cpu_linear_demo_onednn_{3,4}.json
CPU_MS_ONEDNN = {0: 12.0, 1: 16.4, 2: 20.3, 3: 24.3, 4: 27.4}
# the demo model on an H100 with CUDA graphs (stop 59, bench_demo_carried_h100.json: ms a cycle from tokens a cycle /
# tok/s; depth 1 not a row there, guessed below depth 2). Its catch-up after plain steps is one padded graph replay
# whatever their number: --switch-ms 0.33 (the refresh phase of a probe's cycle), no cost a token
GPU_DEMO_MS = {0: 0.449, 1: 0.80, 2: 0.94, 3: 1.065, 4: 1.169}
# the same with stop 60's and stop 62's kernels (bench_demo_rope_triton_h100.json: depths 0, 2, 3 from tokens a cycle /
# tok/s; 1 and 4 guessed from their neighbours' step)
GPU_DEMO_MS_62 = {0: 0.304, 1: 0.62, 2: 0.724, 3: 0.822, 4: 0.92}
# stop 63 (bench_demo_climb63_h100.json: depths 0, 3 and 4 from tokens a cycle / tok/s; 1 and 2 guessed a step apart)
GPU_DEMO_MS_63 = {0: 0.281, 1: 0.62, 2: 0.70, 3: 0.776, 4: 0.853}
# stop 65 (bench_demo_stop65{,b}_h100.json: depths 0-3 from tokens a cycle / tok/s; 4 guessed a step past 3)
GPU_DEMO_MS_65 = {0: 0.177, 1: 0.352, 2: 0.394, 3: 0.455, 4: 0.515}
# stop 66 (bench_demo_stop66_h100.json: depths 0, 2 and 3 from tokens a cycle / tok/s; 1 and 4 guessed)
GPU_DEMO_MS_66 = {0: 0.171, 1: 0.33, 2: 0.36, 3: 0.402, 4: 0.45}
# stop 67 (auto_overhead_stop67_h100.json: the costs the chooser learned, ms a cycle, after api.py's launch fix;
# its switch_ms 0.37)
GPU_DEMO_MS_67 = {0: 0.165, 1: 0.349, 2: 0.377, 3: 0.406, 4: 0.455}
# stop 68 (bench_demo_stop68_h100.json, after gdn_triton and streamrows: depths 1-4 from tokens a cycle / tok/s;
# plain from auto_ab_stop68_h100.json's rounds, 5,384 tok/s: the bench's plain row, 4,598, ran slow that call)
GPU_DEMO_MS_68 = {0: 0.186, 1: 0.305, 2: 0.327, 3: 0.359, 4: 0.401}
COSTS = {"h200-27b": (COST_MS, 0.0), "cpu-demo": (CPU_MS, 0.05), "cpu-demo-now": (CPU_MS_NOW, 0.09),
         "cpu-demo-onednn": (CPU_MS_ONEDNN, 0.07), "h100-demo": (GPU_DEMO_MS, 0.0), "h100-demo-62": (GPU_DEMO_MS_62, 0.0),
         "h100-demo-63": (GPU_DEMO_MS_63, 0.0), "h100-demo-65": (GPU_DEMO_MS_65, 0.0),
         "h100-demo-66": (GPU_DEMO_MS_66, 0.0), "h100-demo-67": (GPU_DEMO_MS_67, 0.0),
         "h100-demo-68": (GPU_DEMO_MS_68, 0.0)}
CATCH_UP_MS, NOISE, SWITCH_MS, RESUME = 0.0, 0.0, 0.0, None  # (main sets them, and COST_MS)
EASY, HARD = [0.95, 0.9, 0.85, 0.8], [0.3, 0.1, 0.05, 0.0]  # cmd_bench's 'changing' profile
PROFILES = {
    "flat 1.0": lambda made, n: [1.0] * 4,
    "flat 0.5": lambda made, n: [0.5] * 4,
    "flat 0": lambda made, n: [0.0] * 4,
    "0.92/0.84/0.65/0.54": lambda made, n: [0.92, 0.84, 0.65, 0.54],
    "changing": lambda made, n: EASY if made < n // 2 else HARD,
    # and the other way round: text that turns predictable, which only a probe from plain decoding notices (once at
    # mid-reply, or every eighth of the reply: 32 tokens of 256)
    "hard then easy": lambda made, n: HARD if made < n // 2 else EASY,
    "hard-easy x4": lambda made, n: HARD if (made * 8 // n) % 2 == 0 else EASY,
    # the demo model's MTP head on the bench prompt, conditional per position (its depth 2-4 rows on the 2-core CPU,
    # stop 42: unconditional 0.70 0.42 0.39 0.30 at depth 4): low at the first position, higher deeper
    "demo": lambda made, n: [0.71, 0.64, 0.85, 0.77],
    # the same head in bf16 on a GPU (bench_demo_carried_h100.json's depth 4 row, 0.64 0.41 0.34 0.29 unconditional)
    "demo-gpu": lambda made, n: [0.64, 0.64, 0.83, 0.85],
    # and with stop 62's kernels (bench_demo_rope_triton_h100.json's depth 3 row, 0.73 0.62 0.55 unconditional; the
    # 4th position guessed)
    "demo-gpu-62": lambda made, n: [0.73, 0.85, 0.89, 0.85],
    # stop 63's depth 4 row (bench_demo_climb63_h100.json: 0.68 0.54 0.48 0.42 unconditional)
    "demo-gpu-63": lambda made, n: [0.68, 0.79, 0.89, 0.875],
    # stop 65's depth 3 row (bench_demo_stop65_h100.json: 0.66 0.44 0.36 unconditional; the 4th position guessed)
    "demo-gpu-65": lambda made, n: [0.66, 0.66, 0.82, 0.8],
}


def reply(profile, depth, n: int, seed: int, known: bool = False, trace: list | None = None,
          keep: list | None = None) -> float:
    """Tokens per second of one n-token reply at `depth` (an int, or "auto"). known (--known-costs): the reply
    starts from every depth's cost, as the engine keeps the costs a reply measured for the next one (fixed
    depths' cycles included: in the bench the fixed rows run before auto's). trace: gets each cycle's (token
    index, depth, the chooser's acceptance estimates and costs before the pick, its why). --resume P: an auto
    reply starts from the estimates an auto reply of profile P left (another seed's), as the engine's next reply
    does (DepthChooser.estimates); keep: gets this reply's."""
    learned = {"cost": dict(COST_MS) if known else {}}
    if depth == "auto" and RESUME and keep is None:
        before = []
        reply(PROFILES[RESUME], "auto", n, seed + 1_000_000, known, keep=before)
        learned = before[0]
    chooser = DepthChooser(4, mean_first=True, **learned)
    made, ms, backlog = 0, 0.0, 0
    while made < n:
        before = (list(chooser.acceptance), chooser.costs())
        k = chooser.pick() if depth == "auto" else depth
        if trace is not None:
            trace.append((made, k, *before, chooser.why))
        flags = []
        for i, p in enumerate(profile(made, n)[:k]):  # conditional on the position before: a miss ends the cycle
            flags.append(uniform(seed, made + i, i) < p)  # (OracleDrafter.correct's key)
            if not flags[-1]:
                break
        cycle_ms = COST_MS[k] * (1 + NOISE * (2 * uniform(seed, made, 99) - 1))
        if k:  # (the head over the plain cycles' tokens first)
            cycle_ms, backlog = cycle_ms + CATCH_UP_MS * backlog + SWITCH_MS * (backlog > 0), 0
        chooser.observe(k, flags, cycle_ms)
        made += 1 + sum(flags[: flags.index(False)] if False in flags else flags)
        ms += cycle_ms
        backlog += k == 0
    if keep is not None:
        keep.append(chooser.estimates())
    return made / ms * 1e3


def bench_row(profile, depth, n: int, repeat: int, seed: int, known: bool = False) -> float:
    # (the draws are the run's seed's: here a row's repeats are one reply again, in a bench they differ only in
    # timing; a longer reply, not more repeats, is what averages the draws)
    return statistics.mean(reply(profile, depth, n, seed, known) for _ in range(repeat))


def show_trace(profile, n: int, seed: int, known: bool) -> None:
    """An auto reply's depths over its cycles (run-length: depth x cycles) and the estimates at each cycle that
    left the deepest depth, or came back to it."""
    trace = []
    reply(profile, "auto", n, seed, known, trace)
    runs = []
    for _, k, *_ in trace:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    print("  depths: " + " ".join(f"{k}x{c}" for k, c in runs))
    for (_, prev, *_), (made, k, acc, costs, why) in zip(trace, trace[1:]):
        if (prev == 4) != (k == 4):
            print(f"  token {made}: {prev} -> {k}; acceptance {' '.join(f'{a:.2f}' for a in acc)}; "
                  f"costs {' '.join(f'{c:.2f}' for c in costs)}; {why}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--trace", choices=PROFILES, help="for this profile: each run below 0.97, auto's depths")
    ap.add_argument("--known-costs", action="store_true", help="replies start from every depth's cost")
    ap.add_argument("--costs", choices=COSTS, default="h200-27b")
    ap.add_argument("--catch-up", type=float, help="ms a plain token (default: the --costs one's)")
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="what a drafting cycle after plain ones pays besides the catch-up per token")
    ap.add_argument("--resume", choices=PROFILES, help="auto replies start from what one of this profile left")
    args = ap.parse_args()
    global COST_MS, CATCH_UP_MS, NOISE, SWITCH_MS, RESUME
    RESUME = args.resume
    COST_MS, CATCH_UP_MS = COSTS[args.costs]
    CATCH_UP_MS = CATCH_UP_MS if args.catch_up is None else args.catch_up
    NOISE, SWITCH_MS = args.noise, args.switch_ms
    known = args.known_costs
    if args.trace:
        profile = PROFILES[args.trace]
        for seed in range(args.runs):
            fixed = max(bench_row(profile, d, args.tokens, 1, seed) for d in range(5))
            ratio = reply(profile, "auto", args.tokens, seed, known) / fixed
            if ratio < 0.97:
                print(f"seed {seed}: auto / best row {ratio:.3f}")
                show_trace(profile, args.tokens, seed, known)
        return
    for name, profile in PROFILES.items():
        # in expectation (many seeds): auto against the best fixed depth
        expected = {d: statistics.mean(reply(profile, d, args.tokens, 10_000 + s, known) for s in range(400))
                    for d in (0, 1, 2, 3, 4, "auto")}
        best = max(range(5), key=expected.get)
        ratios, ideal = [], []
        for seed in range(args.runs):  # one bench run each: a row against the best fixed row of that run
            fixed = max(bench_row(profile, d, args.tokens, args.repeat, seed) for d in range(5))
            ratios.append(bench_row(profile, "auto", args.tokens, args.repeat, seed, known) / fixed)
            ideal.append(bench_row(profile, best, args.tokens, args.repeat, seed) / fixed)
        ratios.sort()
        tenth, ninetieth = ratios[len(ratios) // 10], ratios[len(ratios) * 9 // 10]
        print(f"{name:>20}: expected auto / best (depth {best}) {expected['auto'] / expected[best]:.3f}; one run's "
              f"auto / its best row: median {statistics.median(ratios):.3f}, 10-90% {tenth:.3f}-{ninetieth:.3f}, "
              f"below 0.97 in {sum(r < 0.97 for r in ratios) / len(ratios):.0%} (depth {best} fixed, as a row "
              f"against the same runs' best: median {statistics.median(ideal):.3f})", flush=True)


if __name__ == "__main__":
    main()
