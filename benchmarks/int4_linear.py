"""W4A16 linears against bf16 on the GPU, one projection shape at a time:

    python benchmarks/int4_linear.py [--shapes 8b] [--tokens 1,4,16,64,256,1024,8192]
        [--group 128] [--act-order] [--bits 4|8] [--layers 8] [--json FILE]
        [--sweep] [--sweep-tokens 1,4,16,64,256] [--write-tiles FILE]

Every time is a CUDA graph's (as the engine replays its decode steps: no launch overhead),
over --layers distinct random weights of each shape replayed in turn (so no weight stays in
L2), divided by the layers: median of 10 replays after 3. On the same random weights:
- bf16: `F.linear(x, W)` with W the dequantized weight;
- w4a16: the Triton GEMM that dequantizes in registers (`ops/w4a16_gemm.py`, tiles from its
  table keyed by M, or the sweep's best), reading 4-bit codes or, with --bits 8, 8-bit ones;
- dequant + bf16: the whole weight dequantized by its kernel, then the dense GEMM (the large-M
  path that `DEQUANTIZE_ABOVE_M` switches to),
and prints each path's time per projection, its speed-up over bf16 and the max relative error
of w4a16 against the float32 product. The weight bytes of each form are printed per shape.

`--sweep` first tries, for each M, a set of launch shapes over a decoder layer's four
projections and keeps the one with the least time a layer; the table then uses it.
`--write-tiles FILE` writes the winners keyed by the largest M each serves (the midpoints
between the swept M), as `PAGEDSERVE_W4A16_TILES` reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.quantization.int_codes import IntCodes
from pagedserve.quantization.ops.w4a16_gemm import Tiles, select_tiles, w4a16_layout, w4a16_mm

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336)}}


def _time(fn: Callable[[], object], replays: int = 10, warmup: int = 3) -> float:
    """ms of one `fn()` captured in a CUDA graph and replayed (median)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _each(fn: Callable[[object], object], weights: list) -> float:
    """ms of `fn(w)` a weight, over the distinct weights in one graph."""
    def step() -> None:
        for w in weights:
            fn(w)
    return _time(step) / len(weights)


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


def _dequantized_path(x: torch.Tensor, weight) -> torch.Tensor:
    order = x if weight.perm is None else x.index_select(1, weight.perm)
    return order @ weight.dequantize_in_group_order(x.dtype)


def candidates(m: int) -> list[Tiles]:
    """The launch shapes tried at M rows (4-bit positions per tile at least 16 per dot)."""
    if m == 1:  # the one-row path, and the GEMV kernel that keeps the words' shape
        grid = itertools.chain(
            itertools.product([1], [16, 32, 64], [128, 256], [1], [4, 8], [3], [0, 1, 4]),
            itertools.product([1], [32, 64], [128, 256], [1], [4], [3], [0, 4], [True]))
    elif m <= 16:  # and a dot per bit-field (no tile reshaped)
        grid = itertools.chain(
            itertools.product([16], [32, 64], [64, 128, 256], [1], [4], [3], [0, 1]),
            itertools.product([16], [32, 64], [128], [1], [4], [3], [0, 1], [False], [True]))
    elif m <= 64:
        grid = itertools.chain(
            itertools.product([16, 32, 64], [64, 128], [64, 128], [4], [4], [3], [0, 1]),
            itertools.product([32, 64], [64, 128], [128], [4], [4], [3], [0], [False], [True]))
    else:
        grid = itertools.chain(
            itertools.product([64, 128], [64, 128, 256], [64, 128], [8], [4, 8], [3], [1]),
            itertools.product([64, 128], [128], [128], [8], [4, 8], [3], [1], [False], [True]))
    return [Tiles(*t) for t in grid]


def sweep(layers: list[dict], m: int) -> tuple[Tiles, float, float]:
    """(best tiles, their ms a layer's four projections, the built-in table's ms)."""
    xs = {name: torch.randn(m, w.in_features, device="cuda", dtype=torch.bfloat16)
          for name, w in layers[0].items()}

    def per_layer(tiles: Tiles | None) -> float:
        def step() -> None:
            for layer in layers:
                for name, w in layer.items():
                    w4a16_mm(xs[name], w, tiles)
        return _time(step) / len(layers)

    best, best_ms = None, float("inf")
    for tiles in candidates(m):
        try:
            ms = per_layer(tiles)
        except Exception as e:  # a shape that does not compile or fit: skip it, say so
            print(f"  M={m} {tiles}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        print(f"  M={m} {tiles}: {ms:.4f} ms")
        if ms < best_ms:
            best, best_ms = tiles, ms
    return best, best_ms, per_layer(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8b")
    parser.add_argument("--tokens", default="1,4,16,64,256,1024,8192")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--layers", type=int, default=8,
                        help="distinct random weights per shape, replayed in turn")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-tokens", default="1,4,16,64,256",
                        help="the M swept (above DEQUANTIZE_ABOVE_M the dense path runs)")
    parser.add_argument("--write-tiles")
    parser.add_argument("--json")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = SHAPES[args.shapes]
    codes = [{name: _weight(n, k, args.group, args.act_order, args.bits)
              for name, (n, k) in shapes.items()} for _ in range(args.layers)]
    layers = [{name: w4a16_layout(c.codes, c.zeros, c.scales, c.group, args.bits)
               for name, c in layer.items()} for layer in codes]
    chosen: dict[int, Tiles] = {}
    sweeps = []
    if args.sweep:
        swept = [int(t) for t in args.sweep_tokens.split(",")]
        for m in swept:
            began = time.perf_counter()
            best, best_ms, table_ms = sweep(layers, m)
            chosen[m] = best
            sweeps.append({"m": m, "tiles": dataclasses.asdict(best), "ms": best_ms,
                           "table_ms": table_ms})
            print(f"sweep M={m}: best {best} {best_ms:.4f} ms a layer's four projections, "
                  f"the table's {table_ms:.4f} ({time.perf_counter() - began:.0f} s)")
        if args.write_tiles:
            bounds = [(a + b) // 2 for a, b in zip(swept, swept[1:], strict=False)] + ["inf"]
            with open(args.write_tiles, "w") as f:
                json.dump({str(b): dataclasses.asdict(chosen[m])
                           for b, m in zip(bounds, swept, strict=True)}, f, indent=1)
    rows = []
    print(f"{'shape':>8} {'N':>6} {'K':>6} {'M':>5} {'bf16 ms':>8} {'w4a16 ms':>9} "
          f"{'x':>5} {'deq+bf16':>9} {'x':>5} {'rel err':>8}")
    for name in shapes:
        weights = [layer[name] for layer in layers]
        dense = [layer[name].dequantize().to(torch.bfloat16) for layer in codes]
        packed_bytes = sum(t.numel() * t.element_size() for t in weights[0].tensors().values())
        print(f"{name}: weight bytes bf16 {dense[0].numel() * 2}, w4a16 {packed_bytes} "
              f"({packed_bytes / (dense[0].numel() * 2):.3f}x)")
        for m in tokens:
            x = torch.randn(m, weights[0].in_features, device="cuda", dtype=torch.bfloat16)
            tiles = chosen.get(m) or select_tiles(m, x.device)
            bf16 = _each(lambda w: F.linear(x, w), dense)  # noqa: B023
            w4 = _each(lambda w: w4a16_mm(x, w, tiles), weights)  # noqa: B023
            deq = _each(lambda w: _dequantized_path(x, w), weights)  # noqa: B023
            want = x.float() @ dense[0].float().T
            err = float((w4a16_mm(x, weights[0], tiles).float() - want).abs().max()
                        / want.abs().max())
            rows.append({"shape": name, "n": weights[0].out_features,
                         "k": weights[0].in_features, "m": m, "bf16_ms": bf16,
                         "w4a16_ms": w4, "dequant_bf16_ms": deq, "rel_err": err,
                         "tiles": dataclasses.asdict(tiles)})
            print(f"{name:>8} {weights[0].out_features:>6} {weights[0].in_features:>6} {m:>5} "
                  f"{bf16:>8.4f} {w4:>9.4f} {bf16 / w4:>5.2f} {deq:>9.4f} {bf16 / deq:>5.2f} "
                  f"{err:>8.1e}")
        del dense
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "group": args.group,
                       "act_order": args.act_order, "bits": args.bits, "sweeps": sweeps,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
