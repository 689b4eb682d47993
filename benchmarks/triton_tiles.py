"""Sweep the TRITON unified attention kernel's launch shapes on the GPU and print the fastest.

Same workloads as `attention_kernels.py` (decode 64 x 2,048 context, prefill 8 x 2,048 new
tokens, 32:8 heads, d128, bf16, page 16). Each TileConfig (block_m, block_n, num_warps,
num_stages) and, for decode, each split-KV factor runs the kernel on the same data, by default
as the TRITON backend runs it (writing the step's K/V itself; `--no-fused`: the kernel alone,
every key read from the pages); its output is checked against the first configuration's,
and shapes that do not compile (shared memory) are reported and skipped. `write` times
`reshape_and_cache` storing the prefill's 16,384 new tokens for each tokens-per-program and
warp count. The winners go
into `ops/unified_attention.py`'s DECODE_TILES / PREFILL_TILES (and reshape_and_cache's
defaults) by hand.

    python benchmarks/triton_tiles.py [--workloads decode,prefill,write] [--top 8] [--no-fused]
        [--prefill-shapes 128/32/4/4,128/64/4/4] [--decode-shapes ...]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import (  # noqa: E402
    Setup,
    Workload,
    add_workload_args,
    attention_flops,
    kv_bytes,
    time_cuda,
)

from pagedserve.attention.ops.decode_split_kv import allocate_partials, split_kv_decode  # noqa: E402
from pagedserve.attention.ops.query_blocks import QueryBlockMap  # noqa: E402
from pagedserve.attention.ops.unified_attention import (  # noqa: E402
    TileConfig,
    query_block_shape,
    unified_attention,
)

DECODE_GRID = dict(block_m=[16], block_n=[32, 64, 128], num_warps=[2, 4, 8],
                   num_stages=[2, 3, 4])
DECODE_SPLITS = [1, 2]
PREFILL_GRID = dict(block_m=[64, 128], block_n=[32, 64, 128], num_warps=[4, 8],
                    num_stages=[2, 3, 4])


def configs(grid: dict[str, list[int]]) -> list[TileConfig]:
    return [TileConfig(*values) for values in itertools.product(*grid.values())]


def run_config(setup: Setup, args, tiles: TileConfig, num_splits: int, qmap: QueryBlockMap,
               partials) -> tuple[float, torch.Tensor]:
    w, common = setup.w, setup.common
    decode = w.new == 1
    block_q, block_m = query_block_shape(args.heads // args.kv_heads, tiles, decode)
    num_qblocks = qmap.fill(common, block_q)
    out = torch.empty_like(setup.query)
    scale = args.head_dim ** -0.5

    def step():
        new_kv = (dict(key=setup.key, value=setup.value, slot_mapping=common.slot_mapping)
                  if args.fused else {})
        if num_splits > 1:
            split_kv_decode(setup.query, setup.k_cache, setup.v_cache, out, common.block_table,
                            common.query_start_loc, common.seq_lens, qmap.req, qmap.start,
                            num_qblocks, block_m, scale, tiles, num_splits, partials, **new_kv)
        else:
            unified_attention(setup.query, setup.k_cache, setup.v_cache, out,
                              common.block_table, common.query_start_loc, common.seq_lens,
                              qmap.req, qmap.start, num_qblocks, block_q, block_m, scale, tiles,
                              **new_kv)

    step()  # compile
    torch.cuda.synchronize()
    return time_cuda(step, args.warmup, args.iters), out


def sweep(w: Workload, args) -> None:
    setup = Setup(w, args)
    decode = w.new == 1
    qmap = QueryBlockMap(w.seqs * w.new, setup.device)
    partials = allocate_partials(w.seqs, args.heads, args.head_dim, max(DECODE_SPLITS),
                                 setup.device) if decode else None
    listed = args.decode_shapes if decode else args.prefill_shapes
    shapes = ([TileConfig(*map(int, x.split("/"))) for x in listed.split(",")] if listed
              else configs(DECODE_GRID if decode else PREFILL_GRID))
    trials = [(t, s) for t in shapes for s in (DECODE_SPLITS if decode else [1])]
    work = kv_bytes(w, args) if decode else attention_flops(w, args)
    unit = "TB/s" if decode else "TFLOP/s"
    print(f"\n{w.name}: {w.seqs} seqs x {w.seq_len}, {len(trials)} launch shapes", flush=True)
    results, reference = [], None
    for tiles, splits in trials:
        try:
            seconds, out = run_config(setup, args, tiles, splits, qmap, partials)
        except Exception as exc:  # out of shared memory and the like
            print(f"  {tiles} splits={splits}: failed ({type(exc).__name__})", flush=True)
            continue
        if reference is None:
            reference = out.float()
            err = 0.0
        else:
            err = (out.float() - reference).abs().max().item()
        rate = work / seconds / 1e12
        results.append((seconds, tiles, splits, rate, err))
        print(f"  {tiles} splits={splits}: {seconds * 1e6:8.1f} us {rate:7.2f} {unit}"
              f" (max diff {err:.2g})", flush=True)
    results.sort(key=lambda r: r[0])
    print(f"\n{w.name}: fastest {args.top}")
    for seconds, tiles, splits, rate, err in results[:args.top]:
        print(f"  {seconds * 1e6:8.1f} us {rate:7.2f} {unit}  block_m={tiles.block_m} "
              f"block_n={tiles.block_n} warps={tiles.num_warps} stages={tiles.num_stages} "
              f"splits={splits}  (max diff {err:.2g})")


def sweep_write(args) -> None:
    """reshape_and_cache of the prefill workload's new K/V, per (block_t, num_warps)."""
    from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache

    setup = Setup(Workload("prefill", 0, args.prefill_len, args.prefill_seqs), args)
    k_cache, v_cache = torch.empty_like(setup.k_cache), torch.empty_like(setup.v_cache)
    moved = 4 * setup.key.numel() * setup.key.element_size()  # K and V, read and written
    slots = setup.common.slot_mapping
    print(f"\nwrite: {setup.key.shape[0]} tokens of K and V ({moved / 2**20:.0f} MiB moved)")
    results = []
    for block_t, warps in itertools.product([1, 2, 4, 8, 16, 32], [1, 2, 4, 8]):
        def step(block_t=block_t, warps=warps):
            reshape_and_cache(setup.key, setup.value, k_cache, v_cache, slots, block_t=block_t,
                              num_warps=warps)
        step()
        seconds = time_cuda(step, args.warmup, args.iters)
        results.append((seconds, block_t, warps))
        print(f"  block_t={block_t:2d} warps={warps}: {seconds * 1e6:7.1f} us "
              f"{moved / seconds / 1e12:5.2f} TB/s", flush=True)
    seconds, block_t, warps = min(results)
    print(f"write: fastest block_t={block_t} warps={warps}: {seconds * 1e6:.1f} us "
          f"({moved / seconds / 1e12:.2f} TB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="decode,prefill,write")
    add_workload_args(parser, warmup=5, iters=30)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                        help="the kernel writes the step's K/V, as the TRITON backend runs it")
    for name in ("decode", "prefill"):
        parser.add_argument(f"--{name}-shapes",
                            help="only these block_m/block_n/warps/stages, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this sweep needs a CUDA GPU")
    args.device = "cuda"
    names = args.workloads.split(",")
    if "decode" in names:
        sweep(Workload("decode", args.context - 1, 1, args.decode_seqs), args)
    if "prefill" in names:
        sweep(Workload("prefill", 0, args.prefill_len, args.prefill_seqs), args)
    if "write" in names:
        sweep_write(args)


if __name__ == "__main__":
    main()
