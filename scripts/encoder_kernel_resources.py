"""Compile the encoder's fused add + LayerNorm kernel (`models/layer_kernels.py` `layer_norm`)
for a GPU architecture on any machine (no GPU needed), at the widths of MiniLM, bge-base and
bge-large, with and without the residual, and print what ptxas reports: registers, spills,
shared memory.

    python scripts/encoder_kernel_resources.py [--arch 90] [--widths 384,768,1024]

With triton 3.6 (the GPU machine's) from a separate directory:
    PYTHONPATH=<dir with triton 3.6>:. python scripts/encoder_kernel_resources.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernel_resources import compile_through, resources  # noqa: E402

from pagedserve.models import layer_kernels as lk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--widths", default="384,768,1024")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failed = False
    for width in map(int, args.widths.split(",")):
        for dtype in (torch.bfloat16, torch.float16):
            for add in (True, False):
                x = torch.zeros(4, width, dtype=dtype)
                w, b = torch.ones(width, dtype=dtype), torch.zeros(width, dtype=dtype)
                label = f"width {width} {str(dtype)[6:]} {'add + norm' if add else 'norm'}"
                stand_ins = compile_through(
                    lk, ("_layer_norm_kernel",), target,
                    lambda x=x, w=w, b=b, add=add: lk.layer_norm(
                        x, x.clone() if add else None, w, b, 1e-12), label)
                if stand_ins is None:
                    failed = True
                    continue
                for compiled in stand_ins[0].compiled:
                    print(f"{label}: {resources(compiled, args.arch)}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
