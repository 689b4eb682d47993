"""Float weights as the checkpoint gives them: the method every layer has unless a quantization
config chooses another."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quantization.base import LinearMethod, MoEMethod


def load_float(layer: nn.Linear, name: str, tensor: Any, shard: str | None,
               rows: tuple[int, int] | None) -> None:
    """This rank's part of a float checkpoint tensor (`layer.rank_part`) into parameter `name`,
    at `rows` for a fused part; shapes must agree."""
    part = layer.rank_part(tensor, name, shard)
    if part.dtype in FP8_DTYPES:
        raise ValueError(f"{name} of a layer with float weights is {part.dtype}: an FP8 "
                         "checkpoint needs its quantization_config (or the layer is listed as "
                         "ignored but stored in FP8)")
    param = getattr(layer, name, None)
    if not isinstance(param, torch.Tensor):
        what = f"{getattr(layer, 'prefix', type(layer).__name__)}.{name}"
        hint = (": a quantization scale, but the model's config.json has no quantization_config "
                "for this layer" if "scale" in name else "")
        raise ValueError(f"checkpoint tensor {what!r} has no parameter{hint}")
    dst = param.data if rows is None else param.data.narrow(0, *rows)
    if dst.shape != part.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(part.shape)}, the model "
                         f"expects {tuple(dst.shape)}")
    dst.copy_(part)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


class UnquantizedLinearMethod(LinearMethod):
    """y = x W^T + b in the model's dtype."""

    name = "unquantized"

    def load(self, layer: nn.Linear, name: str, tensor: Any, shard: str | None,
             rows: tuple[int, int] | None) -> None:
        load_float(layer, name, tensor, shard, rows)

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


def expert_destination(layer: nn.Module, param: torch.Tensor, expert: int, shard: str
                       ) -> torch.Tensor:
    """Where one expert's gate, up or down rows go in a stacked [E, 2I, H] / [E, H, I]
    parameter (a view to copy into)."""
    if shard == "down":
        return param.data[expert]
    n = param.shape[1] // 2
    return param.data[expert].narrow(0, 0 if shard == "gate" else n, n)


class UnquantizedMoEMethod(MoEMethod):
    """Float expert weights; the Triton grouped GEMM on CUDA, `torch_experts` elsewhere."""

    name = "unquantized"

    def load_expert(self, layer: nn.Module, expert: int, shard: str, name: str,
                    tensor: Any) -> None:
        if name != "weight":
            raise ValueError(f"expert {expert}'s {shard} {name!r}: a float MoE layer loads "
                             "weights only; the model's config.json has no "
                             "quantization_config for it")
        part = layer.rank_part(tensor, "", shard)
        if part.dtype in FP8_DTYPES:
            raise ValueError(f"expert {expert}'s {shard} weight is {part.dtype}: an FP8 "
                             "checkpoint needs its quantization_config")
        param = layer.down_proj if shard == "down" else layer.gate_up_proj
        dst = expert_destination(layer, param, expert, shard)
        if dst.shape != part.shape:
            raise ValueError(f"expert {expert}'s {shard} weight has shape {tuple(part.shape)}, "
                             f"the model expects {tuple(dst.shape)}")
        dst.copy_(part)

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        return layer.run_experts(x, weights, ids)


UNQUANTIZED_MOE = UnquantizedMoEMethod()
