"""The 8B-shaped model's projections as cuBLAS runs them, one shape at a time (GPU):

    python benchmarks/linear_shapes.py [--tokens 128,256,8192]

For each token count M and each projection (fused QKV, O, fused gate/up, down, LM head) it times
`F.linear(x, W)` with the weight as the model stores it ([N, K], the "TN" GEMM) and with the
weight stored transposed ([K, N], `x @ Wt`, the "NN" GEMM), each next to its floor:
max(weight + activation bytes / copy bandwidth, FLOPs / the bf16 matmul rate), both measured
here on 8192^3 and a 2 GiB copy. It says where a decode step's GEMM time goes beyond its floor
and whether the weight layout changes cuBLAS's choice.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

# Llama-3.1-8B: hidden 4096, 32 heads of 128 (8 KV heads), intermediate 14336, vocab 128256.
SHAPES = {  # name: (N, K)
    "qkv": (4096 + 2 * 1024, 4096),
    "o": (4096, 4096),
    "gate_up": (2 * 14336, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def gpu_time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def time_layouts(inp: torch.Tensor, n: int, k: int) -> tuple[float, float]:
    """GPU us of inp @ W^T with W stored [N, K] (F.linear), then stored [K, N]."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    wt = w.t().contiguous()
    return gpu_time_us(lambda: F.linear(inp, w)), gpu_time_us(lambda: inp @ wt)


def rates() -> tuple[float, float]:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    flops = 2 * 8192 ** 3 / (gpu_time_us(lambda: a @ a, 20) * 1e-6)
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (gpu_time_us(lambda: dst.copy_(src), 10) * 1e-6)
    return flops, bw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="128,256,512,8192")
    args = parser.parse_args()
    flops_rate, bw = rates()
    print(f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s")
    print(f"{'M':>5} {'proj':>8} {'floor us':>9} {'TN us':>8} {'x':>5} {'NN us':>8} {'x':>5}"
          f" {'TN TFLOP/s':>10}")
    totals: dict[int, list[float]] = {}
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
        xd = torch.randn(m, 14336, dtype=torch.bfloat16, device="cuda")
        for name, (n, k) in SHAPES.items():
            inp = xd if k == 14336 else x
            flops = 2 * m * n * k
            nbytes = 2 * (n * k + m * k + m * n)
            floor = max(flops / flops_rate, nbytes / bw) * 1e6
            tn, nn = time_layouts(inp, n, k)
            t = totals.setdefault(m, [0.0, 0.0, 0.0])
            t[0] += floor
            t[1] += tn
            t[2] += nn
            print(f"{m:>5} {name:>8} {floor:>9.1f} {tn:>8.1f} {tn / floor:>5.2f} {nn:>8.1f} "
                  f"{nn / floor:>5.2f} {flops / tn / 1e6:>10.0f}", flush=True)
        torch.cuda.empty_cache()
    print("\nper token count, the five projections once (a layer's four + the head):")
    for m, (floor, tn, nn) in totals.items():
        print(f"  M={m}: floor {floor:.0f} us, TN {tn:.0f} us ({tn / floor:.2f}x), "
              f"NN {nn:.0f} us ({nn / floor:.2f}x)")


if __name__ == "__main__":
    main()
