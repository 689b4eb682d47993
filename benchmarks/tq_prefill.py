"""One prefill step of TURBOQUANT against bf16 TRITON on the same K/V (CUDA; 32:8 heads, d128).

Each of N requests has `context` tokens in the cache (a later chunk of a long prompt; 0: a
first chunk) and `chunk` new tokens. TRITON runs its unified kernel over a bf16 cache (the
K/V write fused); TURBOQUANT quantizes the new tokens into its cache, attends them to each
other through the same dense kernel and merges the quantized context's attention into that
(backends/turboquant.py). Rows: the step's time, its ratio to TRITON's, the store alone, and the
output's relative error against TRITON's (the quantization's).

    python benchmarks/tq_prefill.py [--num-seqs 1] [--context 6144] [--chunk 2048]
        [--presets tq_k8v4,tq_4bit,tq_3bit] [--prefill-tiles 64/64/8/2,64/64/8/2/prmt]

--prefill-tiles: launch shapes of the context launch (ops/turboquant_kernels.TQTiles; the
default is PREFILL_TILES), the knob to tune the merge's dequantizing kernel with.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_seconds(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:  # the interpreter (tests): wall time
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_benchmark(num_seqs: int = 1, context: int = 6144, chunk: int = 2048,
                      num_heads: int = 32, num_kv_heads: int = 8, head_size: int = 128,
                      block_size: int = 16, presets: tuple[str, ...] = ("tq_k8v4", "tq_4bit",
                                                                        "tq_3bit"),
                      prefill_tiles: list[str] | None = None, device: str = "cuda",
                      dtype: torch.dtype = torch.bfloat16, warmup: int = 3, iters: int = 10,
                      seed: int = 0) -> list[dict]:
    """Times one prefill step (builder + impl.forward) per backend, preset and context-launch
    shape; prints and returns rows {impl, tiles, us, vs_triton, store_us, rel_err}. (device
    "cpu" with float32 runs the kernels in the interpreter: tests only.)"""
    from pagedserve.attention import AttentionLayerConfig, BuilderConfig, get_backend_cls
    from pagedserve.attention.metadata import CommonMetadataBuilder
    from pagedserve.attention.ops import turboquant_format as tqf
    from pagedserve.attention.ops.reshape_and_cache import reshape_and_cache
    from pagedserve.attention.ops.turboquant_kernels import TQTiles, format_tensors, tq_store
    from pagedserve.engine.input_batch import BlockTable

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages = -(-(context + chunk) // block_size)
    num_blocks = num_seqs * pages + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = BlockTable(num_seqs, pages)
    for row in range(num_seqs):
        table.add_row(row, perm[row * pages:(row + 1) * pages])
    tokens = num_seqs * chunk
    common = CommonMetadataBuilder(num_seqs, tokens, pages, block_size, dev).build(
        rows=np.arange(num_seqs), num_computed=np.full(num_seqs, context, np.int32),
        num_scheduled=np.full(num_seqs, chunk, np.int32), num_prefills=num_seqs,
        block_table=table.table)
    positions = torch.arange(context)
    slots = torch.cat([torch.tensor(perm[r * pages:(r + 1) * pages])[positions // block_size]
                       * block_size + positions % block_size for r in range(num_seqs)]).to(dev)
    triton_cls = get_backend_cls("TRITON")
    base_cache = torch.zeros(triton_cls.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                           head_size), dtype=dtype, device=dev)
    tq_caches = {}
    for preset in presets:
        cls = get_backend_cls("TURBOQUANT").for_kv_cache_dtype(preset)
        tq_caches[preset] = torch.zeros(cls.get_kv_cache_shape(num_blocks, block_size,
                                                               num_kv_heads, head_size),
                                        dtype=torch.uint8, device=dev)
    for start in range(0, len(slots), 1 << 16):  # the context, the same K/V in every cache
        s = slots[start:start + (1 << 16)]
        k = torch.randn(len(s), num_kv_heads, head_size, generator=gen, device=dev, dtype=dtype)
        v = torch.randn(len(s), num_kv_heads, head_size, generator=gen, device=dev, dtype=dtype)
        reshape_and_cache(k, v, base_cache[0], base_cache[1], s)
        for preset, cache in tq_caches.items():
            p = tqf.PRESETS[preset]
            tq_store(p, format_tensors(p, head_size, dev), k, v, cache, s)
    query = torch.randn(tokens, num_heads, head_size, generator=gen, device=dev, dtype=dtype)
    key = torch.randn(tokens, num_kv_heads, head_size, generator=gen, device=dev, dtype=dtype)
    value = torch.randn_like(key)

    def run(name: str, kv_cache: torch.Tensor, preset: str = "auto", tiles=None):
        cls = get_backend_cls(name)
        config = BuilderConfig(num_heads, num_kv_heads, head_size, dtype, block_size, num_seqs,
                               tokens, pages, dev, kv_cache_dtype=preset)
        builder = cls.get_builder_cls()(config)
        if name == "TURBOQUANT":
            builder.use_kernels = True  # (already so on CUDA; the interpreter in tests)
            builder.prefill_tiles = tiles
        impl = cls.get_impl_cls()(AttentionLayerConfig(num_heads, num_kv_heads, head_size,
                                                       dtype, kv_cache_dtype=preset))
        out = torch.empty_like(query)
        # The builder inside the timed step: its host work is part of every step.
        seconds = _median_seconds(lambda: impl.forward(query, key, value, kv_cache,
                                                       builder.build(common), output=out),
                                  warmup, iters)
        return seconds, out

    base_s, base_out = run("TRITON", base_cache)
    rows = [dict(impl="TRITON bf16" if dtype == torch.bfloat16 else "TRITON", tiles="",
                 us=base_s * 1e6, vs_triton=1.0, store_us=0.0, rel_err=0.0)]
    slot_mapping = common.slot_mapping
    for preset, cache in tq_caches.items():
        p = tqf.PRESETS[preset]
        tensors = format_tensors(p, head_size, dev)
        store_s = _median_seconds(lambda p=p, c=cache, t=tensors: tq_store(
            p, t, key, value, c, slot_mapping), warmup, iters)
        for text in prefill_tiles or [None]:
            tiles = TQTiles.parse(text) if text else None
            seconds, out = run("TURBOQUANT", cache, preset, tiles)
            rel = float((out.float() - base_out.float()).norm() / base_out.float().norm())
            rows.append(dict(impl=f"TURBOQUANT {preset}", tiles=text or "default",
                             us=seconds * 1e6, vs_triton=base_s / seconds,
                             store_us=store_s * 1e6, rel_err=rel))
    print(f"prefill step: {num_seqs} x ({context} cached + {chunk} new), {num_heads}:"
          f"{num_kv_heads} heads, d{head_size}, block {block_size}, {dtype}")
    print(f"{'impl':<22} {'context tiles':<22} {'us':>10} {'x TRITON':>9} {'store us':>9} "
          f"{'rel err':>8}")
    for r in rows:
        print(f"{r['impl']:<22} {r['tiles']:<22} {r['us']:>10.1f} {r['vs_triton']:>9.2f} "
              f"{r['store_us']:>9.1f} {r['rel_err']:>8.4f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=1)
    parser.add_argument("--context", type=int, default=6144)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--presets", default="tq_k8v4,tq_4bit,tq_3bit")
    parser.add_argument("--prefill-tiles", default=None,
                        help="TQTiles strings of the context launch, comma-separated")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    prefill_benchmark(args.num_seqs, args.context, args.chunk,
                      presets=tuple(args.presets.split(",")),
                      prefill_tiles=args.prefill_tiles.split(",") if args.prefill_tiles
                      else None, iters=args.iters)


if __name__ == "__main__":
    main()
