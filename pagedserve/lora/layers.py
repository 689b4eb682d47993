"""The LoRA wrapper around a linear layer, and which of a model's layers it wraps.

Every adapter slot's factors for a layer are stacked into two fixed tensors: A [slots, P * R,
in] and B [slots, out, R] (R = --max-lora-rank; P the fused parts q/k/v or gate/up, whose A
sit side by side; each output row of B holds the factors of its part). Fixed addresses, so a
CUDA graph captures the products with the step's slots (`LoRABatch`) as its only input. The
products themselves are in `ops.py` (torch) and `kernels.py` (Triton): each token goes
through its own adapter only, and base-model tokens (slot -1) through none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.distributed import all_reduce
from pagedserve.lora.batch import LoRABatch
from pagedserve.lora.ops import add_lora
from pagedserve.models.parallel import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
)


def part_rows(layer: LinearBase) -> list[int]:
    """Output rows of each fused part (q, k, v / gate, up / the whole layer)."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return [layer.local_size, layer.local_size]
    return [layer.out_features]


def full_parts(layer: LinearBase) -> list[tuple[int, str | None]]:
    """(rows in the checkpoint, shard name for `rank_slice`) of each fused part: with tensor
    parallelism a column-parallel layer holds a slice of each."""
    tp = layer.tp_size
    if isinstance(layer, QKVParallelLinear):
        kv = layer.total_kv_heads * layer.head_dim
        return [(layer.q_size * tp, "q"), (kv, "k"), (kv, "v")]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(layer.local_size * tp, None)] * 2
    if isinstance(layer, ColumnParallelLinear):
        return [(layer.out_features * tp, None)]
    return [(layer.out_features, None)]


def full_in_features(layer: LinearBase) -> int:
    """Input features in the checkpoint (a row-parallel layer holds a slice)."""
    return layer.in_features * (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)


def lora_targets(model: nn.Module) -> dict[str, LinearBase]:
    """Our linear layers an adapter may target, by prefix (every linear but the output head,
    also where it is a plain linear: a tied head of int8 codes on the CPU)."""
    head = getattr(model, "lm_head", None)
    return {prefix: m for prefix, m in model.named_modules()
            if isinstance(m, LinearBase) and not isinstance(m, ParallelLMHead) and m is not head}


@dataclass(frozen=True)
class LoRATarget:
    """Where one checkpoint module's factors go: our layer (by prefix), the first local row of
    its part, the part's rows and input features in the checkpoint, and the shard name that
    `layer.rank_slice` takes (rows -1: not loadable here)."""

    prefix: str
    layer: LinearBase
    row_start: int
    rows: int
    shard: str | None
    in_features: int


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
        if weight is None:  # replaced by codes after loading (int8 on the CPU, GGUF blocks)
            weight = next(iter(base_layer.buffers()))
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
        base = self.base_layer
        lora = self.batch.active or self.batch.graph_mode
        if isinstance(base, RowParallelLinear) and base.tp_size > 1 and lora:
            # A holds this rank's input columns: its term is partial, summed by the layer's
            # own all-reduce together with the base product's.
            y = base.quant_method.apply(base, x, None)
            self._add(x, y)
            y = all_reduce(y)
            return y if base.bias is None else y + base.bias
        y = base(x)
        if lora:
            self._add(x, y)
        return y

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        add_lora(flat, y.view(flat.shape[0], -1), self.lora_a, self.lora_b, self.lora_b_t,
                 self.bounds, self.bounds_device, self.batch)

    def set_slot(self, slot: int, parts: list | None) -> None:
        """Write an adapter's `PartFactors` for this layer into `slot` (None: zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for part in parts or []:
            r, start = part.a.shape[0], part.row_start
            end = start + part.b.shape[0]
            self.lora_b[slot, start:end, :r].copy_(part.b)
            # A goes to every fused part B covers (one factor pair may span several: a
            # layer stored fused in the checkpoint too, Phi-3's qkv_proj)
            for p in range(len(self.parts)):
                if start < self.bounds[p + 1] and self.bounds[p] < end:
                    self.lora_a[slot, p * self.max_rank:p * self.max_rank + r].copy_(part.a)
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


def hf_targets(model: nn.Module, wrapped: dict[str, LoRALinear]) -> dict[str, LoRATarget]:
    """Hugging Face module name -> where its factors go: the checkpoint's q/k/v and gate/up
    land on slices of our fused layers (and of this rank's share of them)."""
    targets = {}
    for prefix, wrapper in wrapped.items():
        layer = wrapper.base_layer
        names = model.hf_names(prefix) if hasattr(model, "hf_names") else [prefix]
        parts, full_in = full_parts(layer), full_in_features(layer)
        if len(names) == len(parts):
            for hf, start, (rows, shard) in zip(names, wrapper.bounds, parts, strict=False):
                targets[hf] = LoRATarget(prefix, layer, start, rows, shard, full_in)
        if prefix not in targets:
            # the whole layer by our name, as a checkpoint that stores it fused names it
            # (Phi-3's qkv_proj and gate_up_proj); fused rows do not split into one slice
            # per rank
            rows = parts[0][0] if len(parts) == 1 else \
                wrapper.bounds[-1] if layer.tp_size == 1 else -1
            targets[prefix] = LoRATarget(prefix, layer, 0, rows, None, full_in)
    return targets
