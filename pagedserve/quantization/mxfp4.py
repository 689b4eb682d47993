"""MXFP4 experts (`quant_method: mxfp4`, gpt-oss as OpenAI publishes it): each expert
projection as `*_blocks` uint8 [.., rows, in / 32, 16], two e2m1 codes a byte (low nibble
first), and `*_scales` uint8 [.., rows, in / 32], an e8m0 exponent (bias 127) per 32 inputs:
w = e2m1(code) * 2^(scale - 127). Only the experts are MXFP4; attention, router, embeddings
and head are float in the checkpoint and stay so.

gpt-oss stores all experts of a layer stacked, gate and up rows interleaved
(`models/gpt_oss.py` splits them into per-expert gate, up and down tensors named `blocks` and
`scales`); the experts are dequantized at load into the model's dtype (packed.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.quantization import int_codes as fmt
from pagedserve.quantization.base import QuantizationConfig
from pagedserve.quantization.packed import PackedFormat, PackedMoEMethod, check_family

BLOCK = 32  # inputs per scale
# e2m1 codes 0..15: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
E8M0_BIAS = 127


class Mxfp4Format(PackedFormat):
    name = "MXFP4"

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return ("blocks", "scales")

    def dequantize(self, tensors: dict[str, torch.Tensor], what: str) -> torch.Tensor:
        return dequantize_mxfp4(tensors["blocks"], tensors["scales"], what)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> torch.Tensor:
    """blocks uint8 [rows, G, 16], scales uint8 [rows, G] -> float32 [rows, 32 G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what} blocks / scales are {blocks.dtype} / {scales.dtype}; MXFP4 "
                         "stores both as uint8")
    if blocks.dim() != 3 or blocks.shape[2] != BLOCK // 2:
        raise ValueError(f"{what}.blocks has shape {tuple(blocks.shape)}; MXFP4 blocks are "
                         f"[rows, groups, {BLOCK // 2}] bytes")
    fmt.check_shape(scales, tuple(blocks.shape[:2]), f"{what}.scales",
                    f"blocks of shape {tuple(blocks.shape)}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # lo first
    values = E2M1[codes]  # [rows, G, 32]
    exponent = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponent[..., None].float()).flatten(1)


class Mxfp4Config(QuantizationConfig):
    name = "mxfp4"

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> Mxfp4Config:
        return cls(list(data.get("modules_to_not_convert") or []))

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]) -> Any:
        from pagedserve.models.moe import FusedMoE

        # gpt-oss's checkpoints hold only the experts in MXFP4.
        if isinstance(layer, FusedMoE):
            return PackedMoEMethod(Mxfp4Format())
        return None

    def check_model(self, model: nn.Module) -> None:
        check_family(model, "MXFP4")
        if not getattr(model, "reads_mxfp4_experts", False):
            raise ValueError(f"MXFP4 experts are read for gpt-oss only, not "
                             f"{type(model).__name__}")
