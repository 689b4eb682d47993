"""Which packed experts keep their 4-bit codes for the grouped expert GEMMs
(`ops/w4_moe_kernels.py`), and their layout: each expert's gate, up and down as codes two a
byte along the inputs, with their scales (and zero points) and each input's group, cut to this
rank's slice and stacked [E, rows, ...] (gate rows, then up rows).

MXFP4's blocks are that layout already (bytes, low nibble first; one e8m0 scale per 32
inputs). An integer format is unpacked (`IntCodes`) and repacked. Where every expert's groups
of a projection run along the inputs in order with one size, the kernel computes each input's
group; otherwise (act-order, whose map differs per expert and may differ between gate and up;
a row-parallel slice that splits a group; parts whose group sizes differ) the projection keeps
a group map `g_idx` [E, P, K] the kernel reads, with the scales padded to the most groups any
part has. Inputs an odd number (or a slice that splits a byte of two codes) and 8-bit experts
(GPTQ, compressed-tensors) are refused by name: the dequantizing path
(`PAGEDSERVE_W4A16_KERNEL=0`) serves them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class _Codes:
    """One expert projection as the kernel reads it: codes uint8 [N, K/2], scales [N, G],
    zeros uint8 [N, G] (None: MXFP4), group int64 [K] (each input's group)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: torch.Tensor

    def in_order_size(self) -> int | None:
        """The group size where the groups are runs of it in input order; else None."""
        k, groups = self.group.numel(), self.scales.shape[1]
        if groups == 0 or k % groups:
            return None
        size = k // groups
        return size if torch.equal(self.group, torch.arange(k) // size) else None


def use_moe_kernel(layer: nn.Module, packed: Any, staged: dict[tuple[int, str], dict],
                   shapes: dict[str, tuple[int, ...]]) -> bool:
    """Lay the staged experts out for the kernel (True); False only where the dequantizing
    path names what is wrong with a tensor (a malformed MXFP4 block)."""
    prefix = getattr(layer, "prefix", "experts")
    _, hidden, inter = shapes["down_proj"]
    parts: dict[tuple[int, str], _Codes] = {}
    for (expert, shard), tensors in staged.items():
        what = f"{prefix}.{expert}.{shard}"
        part = _codes(packed, tensors, what)
        if part is None:
            return False
        part = _rank_part(layer, part, shard, what)
        want = (hidden, inter) if shard == "down" else (inter, hidden)
        if (part.codes.shape[0], part.group.numel()) != want:
            raise ValueError(f"{what} has shape {(part.codes.shape[0], part.group.numel())} "
                             f"in 4 bits (this rank's part); the model expects {want}")
        parts[expert, shard] = part
    device = layer.gate_up_proj.device
    stacked = []
    for name, shards in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
        rows = [[parts[e, s] for s in shards] for e in range(shapes[name][0])]
        weight = _stack(rows, device)
        if weight.shape != shapes[name]:
            raise ValueError(f"{name} of {prefix} has shape {weight.shape} in 4 bits; the "
                             f"model expects {shapes[name]}")
        stacked.append(weight)
    layer.w4_experts = tuple(stacked)
    return True


def _stack(rows: list[list[_Codes]], device: torch.device) -> Any:
    """Every expert's parts (gate and up, or down) -> one `W4Experts` on `device`."""
    from pagedserve.quantization.ops.w4_moe_kernels import W4Experts

    flat = [p for expert in rows for p in expert]
    sizes = {p.in_order_size() for p in flat}
    mxfp4 = flat[0].zeros is None
    if len(sizes) == 1 and None not in sizes:
        return W4Experts(*_fields(rows, device), sizes.pop())
    # A group map: every part's scales padded to the most groups (the map never names those).
    groups = max(p.scales.shape[1] for p in flat)
    rows = [[_Codes(p.codes, _pad(p.scales, groups), None if mxfp4 else _pad(p.zeros, groups),
                    p.group) for p in expert] for expert in rows]
    shared = all(torch.equal(expert[0].group, p.group) for expert in rows for p in expert)
    maps = torch.stack([torch.stack([p.group for p in (expert[:1] if shared else expert)])
                        for expert in rows]).to(torch.int32)
    codes, scales, zeros = _fields(rows, device)
    return W4Experts(codes, scales, zeros, 0, maps.to(device).contiguous())


def _fields(rows: list[list[_Codes]], device: torch.device) -> tuple:
    """(codes, scales, zeros or None) stacked [E, rows of the parts, ...] on `device`."""
    out = []
    for field in ("codes", "scales", "zeros"):
        if getattr(rows[0][0], field) is None:
            out.append(None)
            continue
        out.append(torch.stack([torch.cat([getattr(p, field) for p in expert])
                                for expert in rows]).to(device).contiguous())
    return tuple(out)


def _pad(t: torch.Tensor, groups: int) -> torch.Tensor:
    return F.pad(t, (0, groups - t.shape[1]))


def _codes(packed: Any, tensors: dict[str, torch.Tensor], what: str) -> _Codes | None:
    """One expert projection in the kernel's layout; None where the dequantizing path names
    what is wrong (MXFP4 blocks of another shape or type)."""
    if packed.name == "MXFP4":
        blocks, scales = tensors["blocks"], tensors["scales"]
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3
                or blocks.shape[2] != 16 or tuple(scales.shape) != tuple(blocks.shape[:2])):
            return None
        k = blocks.shape[1] * 32
        return _Codes(blocks.reshape(blocks.shape[0], -1), scales, None,
                      torch.arange(k) // 32)
    c = packed.unpack(tensors, what)
    if c.bits != 4:
        raise ValueError(f"{what} is {packed.name}: the MoE kernel reads 4-bit codes only "
                         "(PAGEDSERVE_W4A16_KERNEL=0 dequantizes the experts at load)")
    n, k = c.codes.shape
    if k % 2:
        raise ValueError(f"{what} has {k} inputs; the 4-bit MoE kernel packs two codes a "
                         "byte and needs an even number (PAGEDSERVE_W4A16_KERNEL=0 "
                         "dequantizes the experts at load)")
    codes = c.codes.to(torch.uint8)
    return _Codes(codes[:, 0::2] | (codes[:, 1::2] << 4), c.scales.float(),
                  c.zeros.to(torch.uint8), c.group.long())


def _rank_part(layer: nn.Module, part: _Codes, shard: str, what: str) -> _Codes:
    """This rank's rows (gate, up) or inputs (down) of one projection: the inputs keep their
    groups, and the scales the groups they name (a slice that splits a group reads it
    through the map)."""
    dim_start_len = layer.rank_slice("", shard)
    if dim_start_len is None:
        return part
    dim, start, length = dim_start_len
    if dim == 0:
        return _Codes(part.codes.narrow(0, start, length), part.scales.narrow(0, start, length),
                      None if part.zeros is None else part.zeros.narrow(0, start, length),
                      part.group)
    if start % 2 or length % 2:
        raise ValueError(f"{what}: this rank's inputs {start}..{start + length} split a byte "
                         "of two 4-bit codes (PAGEDSERVE_W4A16_KERNEL=0 dequantizes the "
                         "experts at load)")
    group = part.group.narrow(0, start, length)
    lo, hi = int(group.min()), int(group.max()) + 1
    return _Codes(part.codes.narrow(1, start // 2, length // 2), part.scales[:, lo:hi],
                  None if part.zeros is None else part.zeros[:, lo:hi], group - lo)
