"""FLEX_ATTENTION beside CPU on the CPU: each backend's per-step host work (its metadata build,
once per step for all layers) and one layer's forward (float32, 8:2 heads of 64, block 16), for
a decode batch and a prefill batch. Eager flex on the CPU is the reference path, not a fast
one: this records what it costs. "FLEX physical" is the layout CUDA runs (the cache itself as
keys, the block mask planned from the page table): its host build (plan + block mask) is what
a CUDA step pays on the host; its eager forward materialises scores over every cache slot, so
it runs only where the cache is small (prefill).

    python benchmarks/flex_attention_cpu.py [--threads 2] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig, get_backend_cls
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 64, 16


def _step(reqs: int, context: int, new: int, max_blocks: int):
    rng = np.random.default_rng(0)
    table = BlockTable(reqs, max_blocks)
    per_req = -(-(context + new) // BLOCK)
    perm = rng.permutation(reqs * per_req)
    for row in range(reqs):
        table.add_row(row, perm[row * per_req:(row + 1) * per_req].tolist())
    common_builder = CommonMetadataBuilder(reqs, reqs * new, max_blocks, BLOCK,
                                           torch.device("cpu"))
    prefills = 0 if new == 1 else reqs
    return common_builder.build(np.arange(reqs), np.full(reqs, context, dtype=np.int32),
                                np.full(reqs, new, dtype=np.int32), prefills, table.table)


def _median_ms(fn, iters: int) -> float:
    fn()  # first call: imports, tracing
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _flex_physical():
    from pagedserve.attention.backends.flex_attention import (
        FlexAttentionBackend,
        FlexAttentionMetadataBuilder,
    )

    class PhysicalBuilder(FlexAttentionMetadataBuilder):
        physical_kv = True

    class PhysicalBackend(FlexAttentionBackend):
        builder_cls = PhysicalBuilder

    return PhysicalBackend


# Rows: (label, backend); "FLEX physical" is the CUDA layout run on the CPU.
BACKENDS = {"CPU": lambda: get_backend_cls("CPU"),
            "FLEX_ATTENTION": lambda: get_backend_cls("FLEX_ATTENTION"),
            "FLEX physical": _flex_physical}
# Slots past which an eager forward over the whole cache is not run (scores [H, rows, slots]).
MAX_EAGER_SLOTS = 1 << 14


def measure(name: str, reqs: int, context: int, new: int, iters: int
            ) -> tuple[float, float | None]:
    backend = BACKENDS[name]()
    layer = AttentionLayerConfig(HEADS, KV_HEADS, HEAD_SIZE, torch.float32)
    max_blocks = -(-(context + new) // BLOCK)
    common = _step(reqs, context, new, max_blocks)
    builder = backend.get_builder_cls()(BuilderConfig.for_layer(
        layer, BLOCK, reqs, reqs * new, max_blocks, torch.device("cpu")))
    impl = backend.get_impl_cls()(layer)
    cache = torch.randn(backend.get_kv_cache_shape(reqs * max_blocks, BLOCK, KV_HEADS,
                                                   HEAD_SIZE))
    t = reqs * new
    q = torch.randn(t, HEADS, HEAD_SIZE)
    k, v = torch.randn(t, KV_HEADS, HEAD_SIZE), torch.randn(t, KV_HEADS, HEAD_SIZE)
    num_blocks = reqs * max_blocks

    def build():
        md = builder.build(common)
        if md.__class__.__name__ == "FlexAttentionMetadata" and md.physical:
            md.block_mask_for(num_blocks)  # the first layer's share: inverse table, BlockMask
        return md

    build_ms = _median_ms(build, iters)
    md = build()
    if getattr(md, "physical", False) and num_blocks * BLOCK > MAX_EAGER_SLOTS:
        return build_ms, None
    forward_ms = _median_ms(lambda: impl.forward(q, k, v, cache, md), iters)
    return build_ms, forward_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; median of {args.iters}")
    print(f"{'step':<28}{'backend':<16}{'host build ms':>14}{'layer forward ms':>18}")
    for label, reqs, context, new in (("decode 64 x 2,048", 64, 2048, 1),
                                       ("prefill 4 x 512", 4, 0, 512)):
        for name in BACKENDS:
            build, forward = measure(name, reqs, context, new, args.iters)
            shown = "-" if forward is None else f"{forward:.2f}"
            print(f"{label:<28}{name:<16}{build:>14.2f}{shown:>18}")


if __name__ == "__main__":
    main()
