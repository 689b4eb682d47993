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


def per_prompt(lora_request: LoRARequest | list | tuple | None, num_prompts: int
               ) -> list[LoRARequest | None]:
    """`LLM.generate`'s lora_request: one for every prompt, or a list with one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"{len(loras)} LoRA requests for {num_prompts} prompts")
    return loras
