"""Which packed experts keep their 4-bit codes for the grouped expert GEMMs
(`ops/w4_moe_kernels.py`), and their layout: each expert's gate, up and down as codes two a
byte along the inputs, with their scales (and zero points), cut to this rank's slice and
stacked [E, rows, ...] (gate rows, then up rows).

MXFP4's blocks are that layout already (bytes, low nibble first; one e8m0 scale per 32
inputs). An integer format is unpacked (`Int4Codes`) and repacked; its groups must run along
the inputs in order (act-order experts stay dequantized, as do projections whose group sizes
differ, and a row-parallel slice that splits a group), and the start-up log says which layers
did.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


def use_moe_kernel(layer: nn.Module, packed: Any, staged: dict[tuple[int, str], dict],
                   shapes: dict[str, tuple[int, ...]]) -> bool:
    """Lay the staged experts out for the kernel (True) or leave them (False)."""
    from pagedserve.quantization.ops.w4_moe_kernels import W4Experts

    parts: dict[tuple[int, str], tuple] = {}
    for (expert, shard), tensors in staged.items():
        what = f"{getattr(layer, 'prefix', 'experts')}.{expert}.{shard}"
        part = _codes(packed, tensors, what)
        part = part and _rank_part(layer, part, shard)
        if part is None:
            logger.info("%s: experts dequantized (act-order, or groups the layout cannot "
                        "take)", getattr(layer, "prefix", "a MoE layer"))
            return False
        parts[expert, shard] = part
    device = layer.gate_up_proj.device
    stacked = []
    for name, shards in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
        rows = [[parts[e, s] for s in shards] for e in range(shapes[name][0])]
        groups = {p[3] for expert in rows for p in expert}
        if len(groups) != 1:
            return False
        fields = [torch.stack([torch.cat([p[i] for p in expert]) for expert in rows])
                  .to(device) if rows[0][0][i] is not None else None for i in range(3)]
        weight = W4Experts(fields[0].contiguous(), fields[1].contiguous(),
                           None if fields[2] is None else fields[2].contiguous(), groups.pop())
        if weight.shape != shapes[name]:
            raise ValueError(f"{name} of {getattr(layer, 'prefix', 'experts')} has shape "
                             f"{weight.shape} in 4 bits; the model expects {shapes[name]}")
        stacked.append(weight)
    layer.w4_experts = tuple(stacked)
    return True


def _codes(packed: Any, tensors: dict[str, torch.Tensor], what: str) -> tuple | None:
    """(codes uint8 [N, K/2], scales [N, G], zeros uint8 [N, G] or None, group size) of one
    expert projection; None if the layout cannot take it."""
    if packed.name == "MXFP4":
        blocks, scales = tensors["blocks"], tensors["scales"]
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 3
                or blocks.shape[2] != 16 or tuple(scales.shape) != tuple(blocks.shape[:2])):
            return None  # the dequantizing path names what is wrong
        return blocks.reshape(blocks.shape[0], -1), scales, None, 32
    c = packed.unpack(tensors, what)
    if c is None:
        return None
    n, k = c.codes.shape
    size = k // c.scales.shape[1]
    if k % 2 or k % size or not torch.equal(c.group.long(), torch.arange(k) // size):
        return None
    codes = c.codes.to(torch.uint8)
    return ((codes[:, 0::2] | (codes[:, 1::2] << 4)), c.scales.float(),
            c.zeros.to(torch.uint8), size)


def _rank_part(layer: nn.Module, part: tuple, shard: str) -> tuple | None:
    """This rank's rows (gate, up) or inputs (down) of one projection's codes; None where an
    input slice would split a group."""
    dim_start_len = layer.rank_slice("", shard)
    if dim_start_len is None:
        return part
    codes, scales, zeros, group = part
    dim, start, length = dim_start_len
    if dim == 0:
        return (codes.narrow(0, start, length), scales.narrow(0, start, length),
                None if zeros is None else zeros.narrow(0, start, length), group)
    if start % group or length % group:
        return None
    g0, gn = start // group, length // group
    return (codes.narrow(1, start // 2, length // 2), scales.narrow(1, g0, gn),
            None if zeros is None else zeros.narrow(1, g0, gn), group)
