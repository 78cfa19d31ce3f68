"""--depth auto A/B on the demo model, in rounds: each round one reply at depth 0, one at each fixed depth asked for, one at auto with autodepth
constants set one way (A) and one the other (B), so that a machine's drift and the estimates carried from reply to
reply (DepthChooser.estimates) fall on both alike. Per variant: tok/s (median and mean over the rounds), the depths
picked, and the plain cost each reply started from. One auto row of a bench is five replies: its ratio to plain
strayed by +-4% between runs on an H100 (stop 67), more than the changes it was to tell apart.

    python packaging/bench/auto_ab.py [--rounds 30] [--a PROBE_MAX=64] [--b PROBE_MAX=128]
"""
import argparse
import json
import os
import statistics
import time

import torch
from engine import GenerationSettings, load_engine
from engine import autodepth

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=30)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--a", default="PROBE_MAX=64")
ap.add_argument("--b", default="PROBE_MAX=128")
ap.add_argument("--fixed", default="3", help="fixed depths measured in each round too (comma-separated)")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
e = load_engine("engine/assets/demo", device=device)
prompt = e.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
e.warm_up(depths=[0, 1, 2, 3, 4])


def constants(spec: str) -> dict:
    return {k: type(getattr(autodepth, k))(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}


def reply(depth, setting: dict) -> tuple:
    saved = {k: getattr(autodepth, k) for k in setting}
    for k, v in setting.items():
        setattr(autodepth, k, v)
    start = dict(e.auto_estimates.get("MTPDrafter", {}).get("cost", {}))
    picked = {}
    try:
        sync(); t = time.perf_counter()
        n = 0
        for ev in e.generate(prompt, GenerationSettings(max_new_tokens=args.tokens, depth=depth, ignore_eos=True)):
            n += len(getattr(ev, "token_ids", ()))
            if hasattr(ev, "stats") and isinstance(ev.stats, dict):
                picked = ev.stats.get("auto_depths") or {}
        sync()
        return n / (time.perf_counter() - t), picked, start.get(0)
    finally:
        for k, v in saved.items():
            setattr(autodepth, k, v)


variants = {"plain": (0, {}), **{f"depth {d}": (int(d), {}) for d in args.fixed.split(",") if d},
            "A " + args.a: ("auto", constants(args.a)), "B " + args.b: ("auto", constants(args.b))}
for name, (depth, setting) in variants.items():  # (one unmeasured reply each: first calls, captures)
    reply(depth, setting)
rows = {name: [] for name in variants}
for _ in range(args.rounds):
    for name, (depth, setting) in variants.items():
        rows[name].append(reply(depth, setting))
plain = statistics.median(r[0] for r in rows["plain"])
res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rounds": args.rounds,
       "tokens": args.tokens}
for name, rs in rows.items():
    rates = [r[0] for r in rs]
    depths = {}
    for _, picked, _ in rs:
        for d, c in picked.items():
            depths[d] = depths.get(d, 0) + c
    res[name] = {"median_tok_s": statistics.median(rates), "mean_tok_s": statistics.mean(rates),
                 "median_vs_plain": statistics.median(rates) / plain, "mean_vs_plain": statistics.mean(rates) / plain,
                 "depths": depths, "start_plain_ms": [None if r[2] is None else round(r[2], 4) for r in rs],
                 "tok_s": [round(r, 1) for r in rates]}
print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk not in ("start_plain_ms", "tok_s")} if isinstance(v, dict)
                      else v)
                  for k, v in res.items()}))
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/auto_ab.json", "w"), indent=1)
