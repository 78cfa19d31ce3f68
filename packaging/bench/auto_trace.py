"""Per-cycle trace of replies at --depth auto (or fixed depths): each cycle's depth, wall ms, phases and why.

    python3 packaging/bench/auto_trace.py --model engine/assets/demo --depths auto,auto,0,3 [--json F]
"""

import argparse
import json
import time

from engine import GenerationSettings, load_engine
from engine.events import Cycle, Tokens
from engine.limits import AUTO


def captures(engine) -> dict:
    r = engine.diagnostics()["compile"]["cuda_graphs"]
    out = {k: v["captures"] for k, v in r.items() if isinstance(v, dict) and "captures" in v}
    out["steps"] = r.get("captures")
    for name in ("graphs", "chains"):  # the MTP head's own step and chain graphs
        g = getattr(engine.mtp_drafter, name, None)
        out["mtp_" + name] = None if g is None else g.captures
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="engine/assets/demo")
    ap.add_argument("--depths", default="auto,auto,0,3")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="cProfile the last reply; graph captures before / after")
    a = ap.parse_args()
    engine = load_engine(a.model, cuda_graphs=True)
    print("warm-up", engine.warm_up(depths=(0, 1, 2, 3, 4)), flush=True)
    prompt = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    replies = []
    depths = a.depths.split(",")
    for i, d in enumerate(depths):
        profiler = None
        if a.profile and i == len(depths) - 1:
            import cProfile
            before = captures(engine)
            profiler = cProfile.Profile()
            profiler.enable()
        depth = AUTO if d == "auto" else int(d)
        s = GenerationSettings(max_new_tokens=a.max_new_tokens, depth=depth, ignore_eos=True)
        t0 = last = time.perf_counter()
        rows, n = [], 0
        for ev in engine.generate(prompt, s):
            now = time.perf_counter()
            if isinstance(ev, Cycle):
                rows.append({"depth": ev.depth, "accepted": ev.accepted, "wall_ms": round((now - last) * 1e3, 3),
                             "phase_ms": {k: round(v, 3) for k, v in ev.phase_ms.items()}, "why": ev.why})
                last = now
            elif isinstance(ev, Tokens):
                n += len(ev.token_ids)
        dt = time.perf_counter() - t0
        if profiler is not None:
            import pstats
            profiler.disable()
            print("captures before / after:", before, captures(engine), flush=True)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        replies.append({"depth": d, "tokens": n, "tok_s": n / dt, "cycles": rows})
        by = {}
        for r in rows:
            by.setdefault(r["depth"], []).append(r["wall_ms"])
        mean = {k: f"{len(v)} x {sum(v) / len(v):.3f} ms" for k, v in sorted(by.items())}
        print(f"depth {d}: {n / dt:.1f} tok/s, {len(rows)} cycles, {mean}; slowest:", flush=True)
        for r in sorted(rows, key=lambda r: -r["wall_ms"])[:4]:
            print("   ", r, flush=True)
        for r in rows[:: max(1, len(rows) // 10)]:
            print("  ", r["depth"], r["wall_ms"], r["phase_ms"].get("refresh"), r["why"][:100], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "replies": replies}, f, indent=1)


if __name__ == "__main__":
    main()
