"""The LoRA wrapper around a linear layer, and which of a model's layers it wraps.

Every adapter slot's factors for a layer are stacked into two fixed tensors: A [slots, P * R,
in] and B [slots, out, R] (R = --max-lora-rank; P the fused parts q/k/v or gate/up, whose A
sit side by side; each output row of B holds the factors of its part). Fixed addresses, so a
CUDA graph captures the products with the step's slots (`LoRABatch`) as its only input. The
products themselves are in `ops.py` (torch) and `kernels.py` (Triton): each token goes
through its own adapter only, and base-model tokens (slot -1) through none.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.lora.batch import LoRABatch
from pagedserve.lora.ops import add_lora
from pagedserve.models.parallel import (
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
)


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
        self.bounds = [sum(self.parts[:i]) for i in range(len(self.parts) + 1)]
        self.max_rank = max_rank
        weight = base_layer.weight
        device = weight.device
        dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 \
            else torch.bfloat16  # quantized base weights: factors in a float dtype
        self.register_buffer("lora_a", torch.zeros(num_slots, len(self.parts) * max_rank,
                                                   base_layer.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, self.bounds[-1], max_rank,
                                                   dtype=dtype, device=device),
                             persistent=False)
        # The CPU's decode path wants B transposed too ([slots, R, out]; ops.lora_torch_masked).
        self.register_buffer("lora_b_t", None if device.type == "cuda" else torch.zeros(
            num_slots, max_rank, self.bounds[-1], dtype=dtype, device=device), persistent=False)
        self.register_buffer("bounds_device", torch.tensor(self.bounds, dtype=torch.int32,
                                                           device=device), persistent=False)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base_layer"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not (self.batch.active or self.batch.graph_mode):
            return y
        flat = x.reshape(-1, x.shape[-1])
        add_lora(flat, y.view(flat.shape[0], -1), self.lora_a, self.lora_b, self.lora_b_t,
                 self.bounds, self.bounds_device, self.batch)
        return y

    def set_slot(self, slot: int, parts: list | None) -> None:
        """Write an adapter's `PartFactors` for this layer into `slot` (None: zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for part in parts or []:
            p = self.bounds.index(part.row_start)
            r, rows = part.a.shape[0], part.b.shape[0]
            col = p * self.max_rank
            self.lora_a[slot, col:col + r].copy_(part.a)
            self.lora_b[slot, part.row_start:part.row_start + rows, :r].copy_(part.b)
        if self.lora_b_t is not None:
            self.lora_b_t[slot].copy_(self.lora_b[slot].t())


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
