"""W4A16 linears against bf16 on the GPU, one projection shape at a time:

    python benchmarks/int4_linear.py [--shapes 8b] [--tokens 1,4,16,64,256,1024,8192]
        [--group 128] [--act-order] [--bits 4|8] [--json FILE]

For each projection (N, K) of Llama-3.1-8B and each token count M it times, with CUDA events
(median of 20 after 5 warm-ups), on the same random weights:
- bf16: `F.linear(x, W)` with W the dequantized weight;
- w4a16: the Triton GEMM that dequantizes in registers (`ops/w4a16_gemm.py`, tiles from its
  table keyed by M), reading 4-bit codes or, with --bits 8, 8-bit ones (W8A16);
- dequant + bf16: the whole weight dequantized, then `F.linear` (the large-M alternative that
  `DEQUANTIZE_ABOVE_M` switches to),
and prints each path's time, its speed-up over bf16 and the max relative error of w4a16
against the float32 product. The weight bytes of each form are printed once per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pagedserve.quantization.int_codes import IntCodes
from pagedserve.quantization.ops.w4a16_gemm import w4a16_layout, w4a16_mm

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336)}}


def _time(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _weight(n: int, k: int, group: int, act_order: bool, bits: int) -> IntCodes:
    groups = k // group
    index = torch.arange(k, device="cuda") // group
    if act_order:
        index = index[torch.randperm(k, device="cuda")]
    top = 1 << bits
    return IntCodes(torch.randint(0, top, (n, k), device="cuda", dtype=torch.int32),
                     torch.randint(0, top, (n, groups), device="cuda", dtype=torch.int32),
                     torch.rand(n, groups, device="cuda", dtype=torch.float16) * 0.01,
                     index, bits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8b")
    parser.add_argument("--tokens", default="1,4,16,64,256,1024,8192")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print(f"{'shape':>8} {'N':>6} {'K':>6} {'M':>5} {'bf16 ms':>8} {'w4a16 ms':>9} "
          f"{'x':>5} {'deq+bf16':>9} {'x':>5} {'rel err':>8}")
    for name, (n, k) in SHAPES[args.shapes].items():
        codes = _weight(n, k, args.group, args.act_order, args.bits)
        weight = w4a16_layout(codes.codes, codes.zeros, codes.scales, codes.group, args.bits)
        dense = codes.dequantize().to(torch.bfloat16)
        packed_bytes = sum(t.numel() * t.element_size() for t in
                           (weight.qweight, weight.scales, weight.zeros, weight.g_idx))
        print(f"{name}: weight bytes bf16 {dense.numel() * 2}, w4a16 {packed_bytes} "
              f"({packed_bytes / (dense.numel() * 2):.3f}x)")
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = _time(lambda: F.linear(x, dense))  # noqa: B023
            w4 = _time(lambda: w4a16_mm(x, weight))  # noqa: B023
            deq = _time(lambda: F.linear(x, weight.dequantize(torch.bfloat16)))  # noqa: B023
            want = x.float() @ dense.float().T
            err = float((w4a16_mm(x, weight).float() - want).abs().max() / want.abs().max())
            rows.append({"shape": name, "n": n, "k": k, "m": m, "bf16_ms": bf16,
                         "w4a16_ms": w4, "dequant_bf16_ms": deq, "rel_err": err})
            print(f"{name:>8} {n:>6} {k:>6} {m:>5} {bf16:>8.4f} {w4:>9.4f} {bf16 / w4:>5.2f} "
                  f"{deq:>9.4f} {bf16 / deq:>5.2f} {err:>8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "group": args.group,
                       "act_order": args.act_order, "bits": args.bits,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
