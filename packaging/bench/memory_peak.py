"""What holds CUDA memory at the peak of one long-prompt request: the allocator's trace replayed to its highest
point, the blocks alive there grouped by the engine line that allocated them (issue #29: the 27B shape's Int4
memory at a 32k context).

    python3 packaging/bench/memory_peak.py --random-weights qwen3.5-27b --quant int4 --prompt-tokens 32768 \
        [--max-context N] [--prefill-chunk auto,512] [--depth 0] [--compile] [--warm-depths 0,3] [--json OUT]

--warm-depths: short requests at these depths first, as a chat's earlier turns: their CUDA graphs (and compiled
steps) stay alive, and the lines that allocated them count at the peak too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from engine import Engine, Finished, GenerationSettings, random_model  # noqa: E402

NEW_TOKENS = 8  # the long request's
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def where(frames) -> str:
    """The innermost frame inside this repository (engine/, app/): the line that asked for the block."""
    for f in frames:
        name = os.path.abspath(f.get("filename", ""))
        if name.startswith(ROOT) and "memory_peak" not in name:
            return f"{os.path.relpath(name, ROOT)}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def peak_blocks(trace) -> tuple[int, dict]:
    """Replay alloc / free events: (the highest live total, its live blocks {addr: (size, where)})."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        action, addr, size = ev["action"], ev["addr"], ev["size"]
        if action == "alloc":
            live[addr] = (size, where(ev.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested",) and addr in live:
            total -= live.pop(addr)[0]
    return peak, at_peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--random-weights", default="qwen3.5-27b")
    p.add_argument("--quant", default="int4")
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--prefill-chunk", default="auto", help="comma-separated: one request each (auto: the engine's)")
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--warm-depths", default="", help="comma-separated depths of 32-token requests run first")
    p.add_argument("--max-context", type=int, default=None,
                   help="the context limit (`--max-context`; default: the prompt and its 8 new tokens): the KV cache "
                        "holds no more, where without one it keeps room ahead for the next turns (api.KV_AHEAD)")
    p.add_argument("--json")
    a = p.parse_args()
    engine = Engine(random_model(a.random_weights, None, "cuda", "bfloat16", quant=a.quant), None, set(),
                    compile=a.compile or None, max_context=a.max_context or a.prompt_tokens + NEW_TOKENS)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    prompt = torch.randint(0, engine.trunk.config.vocab_size, (a.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    warm = [int(d) for d in a.warm_depths.split(",") if d]
    out = []
    for i, chunk in enumerate([int(c) if c != "auto" else None for c in a.prefill_chunk.split(",")]):
        out.append(one_request(engine, prompt, chunk, a.depth, loaded, warm if i == 0 else []))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def one_request(engine, prompt, chunk, depth, loaded, warm_depths=()) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    for d in warm_depths:  # (recorded: what their graphs keep is live at the peak)
        turn = GenerationSettings(max_new_tokens=16, depth=d, ignore_eos=True, reuse=False)
        next(ev for ev in engine.generate(prompt[:32], turn) if isinstance(ev, Finished))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, depth=depth, ignore_eos=True, reuse=False, prefill_chunk=chunk)
    fin = next(ev for ev in engine.generate(prompt, settings) if isinstance(ev, Finished))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    growth, blocks = peak_blocks(snap["device_traces"][torch.cuda.current_device()])
    groups = defaultdict(int)
    for size, line in blocks.values():
        groups[line] += size
    top = sorted(groups.items(), key=lambda t: -t[1])[:20]
    out = {"loaded_bytes": loaded, "warm_depths": list(warm_depths), "before_request_bytes": base,
           "max_allocated_bytes": torch.cuda.max_memory_allocated(), "peak_over_traced_start_bytes": growth,
           "prompt_tokens": len(prompt), "prefill_chunk": chunk, "depth": depth,
           "tokens_per_s": fin.stats.get("tokens_per_s"),
           "at_peak_by_line": [{"line": line, "bytes": b} for line, b in top]}
    print(f"chunk {chunk}: loaded {loaded / 1e9:.2f} GB, before the request {base / 1e9:.2f} GB, max allocated "
          f"{out['max_allocated_bytes'] / 1e9:.2f} GB ({out['max_allocated_bytes'] / 2**30:.2f} GiB); the trace's "
          f"peak adds {growth / 1e9:.2f} GB to its start (before any warm-up request):", flush=True)
    for line, b in top:
        print(f"  {b / 1e6:9.1f} MB  {line}", flush=True)
    return out

if __name__ == "__main__":
    main()
