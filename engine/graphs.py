"""CUDA graphs for the verify step (plain decoding is its width-1 case): one graph per width, static buffers.

A verify pass reads the committed state and writes only the stash and KV rows past the committed length, so a
replay is always safe; the graph is re-captured when the KV cache or the stash is reallocated. Capture is
certified by replay counters, not by configuration: diagnostics report what actually replayed.
"""

from __future__ import annotations

import torch


class GraphRunner:
    def __init__(self, trunk, max_width: int = 8):
        self.trunk, self.max_width = trunk, max_width
        self.pos = torch.zeros((), dtype=torch.long, device=trunk.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}
        self.key = None
        self.replays: dict[int, int] = {}
        self.captures = 0
        self.failure: str | None = None

    def run(self, tokens: torch.Tensor, pos: int, caches) -> torch.Tensor:
        T = tokens.shape[1]
        stash = caches.stash_for(max(self.max_width, T), self.trunk)
        key = (caches.kv.k.data_ptr(), stash.q.data_ptr(), caches.gdn.recurrent.data_ptr())
        if key != self.key:
            self.graphs, self.key = {}, key
        self.pos.fill_(pos)
        if T not in self.graphs:
            try:
                self.capture(T, tokens, caches)
            except Exception as e:  # capture failed: eager from now on, with the reason on record
                self.failure = f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:160]}): eager decoding"
                self.trunk.graphs = None
                torch.cuda.synchronize()
                return self.trunk.forward(tokens, pos, caches, verify=True)
        graph, buf, out = self.graphs[T]
        buf.copy_(tokens)
        graph.replay()
        stash.width = T  # the Python side effect of the captured forward
        self.replays[T] = self.replays.get(T, 0) + 1
        return out

    def capture(self, T: int, tokens: torch.Tensor, caches) -> None:
        buf = tokens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton autotuning must not happen during capture
            for _ in range(2):
                self.trunk.forward(buf, self.pos, caches, verify=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.trunk.forward(buf, self.pos, caches, verify=True)
        self.graphs[T] = (graph, buf, out)
        self.captures += 1

    def report(self) -> dict:
        return {"captured_widths": sorted(self.graphs), "captures": self.captures, "failure": self.failure,
                "replays": {str(k): v for k, v in sorted(self.replays.items())}}
