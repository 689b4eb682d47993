"""Compile the GGUF block GEMMs (`ops/gguf_gemm.py`) for a GPU architecture on any machine (no
GPU needed), one per block type, as the GEMM (bf16 activations, the device tiles) and as the
whole-weight decode, and print what ptxas reports: registers, spills, shared memory.

    python scripts/gguf_kernel_resources.py [--arch 90]

With triton 3.6 (the GPU machine's) from a separate directory:
    PYTHONPATH=<dir with triton 3.6>:. python scripts/gguf_kernel_resources.py
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
from kernel_resources import Compile, ptxas_and_sass  # noqa: E402

from pagedserve.quantization.gguf_types import BLOCKS  # noqa: E402
from pagedserve.quantization.ops import gguf_gemm as gg  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    gg._tiles = lambda device: gg.GPU_TILES  # the device's tiles, not the interpreter's
    real = gg._gguf_gemm_kernel, gg._gguf_dequantize_kernel
    print(f"triton {triton.__version__}, sm_{args.arch}a, tiles {gg.GPU_TILES}")
    failed = 0
    for qtype, (block, size, name) in BLOCKS.items():
        k, n = 1024, 256
        weight = gg.GGUFBlocks(qtype, torch.zeros(n, k // block * size, dtype=torch.uint8), k)
        gemm, decode = Compile(real[0], target), Compile(real[1], target)
        gg._gguf_gemm_kernel, gg._gguf_dequantize_kernel = gemm, decode
        try:
            gg.gguf_mm(torch.zeros(1, k, dtype=torch.bfloat16), weight)
            gg.gguf_dequantize(weight, torch.bfloat16)
        except Exception as exc:  # report every type, then fail
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        finally:
            gg._gguf_gemm_kernel, gg._gguf_dequantize_kernel = real
        for what, stand_in in (("gemm", gemm), ("decode", decode)):
            compiled = stand_in.compiled[0]
            usage, _ = ptxas_and_sass(compiled, args.arch)
            print(f"{name} {what}: shared memory {compiled.metadata.shared / 1024:.1f} KB; "
                  f"{usage}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
