"""Compile TRITON_MLA's decode kernel (ops/mla_decode.py) for a GPU architecture on any machine
(no GPU needed) and print what ptxas reports (registers, spills, shared memory), whether the
dots became Hopper wgmma (HGMMA), ptxas's performance advisories (C7515: wgmma serialized, as a
restructured loop can make them; none for the shapes the sweep holds) and the SASS mix of the
hot loop (the walk over key tiles).

    python scripts/mla_kernel_resources.py [--arch 90] [--heads 128] [--lora 512] [--rope 64]
        [--tiles 64/1/32/8/3/1/1,...] [--block-size 64] [--sass DIR]

Tile strings are MLATiles fields in order: block_h/block_q/block_n/num_warps/num_stages/
num_splits/lazy_rescale (0 or 1); `--tiles sweep` compiles benchmarks/mla_decode.py's sweep
grid. An H200 SM has 64K registers and 227 KB of shared memory for its programs; a kernel that
spills, or whose dots are not HGMMA, will not come near the tensor cores' rate (a 128-head
decode is bound by its dots, not by HBM: see benchmarks/mla_decode.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.attention.ops import mla_decode as mla  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_resources import BIN, Compile  # noqa: E402
from tq_kernel_resources import report  # noqa: E402


def advisories(compiled, arch: int) -> list[str]:
    """ptxas's "Potential Performance Loss" lines for a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        result = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name", f"sm_{arch}a", str(ptx),
                                 "-o", str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True)
    return [line.split("info    : ")[-1] for line in result.stderr.splitlines()
            if "Performance Loss" in line]


def parse_tiles(text: str) -> mla.MLATiles:
    """block_h/block_q/block_n/num_warps/num_stages[/num_splits[/lazy_rescale]]"""
    values = [int(v) for v in text.split("/")]
    if len(values) > 6:
        values[6] = bool(values[6])
    return mla.MLATiles(*values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--lora", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tiles", default=None,
                        help="comma-separated tile strings (default: the H200 decode default)")
    parser.add_argument("--sass", type=Path, default=None, help="write each kernel's SASS here")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    texts: list = args.tiles.split(",") if args.tiles else [None]
    if args.tiles == "sweep":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
        from mla_decode import sweep_tiles

        texts = sweep_tiles(args.heads)
    real_kernel, real_merge, real_upcast = (mla._mla_attention_kernel, mla._merge_splits_kernel,
                                            mla.upcast_tiles)
    mla.upcast_tiles = lambda kv_cache: False  # the bf16 tensor-core variant
    dtype, i32, t, h = torch.bfloat16, torch.int32, 2, args.heads
    try:
        for text in texts:
            if isinstance(text, mla.MLATiles):
                tiles = text
            else:
                tiles = (parse_tiles(text) if text
                         else mla.default_decode_tiles(132, h, t, args.block_size))
            kernel, merge = Compile(real_kernel, target), Compile(real_merge, target)
            mla._mla_attention_kernel, mla._merge_splits_kernel = kernel, merge
            cache = torch.zeros(8, args.block_size, args.lora + args.rope, dtype=dtype)
            q_lat = torch.zeros(t, h, args.lora, dtype=dtype)
            q_pe = torch.zeros(t, h, args.rope, dtype=dtype)
            mla.mla_attention(q_lat, q_pe, cache, torch.empty_like(q_lat),
                              torch.zeros(t, 4, dtype=i32), torch.tensor([0, 1, 2], dtype=i32),
                              torch.tensor([10, 10], dtype=i32), torch.arange(t, dtype=i32),
                              torch.zeros(t, dtype=i32), t, 0.1, tiles)
            label = "/".join(str(v) for v in (tiles.block_h, tiles.block_q, tiles.block_n,
                                              tiles.num_warps, tiles.num_stages,
                                              tiles.num_splits, int(tiles.lazy_rescale)))
            for compiled in kernel.compiled:
                hgmma = compiled.asm["ptx"].count("wgmma.mma_async")
                print(f"attention {label}: {hgmma} wgmma.mma_async in the PTX")
                for line in advisories(compiled, args.arch):
                    print(f"    ptxas: {line}")
                report(f"attention {label}", compiled, args.arch, tiles.block_n, args.sass)
            for compiled in merge.compiled:
                report(f"merge {label}", compiled, args.arch, 1, None)
    finally:
        mla._mla_attention_kernel, mla._merge_splits_kernel = real_kernel, real_merge
        mla.upcast_tiles = real_upcast


if __name__ == "__main__":
    main()
