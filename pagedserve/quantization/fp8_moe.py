"""FP8 experts (`FusedMoE`): each expert's gate, up and down arrive as FP8 with their own
scales (per tensor, per channel or in blocks). Where the kernels run (CUDA), block-scaled
experts with SiLU and dynamic activations keep their codes and run the FP8 grouped GEMM
(`ops/fp8_moe_kernels.py`, the scales stacked per expert: gate's block rows, then up's);
everything else (the CPU, per-tensor or per-channel experts) is dequantized into the model's
dtype after loading and runs the float experts."""

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
        if self._runs_fp8(layer):
            _stack_block_scales(layer, scales, self.scheme.block)
            layer.fp8_kernel = "triton_block_moe"
            return
        layer.fp8_kernel = "dequantized"
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

    def _runs_fp8(self, layer: nn.Module) -> bool:
        from pagedserve.quantization.fp8_linear import kernel_takes, kernels_on

        s = self.scheme
        return (not s.online and s.weight == "block" and kernel_takes(s)
                and kernels_on(layer.gate_up_proj.device) and layer.activation.kind == "silu"
                and layer.gate_up_proj_bias is None)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        if layer.fp8_kernel == "dequantized":
            return UNQUANTIZED_MOE.apply(layer, x, weights, ids)
        from pagedserve.quantization.ops.fp8_moe_kernels import fp8_fused_experts

        return fp8_fused_experts(x, layer.gate_up_proj, layer.gate_up_scale, layer.down_proj,
                                 layer.down_scale, weights, ids, self.scheme.block)


def _stack_block_scales(layer: nn.Module, scales: dict, block: tuple[int, int]) -> None:
    """Per expert: [gate's block rows; up's] and down's, as the FP8 grouped GEMM reads them."""
    device = layer.gate_up_proj.device
    layer.gate_up_scale = torch.stack([
        torch.cat([scales[e, "gate"], scales[e, "up"]]) for e in range(layer.num_experts)
    ]).to(device).contiguous()
    layer.down_scale = torch.stack([scales[e, "down"] for e in range(layer.num_experts)]
                                   ).to(device).contiguous()


def _online(weight: torch.Tensor) -> torch.Tensor:
    codes, scale = fmt.quantize_per_channel(weight)
    return fmt.dequantize(codes, scale, Fp8Scheme("channel"))
