"""FP8 linears at prefill widths on one GPU (issue #23's "prefill with FP8 weights not slower than bf16"): per call
inside a CUDA graph, at the 27B shape's projections and 2,048 rows (a prefill chunk), against bf16's cuBLAS:
  - dequantize the FP8 weight to bf16, then cuBLAS (today's path above fp8_triton.MAX_ROWS rows);
  - fp8_triton's tensor-core "dot" kernel (W8A16: bf16 activations, FP8 weights converted in registers), each
    configuration;
  - F.scaled_mm with block scales (cuBLASLt FP8 x FP8: the activations quantized per 1x128 token group, as the
    checkpoints' "activation_scheme": "dynamic" describes), the quantization's own kernels included.
Error: relative to the dequantized weight's bf16 matmul.

    python3 packaging/bench/fp8_prefill_ops.py [--rows 2048] [--json OUT]
"""

import argparse
import json

import torch
import torch.nn.functional as F

from engine import fp8
from engine.fp8_triton import CONFIGS, _launch
from engine.splitk import graph_ms
from engine.kernels import relative_error

SHAPES = {"gate_up": (34816, 5120), "down": (5120, 17408), "qkvz": (16384, 5120), "o_proj": (5120, 6144)}
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor):
    """x [M, K] -> e4m3 [M, K] and float32 scales [M, K/128] (per token, per 128 columns), the scales laid out
    M-major as cuBLASLt's 1x128 block scaling takes them."""
    M, K = x.shape
    g = x.float().view(M, K // 128, 128)
    scale = g.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    q = (g / scale[..., None]).to(torch.float8_e4m3fn).view(M, K)
    return q, scale.t().contiguous().t()


def scaled(x, w, s):
    q, sx = quantize_rows(x)
    return F.scaled_mm(q, w.t(), sx, F.ScalingType.BlockWise1x128, s.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=x.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, out = torch.device("cuda"), {}
    for name, (N, K) in SHAPES.items():
        wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        w, s = fp8.quantize(wb)
        x = torch.randn(args.rows, K, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, fp8.dequantize(w, s, x.dtype))
        flops = 2 * args.rows * N * K
        row = {}

        def put(label, fn):
            try:
                ms = graph_ms(fn, reps=8)
                err = relative_error(fn(), ref)
            except Exception as e:  # an unsupported path on this GPU / torch: say which
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                print(f"{name:8s} {label:22s} failed: {row[label]['error']}", flush=True)
                return
            row[label] = {"ms": ms, "tflops": flops / ms / 1e9, "error": err}
            print(f"{name:8s} {label:22s} {ms * 1e3:8.1f} us {flops / ms / 1e9:7.0f} TFLOP/s  err {err:.1e}",
                  flush=True)

        put("bf16 cublas", lambda: F.linear(x, wb))
        put("dequantize + cublas", lambda: F.linear(x, fp8.dequantize(w, s, x.dtype)))
        for c in CONFIGS["dot"]:
            put(f"dot {c}", lambda c=c: _launch(x, w, s, ("dot", c)))
        put("scaled_mm 1x128/128x128", lambda: scaled(x, w, s))
        q, sx = quantize_rows(x)
        put("  its matmul alone", lambda: F.scaled_mm(q, w.t(), sx, F.ScalingType.BlockWise1x128, s.t(),
                                                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype))
        out[name] = row
        del wb, w, s, x, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "gpu": torch.cuda.get_device_name(), "shapes": out}, f, indent=2)


if __name__ == "__main__":
    main()
