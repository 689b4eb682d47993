"""Adapters kept in host memory, least recently used first out (--max-cpu-loras)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedserve.lora.adapter import LoRAAdapter
from pagedserve.lora.request import LoRARequest


class HostAdapterCache:
    """Loaded adapters by `lora_int_id`. A request for one not here loads it (`load`); past
    `capacity` the least recently used goes (it is read again from disk if asked for)."""

    def __init__(self, capacity: int, load: Callable[[LoRARequest], LoRAAdapter]) -> None:
        if capacity < 1:
            raise ValueError(f"--max-cpu-loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self.load = load
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            adapter = self.load(request)
            self.adapters[request.lora_int_id] = adapter
            while len(self.adapters) > self.capacity:
                self.adapters.popitem(last=False)
        self.adapters.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        return self.adapters.pop(lora_int_id, None) is not None

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self.adapters
