"""Which packed linears keep their 4- or 8-bit codes for the W4A16 kernel (`ops/w4a16_gemm.py`,
which serves both widths), and their layout: each part of a fused layer (q, k, v; gate, up)
unpacked to `IntCodes`, cut to this rank's slice (rows of a column-parallel part; inputs of a
row-parallel one, with their group indices), and stacked along the outputs.

The kernel reads one group index per input for the whole layer. The parts of a fused layer
share their input, so GPTQ's act-order gives them the same order; parts whose indices differ
anyway (or a format that is not integer: MXFP4) stay dequantized, and the start-up log says
which layers did.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedserve.quantization.int_codes import IntCodes

logger = logging.getLogger(__name__)


def use_kernel(layer: nn.Linear, method: Any, staged: dict[str | None, dict],
               rows: dict[str | None, tuple[int, int] | None]) -> bool:
    """Lay the layer's staged parts out for the kernel (True), or leave them (False)."""
    from pagedserve.quantization.ops.w4a16_gemm import w4a16_layout

    parts = []
    for shard, tensors in staged.items():
        what = method.part_name(shard)
        codes = method.packed.unpack(tensors, what)
        if codes is None:
            return False
        codes = _rank_part(layer, codes, shard)
        start, size = rows[shard] or (0, layer.out_features)
        if tuple(codes.codes.shape) != (size, layer.in_features):
            raise ValueError(f"{what} has shape {tuple(codes.codes.shape)} after unpacking "
                             f"(this rank's part), the model expects "
                             f"{(size, layer.in_features)}")
        parts.append((start, codes))
    parts.sort(key=lambda p: p[0])
    group = parts[0][1].group
    if any(not torch.equal(c.group, group) or c.scales.shape[1] != parts[0][1].scales.shape[1]
           for _, c in parts):
        logger.info("%s: its parts' input groups differ (act-order per part); dequantized",
                    getattr(layer, "prefix", "a layer"))
        return False
    device = layer.weight.device
    try:
        weight = w4a16_layout(*(torch.cat([getattr(c, f) for _, c in parts]).to(device)
                                for f in ("codes", "zeros", "scales")), group.to(device),
                              parts[0][1].bits)  # one format, one width
    except ValueError as e:
        logger.info("%s: %s; dequantized", getattr(layer, "prefix", "a layer"), e)
        return False
    layer.w4a16 = weight
    # As buffers the codes count in the module's memory and move with it.
    for name, tensor in weight.tensors().items():
        layer.register_buffer(f"w4a16_{name}", tensor, persistent=False)
    del layer.weight
    layer.register_parameter("weight", None)
    return True


def _rank_part(layer: nn.Linear, codes: IntCodes, shard: str | None) -> IntCodes:
    """This rank's slice of a full weight's codes: output rows with their zeros and scales, or
    inputs with their group indices (every group's scales stay)."""
    part = layer.rank_slice("weight", shard)
    if part is None:
        return codes
    dim, start, length = part
    if dim == 0:
        return IntCodes(codes.codes.narrow(0, start, length),
                         codes.zeros.narrow(0, start, length),
                         codes.scales.narrow(0, start, length), codes.group, codes.bits)
    return IntCodes(codes.codes.narrow(1, start, length), codes.zeros, codes.scales,
                     codes.group.narrow(0, start, length), codes.bits)
