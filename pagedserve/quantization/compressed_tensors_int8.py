"""compressed-tensors `int-quantized` (and `naive-quantized` with int weights) checkpoints,
weight-only int8 (llm-compressor's W8A16 without packing): per linear `weight` int8 [out, in],
the signed code itself; `weight_scale` [out, in / group_size] (strategy group), [out, 1]
(channel) or one value (tensor); when asymmetric `weight_zero_point`, signed, shaped as the
scale (older releases save a symmetric weight's too, all zero); group act-order adds
`weight_g_idx` [in]. w = (q - zero) * scale.

The codes become the 8-bit `IntCodes` the pack-quantized reader makes (code = q + 128, zero =
zero point + 128, or 128 when symmetric), so they are dequantized at load, or kept for the
W8A16 kernel, exactly as 8-bit pack-quantized weights are. Activation quantization (W8A8 int8)
and other widths are refused by name."""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.quantization import int_codes as fmt
from pagedserve.quantization.compressed_tensors_int import (
    CompressedTensorsIntConfig,
    brief,
    weight_scheme,
)
from pagedserve.quantization.packed import PackedFormat

FORMATS = ("int-quantized", "naive-quantized")
BITS = 8
OFFSET = 1 << (BITS - 1)  # signed int8 -> unsigned code
SUPPORTED = ("weights: 8-bit int, strategy tensor, channel or group (group_size), symmetric or "
             "not, actorder none / group / weight; no input activations; targets: Linear")


class CompressedInt8Format(PackedFormat):
    bits = BITS

    def __init__(self, group_size: int | None, symmetric: bool, g_idx: bool) -> None:
        """group_size: -1 per channel, None per tensor (one scale)."""
        self.group_size = group_size
        self.symmetric = symmetric
        self.g_idx = g_idx
        group = {None: "per tensor", -1: "per channel"}.get(group_size, f"group {group_size}")
        self.name = (f"compressed-tensors int8 {'symmetric' if symmetric else 'asymmetric'}, "
                     f"{group}" + (", act-order" if g_idx else ""))

    def checkpoint_tensors(self) -> tuple[str, ...]:
        names = ("weight", "weight_scale") + (() if self.symmetric else ("weight_zero_point",))
        return (*names, "weight_g_idx") if self.g_idx else names

    def optional_tensors(self) -> tuple[str, ...]:
        # Older compressed-tensors releases saved a symmetric weight's zero points (zeros).
        return ("weight_g_idx", "weight_zero_point") if self.symmetric else ("weight_g_idx",)

    def unpack(self, tensors: dict[str, torch.Tensor], what: str) -> fmt.IntCodes:
        weight = tensors["weight"]
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"{what}.weight is {weight.dtype} {tuple(weight.shape)}; "
                             f"{self.name} weights are int8 [out, in]")
        n, k = weight.shape
        scale = tensors["weight_scale"]
        if self.group_size is None:  # one scale: one group of k inputs per row
            scale = _one_value(scale, f"{what}.weight_scale").expand(n, 1)
            size, groups = k, 1
        else:
            size, groups = fmt.groups_of(k, self.group_size, what)
            fmt.check_shape(scale, (n, groups), f"{what}.weight_scale",
                            f"a [{n}, {k}] weight in groups of {size}")
        codes = weight.to(torch.int32) + OFFSET
        zeros = torch.full((n, groups), OFFSET, dtype=torch.int32)
        if "weight_zero_point" in tensors:
            zp_name = f"{what}.weight_zero_point"
            given = _zero_points(tensors["weight_zero_point"], tuple(scale.shape),
                                 self.group_size is None, zp_name)
            if self.symmetric and not bool((given == OFFSET).all()):
                raise ValueError(f"{zp_name} is not all zero, but the config says the weights "
                                 "are symmetric")
            zeros = given
        group = fmt.group_index(tensors.get("weight_g_idx"), k, size, groups,
                                f"{what}.weight_g_idx")
        return fmt.IntCodes(codes, zeros.expand(n, groups).contiguous(), scale.contiguous(),
                             group, BITS)


def _one_value(t: torch.Tensor, what: str) -> torch.Tensor:
    """A per-tensor value ([], [1] or [1, 1]) as [1, 1]."""
    if t.numel() != 1:
        raise ValueError(f"{what} has shape {tuple(t.shape)}; a per-tensor weight needs one "
                         "value")
    return t.reshape(1, 1)


def _zero_points(zp: torch.Tensor, want: tuple[int, int], per_tensor: bool,
                 what: str) -> torch.Tensor:
    """Signed zero points, shaped as the scale, + 128 as int32."""
    if zp.dtype.is_floating_point or zp.dtype == torch.bool:
        raise ValueError(f"{what} is {zp.dtype}; int8 zero points are integers")
    if per_tensor:
        zp = _one_value(zp, what)
    else:
        fmt.check_shape(zp, want, what, "the scale's shape")
    zp = zp.to(torch.int32)
    if zp.numel() and (int(zp.min()) < -OFFSET or int(zp.max()) >= OFFSET):
        raise ValueError(f"{what} holds {int(zp.min())}..{int(zp.max())}; int8 zero points "
                         f"are {-OFFSET}..{OFFSET - 1}")
    return zp + OFFSET


def is_int(data: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config's weights are integers (a `naive-quantized`
    checkpoint may hold int8 or FP8)."""
    groups = (data.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("type") == "int" for g in groups)


class CompressedTensorsInt8Config(CompressedTensorsIntConfig):
    format_type = CompressedInt8Format

    @staticmethod
    def scheme(group: dict[str, Any], format_name: str | None) -> tuple[int | None, bool, bool]:
        """(group size: -1 per channel, None per tensor; symmetric; act-order g_idx) of one
        config group."""
        targets = group.get("targets") or []
        weights = group.get("weights") or {}
        acts = group.get("input_activations")
        if acts:
            kind = {k: acts.get(k) for k in ("num_bits", "type", "strategy", "dynamic")}
            raise ValueError(f"compressed-tensors {format_name} with input_activations {kind} "
                             "(int8 activation quantization, W8A8) is not supported: only "
                             f"weight-only int8 is (supported: {SUPPORTED})")
        refuse = (f"compressed-tensors {format_name} targets {targets}, weights "
                  f"{brief(weights)} are not supported (supported: {SUPPORTED})")
        if list(targets) != ["Linear"]:
            raise ValueError(refuse)
        return weight_scheme(weights, ("tensor", "group", "channel"), (BITS,), refuse)
