"""Each product of a decode step alone, float32: F.linear (MKL) against oneDNN's prepacked product and
other forms, in ms. Part 1: 32 rows, best of 20; part 2: 1, 8, 64 and 1,100 rows (1,100: a scored
trajectory; bwd_*: the input-gradient product), best of 5. Output of 2026-12-07 (AVX2-only EPYC,
2 threads): matmul-shapes-fp32-2026-12-07.txt. Run: python results/bench/matmul_shapes_fp32.py"""
import time

import torch

torch.manual_seed(0)


def best(f, n):
    f()
    f()
    b = 1e9
    for _ in range(n):
        t = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t)
    return b * 1e3


def linear_pointwise(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


shapes = {"qkv": (960, 576), "o": (576, 576), "gateup": (3072, 576), "down": (576, 1536), "head": (49152, 576),
          "q": (576, 576), "kv": (192, 576), "gate": (1536, 576)}
for name, (n, k) in shapes.items():   # part 1
    W, x = torch.randn(n, k) * 0.02, torch.randn(32, k)
    Wt, P = W.t().contiguous(), torch.ops.mkldnn._reorder_linear_weight(W)
    assert torch.allclose(linear_pointwise(x, P), x @ W.t(), atol=1e-4)
    Wm = W.to_mkldnn()
    r = {"F.linear": best(lambda: torch.nn.functional.linear(x, W), 20), "x@Wt": best(lambda: x @ Wt, 20),
         "mkldnn": best(lambda: linear_pointwise(x, P), 20),
         "mkldnn_linear": best(lambda: torch._C._nn.mkldnn_linear(x.to_mkldnn(), Wm).to_dense(), 20)}
    print(name, {a: round(b, 3) for a, b in r.items()})

for rows in (1, 8, 64, 1100):          # part 2
    for name in ("q", "kv", "gate", "down", "head"):
        n, k = shapes[name]
        W, x, g = torch.randn(n, k) * 0.02, torch.randn(rows, k), torch.randn(rows, n)
        P, Pt = torch.ops.mkldnn._reorder_linear_weight(W), torch.ops.mkldnn._reorder_linear_weight(W.t().contiguous())
        r = {"F.linear": best(lambda: torch.nn.functional.linear(x, W), 5), "mkldnn": best(lambda: linear_pointwise(x, P), 5)}
        if rows == 1100:
            r["bwd_mm"] = best(lambda: g @ W, 5)
            r["bwd_mkldnn"] = best(lambda: linear_pointwise(g, Pt), 5)
        print(rows, name, {a: round(b, 3) for a, b in r.items()})
