"""Compile the TRITON attention kernel for a GPU architecture on any machine (no GPU needed) and
print what ptxas reports: registers, spills, shared memory. Occupancy follows from them: an
H100/H200 SM has 64K registers and 227 KB of shared memory for its programs.

    python scripts/kernel_resources.py [--arch 90] [--head-size 128] [--heads 32:8]
        [--tiles 16/64/2/4,128/32/4/4] [--unfused] [--window 64] [--attend-limit]

Each tile shape is compiled as a decode (block_m 16: one query token per program) when its
block_m is 16, else as a prefill; by default with the fused K/V write, as the backend runs it.
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
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.attention.ops import unified_attention as ua  # noqa: E402

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"


class Compile:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args)` compiles for `target` and
    records the result in `compiled` instead of launching."""

    def __init__(self, kernel, target: GPUTarget) -> None:
        self.kernel, self.target = kernel, target
        self.backend = make_backend(target)
        self.compiled = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            fn = self.kernel
            binder = create_function_from_signature(fn.signature, fn.params, self.backend)
            bound, spec, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound,
                                                                  spec, options)
            self.compiled.append(compile(ASTSource(fn, signature, constexprs, attrs),
                                         target=self.target, options=options.__dict__))
        return launch


def compile_through(module, names: tuple[str, ...], target: GPUTarget, call, label: str
                    ) -> list[Compile] | None:
    """`call()` with `module`'s kernels `names` replaced by `Compile` stand-ins (restored
    after): the stand-ins, whose `compiled` hold what each launch compiled; None (with the
    error printed under `label`) when the call failed."""
    real = [getattr(module, name) for name in names]
    stand_ins = [Compile(kernel, target) for kernel in real]
    for name, stand_in in zip(names, stand_ins, strict=True):
        setattr(module, name, stand_in)
    try:
        call()
    except Exception as exc:  # the caller reports every variant, then fails
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
        return None
    finally:
        for name, kernel in zip(names, real, strict=True):
            setattr(module, name, kernel)
    return stand_ins


def ptxas_and_sass(compiled, arch: int) -> tuple[str, str]:
    """ptxas's register/spill lines for a compiled kernel, and its SASS ("" if none)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        cubin = Path(tmp) / "kernel.cubin"
        ptx.write_text(compiled.asm["ptx"])
        result = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name", f"sm_{arch}a", str(ptx),
                                 "-o", str(cubin)], capture_output=True, text=True)
        lines = [line.split("info    : ")[-1].strip() for line in result.stderr.splitlines()
                 if "registers" in line or "spill" in line]
        usage = "; ".join(lines[-2:]) if lines else result.stderr[-500:]
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", "-hex", str(cubin)],
                              capture_output=True, text=True).stdout \
            if cubin.exists() else ""
        if not sass and cubin.exists():
            sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)],
                                  capture_output=True, text=True).stdout
    return usage, sass


def resources(compiled, arch: int) -> str:
    """A compiled kernel's shared memory and what ptxas reports (registers, spills)."""
    usage, _ = ptxas_and_sass(compiled, arch)
    return f"shared memory {compiled.metadata.shared / 1024:.1f} KB; {usage}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--heads", default="32:8", help="query:KV heads")
    parser.add_argument("--tiles", default="16/64/2/4,128/32/4/4",
                        help="block_m/block_n/warps/stages, comma-separated")
    parser.add_argument("--unfused", action="store_true", help="the kernel without its write")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--attend-limit", action="store_true",
                        help="prefills with a per-token attend limit (bidirectional spans)")
    args = parser.parse_args()
    heads, kv_heads = map(int, args.heads.split(":"))
    d, dtype, i32 = args.head_size, torch.bfloat16, torch.int32
    target = GPUTarget("cuda", args.arch, 32)
    real = ua._unified_attention_kernel
    ua.interpreting = lambda device: False  # compile the tensor-core (not interpreter) variant
    for text in args.tiles.split(","):
        tiles = ua.TileConfig(*map(int, text.split("/")))
        decode = tiles.block_m == 16
        block_q, block_m = ua.query_block_shape(heads // kv_heads, tiles, decode)
        stand_in = Compile(real, target)
        ua._unified_attention_kernel = stand_in
        t = 4
        query = torch.zeros(t, heads, d, dtype=dtype)
        key = torch.zeros(t, kv_heads, d, dtype=dtype)
        cache = torch.zeros(8, 16, kv_heads, d, dtype=dtype)
        new_kv = {} if args.unfused else dict(key=key, value=key,
                                              slot_mapping=torch.zeros(t, dtype=torch.int64))
        if args.attend_limit and not decode:
            new_kv["attend_limit"] = torch.zeros(t, dtype=i32)
        ua.unified_attention(query, cache, cache.clone(), torch.empty_like(query),
                             torch.zeros(2, 4, dtype=i32), torch.tensor([0, 2, 4], dtype=i32),
                             torch.tensor([10, 10], dtype=i32), torch.zeros(2, dtype=i32),
                             torch.zeros(2, dtype=i32), 2, block_q, block_m, d ** -0.5, tiles,
                             args.window, **new_kv)
        for compiled in stand_in.compiled:
            print(f"{'decode' if decode else 'prefill'} {text}"
                  f"{' unfused' if args.unfused else ''}: {resources(compiled, args.arch)}")
    ua._unified_attention_kernel = real


if __name__ == "__main__":
    main()
