"""Compile the FP8 decode kernels (`ops/fp8_small_m.py`: the small-M linear and its split-K
reduction; `ops/fp8_token_quant.py`: per-token quantization) for a GPU architecture on any
machine (no GPU needed), at the 8B projection shapes with the launch shapes the rules pick for
a 132-SM H100 (or `--tiles`), and print what ptxas reports: registers, spills, shared memory.

    python scripts/fp8_kernel_resources.py [--arch 90] [--tiles 32/128/3/4/4]

`--tiles` is block_n/block_k/split_k/num_warps/num_stages, for every shape. With triton 3.6
(the GPU machine's) from a separate directory:
    PYTHONPATH=<dir with triton 3.6>:. python scripts/fp8_kernel_resources.py
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

from pagedserve.quantization.ops import fp8_small_m as sm  # noqa: E402
from pagedserve.quantization.ops import fp8_token_quant as tq  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}
H100_SMS = 132
FP8 = torch.float8_e4m3fn


def _variants(n: int, k: int):
    """(name, kwargs builder) of each input / weight layout the linear method runs."""
    bf16 = torch.zeros(4, k, dtype=torch.bfloat16)
    codes = torch.zeros(4, k, dtype=FP8)
    channel = torch.zeros(n)
    blocks = torch.zeros(triton.cdiv(n, 128), triton.cdiv(k, 128))
    bias = torch.zeros(n, dtype=torch.bfloat16)
    yield "bf16 x, channel", (bf16, channel), dict(bias=bias)
    yield "bf16 x, block", (bf16, blocks), dict(block=(128, 128))
    yield "fp8 x per row, channel", (codes, channel), dict(
        x_scale=torch.zeros(4, 1), out_dtype=torch.bfloat16)
    yield "fp8 x per 128, block", (codes, blocks), dict(
        block=(128, 128), x_scale=torch.zeros(4, triton.cdiv(k, 128)), x_group=128,
        out_dtype=torch.bfloat16)


def compile_small_m(target: GPUTarget, arch: int, fixed: sm.SmallMTiles | None) -> int:
    failed = 0
    for proj, (n, k) in SHAPES_8B.items():
        tiles = fixed or sm.select_small_m_tiles(n, k, torch.device("cuda"), sms=H100_SMS)
        weight = torch.zeros(n, k, dtype=FP8)
        for name, (x, scale), kwargs in _variants(n, k):
            stand_ins = compile_through(
                sm, ("_small_m_kernel", "_reduce_splits_kernel"), target,
                lambda: sm.small_m_linear(x, weight, scale, tiles=tiles, **kwargs),  # noqa: B023
                f"{proj} {name}")
            if stand_ins is None:
                failed += 1
                continue
            for what, stand_in in zip(("gemm", "reduce"), stand_ins, strict=True):
                for compiled in stand_in.compiled:
                    print(f"{proj} [{n}x{k}] {name} {what} {tiles}: "
                          f"{resources(compiled, arch)}")
    return failed


def compile_token_quant(target: GPUTarget, arch: int) -> int:
    failed = 0
    for k in (4096, 14336):
        for static in (None, torch.ones(())):
            what = f"token quant K={k} {'static' if static is not None else 'dynamic'}"
            x = torch.zeros(4, k, dtype=torch.bfloat16)
            stand_ins = compile_through(
                tq, ("_token_quant_kernel",), target,
                lambda: tq.launch(x, static, torch.empty(4, k, dtype=FP8),  # noqa: B023
                                  torch.empty(4, 1), round_first=False),  # the GPU's variant
                what)
            if stand_ins is None:
                failed += 1
                continue
            compiled = stand_ins[0].compiled[0]
            print(f"{what}: {resources(compiled, arch)}")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--tiles", default=None,
                        help="block_n/block_k/split_k/num_warps/num_stages for every shape")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    fixed = sm.SmallMTiles(*map(int, args.tiles.split("/"))) if args.tiles else None
    print(f"triton {triton.__version__}, sm_{args.arch}a")
    failed = compile_small_m(target, args.arch, fixed) + compile_token_quant(target, args.arch)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
