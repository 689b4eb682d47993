"""The LoRA wrapper around a linear layer, and which of a model's layers it wraps.

Every adapter slot's factors for a layer are stacked into two fixed tensors: A [slots + 1,
W, in] and B [slots + 1, W, out] (W = parts * R, R = --max-lora-rank; a fused layer's parts
q/k/v or gate/up side by side, each part's B columns only at its slice of the output, so one
product serves the whole fused layer). The last slot stays zero: the base model.

The forward reads one slot index per token from the shared `LoRABatch` and computes, for all
tokens at once, x A_all^T over every slot (the shrink is cheap: (slots + 1) * W columns),
zeroes each token's columns of the other slots, and multiplies by B_all: two dense matmuls, no
loop over tokens or adapters, no per-token copy of A or B, and no shape that depends on which
adapters a step uses, so a CUDA graph could capture it with the indices as an input. (A
gather of each token's A and B would copy T * W * (in + out) values: 0.8 GB for a 2k-token
8B-shaped prefill.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.parallel import (
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
)


class LoRABatch:
    """The step's slot index per token (`num_slots` = the base model), set by the runner."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device) -> None:
        self.base_slot = num_slots
        self.token_slots = torch.full((max_tokens,), num_slots, dtype=torch.long, device=device)
        self.active = False  # any token with an adapter: else the wrappers skip the products

    def set(self, slots: torch.Tensor) -> None:
        if slots.numel() > self.token_slots.numel():
            self.token_slots = torch.empty_like(slots)  # grows for an eager step past the size
        self.token_slots[:slots.numel()].copy_(slots)
        self.active = bool((slots != self.base_slot).any())


def part_rows(layer: LinearBase) -> list[int]:
    """Output rows of each fused part (q, k, v / gate, up / the whole layer)."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return [layer.local_size, layer.local_size]
    return [layer.out_features]


def lora_targets(model: nn.Module) -> dict[str, LinearBase]:
    """Our linear layers an adapter may target, by prefix (every linear but the output head)."""
    return {prefix: m for prefix, m in model.named_modules()
            if isinstance(m, LinearBase) and not isinstance(m, ParallelLMHead)}


class LoRALinear(nn.Module):
    """`base_layer`'s output plus the low-rank term of each token's slot."""

    def __init__(self, base_layer: LinearBase, batch: LoRABatch, num_slots: int,
                 max_rank: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.batch = batch
        self.parts = part_rows(base_layer)
        self.max_rank = max_rank
        weight = base_layer.weight
        width = len(self.parts) * max_rank
        dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 \
            else torch.bfloat16  # quantized base weights: factors in a float dtype
        self.register_buffer("lora_a", torch.zeros(num_slots + 1, width, base_layer.in_features,
                                                   dtype=dtype, device=weight.device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots + 1, width, sum(self.parts),
                                                   dtype=dtype, device=weight.device),
                             persistent=False)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base_layer"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.batch.active:
            return y
        flat = x.reshape(-1, x.shape[-1]).to(self.lora_a.dtype)
        num_slots, width, _ = self.lora_a.shape
        slots = self.batch.token_slots[:flat.shape[0]]
        shrunk = flat @ self.lora_a.view(num_slots * width, -1).t()  # [T, slots * W]
        own = F.one_hot(slots, num_slots).to(shrunk.dtype).unsqueeze(-1)  # [T, slots, 1]
        shrunk = (shrunk.view(-1, num_slots, width) * own).view(-1, num_slots * width)
        delta = shrunk @ self.lora_b.view(num_slots * width, -1)  # [T, out]
        return y + delta.to(y.dtype).reshape(y.shape)

    def set_slot(self, slot: int, parts: list | None) -> None:
        """Write an adapter's `PartFactors` for this layer into `slot` (None: zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        starts = [sum(self.parts[:i]) for i in range(len(self.parts))]
        for part in parts or []:
            p = starts.index(part.row_start)
            r, rows = part.a.shape[0], part.b.shape[0]
            col = p * self.max_rank
            self.lora_a[slot, col:col + r].copy_(part.a)
            self.lora_b[slot, col:col + r, part.row_start:part.row_start + rows].copy_(part.b.t())


def wrap_layers(model: nn.Module, batch: LoRABatch, num_slots: int, max_rank: int
                ) -> dict[str, LoRALinear]:
    """Replace every target layer by its wrapper in place; the wrappers by prefix."""
    wrapped = {}
    for prefix, layer in lora_targets(model).items():
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = LoRALinear(layer, batch, num_slots, max_rank)
        setattr(parent, child, wrapper)
        wrapped[prefix] = wrapper
    return wrapped


def hf_targets(model: nn.Module, wrapped: dict[str, LoRALinear]
               ) -> dict[str, tuple[str, LinearBase, int, int]]:
    """Hugging Face module name -> (our prefix, layer, part's first row, part rows): the
    checkpoint's q/k/v and gate/up land on slices of our fused layers."""
    targets = {}
    for prefix, wrapper in wrapped.items():
        names = model.hf_names(prefix) if hasattr(model, "hf_names") else [prefix]
        if len(names) != len(wrapper.parts):
            names = [prefix]  # a layer stored fused in the checkpoint too (Phi-3's qkv_proj)
            rows = [sum(wrapper.parts)]
        else:
            rows = wrapper.parts
        start = 0
        for hf, n in zip(names, rows, strict=True):
            targets[hf] = (prefix, wrapper.base_layer, start, n)
            start += n
    return targets
