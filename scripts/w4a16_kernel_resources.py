"""Compile the W4A16 GEMM (`ops/w4a16_gemm.py`) for a GPU architecture on any machine (no GPU
needed): every M bucket's tiles, 4- and 8-bit codes, bf16 and fp16 activations, and print what
ptxas reports: registers, spills, shared memory.

    python scripts/w4a16_kernel_resources.py [--arch 90]

With triton 3.6 (the GPU machine's) from a separate directory:
    PYTHONPATH=<dir with triton 3.6>:. python scripts/w4a16_kernel_resources.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernel_resources import compile_through, resources  # noqa: E402

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
        codes = torch.zeros(n, k, dtype=torch.int32)
        weight = wg.w4a16_layout(codes, torch.zeros(n, k // group), torch.ones(n, k // group),
                                 torch.arange(k) // group, bits)
        for bound, tiles in wg._TILES:
            for dtype in (torch.bfloat16, torch.float16):
                m = 1 if bound == 16 else int(min(bound, 512))
                label = f"{bits}-bit M<={bound} {dtype} {tiles}"

                def call(m=m, dtype=dtype, weight=weight, tiles=tiles) -> None:
                    wg.w4a16_mm(torch.zeros(m, k, dtype=dtype), weight, tiles)

                stand_ins = compile_through(wg, ("_w4a16_kernel",), target, call, label)
                if stand_ins is None:
                    failed += 1
                    continue
                compiled = stand_ins[0].compiled[0]
                print(f"{label}: {resources(compiled, args.arch)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
