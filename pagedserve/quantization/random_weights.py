"""Random weights made straight into a quantized model (`random:<preset>` with
`--quantization fp8`): each tensor is drawn as the float model draws it (same generator, same
order, same dtype, so the values equal the bf16 model's) and quantized as it is made, one
tensor at a time. A 70B shape then never holds its bf16 weights (140 GB) on the device, only
its FP8 codes (70 GB) and one float tensor in flight.

Linears get one scale per output row (as `--quantization fp8` of a checkpoint: the
`torch._scaled_mm` kernel); experts get 128 x 128 blocks (as the Qwen3-MoE and DeepSeek FP8
releases: the FP8 grouped GEMM)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.quantization import fp8_format as fmt
from pagedserve.quantization.fp8 import Fp8Config
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.fp8_moe import Fp8MoEMethod
from pagedserve.quantization.layers import attach_methods, process_after_loading

EXPERT_BLOCKS = Fp8Scheme("block", "dynamic", (128, 128), "weight_scale_inv")


class RandomFp8Config(Fp8Config):
    """Per-row FP8 linears, block-FP8 experts."""

    def __init__(self) -> None:
        super().__init__(Fp8Scheme("channel", "dynamic"))

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]) -> Any:
        method = super().get_method(layer, prefix, hf_names)
        return Fp8MoEMethod(EXPERT_BLOCKS) if isinstance(method, Fp8MoEMethod) else method


@torch.no_grad()
def random_fp8_model(module: nn.Module, dtype: torch.dtype, device: torch.device, seed: int,
                     std: float) -> nn.Module:
    """`module` (on the meta device, already in `dtype`) with FP8 projections, materialised on
    `device` and filled as `random_models.init_random_weights` fills the float model."""
    config = RandomFp8Config()
    attach_methods(module, config, dtype)
    module = module.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed)
    owners = dict(module.named_modules())
    for name, param in list(module.named_parameters()):
        if name.endswith(".bias"):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
        elif param.dtype == fmt.FP8:
            weight = torch.empty(param.shape, dtype=dtype, device=device)
            weight.normal_(0.0, std, generator=generator)
            owner, _, leaf = name.rpartition(".")
            _quantize_into(owners[owner], leaf, param, weight)
            del weight
        else:
            param.normal_(0.0, std, generator=generator)
    process_after_loading(module, config)
    return module


def _quantize_into(layer: nn.Module, leaf: str, param: torch.Tensor,
                   weight: torch.Tensor) -> None:
    """FP8 codes of `weight` into `param`, its scales staged as the loader stages a
    checkpoint's."""
    if weight.dim() == 2:  # a linear: one part, one scale per row
        codes, scale = fmt.quantize_per_channel(weight)
        param.copy_(codes)
        layer.fp8_parts[(0, layer.out_features)] = {"weight_scale": scale}
        return
    shards = ("gate", "up") if leaf == "gate_up_proj" else ("down",)
    for expert in range(weight.shape[0]):
        for i, shard in enumerate(shards):
            rows = weight.shape[1] // len(shards)
            codes, scale = fmt.quantize_blocks(weight[expert, i * rows:(i + 1) * rows],
                                               EXPERT_BLOCKS.block)
            param[expert, i * rows:(i + 1) * rows] = codes
            layer.fp8_scales[expert, shard] = scale
