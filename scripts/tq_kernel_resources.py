"""Compile the TURBOQUANT attention kernel for a GPU architecture on any machine (no GPU needed)
and print what ptxas reports (registers, spills, shared memory) and the SASS instruction mix of
the hot loop (the phase-1 loop over the quantized context: the largest loop of the cubin), per
key tile and per key.

    python scripts/tq_kernel_resources.py [--arch 90] [--presets tq_k8v4,tq_4bit,tq_3bit]
        [--tiles 16/64/8/2/prmt/128,...] [--prefill [--merge]] [--sass DIR] [--splits 1]

Decode shapes (one query token per request; 32:8 heads, d128, block size 16, bf16) unless
--prefill, which compiles the prefill block shape of each tile string; --splits N compiles the
split-KV decode variant. --sass DIR writes each kernel's SASS there. An H200 SM has 64K
registers, 227 KB of shared memory and up to 64 warps.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.attention.ops import decode_split_kv  # noqa: E402
from pagedserve.attention.ops import turboquant_format as tqf  # noqa: E402
from pagedserve.attention.ops import turboquant_kernels as tqk  # noqa: E402
from pagedserve.attention.ops.unified_attention import query_block_shape  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_resources import Compile, ptxas_and_sass  # noqa: E402

# SASS opcode (before the first dot) -> class.
CLASSES = {
    "LDG": "LDG", "LD": "LDG", "LDGSTS": "LDGSTS", "LDS": "LDS", "STS": "STS", "LDSM": "LDS",
    "STG": "STG", "SHFL": "SHFL", "HMMA": "HMMA", "HGMMA": "HMMA",
    "FFMA": "FFMA/FMUL/FADD", "FMUL": "FFMA/FMUL/FADD", "FADD": "FFMA/FMUL/FADD",
    "FMNMX": "FMNMX/FSEL/FSETP", "FSEL": "FMNMX/FSEL/FSETP", "FSETP": "FMNMX/FSEL/FSETP",
    "MUFU": "MUFU", "F2F": "cvt", "F2FP": "cvt", "I2F": "cvt", "F2I": "cvt", "HADD2": "half",
    "HMUL2": "half", "HFMA2": "half", "PRMT": "PRMT", "SEL": "SEL", "BAR": "BAR",
    "IMAD": "int", "IADD3": "int", "LOP3": "int", "SHF": "int", "ISETP": "int", "LEA": "int",
    "IMNMX": "int", "IABS": "int", "SGXT": "int", "BMSK": "int", "IMAD.WIDE": "int",
    "MOV": "MOV", "S2R": "other", "CS2R": "other", "BRA": "branch", "NOP": "NOP",
}


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """[(address, opcode, operands)], branch targets given as addresses (0x...)."""
    out, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            out.append((addr, m.group(3), m.group(4)))
    return [(a, op, re.sub(r"`?\((\.L_x_\d+)\)", lambda m: hex(labels.get(m.group(1), 0)),
                           args)) for a, op, args in out]


def hot_loop(insns: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the largest loop: [branch target, backward branch]."""
    best: list = []
    for addr, op, args in insns:
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", args)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr:
            body = [x for x in insns if target <= x[0] <= addr]
            if len(body) > len(best):
                best = body
    return best


def classify(op: str) -> str:
    base = op.split(".")[0]
    return CLASSES.get(base, base)


def report(label: str, compiled, arch: int, block_n: int, sass_dir: Path | None) -> None:
    usage, sass = ptxas_and_sass(compiled, arch)
    shared = compiled.metadata.shared / 1024
    warps = compiled.metadata.num_warps
    regs = re.search(r"Used (\d+) registers", usage)
    occ = ""
    if regs:
        r = int(regs.group(1))
        per_prog = max(r, 1) * 32 * warps
        progs = min(65536 // per_prog, 64 // warps,
                    int(227 * 1024 // max(compiled.metadata.shared, 1)))
        occ = f"; <= {progs} programs ({progs * warps} warps) per SM"
    print(f"{label}: smem {shared:.1f} KB; {usage}{occ}")
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / (re.sub(r"[^\w.-]+", "_", label) + ".sass")).write_text(sass)
    loop = hot_loop(parse_sass(sass))
    if not loop:
        print("    (no loop found)")
        return
    counts = collections.Counter(classify(op) for _, op, _ in loop)
    total = sum(counts.values())
    mix = ", ".join(f"{k} {v}" for k, v in counts.most_common())
    print(f"    hot loop: {total} SASS per {block_n}-key tile ({total / block_n:.1f} per key, "
          f"{total * warps / block_n:.0f} warp-instructions per key): {mix}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--heads", default="32:8", help="query:KV heads")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--presets", default="tq_k8v4,tq_4bit,tq_3bit")
    parser.add_argument("--tiles", default=str(tqk.DECODE_TILES),
                        help="TQTiles strings, comma-separated")
    parser.add_argument("--prefill", action="store_true", help="the prefill block shape")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--sass", type=Path, default=None, help="write each kernel's SASS here")
    parser.add_argument("--splits", type=int, default=1, help="split-KV decode programs")
    parser.add_argument("--merge", action="store_true",
                        help="with --prefill: the context-only variant that merges into a "
                             "dense kernel's output (a prefill step continuing its pages)")
    args = parser.parse_args()
    heads, kv_heads = map(int, args.heads.split(":"))
    d, bs, dtype, i32 = args.head_size, args.block_size, torch.bfloat16, torch.int32
    target = GPUTarget("cuda", args.arch, 32)
    tqk.inline_asm_supported = lambda device: True  # compile the CUDA variant
    allocate_partials = decode_split_kv.allocate_partials
    decode_split_kv.reduce_split_kv = lambda *a, **k: None  # compiles only the attention kernel
    real = {name: getattr(tqk, name) for name in dir(tqk) if name.startswith("_tq_")
            and name.endswith("_kernel")}
    try:
        for preset_name in args.presets.split(","):
            preset = tqf.PRESETS[preset_name]
            tensors = tqk.format_tensors(preset, d, torch.device("cpu"))
            for text in args.tiles.split(","):
                tiles = tqk.TQTiles.parse(text)
                stand_ins = {name: Compile(k, target) for name, k in real.items()}
                for name, c in stand_ins.items():
                    setattr(tqk, name, c)
                decode = not args.prefill
                block_q, block_m = query_block_shape(heads // kv_heads, tiles, decode)
                t = 4
                query = torch.zeros(t, heads, d, dtype=dtype)
                key = torch.zeros(t, kv_heads, d, dtype=dtype)
                cache = torch.zeros(tqf.cache_shape(preset, 8, bs, kv_heads, d),
                                    dtype=torch.uint8)
                split = {}
                if args.splits > 1 and not args.prefill:
                    split = dict(num_splits=args.splits,
                                 partials=allocate_partials(t, heads, d, args.splits, "cpu"))
                if args.merge and args.prefill:
                    split = dict(merge_lse=torch.zeros(t, heads, dtype=torch.float32))
                tqk.tq_attention(preset, tensors, query, key, key, cache, torch.empty_like(query),
                                 torch.zeros(2, 4, dtype=i32), torch.tensor([0, 2, 4], dtype=i32),
                                 torch.tensor([10, 10], dtype=i32), torch.zeros(2, dtype=i32),
                                 torch.zeros(2, dtype=i32), 2, block_q, block_m, d ** -0.5,
                                 tiles, args.window, upcast=False, **split)
                for name, c in stand_ins.items():
                    for compiled in c.compiled:
                        label = (f"{preset_name} {'prefill' if args.prefill else 'decode'} "
                                 f"{text} {name.strip('_').removesuffix('_kernel')}")
                        report(label, compiled, args.arch, tiles.block_n, args.sass)
    finally:
        for name, k in real.items():
            setattr(tqk, name, k)


if __name__ == "__main__":
    main()
