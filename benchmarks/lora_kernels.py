"""LoRA's grouped shrink/expand kernels (pagedserve/lora/kernels.py) on the 8B shape's
projections beside the base projection they add to, on the GPU:

    python benchmarks/lora_kernels.py [--tokens 1,16,64,256,2048] [--adapters 1,8] [--rank 16]
    python benchmarks/lora_kernels.py --sweep [--tokens 64,256]  # launch shapes, one adapter

For each projection (qkv, o, gate_up, down), token count T and number of adapters (the tokens
dealt round-robin over them) it times, as the engine's decode graphs run them, a CUDA graph of
20 calls replayed (median of 30 replays, CUDA events): the base bf16 GEMM (`torch.mm` into the
output), and the LoRA term under a graph's grid (`grouped` over all T rows, as `ops.add_lora`
launches it in graph mode). Each "step" line sums one layer's four projections and scales by
32 layers: the milliseconds LoRA adds to a step, beside the base's.

`--sweep` times the LoRA term alone under other launch shapes (`kernels.LoRATiles`): the
shrink's varied with the expand's at the default, then the expand's, one adapter; each line is
a step's LoRA milliseconds (four projections, 32 layers) at each token count.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

from pagedserve.lora import kernels
from pagedserve.lora.batch import LoRABatch

PROJECTIONS = {  # name: (in features, fused parts' rows), Llama-3-8B
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
LAYERS = 32
REPS = 20


def time_us(fn) -> float:
    """Median microseconds a call: a CUDA graph of REPS calls, replayed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return statistics.median(times)


SHRINK_SHAPES = [dict(), dict(k_per_split=1024), dict(k_per_split=512)]
EXPAND_SHAPES = [dict(n_tiles=1), dict(block_n=128), dict(block_n=256, n_tiles=2, expand_warps=8)]


def row(name: str, tokens: int, adapters: int, rank: int, slots: int,
        tiles: kernels.LoRATiles | None = None, base_too: bool = True) -> tuple[float, float]:
    in_features, parts = PROJECTIONS[name]
    bounds = [sum(parts[:i]) for i in range(len(parts) + 1)]
    dev, dt = torch.device("cuda"), torch.bfloat16
    weight = torch.randn(bounds[-1], in_features, device=dev, dtype=dt) * 0.02
    a = torch.randn(slots, len(parts) * rank, in_features, device=dev, dtype=dt) * 0.02
    b = torch.randn(slots, bounds[-1], rank, device=dev, dtype=dt) * 0.02
    x = torch.randn(tokens, in_features, device=dev, dtype=dt)
    y = torch.empty(tokens, bounds[-1], device=dev, dtype=dt)
    batch = LoRABatch(tokens, slots, dev)
    batch.set(np.arange(tokens) % adapters, np.ones(tokens))
    bounds_t = torch.tensor(bounds, dtype=torch.int32, device=dev)
    base = time_us(lambda: torch.mm(x, weight.t(), out=y)) if base_too else 0.0
    tiles = tiles or kernels.TILES
    lora = time_us(lambda: kernels.grouped(x, y, a, b, bounds, bounds_t, batch.sorted_rows,
                                           batch.blocks, batch.grid_blocks(tokens), tiles))
    return base, lora


def sweep(token_counts: list[int], rank: int, slots: int) -> None:
    """Prints each shape's step milliseconds, then the shrink's best joined with the expand's
    best (timed too) and the best of all at the largest token count as one JSON line
    (`lora_engine.py --lora-tiles` takes it)."""
    print("LoRA ms a step (4 projections x 32 layers), one adapter, by launch shape")
    print(f"{'shape':62s} " + " ".join(f"{'T=' + str(t):>8s}" for t in token_counts))
    last: dict[str, float] = {}  # each shape's ms at the largest token count, by JSON

    def timed(shape: dict) -> None:
        tiles = kernels.LoRATiles(**shape)
        ms = [sum(row(name, t, 1, rank, slots, tiles, base_too=False)[1]
                  for name in PROJECTIONS) * LAYERS / 1e3 for t in token_counts]
        last[json.dumps(shape)] = ms[-1]
        label = ", ".join(f"{k}={v}" for k, v in shape.items()) or "default"
        print(f"{label:62s} " + " ".join(f"{m:8.3f}" for m in ms), flush=True)

    for shape in [*SHRINK_SHAPES, *EXPAND_SHAPES]:
        timed(shape)
    by_shrink = min(SHRINK_SHAPES, key=lambda s: last[json.dumps(s)])
    by_expand = min([dict(), *EXPAND_SHAPES], key=lambda s: last[json.dumps(s)])
    combined = {**by_shrink, **by_expand}
    if json.dumps(combined) not in last:
        timed(combined)
    print("best:", min(last, key=last.get))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,16,64,256,2048")
    p.add_argument("--adapters", default="1,8")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help="launch shapes of the LoRA term")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, rank {args.rank}, {args.slots} slots, bf16")
    if args.sweep:
        sweep([int(t) for t in args.tokens.split(",")], args.rank, args.slots)
        return
    print(f"{'proj':8s} {'T':>5s} {'adapters':>8s} {'base us':>8s} {'lora us':>8s} "
          f"{'lora/base':>9s}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for adapters in [int(n) for n in args.adapters.split(",")]:
            total_base = total_lora = 0.0
            for name in PROJECTIONS:
                base, lora = row(name, tokens, adapters, args.rank, args.slots)
                total_base, total_lora = total_base + base, total_lora + lora
                print(f"{name:8s} {tokens:5d} {adapters:8d} {base:8.1f} {lora:8.1f} "
                      f"{lora / base:9.2f}")
            print(f"{'step':8s} {tokens:5d} {adapters:8d} {total_base * LAYERS / 1e3:7.2f}ms "
                  f"{total_lora * LAYERS / 1e3:7.2f}ms {total_lora / total_base:9.2f}")


if __name__ == "__main__":
    main()
