"""The MoE experts on the GPU: `moe_kernels.fused_experts` (Triton grouped GEMMs) against the
torch path `moe.torch_experts`.

- check: max abs / relative error of fused_experts against torch_experts, tokens {1 .. 8192} x
  experts {8, 32, 128} (k 2, 4, 8: Mixtral-, gpt-oss- and Qwen3-MoE-like), H 2048, I 768, bf16
  and float32 (tf32 off), silu without bias and gpt-oss's clamped swiglu with biases.
- time: a Qwen3-30B-A3B MoE layer (H 2048, I 768, 128 experts, top 8, bf16, routing by a
  softmax top-8 of random logits) at each batch size, against its memory floor: the weights of
  the experts the step hits (unique experts x 3 x H x I x 2 bytes) plus x and the output, over
  --bandwidth (the H200's ~4.8 TB/s). fused_experts is timed replayed from a CUDA graph (as
  the engine's decode graphs run it) and eagerly; the alignment alone from a graph; the torch
  path eagerly (it syncs with the host, so no graph).
- sweep (--sweep): each batch size again under other launch shapes (MoeTiles), the fastest
  first, each output checked against the table's; winners go into moe_kernels' table by hand.

    python benchmarks/moe_kernels.py [--sections check,time] [--batches 1,64,256,1024,4096]
        [--bandwidth 4.8e12] [--sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import time_cuda, time_graph  # noqa: E402
from moe_before import align_by_expert_torch_ops  # noqa: E402

from pagedserve.models.moe import SILU, ExpertActivation, torch_experts  # noqa: E402
from pagedserve.models.moe_kernels import (  # noqa: E402
    MoeTiles,
    align_by_expert,
    fused_experts,
    select_tiles,
)

CHECK_TOKENS = [1, 16, 64, 256, 1024, 4096, 8192]
CHECK_EXPERTS = {8: 2, 32: 4, 128: 8}  # experts: top k
QWEN3_30B_A3B = dict(hidden=2048, inter=768, experts=128, top_k=8)
DEVICE = "cuda"
SWEEP = dict(block_m=[16, 32, 64, 128], n=[(32, 64), (64, 128), (128, 256)],
             block_k=[64, 128], num_warps=[4, 8], num_stages=[3, 4])


def make_layer(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
               dtype: torch.dtype, bias: bool, seed: int = 0) -> tuple:
    """(x, gate_up_proj, down_proj, weights, ids, gate_up_bias, down_bias) on the GPU; routing
    by a renormalised softmax top-k of random logits, weights in the model dtype (Qwen3)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)

    x = rand(tokens, hidden)
    gate_up = rand(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    down = rand(experts, hidden, inter, scale=inter ** -0.5)
    biases = (rand(experts, 2 * inter, scale=0.5), rand(experts, hidden, scale=0.5))
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return (x, gate_up, down, weights, ids, *(biases if bias else (None, None)))


def run(experts_fn, layer: tuple, activation: ExpertActivation = SILU, **kwargs
        ) -> torch.Tensor:
    """fused_experts or torch_experts on a `make_layer` tuple."""
    return experts_fn(*layer[:5], activation, *layer[5:], **kwargs)


def check(args) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    print(f"\ncheck: fused_experts vs torch_experts, H {args.hidden}, I {args.inter}")
    print(f"{'dtype':>9} {'E':>4} {'k':>2} {'activation':>15} {'tokens':>6} "
          f"{'max abs':>9} {'max rel':>9}")
    cases = itertools.product([torch.bfloat16, torch.float32], CHECK_EXPERTS.items(),
                              [(SILU, False), (ExpertActivation("swiglu_clamped"), True)],
                              CHECK_TOKENS)
    for dtype, (experts, top_k), (activation, bias), tokens in cases:
        layer = make_layer(tokens, args.hidden, args.inter, experts, top_k, dtype, bias)
        got = run(fused_experts, layer, activation).float()
        want = run(torch_experts, layer, activation).float()
        err = (got - want).abs().max().item()
        row = dict(dtype=str(dtype).removeprefix("torch."), experts=experts, top_k=top_k,
                   activation=activation.kind, tokens=tokens, max_abs=err,
                   max_rel=err / max(want.abs().max().item(), 1e-30))
        rows.append(row)
        print(f"{row['dtype']:>9} {experts:>4} {top_k:>2} {activation.kind:>15} {tokens:>6} "
              f"{err:9.2e} {row['max_rel']:9.2e}", flush=True)
        del layer, got, want
    return rows


def floor_seconds(ids: torch.Tensor, tokens: int, args) -> tuple[int, float]:
    """(experts hit, seconds to read their weights and x and write the output once)."""
    hit = ids.unique().numel()
    shape = QWEN3_30B_A3B
    weight_bytes = hit * 3 * shape["hidden"] * shape["inter"] * 2
    activation_bytes = 2 * tokens * shape["hidden"] * 2
    return hit, (weight_bytes + activation_bytes) / args.bandwidth


def host_seconds(fn, iters: int) -> float:
    """The host's time to issue one call (the device queue is drained first and the calls
    are too few to fill it, so no launch waits)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    return seconds


def time_layer(tokens: int, args) -> dict:
    shape = QWEN3_30B_A3B
    layer = make_layer(tokens, shape["hidden"], shape["inter"], shape["experts"],
                       shape["top_k"], torch.bfloat16, False, seed=tokens)
    ids = layer[4]
    tiles = select_tiles(tokens * shape["top_k"] / shape["experts"], torch.bfloat16,
                         ids.device)
    hit, floor = floor_seconds(ids, tokens, args)
    graph = time_graph(lambda: run(fused_experts, layer), args.warmup, args.iters)
    eager = time_cuda(lambda: run(fused_experts, layer), args.warmup, args.iters)
    align = time_graph(lambda: align_by_expert(ids, shape["experts"], tiles.block_m),
                       args.warmup, args.iters)
    align_host = host_seconds(lambda: align_by_expert(ids, shape["experts"], tiles.block_m),
                              args.iters)
    ops_host = host_seconds(
        lambda: align_by_expert_torch_ops(ids, shape["experts"], tiles.block_m), args.iters)
    ops = time_graph(lambda: align_by_expert_torch_ops(ids, shape["experts"], tiles.block_m),
                     args.warmup, args.iters)
    reference = time_cuda(lambda: run(torch_experts, layer), args.warmup, max(3, args.iters // 5))
    return dict(tokens=tokens, experts_hit=hit, floor_us=floor * 1e6, graph_us=graph * 1e6,
                pct_of_floor=100 * floor / graph, eager_us=eager * 1e6, align_us=align * 1e6,
                align_host_us=align_host * 1e6, ops_us=ops * 1e6, ops_host_us=ops_host * 1e6,
                torch_us=reference * 1e6, tiles=vars(tiles))


def time_section(args) -> list[dict]:
    print(f"\ntime: Qwen3-30B-A3B MoE layer (H 2048, I 768, E 128, k 8, bf16), floor at "
          f"{args.bandwidth / 1e12:.2f} TB/s")
    print(f"{'tokens':>6} {'hit':>4} {'floor us':>9} {'graph us':>9} {'% floor':>8} "
          f"{'eager us':>9} {'align us':>9} {'torch us':>9} {'x torch':>8}")
    print("  align: the Triton alignment's device time (from a graph); 'align host / ops' below: "
          "its host time a call, and the torch-op version's device and host time")
    rows = []
    for tokens in args.batches:
        r = time_layer(tokens, args)
        rows.append(r)
        print(f"{tokens:>6} {r['experts_hit']:>4} {r['floor_us']:9.1f} {r['graph_us']:9.1f} "
              f"{r['pct_of_floor']:7.1f}% {r['eager_us']:9.1f} {r['align_us']:9.1f} "
              f"{r['torch_us']:9.1f} {r['torch_us'] / r['graph_us']:7.1f}x", flush=True)
        print(f"{'':>6} align host {r['align_host_us']:.1f} us | torch ops: device "
              f"{r['ops_us']:.1f} us, host {r['ops_host_us']:.1f} us", flush=True)
    return rows


def parse_tiles(text: str) -> list[MoeTiles]:
    """"m/n_up/n_down/k/group/warps/stages,..." -> launch shapes."""
    return [MoeTiles(*map(int, item.split("/"))) for item in text.split(",")]


def sweep_tiles(tokens: int, given: list[MoeTiles] | None = None) -> list[MoeTiles]:
    """The sweep's launch shapes for a batch: `given` (--tiles), else the SWEEP grid with
    block_m no taller than ~4x the rows per expert."""
    if given:
        return given
    rows = tokens * QWEN3_30B_A3B["top_k"] / QWEN3_30B_A3B["experts"]
    block_ms = [m for m in SWEEP["block_m"] if m == 16 or m <= 4 * rows]
    shapes = itertools.product(block_ms, SWEEP["n"], SWEEP["block_k"], SWEEP["num_warps"],
                               SWEEP["num_stages"])
    return [MoeTiles(m, n_up, n_down, k, 8 if m >= 64 else 1, warps, stages)
            for m, (n_up, n_down), k, warps, stages in shapes]


def sweep(tokens: int, args) -> list[dict]:
    shape = QWEN3_30B_A3B
    layer = make_layer(tokens, shape["hidden"], shape["inter"], shape["experts"],
                       shape["top_k"], torch.bfloat16, False, seed=tokens)
    _, floor = floor_seconds(layer[4], tokens, args)
    reference = run(fused_experts, layer).float()
    print(f"\nsweep: {tokens} tokens", flush=True)
    results = []
    for tiles in sweep_tiles(tokens, args.tiles):
        try:
            seconds = time_graph(lambda t=tiles: run(fused_experts, layer, tiles=t), args.warmup,
                                 args.iters)
        except Exception as exc:  # out of shared memory or registers
            print(f"  {tiles}: failed ({type(exc).__name__})", flush=True)
            continue
        diff = (run(fused_experts, layer, tiles=tiles).float() - reference).abs().max().item()
        results.append(dict(tokens=tokens, us=seconds * 1e6, pct_of_floor=100 * floor / seconds,
                            max_diff=diff, tiles=vars(tiles)))
    results.sort(key=lambda r: r["us"])
    for r in results[:args.top]:
        print(f"  {r['us']:8.1f} us {r['pct_of_floor']:5.1f}% of floor  {r['tiles']}  "
              f"(max diff {r['max_diff']:.2g})")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="check,time", help="check and/or time")
    parser.add_argument("--batches", default="1,64,256,1024,4096",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--bandwidth", type=float, default=4.8e12,
                        help="HBM bytes/s for the floor (H200: ~4.8e12)")
    parser.add_argument("--hidden", type=int, default=2048, help="check section's H")
    parser.add_argument("--inter", type=int, default=768, help="check section's I")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch shapes")
    parser.add_argument("--top", type=int, default=5, help="sweep: fastest shapes to print")
    parser.add_argument("--tiles", type=parse_tiles, default=None,
                        help="sweep these shapes (m/n_up/n_down/k/group/warps/stages,...) "
                             "instead of the grid")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="write every row to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    sections = args.sections.split(",")
    results = {"device": torch.cuda.get_device_name(),
               "args": {k: v for k, v in vars(args).items() if k != "json"}}
    if "check" in sections:
        results["check"] = check(args)
    if "time" in sections:
        results["time"] = time_section(args)
    if args.sweep:
        results["sweep"] = [r for tokens in args.batches for r in sweep(tokens, args)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
