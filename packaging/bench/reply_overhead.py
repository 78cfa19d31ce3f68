"""What a reply costs besides its decoding, with and without the turn's reuse: on an H100 (stop 69) auto_ab.py's plain
replies (reuse on, the same prompt each time) ran 4,739 tok/s of wall time where the bench's plain row (reuse off)
ran 5,987 tok/s of decoding. In alternating rounds, per variant (depth, reuse): wall tok/s, the engine's decode tok/s
(Finished.stats, after the first token), time to first token, and the CUDA graphs captured during the reply.

    python packaging/bench/reply_overhead.py [--rounds 8] [--tokens 256]
"""
import argparse
import json
import os
import statistics
import time

import torch
from engine import Finished, GenerationSettings, load_engine

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=8)
ap.add_argument("--tokens", type=int, default=256)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
e = load_engine("engine/assets/demo", device=device)
prompt = e.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
e.warm_up(depths=[0, 3])


def captures() -> int:
    runner, head = e.trunk.graphs, e.default_drafter()
    groups = [g for g in vars(runner).values() if hasattr(g, "captures")] if runner is not None else []
    groups += [g for g in (getattr(head, "graphs", None), getattr(head, "chains", None)) if g is not None]
    return sum(g.captures for g in groups)


def reply(depth: int, reuse: bool) -> dict:
    before = captures()
    sync()
    t = time.perf_counter()
    stats = None
    for ev in e.generate(prompt, GenerationSettings(max_new_tokens=args.tokens, depth=depth, ignore_eos=True,
                                                    reuse=reuse)):
        if isinstance(ev, Finished):
            stats = ev.stats
    sync()
    wall = time.perf_counter() - t
    return {"wall_tok_s": args.tokens / wall, "decode_tok_s": stats["tokens_per_s"], "ttft_ms": stats["ttft_ms"],
            "captures": captures() - before}


variants = [(0, True), (0, False), (3, True), (3, False)]
for v in variants:  # (one unmeasured reply each)
    reply(*v)
rows = {v: [] for v in variants}
for _ in range(args.rounds):
    for v in variants:
        rows[v].append(reply(*v))
res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rounds": args.rounds,
       "tokens": args.tokens}
for (depth, reuse), rs in rows.items():
    res[f"depth {depth}, reuse {'on' if reuse else 'off'}"] = {
        k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} | {"captures_total": sum(r["captures"] for r in rs)}
print(json.dumps(res))
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/reply_overhead.json", "w"), indent=1)
