"""Quick: does the draft's greedy chain replay as a graph on CUDA (report, fallbacks, draft ms per cycle)."""
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_h200 import write_draft
from engine import Engine, GenerationSettings, random_model
from engine.events import Finished

target = Engine(random_model("qwen3.5-27b", int(sys.argv[1]), "cuda", "bfloat16"), None, set())
path = write_draft(Path("/tmp/draft_diag"), "qwen3-0.6b", target.trunk.config.vocab_size)
target.attach_draft(str(path), "draft")
for depth in (1, 3, 3):
    for ev in target.generate(list(range(1, 65)), GenerationSettings(max_new_tokens=64, depth=depth, ignore_eos=True)):
        if isinstance(ev, Finished):
            s = ev.stats
            print(depth, {k: round(v / s["cycles"], 2) for k, v in s["phase_ms"].items() if k in ("draft", "verify")},
                  [f.reason for f in ev.fallbacks if f.feature == "cuda_graphs"])
print(target.draft_drafter.graphs.report())
