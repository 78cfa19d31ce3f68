"""Where auto's plain cycles lose to plain decoding on the demo model: depth 0, auto, auto with the chooser's
pick and observe replaced by constants (the drafter's keep alone), auto with why formatting skipped."""
import json, os, sys, time
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
