"""Quick: does the draft's greedy chain replay as a graph on CUDA (report, fallbacks, draft ms per cycle)."""
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import Engine, GenerationSettings, random_model
from engine.presets import random_draft
from engine.events import Finished

target = Engine(random_model("qwen3.5-27b", int(sys.argv[1]), "cuda", "bfloat16"), None, set())
target.draft_drafter = random_draft("random:qwen3-0.6b", target)
target.attach_draft(None, "draft")
for depth in (1, 3, 3):
    for ev in target.generate(list(range(1, 65)), GenerationSettings(max_new_tokens=64, depth=depth, ignore_eos=True)):
        if isinstance(ev, Finished):
            s = ev.stats
            print(depth, {k: round(v / s["cycles"], 2) for k, v in s["phase_ms"].items() if k in ("draft", "verify")},
                  [f.reason for f in ev.fallbacks if f.feature == "cuda_graphs"])
print(target.draft_drafter.graphs.report())
