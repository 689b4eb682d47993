"""Compile the W4A16 GEMM as kept GGUF weights run it (`gguf_codes.py`: 4- or 8-bit codes,
groups of 32 or 16, zero points or offsets) for a GPU architecture on any machine (no GPU
needed), one per block type at every M bucket's tiles (bf16 activations) and as the
whole-weight dequantization, and the 4-bit expert GEMMs (`ops/w4_moe_kernels.py`, MXFP4 with clamped
SwiGLU and biases, int4 with SiLU, int4 act-order (group maps, gate's and up's apart) with SiLU,
at decode and prefill tiles), and print what ptxas reports: registers, spills, shared memory.

    python scripts/gguf_kernel_resources.py [--arch 90]

With triton 3.6 (the GPU machine's) from a separate directory:
    PYTHONPATH=<dir with triton 3.6>:. python scripts/gguf_kernel_resources.py
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
from kernel_resources import Compile, compile_through, resources  # noqa: E402

from pagedserve.quantization.gguf_blocks import random_blocks  # noqa: E402
from pagedserve.quantization.gguf_codes import gguf_codes  # noqa: E402
from pagedserve.quantization.gguf_types import BLOCKS  # noqa: E402
from pagedserve.quantization.ops import w4a16_gemm as wg  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, sm_{args.arch}a")
    failed = 0
    for qtype, (_, _, name) in BLOCKS.items():
        k, n = 1024, 256
        blocks = random_blocks(qtype, n, k, torch.Generator().manual_seed(0))
        weight = gguf_codes(blocks, qtype, k).w4a16()
        for bound, tiles in wg._TILES:
            tiles = replace(tiles, split_k=tiles.split_k or 2)
            m = int(min(bound, 512))

            def call(weight=weight, k=k, m=m, tiles=tiles) -> None:
                wg.w4a16_mm(torch.zeros(m, k, dtype=torch.bfloat16), weight, tiles)

            label = f"{name} M<={bound} {tiles}"
            stand_ins = compile_through(wg, ("_w4a16_kernel", "_sum_splits_kernel"), target,
                                        call, label)
            if stand_ins is None:  # report every type, then fail
                failed += 1
                continue
            print(f"{label}: {resources(stand_ins[0].compiled[0], args.arch)}")
        stand_ins = compile_through(wg, ("_dequantize_kernel",), target,
                                    lambda w=weight: w.dequantize_in_group_order(torch.bfloat16),
                                    f"{name} dequantize")
        if stand_ins is None:
            failed += 1
        else:
            print(f"{name} dequantize: {resources(stand_ins[0].compiled[0], args.arch)}")
    failed += compile_moe(target, args.arch)
    sys.exit(1 if failed else 0)


def compile_moe(target: GPUTarget, arch: int) -> int:
    """The 4-bit expert kernels; returns how many failed."""
    from pagedserve.models.moe import ExpertActivation
    from pagedserve.quantization.ops import w4_moe_kernels as wm

    e, h, i, t, k = 8, 256, 128, 4, 2

    def aligned(ids, num_experts, block_m):  # stands in for the alignment kernels
        blocks = 4
        return (torch.zeros(blocks * block_m, dtype=torch.int32),
                torch.zeros(blocks, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))

    real = wm._w4_gate_up_kernel, wm._w4_down_kernel, wm.align_by_expert, wm.select_w4_tiles
    wm.align_by_expert = aligned
    failed = 0
    for fmt in ("mxfp4", "int4", "int4-act-order"):
        def experts(n: int, kk: int, parts: int = 1):
            codes = torch.zeros(e, n, kk // 2, dtype=torch.uint8)
            if fmt == "mxfp4":  # noqa: B023
                return wm.W4Experts(codes, torch.zeros(e, n, kk // 32, dtype=torch.uint8),
                                    None, 32)
            g_idx = (torch.zeros(e, parts, kk, dtype=torch.int32)
                     if fmt == "int4-act-order" else None)  # noqa: B023
            return wm.W4Experts(codes, torch.zeros(e, n, kk // 128), torch.zeros(
                e, n, kk // 128, dtype=torch.uint8), 128, g_idx)
        swiglu = fmt == "mxfp4"
        for rows in (1.0, 64.0):
            tiles = real[3](rows, torch.device("cuda"))
            wm.select_w4_tiles = lambda *_: tiles  # noqa: B023
            up, down = Compile(real[0], target), Compile(real[1], target)
            wm._w4_gate_up_kernel, wm._w4_down_kernel = up, down
            bias = (torch.zeros(e, 2 * i, dtype=torch.bfloat16),
                    torch.zeros(e, h, dtype=torch.bfloat16)) if swiglu else (None, None)
            try:
                wm.w4_fused_experts(torch.zeros(t, h, dtype=torch.bfloat16), experts(2 * i, h, 2),
                                    experts(h, i), torch.zeros(t, k),
                                    torch.zeros(t, k, dtype=torch.int64),
                                    ExpertActivation("swiglu_clamped" if swiglu else "silu"),
                                    *bias)
            except Exception as exc:
                failed += 1
                print(f"{fmt} experts: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
                continue
            for what, stand_in in (("gate_up", up), ("down", down)):
                compiled = stand_in.compiled[0]
                print(f"{fmt} experts {what} ({tiles}): {resources(compiled, arch)}")
    wm._w4_gate_up_kernel, wm._w4_down_kernel, wm.align_by_expert, wm.select_w4_tiles = real
    return failed


if __name__ == "__main__":
    main()
