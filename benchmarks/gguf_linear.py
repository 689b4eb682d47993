"""A decode step's linears with GGUF blocks kept (Q4_K_M's layout) against the same weights
dequantized to bf16, on one GPU:

    python benchmarks/gguf_linear.py [--shape 8b] [--tokens 1,4,16] [--json FILE]
    python benchmarks/gguf_linear.py --smoke     # tiny shape on the CPU, Triton interpreter

Every layer's projections of the shape (Llama-3.1-8B: 32 layers; qkv 6,144 x 4,096,
o 4,096 x 4,096, gate_up 28,672 x 4,096, down 4,096 x 14,336; the head 128,256 x 4,096) get
random valid blocks of the types llama.cpp's Q4_K_M gives them: Q4_K everywhere except the head
(Q6_K) and, in the layers it spends more bits on (the first and last eighth, and every third
layer between), v and down (Q6_K). The bf16 model is exactly those weights decoded.

For each token count M, one step's projections (each layer's qkv, o, gate_up, down and the head,
in order, on distinct weights so nothing stays in L2) are captured once in a CUDA graph per
path, as the engine graphs its decode steps, and replayed: median of 20 after 5 warm-ups, CUDA
events. Printed: ms per step for bf16 and gguf, their ratio (the issue asks <= 0.5 at M = 1),
the weight bytes of each, and the max relative error of gguf against the bf16 product. Norms,
attention and the embedding are left out: at batch 1 they are a small, equal share of both.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedserve.quantization.gguf_blocks import random_blocks  # noqa: E402
from pagedserve.quantization.gguf_codes import gguf_codes  # noqa: E402
from pagedserve.quantization.gguf_types import Q4_K, Q6_K  # noqa: E402
from pagedserve.quantization.ops.w4a16_gemm import W4A16Weight, w4a16_linear  # noqa: E402

# layers, hidden, q rows, kv rows, intermediate, vocab
SHAPES = {"8b": (32, 4096, 4096, 1024, 14336, 128256),
          "smoke": (2, 256, 256, 128, 512, 512)}


def more_bits(layer: int, layers: int) -> bool:
    """The layers Q4_K_M stores v and down in Q6_K: the first and last eighth, every third
    between (llama.cpp's rule, in its words: use_more_bits)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


@dataclass
class Blocks:
    """One part's GGUF bytes as the file holds them, and the kept weight made of them."""

    qtype: int
    data: torch.Tensor
    in_features: int

    def kept(self) -> W4A16Weight:
        return gguf_codes(self.data, self.qtype, self.in_features).w4a16()


def build(shape: str, device: torch.device) -> list[tuple[str, list[Blocks]]]:
    """(name, parts) of every projection of a step, in order."""
    layers, hidden, q, kv, inter, vocab = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)

    def blocks(qtype: int, rows: int, cols: int) -> Blocks:
        return Blocks(qtype, random_blocks(qtype, rows, cols, g), cols)

    step = []
    for i in range(layers):
        wide = Q6_K if more_bits(i, layers) else Q4_K
        qkv = [blocks(Q4_K, q + kv, hidden)] + [blocks(wide, kv, hidden)]
        if wide == Q4_K:  # one type: the parts stack into one weight, as the method does
            qkv = [Blocks(Q4_K, torch.cat([p.data for p in qkv]), hidden)]
        step += [(f"{i}.qkv", qkv), (f"{i}.o", [blocks(Q4_K, hidden, q)]),
                 (f"{i}.gate_up", [blocks(Q4_K, 2 * inter, hidden)]),
                 (f"{i}.down", [blocks(wide, hidden, inter)])]
    return step + [("head", [blocks(Q6_K, vocab, hidden)])]


def _inputs(step, m: int, device: torch.device, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    ins = {p[0].in_features for _, p in step}
    return {k: torch.randn(m, k, device=device, dtype=dtype) * 0.1 for k in ins}


def _replay(run: Callable[[], object], device: torch.device, iters: int = 20,
            warmup: int = 5) -> float:
    """Median ms of `run`, captured in a CUDA graph on a GPU; wall time on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8b", choices=list(SHAPES))
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny shape on the CPU in the Triton interpreter (float32)")
    parser.add_argument("--json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 is broken
    shape = "smoke" if args.smoke else args.shape
    file_step = build(shape, device)
    file_bytes = sum(p.data.numel() for _, parts in file_step for p in parts)
    step = [(name, [p.kept() for p in parts]) for name, parts in file_step]
    del file_step
    dense = {name: torch.cat([p.dequantize(dtype) for p in parts]).contiguous()
             for name, parts in step}
    gguf_bytes = sum(t.numel() * t.element_size() for _, parts in step for p in parts
                     for t in p.tensors().values())
    dense_bytes = sum(w.numel() * w.element_size() for w in dense.values())
    print(f"{shape} on {torch.cuda.get_device_name() if cuda else 'CPU (interpreter)'}: weight "
          f"bytes {dtype} {dense_bytes / 1e6:.1f} MB, gguf kept {gguf_bytes / 1e6:.1f} MB "
          f"({gguf_bytes / dense_bytes:.3f}x; the file's blocks {file_bytes / 1e6:.1f} MB)")
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        xs = _inputs(step, m, device, dtype)
        outs: dict[str, torch.Tensor] = {}

        def run_dense() -> None:
            for name, _ in step:
                outs[name] = F.linear(xs[dense[name].shape[1]], dense[name])  # noqa: B023

        def run_gguf() -> None:
            for name, parts in step:
                outs[name] = w4a16_linear(xs[parts[0].in_features], parts)  # noqa: B023

        bf16_ms = _replay(run_dense, device)
        want = {k: v.float() for k, v in outs.items()}
        gguf_ms = _replay(run_gguf, device)
        err = max(float((outs[k].float() - w).abs().max() / w.abs().max().clamp_min(1e-30))
                  for k, w in want.items())
        rows.append({"m": m, "dense_ms": bf16_ms, "gguf_ms": gguf_ms, "ratio": gguf_ms / bf16_ms,
                     "rel_err": err})
        print(f"M={m:>4}: {dtype} {bf16_ms:8.3f} ms, gguf {gguf_ms:8.3f} ms per step "
              f"({gguf_ms / bf16_ms:.3f}x), max rel err {err:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "device": str(device), "gguf_bytes": gguf_bytes,
                       "file_bytes": file_bytes,
                       "dense_bytes": dense_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
