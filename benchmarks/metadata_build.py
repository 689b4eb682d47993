"""Time building one step's attention metadata: 256 decoding requests, 2,048-token contexts,
block size 16 (the foundation issue's target: under 1 ms median on a 2-core CPU).

    python benchmarks/metadata_build.py [--reqs 256] [--context 2048] [--block-size 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args()

    torch.set_num_threads(2)
    bs = args.block_size
    max_blocks = -(-args.max_model_len // bs)
    rng = np.random.default_rng(0)
    table = BlockTable(args.reqs, max_blocks)
    blocks_per_req = -(-(args.context + 1) // bs)
    perm = rng.permutation(args.reqs * blocks_per_req)
    for row in range(args.reqs):
        table.add_row(row, perm[row * blocks_per_req:(row + 1) * blocks_per_req].tolist())
    builder = CommonMetadataBuilder(args.reqs, 8192, max_blocks, bs, torch.device("cpu"))
    rows = rng.permutation(args.reqs)
    computed = np.full(args.reqs, args.context - 1, dtype=np.int32)
    scheduled = np.ones(args.reqs, dtype=np.int32)

    times = []
    for i in range(args.iters + 50):
        start = time.perf_counter()
        builder.build(rows, computed, scheduled, 0, table.table)
        if i >= 50:
            times.append(time.perf_counter() - start)
    med = statistics.median(times) * 1e3
    p99 = float(np.percentile(times, 99)) * 1e3
    print(f"metadata build: {args.reqs} decodes x {args.context} context, block {bs}: "
          f"median {med:.3f} ms, p99 {p99:.3f} ms ({args.iters} iterations)")


if __name__ == "__main__":
    main()
