"""FP8 linears against bf16 on the GPU, one projection shape at a time:

    python benchmarks/fp8_linear.py [--models 8b,70b,30b-a3b,dsv3] [--tokens 1,16,128,1024,8192]
        [--check] [--moe] [--json FILE]

For each model's projections (N, K) and each token count M it times, with CUDA events (median):
- bf16: `F.linear(x, W)`;
- fp8 rowwise: per-token activation quantization + `torch._scaled_mm` with per-channel weight
  scales (the "scaled_mm" kernel of per-tensor / per-channel checkpoints and online FP8);
- fp8 block: per-token-group quantization + our Triton block-scaled GEMM (128 x 128 blocks,
  DeepSeek / Qwen FP8 releases), and the GEMM alone (its launch shape from the table in
  `quantization/ops/fp8_block_gemm.py`).
and prints the table with each FP8 path's speed-up over bf16. `--check` also compares every
FP8 output with the float32 product of its dequantized operands (max relative error).
`--moe` adds a Qwen3-30B-A3B expert layer (128 experts of 768, hidden 2048, top 8): the bf16
grouped GEMM (`moe_kernels.fused_experts`) against the FP8 one (`fp8_moe_kernels`) per M.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from pagedserve.quantization import fp8_format as fmt
from pagedserve.quantization.fp8_linear import quantize_per_token, scaled_mm_linear
from pagedserve.quantization.ops.fp8_block_gemm import (
    block_scaled_mm,
    fp8_block_linear,
    quantize_per_token_group,
)

# (N, K) per projection, one rank. Llama-3.1-8B / 70B, Qwen3-30B-A3B (attention; its experts
# run in the grouped GEMM), DeepSeek-V3 (MLA projections, dense MLP of the first layers).
MODELS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192),
            "down": (8192, 28672)},
    "30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096)},
    "dsv3": {"q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168),
             "o": (7168, 16384), "gate_up": (36864, 7168), "down": (7168, 18432)},
}
BLOCK = (128, 128)


def time_us(fn, warmup: int = 5, iters: int = 30) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def run_shape(n: int, k: int, m: int, check: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w16 = w.bfloat16()
    codes_c, scale_c = fmt.quantize_per_channel(w)
    codes_b, scale_b = fmt.quantize_blocks(w, BLOCK)
    row = {"m": m, "n": n, "k": k,
           "bf16_us": time_us(lambda: F.linear(x, w16)),
           "fp8_rowwise_us": time_us(lambda: scaled_mm_linear(x, codes_c, scale_c, None, None)),
           "fp8_block_us": time_us(lambda: fp8_block_linear(x, codes_b, scale_b, BLOCK))}
    q, s = quantize_per_token_group(x, BLOCK[1])
    row["block_gemm_only_us"] = time_us(
        lambda: block_scaled_mm(q, s, codes_b, scale_b, BLOCK, torch.bfloat16))
    if check:
        qc, sc = quantize_per_token(x, None)
        want = (qc.float() * sc) @ fmt.dequantize(codes_c, scale_c, fmt.Fp8Scheme("channel")).T
        row["rowwise_err"] = rel_err(scaled_mm_linear(x, codes_c, scale_c, None, None), want)
        deq_x = q.float() * s.repeat_interleave(BLOCK[1], 1)[:, :k]
        scheme = fmt.Fp8Scheme("block", block=BLOCK, scale_name="weight_scale_inv")
        want = deq_x @ fmt.dequantize(codes_b, scale_b, scheme).T
        row["block_err"] = rel_err(block_scaled_mm(q, s, codes_b, scale_b, BLOCK,
                                                   torch.float32), want)
    return row


def run_moe(m: int) -> dict:
    from pagedserve.models.moe_kernels import fused_experts
    from pagedserve.quantization.ops.fp8_moe_kernels import fp8_fused_experts

    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) * inter ** -0.5
    q13, s13 = (torch.stack(t) for t in zip(*(fmt.quantize_blocks(w, BLOCK) for w in w13),
                                           strict=True))
    q2, s2 = (torch.stack(t) for t in zip(*(fmt.quantize_blocks(w, BLOCK) for w in w2),
                                         strict=True))
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
    probs = torch.softmax(torch.randn(m, experts, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, top_k)
    weights = weights.bfloat16()
    return {"m": m, "bf16_us": time_us(lambda: fused_experts(x, w13, w2, weights, ids)),
            "fp8_us": time_us(lambda: fp8_fused_experts(x, q13, s13, q2, s2, weights, ids,
                                                        BLOCK))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b,70b,30b-a3b,dsv3")
    parser.add_argument("--tokens", default="1,16,128,1024,8192")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear.py times CUDA kernels: run it on a GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = (f"{'model':8} {'proj':8} {'M':>5} {'N':>6} {'K':>6} {'bf16 us':>9} "
              f"{'rowwise':>9} {'x':>5} {'block':>9} {'x':>5} {'gemm':>9}")
    print(header + ("  rowwise_err block_err" if args.check else ""))
    rows = []
    for model in args.models.split(","):
        for proj, (n, k) in MODELS[model].items():
            for m in (int(t) for t in args.tokens.split(",")):
                r = run_shape(n, k, m, args.check)
                r.update(model=model, proj=proj)
                rows.append(r)
                line = (f"{model:8} {proj:8} {m:>5} {n:>6} {k:>6} {r['bf16_us']:>9.1f} "
                        f"{r['fp8_rowwise_us']:>9.1f} {r['bf16_us'] / r['fp8_rowwise_us']:>5.2f} "
                        f"{r['fp8_block_us']:>9.1f} {r['bf16_us'] / r['fp8_block_us']:>5.2f} "
                        f"{r['block_gemm_only_us']:>9.1f}")
                if args.check:
                    line += f"  {r['rowwise_err']:.2e}    {r['block_err']:.2e}"
                print(line, flush=True)
    if args.moe:
        print(f"\n{'qwen3-30b-a3b experts':24} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'x':>5}")
        for m in (int(t) for t in args.tokens.split(",")):
            r = run_moe(m)
            rows.append({"model": "30b-a3b", "proj": "experts", **r})
            print(f"{'':24} {m:>5} {r['bf16_us']:>9.1f} {r['fp8_us']:>9.1f} "
                  f"{r['bf16_us'] / r['fp8_us']:>5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
