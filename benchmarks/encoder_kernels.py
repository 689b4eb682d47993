"""An encoder layer's steps at a bge-base step on CUDA: the residual add + LayerNorm (torch's,
as the engine runs them; a fused Triton kernel measured no faster, 65.2 against 65.6 us on an
H100, and was dropped), the MLP's first GEMM + GELU against the GEMM with the GELU in its
cuBLASLt epilogue (`torch._addmm_activation`, models/bert.py), and the host's time to launch
each.

    python benchmarks/encoder_kernels.py [--tokens 16384] [--hidden 768] [--intermediate 3072]
        [--layers 12]

Prints each variant's GPU microseconds a call (median of CUDA-event spans), the bytes moved
over that time for the memory-bound ones, the host's microseconds to queue one call, and what
the GELU epilogue saves a step of --layers layers.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attention_kernels import time_cuda  # noqa: E402


def host_us(fn: Callable[[], object], iters: int = 200) -> float:
    """Host microseconds to queue one call (the device's work is left queued)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    spent = time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="a step's tokens (64 x 256)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    t, h, i = args.tokens, args.hidden, args.intermediate
    dt = torch.bfloat16
    x, res = (torch.randn(t, h, device="cuda", dtype=dt) for _ in range(2))
    norm = torch.nn.LayerNorm(h, eps=1e-12).to("cuda", dt)
    w1 = torch.randn(i, h, device="cuda", dtype=dt) / h ** 0.5
    b1 = torch.randn(i, device="cuda", dtype=dt)
    variants = {
        "add + LayerNorm (torch)": (lambda: norm(x + res), 5 * t * h * 2),  # add 2 + 1, norm 1 + 1
        "linear + GELU (torch)": (lambda: F.gelu(F.linear(x, w1, b1)), 0),
        "linear, GELU epilogue": (
            lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True), 0),
        "linear alone": (lambda: F.linear(x, w1, b1), 0),
    }
    with torch.inference_mode():
        us = {}
        for name, (fn, nbytes) in variants.items():
            us[name] = time_cuda(fn, 5, args.iters) * 1e6
            rate = f"  {nbytes / us[name] / 1e6:5.2f} TB/s" if nbytes else ""
            print(f"{name:26s} {us[name]:8.1f} us{rate}  host {host_us(fn):5.1f} us a call")
    gelu = (us["linear + GELU (torch)"] - us["linear, GELU epilogue"]) * args.layers
    print(f"a step of {args.layers} layers: the GELU epilogue saves {gelu / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
