"""FP8 linears against bf16 on the GPU, one projection shape at a time:

    python benchmarks/fp8_linear.py [--models 8b,70b,30b-a3b,dsv3] [--tokens 1,16,128,1024,8192]
        [--check] [--moe] [--eager] [--json FILE]
    python benchmarks/fp8_linear.py --sweep-small-m [--models 8b] [--tokens 1,4,16]

For each model's projections (N, K) and each token count M it times (CUDA events, median):
- bf16: `F.linear(x, W)`;
- fp8 rowwise: per-token activation quantization + `torch._scaled_mm` with per-channel weight
  scales (the "scaled_mm" kernel of per-tensor / per-channel checkpoints and online FP8);
- fp8 block: per-token-group quantization + our Triton block-scaled GEMM (128 x 128 blocks,
  DeepSeek / Qwen FP8 releases), and the GEMM alone (its launch shape from the table in
  `quantization/ops/fp8_block_gemm.py`);
- at M <= 16, the small-M kernel (`quantization/ops/fp8_small_m.py`, what the linear method
  runs there): channel scales with bf16 x (o_proj's input), channel scales with FP8 x per
  token and block scales with FP8 x per 128 (the fused norm's / SiLU-and-mul's output).
and prints the table with each FP8 path's speed-up over bf16; at M <= 16 a second line gives
each column's weight bandwidth in TB/s (weight bytes / time: what decode is bound by).

Timing: by default each sample replays a CUDA graph of REPS calls (as the engine's decode
does), so host launch cost does not hide the kernels; `--eager` times one eager call as before.
Each call reads one of several copies of the weight (256 MB or more in all), so the weights come
from HBM, not L2 (50 MB on an H100). `--check` also compares every FP8 output with the float32
product of its dequantized operands (max relative error). `--moe` adds a Qwen3-30B-A3B expert
layer (128 experts of 768, hidden 2048, top 8): the bf16 grouped GEMM
(`moe_kernels.fused_experts`) against the FP8 one (`fp8_moe_kernels`) per M (eager calls).
`--sweep-small-m` times the small-M kernel's launch shapes per projection and M (bf16 x with
channel scales, FP8 x with block scales) and prints the best beside the rules' choice.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
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
from pagedserve.quantization.ops.fp8_small_m import (
    SMALL_M_MAX,
    SmallMTiles,
    select_small_m_tiles,
    small_m_linear,
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
REPS = 20  # calls per graph replay
ROTATE_BYTES = 256 << 20  # weight copies per shape: at least this much in all, past L2
MAX_COPIES = 16
GRAPHS = True  # --eager: False
# The launch shapes --sweep-small-m tries (block_k 256 applies where no scale group is
# narrower: bf16 x with channel scales).
SWEEP = dict(block_n=(16, 32, 64), block_k=(128, 256), split_k=(1, 2, 3, 4, 6, 8),
             num_warps=(2, 4, 8), num_stages=(3, 4, 6))


def time_us(fn, warmup: int = 5, iters: int = 30, graph: bool | None = None) -> float:
    """Median microseconds a call: a CUDA graph of REPS calls replayed (or one eager call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run, per = fn, 1
    if GRAPHS if graph is None else graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                fn()
        run, per = graph.replay, REPS
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return statistics.median(times)


def rotating(make, bytes_each: int):
    """Copies of a weight (made by `make(i)`) to cycle through, and a call counter: each call
    of `fn(copy)` through the returned function reads the next copy."""
    copies = [make(i) for i in range(max(1, min(MAX_COPIES,
                                                math.ceil(ROTATE_BYTES / bytes_each))))]
    state = {"i": 0}

    def wrap(fn):
        def call():
            copy = copies[state["i"] % len(copies)]
            state["i"] += 1
            return fn(*copy)
        return call
    return wrap


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _weights(n: int, k: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5


def run_shape(n: int, k: int, m: int, check: bool) -> dict:
    w = _weights(n, k)
    x = torch.randn(m, k, device="cuda").bfloat16()
    codes_c, scale_c = fmt.quantize_per_channel(w)
    codes_b, scale_b = fmt.quantize_blocks(w, BLOCK)
    bf16 = rotating(lambda i: (w.bfloat16(),), 2 * n * k)
    chan = rotating(lambda i: (codes_c.clone(), scale_c.clone()), n * k)
    blk = rotating(lambda i: (codes_b.clone(), scale_b.clone()), n * k)
    q, s = quantize_per_token_group(x, BLOCK[1])
    qt, st = quantize_per_token(x, None)
    row = {"m": m, "n": n, "k": k,
           "bf16_us": time_us(bf16(lambda w16: F.linear(x, w16))),
           "fp8_rowwise_us": time_us(chan(lambda c, sc: scaled_mm_linear(x, c, sc, None, None))),
           "fp8_block_us": time_us(blk(lambda c, sc: fp8_block_linear(x, c, sc, BLOCK))),
           "block_gemm_only_us": time_us(blk(lambda c, sc: block_scaled_mm(
               q, s, c, sc, BLOCK, torch.bfloat16)))}
    if m <= SMALL_M_MAX:
        row["small_ch_us"] = time_us(chan(lambda c, sc: small_m_linear(x, c, sc)))
        row["small_ch_fp8x_us"] = time_us(chan(lambda c, sc: small_m_linear(
            qt, c, sc, x_scale=st, out_dtype=torch.bfloat16)))
        row["small_block_fp8x_us"] = time_us(blk(lambda c, sc: small_m_linear(
            q, c, sc, block=BLOCK, x_scale=s, x_group=BLOCK[1], out_dtype=torch.bfloat16)))
    if check:
        deq_c = fmt.dequantize(codes_c, scale_c, fmt.Fp8Scheme("channel"))
        scheme = fmt.Fp8Scheme("block", block=BLOCK, scale_name="weight_scale_inv")
        deq_b = fmt.dequantize(codes_b, scale_b, scheme)
        want = (qt.float() * st) @ deq_c.T
        row["rowwise_err"] = rel_err(scaled_mm_linear(x, codes_c, scale_c, None, None), want)
        deq_x = q.float() * s.repeat_interleave(BLOCK[1], 1)[:, :k]
        want = deq_x @ deq_b.T
        row["block_err"] = rel_err(block_scaled_mm(q, s, codes_b, scale_b, BLOCK,
                                                   torch.float32), want)
        if m <= SMALL_M_MAX:
            row["small_ch_err"] = rel_err(small_m_linear(x, codes_c, scale_c),
                                          x.float() @ deq_c.T)
            row["small_block_err"] = rel_err(small_m_linear(
                q, codes_b, scale_b, block=BLOCK, x_scale=s, out_dtype=torch.float32), want)
    return row


def sweep_small_m(n: int, k: int, m: int) -> list[tuple[str, float, SmallMTiles, float]]:
    """(variant, the rules' time, the best tiles, their time) for bf16 x with channel scales
    and FP8 x with block scales (the rules' tiles: `select_small_m_tiles`)."""
    w = _weights(n, k)
    x = torch.randn(m, k, device="cuda").bfloat16()
    codes_c, scale_c = fmt.quantize_per_channel(w)
    codes_b, scale_b = fmt.quantize_blocks(w, BLOCK)
    q, s = quantize_per_token_group(x, BLOCK[1])
    chan = rotating(lambda i: (codes_c.clone(), scale_c.clone()), n * k)
    blk = rotating(lambda i: (codes_b.clone(), scale_b.clone()), n * k)
    variants = {
        "bf16x-channel": lambda t: chan(lambda c, sc: small_m_linear(x, c, sc, tiles=t)),
        "fp8x-block": lambda t: blk(lambda c, sc: small_m_linear(
            q, c, sc, block=BLOCK, x_scale=s, out_dtype=torch.bfloat16, tiles=t)),
    }
    out = []
    for name, make in variants.items():
        rules = time_us(make(None), iters=10)
        best, best_us = None, math.inf
        for values in itertools.product(*SWEEP.values()):
            t = SmallMTiles(*values)
            if math.ceil(k / t.block_k) < t.split_k or (name != "bf16x-channel"
                                                        and t.block_k > BLOCK[1]):
                continue
            try:
                us = time_us(make(t), warmup=2, iters=10)
            except Exception as exc:  # a shape the compiler refuses (shared memory)
                print(f"  {name} {t}: {type(exc).__name__}", flush=True)
                continue
            if us < best_us:
                best, best_us = t, us
        out.append((name, rules, best, best_us))
    return out


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
    # Eager: the expert alignment is not known to be capturable here.
    return {"m": m, "bf16_us": time_us(lambda: fused_experts(x, w13, w2, weights, ids),
                                       graph=False),
            "fp8_us": time_us(lambda: fp8_fused_experts(x, q13, s13, q2, s2, weights, ids,
                                                        BLOCK), graph=False)}


def main() -> None:
    global GRAPHS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b,70b,30b-a3b,dsv3")
    parser.add_argument("--tokens", default="1,16,128,1024,8192")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--eager", action="store_true", help="time eager calls, no CUDA graph")
    parser.add_argument("--sweep-small-m", action="store_true",
                        help="sweep the small-M kernel's launch shapes (M from --tokens, <= 16)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear.py times CUDA kernels: run it on a GPU")
    GRAPHS = not args.eager
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{'eager calls' if args.eager else f'CUDA graphs of {REPS} calls'}")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    if args.sweep_small_m:
        sweep(args.models.split(","), [m for m in tokens if m <= SMALL_M_MAX], rows)
    else:
        table(args.models.split(","), tokens, args.check, rows)
    if args.moe:
        print(f"\n{'qwen3-30b-a3b experts':24} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'x':>5}")
        for m in tokens:
            r = run_moe(m)
            rows.append({"model": "30b-a3b", "proj": "experts", **r})
            print(f"{'':24} {m:>5} {r['bf16_us']:>9.1f} {r['fp8_us']:>9.1f} "
                  f"{r['bf16_us'] / r['fp8_us']:>5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


COLUMNS = [("bf16_us", "bf16"), ("fp8_rowwise_us", "rowwise"), ("fp8_block_us", "block"),
           ("block_gemm_only_us", "gemm"), ("small_ch_us", "small"),
           ("small_ch_fp8x_us", "small8"), ("small_block_fp8x_us", "smallblk8")]


def table(models: list[str], tokens: list[int], check: bool, rows: list[dict]) -> None:
    print("us a call (x: bf16 / it); at M <= 16 the next line: TB/s of weight read. small: "
          "bf16 x, channel; small8: FP8 x per token, channel; smallblk8: FP8 x per 128, block")
    print(f"{'model':8} {'proj':8} {'M':>5} {'N':>6} {'K':>6} "
          + " ".join(f"{name:>15}" for _, name in COLUMNS)
          + ("  errors" if check else ""))
    for model in models:
        for proj, (n, k) in MODELS[model].items():
            for m in tokens:
                r = run_shape(n, k, m, check)
                r.update(model=model, proj=proj)
                rows.append(r)
                cells = []
                for key, _ in COLUMNS:
                    if key not in r:
                        cells.append(f"{'-':>15}")
                    elif key == "bf16_us":
                        cells.append(f"{r[key]:>15.1f}")
                    else:
                        cells.append(f"{r[key]:>8.1f} ({r['bf16_us'] / r[key]:.2f})")
                line = f"{model:8} {proj:8} {m:>5} {n:>6} {k:>6} " + " ".join(cells)
                if check:
                    line += "  " + " ".join(f"{key[:-4]} {v:.1e}" for key, v in r.items()
                                            if key.endswith("_err"))
                print(line, flush=True)
                if m <= SMALL_M_MAX:
                    tbs = [f"{'':>15}" if key not in r else
                           f"{(2 if key == 'bf16_us' else 1) * n * k / r[key] / 1e6:>15.2f}"
                           for key, _ in COLUMNS]
                    print(f"{'':8} {'TB/s':8} {'':>5} {'':>6} {'':>6} " + " ".join(tbs),
                          flush=True)


def sweep(models: list[str], tokens: list[int], rows: list[dict]) -> None:
    print(f"{'model':8} {'proj':8} {'M':>3} {'variant':14} {'rules us':>9} {'best us':>8} "
          f"{'TB/s':>5}  best tiles / the rules' tiles")
    for model in models:
        for proj, (n, k) in MODELS[model].items():
            for m in tokens:
                for name, rules, best, best_us in sweep_small_m(n, k, m):
                    rows.append(dict(model=model, proj=proj, m=m, n=n, k=k, variant=name,
                                     rules_us=rules, best_us=best_us, best=str(best)))
                    chosen = select_small_m_tiles(n, k, torch.device("cuda"))
                    print(f"{model:8} {proj:8} {m:>3} {name:14} {rules:>9.1f} {best_us:>8.1f} "
                          f"{n * k / best_us / 1e6:>5.2f}  {best} / {chosen}", flush=True)


if __name__ == "__main__":
    main()
