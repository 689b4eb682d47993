"""What a request names to be served through an adapter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT directory
    (positional in this order, as vLLM's). Requests with equal ids share the adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be >= 1 "
                             f"(0 is the base model), got {self.lora_int_id}")
