"""Random weights made straight into a quantized model (`random:<preset>` with
`--quantization fp8`): each tensor is drawn as the float model draws it (same generator, same
order, same dtype, so the values equal the bf16 model's) and quantized as it is made, one
tensor at a time. A 70B shape then never holds its bf16 weights (140 GB) on the device, only
its FP8 codes (70 GB) and one float tensor in flight."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.quantization import fp8_format as fmt
from pagedserve.quantization.fp8 import Fp8Config, Fp8LinearMethod
from pagedserve.quantization.fp8_format import Fp8Scheme
from pagedserve.quantization.layers import attach_methods, process_after_loading

# What the random model's layers hold: FP8 codes with one scale per output row, made here
# (not at load: `online` would allocate the float weights first).
RANDOM_FP8 = Fp8Config(Fp8Scheme("channel", "dynamic"))


@torch.no_grad()
def random_fp8_model(module: nn.Module, dtype: torch.dtype, device: torch.device, seed: int,
                     std: float) -> nn.Module:
    """`module` (on the meta device, already in `dtype`) with FP8 projections, materialised on
    `device` and filled as `loader.init_random_weights` fills the float model."""
    attach_methods(module, RANDOM_FP8, dtype)
    module = module.to_empty(device=device)
    params = list(module.named_parameters())
    generator = torch.Generator(device).manual_seed(seed)
    owners = dict(module.named_modules())
    for name, param in params:
        if name.endswith(".bias"):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
        elif param.dtype == fmt.FP8:
            weight = torch.empty(param.shape, dtype=dtype, device=device)
            weight.normal_(0.0, std, generator=generator)
            layer = owners[name.rpartition(".")[0]]
            assert isinstance(layer.quant_method, Fp8LinearMethod)
            codes, scale = fmt.quantize_per_channel(weight)
            param.copy_(codes)
            layer.fp8_parts[(0, layer.out_features)] = {"weight_scale": scale}
            del weight
        else:
            param.normal_(0.0, std, generator=generator)
    process_after_loading(module, RANDOM_FP8)
    return module
