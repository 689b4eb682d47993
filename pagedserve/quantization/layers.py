"""Giving a model's layers their quantization methods, and finishing them after loading.

`attach_methods` runs while the model is on the meta device (after its cast to the model
dtype, so FP8 parameters keep their dtype): each linear and each `FusedMoE` asks the config for
its method, which creates the layer's parameters. A plain `nn.Linear` a family built is first
swapped for a `ReplicatedLinear` (same shape) so that its forward is its method's. After the
model's `load_weights`, `process_after_loading` runs every method's hook once and logs which
method (and kernel) each group of layers got.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

import torch
from torch import nn

from pagedserve.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

_LAYER_NUMBER = re.compile(r"\.\d+\.")


def attach_methods(model: nn.Module, config: QuantizationConfig | None,
                   dtype: torch.dtype) -> None:
    """Each layer's method from `config` (None: the float weights the layers start with)."""
    from pagedserve.models.moe import FusedMoE
    from pagedserve.models.parallel import LinearBase

    if config is None:
        return

    config.check_model(model)
    _swap_plain_linears(model)
    for prefix, layer in list(model.named_modules()):
        if not isinstance(layer, LinearBase | FusedMoE):
            continue
        hf_names = model.hf_names(prefix) if hasattr(model, "hf_names") else [prefix]
        method = config.get_method(layer, prefix, hf_names)
        if method is None:
            continue
        layer.prefix = prefix
        method.create_weights(layer, dtype)
        layer.quant_method = method


def _swap_plain_linears(module: nn.Module) -> None:
    from pagedserve.models.parallel import ReplicatedLinear

    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            swapped = ReplicatedLinear(child.in_features, child.out_features,
                                       bias=child.bias is not None,
                                       device=child.weight.device, dtype=child.weight.dtype)
            setattr(module, name, swapped)
        else:
            _swap_plain_linears(child)


def process_after_loading(model: nn.Module, config: QuantizationConfig | None) -> None:
    """Every method's `process_after_loading`, then one log line per method and kernel."""
    if config is None:
        return
    groups: dict[str, list[str]] = defaultdict(list)
    for prefix, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if method is None or "quant_method" not in vars(layer):
            continue  # the class default: float weights, nothing to finish
        method.process_after_loading(layer)
        kernel = getattr(layer, "fp8_kernel", None)
        label = method.name + (f" -> {kernel}" if kernel else "")
        groups[label].append(_LAYER_NUMBER.sub(".*.", prefix))
    for label, prefixes in groups.items():
        names = sorted(set(prefixes))
        logger.info("%s: %d layers (%s%s)", label, len(prefixes), ", ".join(names[:6]),
                    ", ..." if len(names) > 6 else "")
    _quantize_tied_head(model, config)
    fused = sum(m.fuse_fp8_inputs() for m in model.modules() if hasattr(m, "fuse_fp8_inputs"))
    if fused:
        logger.info("FP8 inputs: %d norms and SiLU-and-muls emit FP8 for the projection after",
                    fused)


def _quantize_tied_head(model: nn.Module, config: QuantizationConfig) -> None:
    """The CPU int8 path gives a tied head int8 codes of the embedding, beside the embedding
    itself (the head reads every row each token)."""
    if getattr(config, "quantizes_tied_head", False) and getattr(model, "lm_head", 0) is None:
        from pagedserve.quantization.int8_cpu import int8_linear

        model.lm_head = int8_linear(model.model.embed_tokens.weight)
