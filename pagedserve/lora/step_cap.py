"""The scheduler's cap on distinct adapters in one step (--max-loras): a request whose adapter
would be one too many waits for a later step, it is never refused."""

from __future__ import annotations


class AdapterCap:
    """Per step: `begin()`, then `admits(lora_int_id)` for each request in scheduling order."""

    __slots__ = ("max_loras", "in_step")

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.in_step: set[int] = set()

    def begin(self) -> None:
        self.in_step.clear()

    def admits(self, lora_int_id: int) -> bool:
        """True (and counted) if the adapter is the base, already in the step, or fits."""
        if not lora_int_id or lora_int_id in self.in_step:
            return True
        if len(self.in_step) >= self.max_loras:
            return False
        self.in_step.add(lora_int_id)
        return True
