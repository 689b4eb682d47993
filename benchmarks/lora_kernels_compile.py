"""Compile LoRA's Triton kernels (pagedserve/lora/kernels.py) for a CUDA target without a GPU,
with whichever triton is first on the path: a check that the device's triton (older than the
CPU machines') accepts them before a device call. bf16 and float32 factors, rank 16.

    pip install --no-deps --target DIR triton==3.6.0
    python benchmarks/lora_kernels_compile.py --triton-path DIR --arch 90
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--triton-path", help="a directory holding the triton to use")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    os.environ.pop("TRITON_INTERPRET", None)
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from kernel_resources import resources

    from pagedserve.lora import kernels

    runs = {"sorted_rows_ptr": "*i32", "blocks_ptr": "*i32", "stride_split": "i32",
            "stride_r": "i32", "R_PAD": "constexpr", "SPLIT_K": "constexpr",
            "BLOCK_M": "constexpr", "DOT_PRECISION": "constexpr"}
    shrink = {"x_ptr": "*T", "a_ptr": "*T", "part_ptr": "*fp32", "in_features": "i32",
              "k_per_split": "i32", "stride_x": "i32", "stride_as": "i32", "stride_ar": "i32",
              **runs, "RANKS": "constexpr", "BLOCK_K": "constexpr"}
    expand = {"part_ptr": "*fp32", "b_ptr": "*T", "y_ptr": "*T", "bounds_ptr": "*i32",
              "stride_bs": "i32", "stride_bn": "i32", "stride_y": "i32", **runs,
              "RANK": "constexpr", "N_GROUPS": "constexpr", "N_TILES": "constexpr",
              "BLOCK_N": "constexpr"}
    tiles = kernels.TILES
    shared = {"SPLIT_K": 16, "BLOCK_M": 16, "BLOCK_K": tiles.block_k, "N_GROUPS": 8,
              "N_TILES": tiles.n_tiles, "BLOCK_N": tiles.block_n}
    # q/k/v at rank 16 (48 ranks in one shrink program), and at rank 256: the shrink's chunk
    # of MAX_SHRINK_RANKS, the expand's 256-wide rank tile
    jobs = [(kernels._shrink, shrink, {"RANKS": 48, "R_PAD": 64}, "rank 16"),
            (kernels._expand, expand, {"RANK": 16, "R_PAD": 16}, "rank 16"),
            (kernels._shrink, shrink, {"RANKS": 768, "R_PAD": kernels.MAX_SHRINK_RANKS},
             "rank 256"),
            (kernels._expand, expand, {"RANK": 256, "R_PAD": 256,
                                       "BLOCK_N": kernels.expand_block_n(256)}, "rank 256")]
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    for fn, signature, ranks, label in jobs:
        for dtype in ("bf16", "fp32"):
            sig = {k: f"*{dtype}" if v == "*T" else v for k, v in signature.items()}
            const = {k: v for k, v in {**shared, **ranks}.items() if k in sig}
            const["DOT_PRECISION"] = "ieee" if dtype == "fp32" else None
            compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=target)
            print(f"{fn.fn.__name__:8s} {label:8s} {dtype}: {resources(compiled, args.arch)}")

if __name__ == "__main__":
    main()
