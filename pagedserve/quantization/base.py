"""What a quantization scheme is to the engine: a config that hands each layer a method, and the
methods that create, load, post-process and apply that layer's weights.

A `QuantizationConfig` comes from config.json's `quantization_config` or from
`--quantization`. `attach_methods` (layers.py) asks it for each linear's `LinearMethod` and each
`FusedMoE`'s `MoEMethod` while the model is still on the meta device; the model's loader hands
every checkpoint tensor of a layer to its method's `load`, and `process_after_loading` runs once
when all are in. A layer's forward is its method's `apply`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import nn


class LinearMethod:
    """How one linear layer holds and multiplies its weights."""

    # Logged at start-up beside the layers that use it.
    name: ClassVar[str] = "?"
    # Whether `load` takes a GGUF file's weight undecoded (`gguf_blocks.GGUFWeight`); any
    # other method gets it dequantized to float32 first.
    takes_gguf_blocks: ClassVar[bool] = False

    def create_weights(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        """Replace the layer's parameters with the ones this method loads (on the meta device:
        the model is materialised afterwards)."""

    def checkpoint_tensors(self, layer: nn.Linear) -> tuple[str, ...]:
        """The tensors a complete checkpoint gives per part of this layer (weight, bias,
        weight_scale, ...), as the checkpoint names them."""
        return ("weight", "bias") if layer.bias is not None else ("weight",)

    def load(self, layer: nn.Linear, name: str, tensor: Any, shard: str | None,
             rows: tuple[int, int] | None) -> None:
        """Checkpoint tensor `name` (weight, bias, a scale) of the full layer, or of its fused
        part `shard`, into this rank's parameters; `rows` (start, size): where that part's
        output rows sit in this rank's layer, None for an unfused layer."""
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Linear) -> None:
        """Once every tensor is in: fuse the parts' scales, cast, lay out for the kernel."""

    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        """x [..., in] -> [..., out], plus `bias` when given."""
        raise NotImplementedError

    def input_group(self, layer: nn.Linear) -> int | None:
        """The activation group (in_features: one per token) in which this layer can take its
        input already quantized to FP8 (`ops/fp8_fused.Fp8Activation`) from the kernel that
        produces it; None: it takes the model's dtype."""
        return None

    def quantizes_activations(self, layer: nn.Linear) -> bool:
        """Whether this layer rounds its input to a coarse format each step (FP8, int8): a
        rounding-sized difference upstream then flips codes, so the same rows at two batch
        sizes may differ by more than rounding (the CUDA graph check only logs it)."""
        return False


class MoEMethod:
    """How a `FusedMoE` holds its stacked expert weights and runs them."""

    name: ClassVar[str] = "?"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """As `LinearMethod.create_weights`, for gate_up_proj [E, 2I, H] and down_proj
        [E, H, I]."""

    def checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        """The tensors a complete checkpoint gives per expert and projection."""
        return ("weight",)

    def load_expert(self, layer: nn.Module, expert: int, shard: str, name: str,
                    tensor: Any) -> None:
        """One expert's checkpoint tensor `name` of projection `shard` (gate, up, down)."""
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Module) -> None:
        """Once every expert is in."""

    def apply(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and ids [T, k] -> [T, H] (before any all-reduce)."""
        raise NotImplementedError


class QuantizationConfig:
    """A scheme read from a checkpoint's `quantization_config` or chosen by flag."""

    # The `quant_method` (or flag) it answers to.
    name: ClassVar[str] = "?"

    def __init__(self, ignored: list[str] | None = None) -> None:
        # Hugging Face module names (or "re:<regex>") that stay unquantized.
        self.ignored = list(ignored or [])

    @classmethod
    def from_config(cls, data: dict[str, Any]) -> QuantizationConfig:
        """From a checkpoint's `quantization_config` dict; refuses what it does not implement."""
        raise NotImplementedError

    def get_method(self, layer: nn.Module, prefix: str, hf_names: list[str]
                   ) -> LinearMethod | MoEMethod | None:
        """The method for the layer at `prefix` (our module name), whose checkpoint names are
        `hf_names` (the parts of a fused layer); None leaves the layer as it is."""
        raise NotImplementedError

    def check_model(self, model: nn.Module) -> None:
        """Refuse, by name, a model family this scheme does not run."""

    def is_ignored(self, hf_names: list[str]) -> bool:
        """Whether the layer (all its fused parts, which must agree) stays unquantized."""
        flags = {any(_matches(pattern, name) for pattern in self.ignored) for name in hf_names}
        if len(flags) > 1:
            raise ValueError(f"the fused parts {hf_names} are partly ignored by the "
                             "quantization config; a fused layer is quantized whole or not")
        return flags == {True}


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors' `re:<regex>` matches the whole module name; a dotted entry is a
    module name or the prefix of one ("model.layers.0.mlp" covers its projections); a bare
    word ("lm_head", "gate") is any module of that name, as transformers reads
    `modules_to_not_convert`."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if "." not in pattern:
        return pattern in name.split(".")
    return name == pattern or name.startswith(pattern + ".")
