"""FP8 experts (`FusedMoE`): each expert's gate, up and down arrive as FP8 with their own
scales (per tensor, per channel or in blocks) and are dequantized into the model's dtype after
loading, on every device: the grouped GEMM (`models/moe_kernels.py`) reads float weights today.
Reading FP8 there, with per-expert and block scales, is the next step; this keeps the
checkpoints loadable meanwhile."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedserve.quantization import fp8_format as fmt
from pagedserve.quantization.base import MoEMethod
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.unquantized import FP8_DTYPES, UNQUANTIZED_MOE, expert_destination

logger = logging.getLogger(__name__)


class Fp8MoEMethod(MoEMethod):
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.name = f"{scheme.describe()}, dequantized at load"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.model_dtype = dtype
        layer.fp8_scales = {}  # (expert, shard) -> this rank's scale
        if self.scheme.online:
            return
        for name in ("gate_up_proj", "down_proj"):
            meta = getattr(layer, name)
            setattr(layer, name, nn.Parameter(torch.empty(meta.shape, dtype=fmt.FP8,
                                                          device=meta.device),
                                              requires_grad=False))

    def checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        return ("weight", *self.scheme.checkpoint_scales())

    def load_expert(self, layer: nn.Module, expert: int, shard: str, name: str,
                    tensor: Any) -> None:
        what = f"expert {expert}'s {shard} {name}"
        if self.scheme.online:
            UNQUANTIZED_MOE.load_expert(layer, expert, shard, name, tensor)
            return
        param = layer.down_proj if shard == "down" else layer.gate_up_proj
        dst = expert_destination(layer, param, expert, shard)
        if name == "weight":
            part = layer.rank_part(tensor, "", shard)
            if part.dtype not in FP8_DTYPES:
                raise ValueError(f"{what} is {part.dtype}, but the quantization config says "
                                 f"{self.scheme.describe()}: a mislabeled checkpoint?")
            if dst.shape != part.shape:
                raise ValueError(f"{what} has shape {tuple(part.shape)}, the model expects "
                                 f"{tuple(dst.shape)}")
            dst.copy_(part)
            return
        if name == "input_scale":
            return  # the experts run dequantized: activations are not quantized
        if name != self.scheme.scale_name:
            raise ValueError(f"{what} is not part of {self.scheme.describe()} (expected "
                             f"{', '.join(self.checkpoint_tensors(layer))})")
        scale = fmt.scale_rank_part(self.scheme, tensor, layer.rank_slice("", shard), what)
        layer.fp8_scales[expert, shard] = fmt.check_scale(self.scheme, scale, *dst.shape, what)

    def process_after_loading(self, layer: nn.Module) -> None:
        scales = layer.fp8_scales
        del layer.fp8_scales
        for name in ("gate_up_proj", "down_proj"):
            codes = getattr(layer, name).data
            if self.scheme.online:  # quantize-dequantize: the rounding FP8 weights have
                out = torch.stack([_online(w) for w in codes.unbind(0)])
            else:
                out = torch.empty(codes.shape, dtype=layer.model_dtype, device=codes.device)
                for (expert, shard), scale in scales.items():
                    if (shard == "down") != (name == "down_proj"):
                        continue
                    src = expert_destination(layer, codes, expert, shard)
                    expert_destination(layer, out, expert, shard).copy_(
                        fmt.dequantize(src, scale.to(codes.device), self.scheme))
            setattr(layer, name, nn.Parameter(out.to(layer.model_dtype), requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        return UNQUANTIZED_MOE.apply(layer, x, weights, ids)


def _online(weight: torch.Tensor) -> torch.Tensor:
    codes, scale = fmt.quantize_per_channel(weight)
    return fmt.dequantize(codes, scale, Fp8Scheme("channel"))
