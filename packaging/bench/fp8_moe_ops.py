"""FP8 vs bf16 routed-expert kernels (engine/moe_triton.py) at real MoE shapes, one H200: time per call inside a
CUDA graph, bandwidth against the bytes of the experts each token reads, error against moe_rowwise."""
import sys
sys.path.insert(0, "tests")  # run from the repository root: python3 packaging/bench/fp8_moe_ops.py
import torch
from engine import fp8
from engine.splitk import graph_ms
from engine.fusion import fuse_layer
from engine.model import moe_rowwise
from engine.moe_triton import moe_triton, inline_shared
from test_moe_triton import moe_block

SHAPES = {"35B-A3B": dict(hidden_size=2048, num_experts=256, moe_intermediate_size=512, num_experts_per_tok=8),
          "80B-A3B": dict(hidden_size=2048, num_experts=512, moe_intermediate_size=512, num_experts_per_tok=10)}
dev = torch.device("cuda")
for name, shape in SHAPES.items():
    for quant in ("bf16", "fp8"):
        block = moe_block(shape, torch.bfloat16, dev)
        layer = torch.nn.Module(); layer.mlp = block
        if quant == "fp8":
            fp8.quantize_experts(block); fp8.quantize_linears(layer)
        fuse_layer(layer)
        H, I, k = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts_per_tok"]
        per_elt = 1 if quant == "fp8" else 2
        for n in (1, 4):
            x = torch.randn(1, n, H, device=dev, dtype=torch.bfloat16)
            with torch.inference_mode():
                err = ((moe_triton(block, x).float() - moe_rowwise(block, x).float()).abs().max()
                       / moe_rowwise(block, x).float().abs().max()).item()
                ms = graph_ms(lambda: moe_triton(block, x))
            # distinct experts read (upper bound n*k) + the shared expert; scales ignored (<1%)
            with torch.inference_mode():
                from engine.model import route
                _, idx = route(block, x[0])
            experts = idx.unique().numel() + 1
            gb = experts * 3 * I * H * per_elt / 1e9
            print(f"{name} {quant} rows={n} inline={inline_shared(block)} {ms*1000:.1f} us  "
                  f"{gb / (ms / 1e3) / 1e3:.2f} TB/s of weights ({experts} experts)  err {err:.1e}", flush=True)
        del block, layer
        torch.cuda.empty_cache()
