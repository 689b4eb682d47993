"""Integer weights as checkpoints pack them, 4-bit and (GPTQ, compressed-tensors) 8-bit, and
the arithmetic those formats share: unpacking codes from int32 words, expanding per-group
scales and zero points to every input column (in order, or through an act-order `g_idx`), and
the checks that name a tensor whose shape does not fit. `IntCodes.bits` says the width.

Everything works in float32 on the CPU and is exact: a code minus a zero point is an integer
of at most 9 bits (8-bit codes), a float16 or bfloat16 scale has at most 11 significant bits,
so their product is a float32 without rounding; an e2m1 value times a power of two likewise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BITS = 4
PER_WORD = 32 // BITS  # nibbles in an int32
WIDTHS = (4, 8)  # the code widths the integer formats read (both divide a word evenly)


def tensor(t: Any) -> torch.Tensor:
    """A checkpoint tensor, read whole (a `LazySlice` too): the packed formats dequantize the
    full tensor and then take this rank's part of the float result."""
    from pagedserve.models.parallel import materialize

    return materialize(t)


def unpack_int32(words: torch.Tensor, dim: int, what: str, bits: int = BITS) -> torch.Tensor:
    """int32 words -> int32 codes 0..2^bits - 1, 32 / bits per word along `dim`, low bits
    first (code i: bits i*bits..(i+1)*bits - 1): [.., W, ..] -> [.., (32 / bits) W, ..]."""
    if words.dtype != torch.int32:
        raise ValueError(f"{what} is {words.dtype}; packed {bits}-bit weights are int32 words")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.movedim(dim, -1)
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, 32 / bits]
    return codes.flatten(-2).movedim(-1, dim)


def group_index(g_idx: torch.Tensor | None, k: int, group_size: int, groups: int,
                what: str) -> torch.Tensor:
    """The group of each of the k input columns: the checkpoint's `g_idx` (act-order: any
    column to any group) or k // group_size."""
    if g_idx is None:
        return torch.arange(k) // group_size
    g_idx = g_idx.long().flatten()
    if g_idx.numel() != k:
        raise ValueError(f"{what} has {g_idx.numel()} entries; the weight has {k} input "
                         "columns, one group index each")
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"{what} names groups {int(g_idx.min())}..{int(g_idx.max())}; the "
                         f"scales hold {groups}")
    return g_idx


def groups_of(k: int, group_size: int, what: str) -> tuple[int, int]:
    """(group size, number of groups) of a weight with k input columns; -1: one group (per
    channel). A size that does not divide k is refused."""
    if group_size == -1:
        return k, 1
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{what}: group_size {group_size} does not divide its {k} input "
                         "columns")
    return group_size, k // group_size


def check_shape(t: torch.Tensor, want: tuple[int, ...], what: str, why: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{what} has shape {tuple(t.shape)}; {why} needs {want}")


@dataclass
class IntCodes:
    """One weight's integer codes, unpacked in a format-neutral layout: w = (codes - zeros[:,
    group]) * scales[:, group]. codes [N, K] 0..2^bits - 1; zeros [N, G] (0..2^bits: GPTQ's v1
    stores a zero of 2^bits as 2^bits - 1); scales [N, G] as stored; group [K], each input's
    group; bits 4 or 8."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group: torch.Tensor
    bits: int = BITS

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        q = self.codes.float() - self.zeros.float()[:, self.group]
        return q * self.scales.float()[:, self.group]
