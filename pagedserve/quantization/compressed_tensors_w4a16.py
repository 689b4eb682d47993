"""compressed-tensors `pack-quantized` checkpoints, weight-only int4 or int8 (llm-compressor's
W4A16 and W8A16; the module keeps its 4-bit name and serves both): per linear `weight_packed`
int32 [out, ceil(in / p)] with p = 32 / num_bits codes a word along the input dim, low bits
first (code i: input p*c+i), each stored as signed value + 2^(num_bits - 1), `weight_shape`
[out, in], `weight_scale` [out, in / group_size] (strategy group) or [out, 1] (channel), and
when asymmetric `weight_zero_point`, packed (and offset) the same way along the output dim
([ceil(out / p), groups]; an unpacked signed [out, groups] is read too). Group act-order adds
`weight_g_idx` [in]. w = (q - zero) * scale. Dequantized at load (packed.py); other schemes
(other widths among them) are refused by name."""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.quantization import int_codes as fmt
from pagedserve.quantization.compressed_tensors_int import (
    CompressedTensorsIntConfig,
    brief,
    weight_scheme,
)
from pagedserve.quantization.packed import PackedFormat

FORMAT = "pack-quantized"
SUPPORTED = ("weights: 4- or 8-bit int, strategy group (group_size) or channel, symmetric or not, "
             "actorder none / group / weight; no input activations; targets: Linear")


class CompressedW4A16Format(PackedFormat):
    def __init__(self, group_size: int, symmetric: bool, g_idx: bool, bits: int = 4) -> None:
        self.group_size = group_size
        self.symmetric = symmetric
        self.g_idx = g_idx
        self.bits = bits
        group = "per channel" if group_size == -1 else f"group {group_size}"
        self.name = (f"compressed-tensors int{bits} {'symmetric' if symmetric else 'asymmetric'}, "
                     f"{group}" + (", act-order" if g_idx else ""))

    def checkpoint_tensors(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        names += () if self.symmetric else ("weight_zero_point",)
        return (*names, "weight_g_idx") if self.g_idx else names

    def optional_tensors(self) -> tuple[str, ...]:
        return ("weight_g_idx",)

    def unpack(self, tensors: dict[str, torch.Tensor], what: str) -> fmt.IntCodes:
        packed = tensors["weight_packed"]
        per_word = 32 // self.bits
        shape = tensors["weight_shape"].flatten().tolist()
        if len(shape) != 2 or packed.dim() != 2 or shape[0] != packed.shape[0] \
                or math.ceil(shape[1] / per_word) != packed.shape[1]:
            raise ValueError(f"{what}.weight_shape is {shape}, but {what}.weight_packed has "
                             f"shape {tuple(packed.shape)} ({per_word} inputs a word)")
        n, k = shape
        size, groups = fmt.groups_of(k, self.group_size, what)
        why = f"a [{n}, {k}] weight in groups of {size}"
        fmt.check_shape(tensors["weight_scale"], (n, groups), f"{what}.weight_scale", why)
        # Codes and zero points are stored as value + 2^(bits - 1): subtracting one from the
        # other cancels the offset, and a symmetric weight's zero point is the offset itself.
        codes = fmt.unpack_int32(packed, 1, f"{what}.weight_packed", self.bits)[:, :k]
        zeros = torch.full((n, groups), 1 << (self.bits - 1), dtype=torch.int32) \
            if self.symmetric else _zero_points(tensors["weight_zero_point"], n, groups,
                                                self.bits, f"{what}.weight_zero_point")
        group = fmt.group_index(tensors.get("weight_g_idx"), k, size, groups,
                                f"{what}.weight_g_idx")
        return fmt.IntCodes(codes, zeros, tensors["weight_scale"], group, self.bits)


def _zero_points(zp: torch.Tensor, n: int, groups: int, bits: int, what: str) -> torch.Tensor:
    """Zero points + 2^(bits - 1) [n, groups], from packed int32 words [ceil(n / p), groups]
    or signed as stored."""
    packed = (math.ceil(n / (32 // bits)), groups)
    if zp.dtype == torch.int32 and tuple(zp.shape) == packed:
        return fmt.unpack_int32(zp, 0, what, bits)[:n]
    fmt.check_shape(zp, (n, groups), what, f"{n} rows in {groups} groups (or packed: "
                    f"{packed} int32)")
    return zp.to(torch.int32) + (1 << (bits - 1))


class CompressedTensorsW4A16Config(CompressedTensorsIntConfig):
    format_type = CompressedW4A16Format

    @staticmethod
    def scheme(group: dict[str, Any], format_name: str | None) -> tuple[int, bool, bool, int]:
        """(group size or -1, symmetric, act-order g_idx, bits) of one config group."""
        targets = group.get("targets") or []
        weights = group.get("weights") or {}
        refuse = (f"compressed-tensors pack-quantized targets {targets}, weights "
                  f"{brief(weights)}, input_activations {group.get('input_activations')} are "
                  f"not supported (supported: {SUPPORTED})")
        if list(targets) != ["Linear"] or group.get("input_activations"):
            raise ValueError(refuse)
        size, symmetric, g_idx = weight_scheme(weights, ("group", "channel"), fmt.WIDTHS,
                                               refuse)
        return size, symmetric, g_idx, int(weights["num_bits"])
