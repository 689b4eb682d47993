"""Many LoRA adapters over one base model: PEFT adapters read onto our (fused) linear layers,
held in host memory (LRU) and in fixed device slots, and one batched low-rank term per layer
for a step that mixes adapters (`manager.LoRAManager` is what the model runner calls)."""

from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
