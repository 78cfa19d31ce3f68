"""Load-to-ready on this machine: load, Engine.warm_up (kernel JIT, autotuning, graph capture), then the first
reply's time to first token and wall time. Run it on a fresh machine (empty kernel caches) and again.

    python packaging/bench/ready.py [--model engine/assets/demo] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="engine/assets/demo")
    p.add_argument("--json")
    a = p.parse_args()
    t0 = time.perf_counter()
    from engine import GenerationSettings, load_engine

    engine = load_engine(a.model)
    loaded = time.perf_counter()
    warm = engine.warm_up()
    ready = time.perf_counter()
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a lighthouse keeper."}])
    for ev in engine.generate(prompt, GenerationSettings(max_new_tokens=64, depth=2)):
        stats = getattr(ev, "stats", None) or {}
    out = {"load_s": loaded - t0, "warm_up_s": warm["seconds"], "warm_up_steps": warm["steps"],
           "load_to_ready_s": ready - t0, "first_reply_ttft_ms": stats["ttft_ms"],
           "first_reply_s": time.perf_counter() - ready, "first_reply_tokens": stats["generated_tokens"]}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
