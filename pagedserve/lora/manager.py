"""The model runner's one handle on LoRA: wrap the model's layers once, then per step put the
step's adapters into device slots and give every token its slot index."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.lora.adapter import LoRAAdapter, load_adapter
from pagedserve.lora.batch import BASE_SLOT, LoRABatch
from pagedserve.lora.cache import HostAdapterCache
from pagedserve.lora.layers import hf_targets, wrap_layers
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.slots import SlotTable

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None, max_tokens: int = 8192) -> None:
        if max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_lora_rank}")
        param = next(model.parameters())
        self.model = model
        self.max_rank = max_lora_rank
        self.dtype = param.dtype if param.dtype.is_floating_point and param.element_size() > 1 \
            else torch.bfloat16
        if param.device.type == "cuda" and self.dtype == torch.float32 and max_lora_rank > 256:
            # The first grouped kernels' float32 tiles at rank 512 passed a Hopper block's
            # 227 KB; the reshaped ones compile to 96 KB there (lora_kernels_compile.py) but
            # have not run on a GPU at that rank, so the refusal stays until they have.
            raise ValueError(f"--max-lora-rank {max_lora_rank} with float32 factors on CUDA: "
                             "at most 256 (or a 16-bit --dtype)")
        self.batch = LoRABatch(max_tokens, max_loras, param.device)
        self.layers = wrap_layers(model, self.batch, max_loras, max_lora_rank)
        self.targets = hf_targets(model, self.layers)
        self.slots = SlotTable(max_loras)
        self.cache = HostAdapterCache(max(max_cpu_loras or max_loras, max_loras), self._load)
        self.requests: dict[int, LoRARequest] = {}
        logger.info("LoRA: %d layers wrapped, %d slots of rank %d", len(self.layers), max_loras,
                    max_lora_rank)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        return load_adapter(request.lora_path, request.lora_name, self.targets, self.max_rank,
                            self.dtype, getattr(self.model, "adapter_module_name", None))

    def add_adapter(self, request: LoRARequest) -> None:
        """Read the adapter now (errors surface here, not mid-step) and remember its path."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                             f"{known.lora_name!r}")
        self.cache.get(request)
        self.requests[request.lora_int_id] = request

    def remove_adapter(self, lora_int_id: int) -> bool:
        self.slots.evict(lora_int_id)
        self.cache.remove(lora_int_id)
        return self.requests.pop(lora_int_id, None) is not None

    def set_step(self, lora_ids: Sequence[int], num_tokens: Sequence[int] | torch.Tensor) -> None:
        """Request i of the step uses adapter `lora_ids[i]` (0: the base model) for its
        `num_tokens[i]` tokens."""
        ids = {i for i in lora_ids if i}
        slot_of, to_write = self.slots.assign(ids)
        for lora_id, slot in to_write:
            adapter = self.cache.get(self.requests[lora_id])
            for prefix, layer in self.layers.items():
                layer.set_slot(slot, adapter.layers.get(prefix))
        per_request = np.array([slot_of.get(i, BASE_SLOT) for i in lora_ids], dtype=np.int32)
        counts = num_tokens.cpu().numpy() if isinstance(num_tokens, torch.Tensor) \
            else np.asarray(num_tokens)
        self.batch.set(per_request, counts)

    # ---- what the model runner calls ----------------------------------------------------

    def add_request(self, lora: LoRARequest) -> None:
        """A new request's adapter is read now (a bad adapter fails the request's add)."""
        if self.requests.get(lora.lora_int_id) != lora:
            self.add_adapter(lora)

    def set_batch(self, batch: Any) -> None:
        """The scheduled step's slots (its requests in batch order)."""
        self.set_step([r.lora_int_id for r in batch.requests], batch.num_scheduled_tokens)


def make_lora_manager(config: Any, model: nn.Module, max_tokens: int) -> LoRAManager | None:
    """The runner's manager with --lora-modules read (None without --enable-lora)."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    manager = LoRAManager(model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras,
                          max_tokens)
    for request, _ in lora.startup_adapters():
        manager.add_adapter(request)
    return manager
