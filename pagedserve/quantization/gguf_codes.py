"""GGUF blocks read as integer codes with per-group scales and zero points (or offsets): the
one decoding of the block bytes, in torch on any device, that both the dequantize-at-load path
(`gguf_blocks.dequantize_array`) and the kept weights use. A kept GGUF weight is these codes in
the W4A16 kernel's layout (`GGUFCodes.w4a16`): 4-bit types as 4-bit codes, Q5_K, Q6_K and Q8_0
as 8-bit ones, one dequantizing GEMM for every format.

Each type's values are w = (code - zero) * scale or w = code * scale + offset per group, with the
very float32 operations gguf's numpy dequantizer does, so both paths give its bits:
- Q8_0 (32 a block): fp16 d, 32 int8 q; code = q + 128 (8 bits), zero 128, scale d.
- Q4_0 (32): d, 16 bytes (value j in byte j's low nibble, 16 + j in its high); zero 8.
- Q4_1 (32): d, m, nibbles as Q4_0; w = q d + m (offset form).
- Q4_K (256, in 8 groups of 32): d, dmin, 12 bytes of eight 6-bit scales and mins (the first
  four in the low 6 bits of bytes 0-3 / 4-7, the last four's low nibbles in bytes 8-11 and
  high bits in the top 2 of bytes 0-7), 4 x 32 bytes: groups 2c and 2c + 1 in the low and high
  nibbles of bytes 32c..32c + 31; w = (d sc) q - dmin m (offset form, offset -(dmin m)).
- Q5_K (256): as Q4_K with 32 bytes of fifth bits after the scales (bit j of byte l: group
  j's value l); 5-bit codes held in 8.
- Q6_K (256, in 16 groups of 16): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
  scales, then d; in half h value r has its nibble in ql[64h + r % 64] (shift 4 (r // 64))
  and its top bits in qh[32h + r % 32] (shift 2 (r // 32)); w = (d sc) (q - 32), zero 32.
The products d sc and dmin m are exact in float32 (11 by at most 8 significant bits), as is
each code times its scale, so the offset form rounds once, as gguf does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.quantization.gguf_types import BLOCKS, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0

if TYPE_CHECKING:  # the kernel's module imports triton
    from pagedserve.quantization.ops.w4a16_gemm import W4A16Weight


@dataclass
class GGUFCodes:
    """A [N, K] weight of one block type: codes uint8 [N, K], scales and zeros (float offsets
    where `offsets`) float32 [N, K / group_size]; `bits` the width the codes need (4 or 8)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    bits: int
    offsets: bool

    def w4a16(self) -> W4A16Weight:
        """The W4A16 kernel's layout of these codes (on their device)."""
        from pagedserve.quantization.ops.w4a16_gemm import w4a16_layout

        k = self.codes.shape[1]
        group = torch.arange(k, device=self.codes.device) // self.group_size
        return w4a16_layout(self.codes, self.zeros, self.scales, group, self.bits,
                            self.offsets)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: gguf's values, bit for bit."""
        n, k = self.codes.shape
        groups = self.codes.view(n, k // self.group_size, self.group_size).float()
        scales, zeros = self.scales[..., None], self.zeros[..., None]
        w = groups * scales + zeros if self.offsets else (groups - zeros) * scales
        return w.reshape(n, k)


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as float32 [n]."""
    return raw[:, start:start + 2].contiguous().view(torch.float16).float().flatten()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Q4_0 / Q4_1's 16 bytes a block -> 32 codes: the low nibbles, then the high."""
    return torch.cat([codes & 0xF, codes >> 4], dim=1)


def _constant(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value)


def check_blocks(qtype: int, data: torch.Tensor, in_features: int) -> None:
    """Refuse bytes that are not whole rows of blocks of `in_features` values."""
    if qtype not in BLOCKS:
        raise ValueError(f"no GGUF kernel for block type {qtype}")
    block, size, name = BLOCKS[qtype]
    if in_features % block or data.dim() != 2 or data.shape[1] != in_features // block * size:
        raise ValueError(f"{name} weight of {in_features} inputs needs rows of "
                         f"{in_features // block * size} bytes in blocks of {block}; got "
                         f"{tuple(data.shape)}")


def gguf_codes(data: torch.Tensor, qtype: int, in_features: int) -> GGUFCodes:
    """uint8 [N, K / block * block bytes] (the file's bytes) -> `GGUFCodes`."""
    block, size, name = BLOCKS[qtype]
    n = data.shape[0]
    raw = data.reshape(-1, size)
    if qtype in (Q8_0, Q4_0, Q4_1):
        d = _f16(raw, 0)
        if qtype == Q8_0:
            codes, zeros, bits = raw[:, 2:] ^ 0x80, _constant(d, 128.0), 8
        else:
            codes, bits = _nibbles(raw[:, size - 16:]), 4
            zeros = _f16(raw, 2) if qtype == Q4_1 else _constant(d, 8.0)
        return GGUFCodes(codes.reshape(n, in_features), d.view(n, -1), zeros.view(n, -1), 32,
                         bits, qtype == Q4_1)
    if qtype in (Q4_K, Q5_K):
        codes, scales, mins = _q45_k(raw, qtype == Q5_K)
        return GGUFCodes(codes.reshape(n, in_features), scales.view(n, -1),
                         (-mins).view(n, -1), 32, 4 if qtype == Q4_K else 8, True)
    if qtype == Q6_K:
        codes, scales = _q6_k(raw)
        return GGUFCodes(codes.reshape(n, in_features), scales.view(n, -1),
                         _constant(scales, 32.0).view(n, -1), 16, 8, False)
    raise ValueError(f"no integer codes for GGUF block type {name}")


def _q45_k(raw: torch.Tensor, fifth_bit: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """Q4_K [n, 144] / Q5_K [n, 176] super-blocks -> codes [n, 256], d sc and dmin m [n, 8]."""
    n = raw.shape[0]
    fields = raw[:, 4:16].reshape(n, 3, 4)
    dd, mm, md = fields[:, 0], fields[:, 1], fields[:, 2]
    sc = torch.cat([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], dim=-1).float()
    mn = torch.cat([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], dim=-1).float()
    codes = raw[:, 48:] if fifth_bit else raw[:, 16:]
    shift = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).view(1, 1, 2, 1)
    q = ((codes.reshape(n, 4, 1, 32) >> shift) & 0x0F).reshape(n, 8, 32)
    if fifth_bit:
        bits = torch.arange(8, dtype=torch.uint8, device=raw.device).view(1, 1, 8, 1)
        q = q | (((raw[:, 16:48].reshape(n, 1, 1, 32) >> bits) & 0x01).reshape(n, 8, 32) << 4)
    return q.reshape(n, 256), _f16(raw, 0)[:, None] * sc, _f16(raw, 2)[:, None] * mn


def _q6_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks [n, 210] -> codes 0..63 [n, 256] and d sc [n, 16]."""
    n = raw.shape[0]
    scales = _f16(raw, 208)[:, None] * raw[:, 192:208].contiguous().view(torch.int8).float()
    low_shift = torch.tensor([0, 4], dtype=torch.uint8, device=raw.device).view(1, 1, 2, 1)
    high_shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)
    low = (raw[:, :128].reshape(n, 2, 1, 64) >> low_shift) & 0x0F
    high = (raw[:, 128:192].reshape(n, 2, 1, 32) >> high_shift.view(1, 1, 4, 1)) & 0x03
    return (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).reshape(n, 256), scales
