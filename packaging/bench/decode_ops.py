"""GPU time per call of the decode step's attention and short convolution, inside CUDA graphs, at the 27B shape:
SDPA (default dispatch, each backend) against model.masked_decode_attention's matmul + softmax form, and
F.conv1d against the multiply-add that compiled code uses (gdn.kernel_inputs). `bash packaging/bench/h200.sh ops`.
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev, dt = "cuda", torch.bfloat16


def graph_ms(fn, reps=64, iters=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters / reps * 1e3


Hq, Hkv, D = 24, 4, 256
G = Hq // Hkv


def explicit(q, k, v, mask, scale):
    T = q.shape[2]
    qg = q.reshape(1, Hkv, G * T, D)
    s = (qg @ k.transpose(-1, -2)).float() * scale
    m = mask.repeat(G, 1)[None, None]
    s = s.masked_fill(~m, float("-inf"))
    p = torch.softmax(s, -1).to(v.dtype)
    return (p @ v).reshape(1, Hq, T, D)


compiled = torch.compile(explicit, fullgraph=True, dynamic=False)

for T in (1, 4):
    for cap in (256, 4096, 32768):
        q = torch.randn(1, Hq, T, D, device=dev, dtype=dt)
        k = torch.randn(1, Hkv, cap, D, device=dev, dtype=dt)
        v = torch.randn(1, Hkv, cap, D, device=dev, dtype=dt)
        pos = torch.tensor(cap // 2, device=dev)
        scale = D ** -0.5

        def mask():
            positions = pos + torch.arange(T, device=dev)
            return torch.arange(cap, device=dev)[None, :] <= positions[:, None]

        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), scale=scale, enable_gqa=True)
        row = {}
        row["sdpa"] = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), scale=scale,
                                                                       enable_gqa=True))
        for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH),
                         ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    row[name] = graph_ms(lambda: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask(), scale=scale, enable_gqa=True))
            except Exception as e:
                row[name] = f"fail {type(e).__name__}"
        row["explicit"] = graph_ms(lambda: explicit(q, k, v, mask(), scale))
        err = (compiled(q, k, v, mask(), scale).float() - ref.float()).abs().max().item()
        row["compiled"] = graph_ms(lambda: compiled(q, k, v, mask(), scale))
        print(f"attn T={T} cap={cap}: " + ", ".join(f"{a} {b:.4f} ms" if isinstance(b, float) else f"{a} {b}"
                                                     for a, b in row.items()) + f" (compiled max err {err:.3g})",
              flush=True)

C, K = 10240, 4
w = torch.randn(C, 1, K, device=dev, dtype=dt)
for T in (1, 4):
    win = torch.randn(1, C, K - 1 + T, device=dev, dtype=dt)

    def conv_ref():
        return F.silu(F.conv1d(win, w, None, groups=C))

    def conv_sum():
        return F.silu((win.unfold(-1, K, 1) * w[:, 0][None, :, None]).sum(-1))

    cs = torch.compile(conv_sum, fullgraph=True, dynamic=False)
    err = (cs().float() - conv_ref().float()).abs().max().item()
    print(f"conv T={T}: conv1d {graph_ms(conv_ref):.4f} ms, compiled sum {graph_ms(cs):.4f} ms (max err {err:.3g})",
          flush=True)
