"""Compile the W4A16 GEMM (`ops/w4a16_gemm.py`) for a GPU architecture on any machine (no GPU
needed): every M bucket's tiles (split K where the table splits), 4- and 8-bit codes, in order and
act-order, bf16 activations, and the whole-weight dequantization, and print what
ptxas reports: registers, spills, shared memory.

    python scripts/w4a16_kernel_resources.py [--arch 90]

With triton 3.6 (the GPU machine's) from a separate directory:
    PYTHONPATH=<dir with triton 3.6>:. python scripts/w4a16_kernel_resources.py
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernel_resources import compile_through, resources  # noqa: E402

from pagedserve.quantization.ops import w4a16_alternatives as wa  # noqa: E402
from pagedserve.quantization.ops import w4a16_gemm as wg  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, sm_{args.arch}a")
    n, k, group = 256, 1024, 128
    failed = 0
    for bits in (4, 8):
        for act_order in (False, True):
            order = torch.randperm(k) if act_order else torch.arange(k)
            weight = wg.w4a16_layout(torch.zeros(n, k, dtype=torch.int32),
                                     torch.zeros(n, k // group), torch.ones(n, k // group),
                                     order // group, bits)
            # The sweep's alternatives (w4a16_alternatives.py), in one K slice.
            gemv = wg.Tiles(1, 32, 128, 1, 4, 3, 1, gemv=True)
            dots = wg.Tiles(64, 128, 128, 4, 4, 3, 1, field_dots=True)
            for bound, tiles in (*wg._TILES, (1, gemv), (64, dots)):
                # Split K as the GPU would (2 slices where the table says "auto").
                tiles = replace(tiles, split_k=tiles.split_k or 2)
                m = int(min(bound, 512))
                label = f"{bits}-bit act-order {act_order} M<={bound} {tiles}"

                def call(m=m, weight=weight, tiles=tiles) -> None:
                    wg.w4a16_mm(torch.zeros(m, k, dtype=torch.bfloat16), weight, tiles)

                if tiles.gemv or tiles.field_dots:
                    module = wa
                    names = ("_w4a16_gemv_kernel" if tiles.gemv else "_w4a16_field_dots_kernel",)
                else:
                    module, names = wg, ("_w4a16_kernel", "_sum_splits_kernel")
                stand_ins = compile_through(module, names, target, call, label)
                if stand_ins is None:
                    failed += 1
                    continue
                print(f"{label}: {resources(stand_ins[0].compiled[0], args.arch)}")
        dense = wg.w4a16_layout(torch.zeros(n, k, dtype=torch.int32), torch.zeros(n, 8),
                                torch.ones(n, 8), torch.arange(k) // group, bits)
        stand_ins = compile_through(wg, ("_dequantize_kernel",), target,
                                    lambda w=dense: w.dequantize_in_group_order(torch.bfloat16),
                                    f"{bits}-bit dequantize")
        if stand_ins is None:
            failed += 1
        else:
            print(f"{bits}-bit dequantize: {resources(stand_ins[0].compiled[0], args.arch)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
