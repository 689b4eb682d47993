"""Per-token FP8 quantization of a projection's input in one launch: x [M, K] (16 or 32 bits)
-> e4m3 codes [M, K] and float32 scales [M, 1], each row by its own absolute maximum
(scale = max(amax * (1 / 448), MIN_SCALE)) or every row by a static input scale.

The torch version (`fp8_linear.quantize_per_token`'s reference) takes about six passes over x
(cast, abs, amax, divide, clamp, cast) and as many launches; here one program per row reads
the row twice (the maximum, then the codes) in chunks. The scale multiplies by the float32
reciprocal of 448 as the torch function does, x / scale rounds to nearest (`div_rn`, Triton's
`/` being approximate) as torch's division does, and the e4m3 cast rounds to nearest even as
torch's does, so codes and scales are the same bits as the torch function's on a GPU. (The
interpreter's cast is not round-to-nearest-even; on CPU tensors, which only the interpreter
runs, the kernel rounds in float32 first.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.quantization.fp8_format import FP8, FP8_MAX, MIN_SCALE

MAX_CHUNK = 2048


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32: what the
    GPU's cast does. The interpreter's cast does not (it moves ties up and some values below a
    power of two down a binade), and casts an e4m3 value exactly, so CPU tensors round here
    first."""
    a = tl.abs(v)
    exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)  # subnormals: 2^-9
    ulp = tl.exp2(exponent - 3.0)
    t = a / ulp
    low = tl.floor(t)
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    up = (t - low > 0.5) | ((t - low == 0.5) & odd)
    r = (low + tl.where(up, 1.0, 0.0)) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def _token_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm,
                        STATIC: tl.constexpr, CHUNK: tl.constexpr, FP8_MAX_: tl.constexpr,
                        MIN_SCALE_: tl.constexpr, ROUND_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in range(0, K, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) * (1.0 / FP8_MAX_), MIN_SCALE_)
    for start in range(0, K, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        ok = cols < K
        x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_)
        if ROUND_FIRST:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_per_token_triton(x: torch.Tensor, input_scale: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]); `input_scale` (one element) for a
    static scale, None for each row's own."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        launch(x, input_scale, q, s, round_first=not x.is_cuda)
    return q, s


def launch(x: torch.Tensor, input_scale: torch.Tensor | None, q: torch.Tensor, s: torch.Tensor,
           round_first: bool) -> None:
    """The kernel's launch (also the compile script's, with the GPU's `round_first` False)."""
    m, k = x.shape
    chunk = min(MAX_CHUNK, triton.next_power_of_2(max(k, 16)))
    static = input_scale is not None
    _token_quant_kernel[(m,)](x, q, s, input_scale if static else s, k, x.stride(0),
                              q.stride(0), STATIC=static, CHUNK=chunk, FP8_MAX_=FP8_MAX,
                              MIN_SCALE_=MIN_SCALE, ROUND_FIRST=round_first,
                              num_warps=4 if chunk >= 1024 else 2)
