"""Where --depth auto's plain cycles lose to plain decoding on the demo model (0.92x on an H100 in stop 65, 245 of
252 cycles plain): tok/s (median of 5) at depth 0, at auto, and at auto with the chooser's pick and observe
replaced by constants (what is left: the drafter's keep of each step's hidden, the loop's bookkeeping), then
depth 0 again. On a GPU (h200.sh auto65); writes $OUT/auto_overhead_h100.json.

    python packaging/bench/auto_overhead.py
"""
import json
import os
import time

import torch
from engine import GenerationSettings, load_engine
from engine import autodepth

e = load_engine("engine/assets/demo", device="cuda")
prompt = e.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
e.warm_up(depths=[0, 1, 2, 3, 4])

def run(depth, n=256, reps=5):
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(); t = time.perf_counter()
        k = sum(len(ev.token_ids) for ev in e.generate(prompt, GenerationSettings(max_new_tokens=n, depth=depth, ignore_eos=True)) if hasattr(ev, "token_ids"))
        torch.cuda.synchronize(); out.append(k / (time.perf_counter() - t))
    return sorted(out[1:])[len(out[1:]) // 2]

res = {"plain": run(0), "auto": run("auto")}
pick, observe = autodepth.DepthChooser.pick, autodepth.DepthChooser.observe
autodepth.DepthChooser.pick = lambda self: 0
autodepth.DepthChooser.observe = lambda self, *a: None
res["auto_constant_chooser"] = run("auto")
autodepth.DepthChooser.pick, autodepth.DepthChooser.observe = pick, observe
res["plain_again"] = run(0)
print(json.dumps(res))
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/auto_overhead_h100.json", "w"))
