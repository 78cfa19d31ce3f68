"""Where --depth auto loses to plain decoding on the demo model (0.92x on an H100 in stop 65, 245 of 252 cycles
plain): tok/s (median of 5) at depth 0; at auto (plain picks held until the next probe could be due,
autodepth.HOLD_MAX); at auto with stop 66's PROBE_MAX of 64; at auto reading the estimates every cycle (HOLD_MAX 0,
stop 65's chooser); at auto with the chooser's pick and observe replaced by constants (what is left: the drafter's
keep of each step's hidden, the loop's bookkeeping); then depth 0 again. Also the depths auto picked, its last
reply's cycles (when, depth, tokens, why), the costs it learned, and the host's Python per token, plain and auto
(cProfile: the functions with the most time of their own). On a GPU (h200.sh auto67); writes
$OUT/auto_overhead_<gpu>.json.

    python packaging/bench/auto_overhead.py
"""
import cProfile
import io
import json
import os
import pstats
import time

import torch
from engine import GenerationSettings, load_engine
from engine.events import Cycle
from engine import autodepth

e = load_engine("engine/assets/demo", device="cuda")
prompt = e.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
e.warm_up(depths=[0, 1, 2, 3, 4])

depths, traces = {}, {}


def run(label, depth, n=256, reps=5):
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(); t = time.perf_counter()
        k, trace = 0, []
        for ev in e.generate(prompt, GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True)):
            k += len(getattr(ev, "token_ids", ()))
            if isinstance(ev, Cycle):  # (the host's clock at each cycle's event: with graphs a cycle ahead)
                trace.append((round((time.perf_counter() - t) * 1e3, 3), ev.depth, ev.committed, ev.why))
            if hasattr(ev, "stats") and isinstance(ev.stats, dict):
                depths[label] = ev.stats.get("auto_depths")
        torch.cuda.synchronize(); out.append(k / (time.perf_counter() - t))
        traces[label] = trace
    return sorted(out[1:])[len(out[1:]) // 2]


res = {"plain": run("plain", 0), "auto": run("auto", "auto")}
probe_max = autodepth.PROBE_MAX
autodepth.PROBE_MAX = 64  # (stop 66's cap on the probes' spacing, against today's)
res["auto_probe_max_64"] = run("auto_probe_max_64", "auto")
autodepth.PROBE_MAX = probe_max
held = autodepth.HOLD_MAX
autodepth.HOLD_MAX = 0
res["auto_every_cycle"] = run("auto_every_cycle", "auto")
autodepth.HOLD_MAX = held
pick, observe = autodepth.DepthChooser.pick, autodepth.DepthChooser.observe
autodepth.DepthChooser.pick = lambda self: 0
autodepth.DepthChooser.observe = lambda self, *a: None
res["auto_constant_chooser"] = run("auto_constant_chooser", "auto")
autodepth.DepthChooser.pick, autodepth.DepthChooser.observe = pick, observe
res["plain_again"] = run("plain_again", 0)
res["auto_depths_last_reply"] = depths
res["auto_trace_last_reply"] = traces["auto"]  # (ms since the reply began, depth, tokens committed, why)
res["auto_estimates"] = {name: {"cost": {str(k): v for k, v in est.get("cost", {}).items()},
                                "switch_ms": est.get("switch_ms")} for name, est in e.auto_estimates.items()}
for label, depth in (("plain", 0), ("auto", "auto")):  # (cProfile slows the loop: its shares, not its rates)
    prof = cProfile.Profile()
    prof.enable()
    run("profiled_" + label, depth, reps=1)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    res["host_profile_" + label] = text.getvalue().splitlines()
    text = io.StringIO()  # (who runs eager linears and custom ops inside a reply: with graphs, none should)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_callers(r"_nn.linear|backend_impl|catch_up|run_head")
    res["host_callers_" + label] = text.getvalue().splitlines()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(r"engine", 40)
    res["host_cumulative_" + label] = text.getvalue().splitlines()
res["gpu"] = torch.cuda.get_device_name()
print(json.dumps(res))
gpu = "h200" if "H200" in res["gpu"] else "h100"
json.dump(res, open(os.environ.get("OUT", "/tmp") + f"/auto_overhead_{gpu}.json", "w"), indent=1)
