"""Acceptance of depth-1 cycles taken now and then from plain decoding (as --depth auto's probes are) against
depth 1 every cycle, on the same prompts: a probe drafts from the MTP head after it caught up on the plain steps'
tokens (on a GPU through the head's padded catch-up graphs), a depth-1 cycle from the head refreshed inside the
verify graph before it. Equal rates say the catch-up path drafts as well as the refresh; on the demo model's GPU
bench rows auto's probes accepted 0.43-0.57 at position 1 where depth 1-3's cycles accepted 0.73-0.80.

    python packaging/bench/probe_acceptance.py --device cuda --dtype bfloat16 --every 1,17 --graphs 1,0
"""

import argparse
import json

from engine import GenerationSettings, load_engine
from engine.api import DecodeControl
from engine.events import Cycle

PROMPTS = ["Tell me a story about a cat.", "What is a dictionary in Python?", "Explain how rain forms.",
           "Write a poem about the sea."]


class Every(DecodeControl):
    """Depth 1 on every `every`-th cycle (counted by the caller), depth 0 otherwise."""

    def __init__(self, every: int):
        super().__init__(None)
        self.n, self.every = 0, every

    @property
    def depth(self):
        return 1 if self.n % self.every == self.every - 1 else 0

    @depth.setter
    def depth(self, value):  # (DecodeControl.__init__ sets it)
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="engine/assets/demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--every", default="1,17")
    ap.add_argument("--graphs", default="1,0")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for graphs in (g == "1" for g in a.graphs.split(",")):
        engine = load_engine(a.model, device=a.device, dtype=a.dtype, cuda_graphs=graphs)
        for every in map(int, a.every.split(",")):
            accepted = drafted = 0
            for prompt in PROMPTS:
                control = Every(every)
                ids = engine.encode_chat([{"role": "user", "content": prompt}])
                settings = GenerationSettings(max_new_tokens=a.tokens, depth=0, ignore_eos=True)
                for event in engine.generate(ids, settings, control):
                    if isinstance(event, Cycle):
                        if event.depth == 1:
                            drafted, accepted = drafted + 1, accepted + event.accepted
                        control.n += 1
            rows.append({"graphs": graphs, "every": every, "drafted": drafted, "accepted": accepted,
                         "acceptance": accepted / max(drafted, 1)})
            print(f"graphs {int(graphs)}  depth 1 every {every:2d} cycles: {accepted}/{drafted} = "
                  f"{accepted / max(drafted, 1):.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "device": a.device, "dtype": a.dtype, "tokens": a.tokens, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
