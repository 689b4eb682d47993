"""The W4A16 GEMM, which serves 8-bit codes too (W8A16; the names keep the common 4-bit case):
y = x W^T with W held as BITS-bit integer codes (4 or 8) and per-group scales and zero points,
dequantized in registers tile by tile (the weight is never written out in 16 bits).

Layout (`W4A16Weight`, built by `w4a16_layout` from any integer format's `IntCodes`):
- `qweight` int32 [ceil(K / p), N], p = 32 / BITS: p codes a word along K, low bits first
  (code i: input p*r+i), so a tile of BLOCK_K inputs x BLOCK_N outputs is BLOCK_K / p rows of
  contiguous words;
- `scales` float32 [G, N] and `zeros` [G, N], one per group and output: uint8 for 4 bits
  (0..16), int16 for 8 bits (0..256: GPTQ's v1 reads a stored 255 as 256);
- `g_idx` int32 [K]: each input's group. Act-order checkpoints map inputs to groups in any
  order; reading the group per input serves them, and tensor-parallel slices of K, unchanged.

BITS is a compile-time constant, so the 4-bit kernel is the code it always was and 8 bits a
second specialisation. One program per BLOCK_M x BLOCK_N output tile walks K by BLOCK_K: it
loads the x tile, the
words, each input's group and that group's scales and zeros, forms (code - zero) * scale in
float32 (exact), rounds it to x's dtype and accumulates the dot in float32. Large M, where the
product is compute bound and the weight is read once per tile row anyway, may instead
dequantize the whole weight and call the dense GEMM (`DEQUANTIZE_ABOVE_M`, to be measured on
the device: `benchmarks/int4_linear.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quantization.ops.tile_order import grouped_tile


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K,
                  stride_xm, stride_qk, stride_sg, stride_zg, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, BITS: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        tile_ok = k_ok[:, None] & col_ok[None, :]
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        words = tl.load(qw_ptr + (ks // (32 // BITS))[:, None] * stride_qk + cols[None, :],
                        mask=tile_ok, other=0)
        codes = (words >> ((ks % (32 // BITS)) * BITS)[:, None]) & ((1 << BITS) - 1)
        group = tl.load(g_ptr + ks, mask=k_ok, other=0)
        scale = tl.load(s_ptr + group[:, None] * stride_sg + cols[None, :], mask=tile_ok,
                        other=0.0)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + cols[None, :], mask=tile_ok,
                       other=0)
        w = ((codes.to(tl.float32) - zero.to(tl.float32)) * scale).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass
class W4A16Weight:
    """A linear's 4- or 8-bit weight as the kernel reads it (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    in_features: int
    bits: int = 4

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype` (the large-M path, and the tests' reference)."""
        k = self.in_features
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=self.qweight.device)
        mask = (1 << self.bits) - 1
        codes = ((self.qweight[:, None, :] >> shifts[None, :, None]) & mask).flatten(0, 1)[:k]
        g = self.g_idx.long()
        w = (codes.float() - self.zeros.float()[g]) * self.scales[g]
        return w.t().to(dtype)


def w4a16_layout(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group: torch.Tensor, bits: int = 4) -> W4A16Weight:
    """Codes [N, K] (0..2^bits - 1), zeros and scales [N, G], group [K] (`IntCodes`'
    fields) -> the kernel's layout, on the codes' device."""
    if bits not in (4, 8):
        raise ValueError(f"the W4A16 kernel reads 4- or 8-bit codes, not {bits}-bit")
    n, k = codes.shape
    per_word = 32 // bits
    pad = -k % per_word
    c = torch.nn.functional.pad(codes.t().to(torch.int64), (0, 0, 0, pad))  # [K padded, N]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (c.view(-1, per_word, n) << shifts[None, :, None]).sum(1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    # A zero of 2^bits (GPTQ v1) needs one bit more than the codes.
    zero_dtype = torch.uint8 if bits == 4 else torch.int16
    return W4A16Weight(words.contiguous(), scales.t().float().contiguous(),
                       zeros.t().to(zero_dtype).contiguous(),
                       group.to(torch.int32).contiguous(), k, bits)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Keyed by M. Hopper, chosen by reasoning and not yet swept: at decode the kernel streams the
# words, so narrow N tiles spread one layer over the SMs; larger M reuses each dequantized
# tile over taller row tiles.
_TILES = (
    (16, Tiles(16, 64, 128, 1, 4, 4)),
    (64, Tiles(32, 64, 64, 4, 4, 4)),
    (256, Tiles(64, 128, 64, 8, 4, 3)),
    (math.inf, Tiles(128, 128, 64, 8, 8, 3)),
)
INTERPRETER_TILES = Tiles(16, 32, 32, 1, 1, 1)
# Above this many rows the weight is dequantized whole and the dense GEMM runs (None: never);
# to be set from benchmarks/int4_linear.py on the device.
DEQUANTIZE_ABOVE_M: int | None = None


def select_tiles(m: int, device: torch.device) -> Tiles:
    if device.type == "cpu":
        return INTERPRETER_TILES
    return next(t for bound, t in _TILES if m <= bound)


def w4a16_mm(x: torch.Tensor, weight: W4A16Weight, tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) -> [M, N] in x's dtype."""
    m, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"input has {k} features; the {weight.bits}-bit weight takes "
                         f"{weight.in_features}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = weight.out_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiles or select_tiles(m, x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _w4a16_kernel[grid](x, weight.qweight, weight.scales, weight.zeros, weight.g_idx, out,
                        m, n, k, x.stride(0), weight.qweight.stride(0), weight.scales.stride(0),
                        weight.zeros.stride(0), out.stride(0), BLOCK_M=t.block_m,
                        BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                        BITS=weight.bits, IEEE=x.dtype == torch.float32, num_warps=t.num_warps,
                        num_stages=t.num_stages)
    return out


def w4a16_linear(x: torch.Tensor, weight: W4A16Weight, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, plus `bias`."""
    flat = x.reshape(-1, x.shape[-1])
    if DEQUANTIZE_ABOVE_M is not None and flat.shape[0] > DEQUANTIZE_ABOVE_M:
        out = torch.nn.functional.linear(flat, weight.dequantize(x.dtype))
    else:
        out = w4a16_mm(flat, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.out_features)
