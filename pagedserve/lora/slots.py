"""Which adapter sits in which of the --max-loras device slots.

A step's adapters take slots; one already resident keeps its slot (no copy), a new one takes a
free slot or the least recently used slot no adapter of this step needs. The scheduler keeps
the distinct adapters of a step within the slots, so a step always fits.
"""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    """lora_int_id -> slot, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"--max-loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.resident: OrderedDict[int, int] = OrderedDict()

    def assign(self, ids: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for `ids` (one step's adapters): (id -> slot, [(id, slot) to write])."""
        if len(ids) > self.num_slots:
            raise ValueError(f"a step names {len(ids)} adapters, over --max-loras "
                             f"{self.num_slots} (the scheduler should have capped it)")
        to_write = []
        for lora_id in sorted(ids):
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
                continue
            slot = self._free_slot(ids)
            self.resident[lora_id] = slot
            to_write.append((lora_id, slot))
        return {i: self.resident[i] for i in ids}, to_write

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self.resident.values())
        for slot in range(self.num_slots):
            if slot not in used:
                return slot
        victim = next(i for i in self.resident if i not in keep)
        return self.resident.pop(victim)

    def evict(self, lora_id: int) -> None:
        self.resident.pop(lora_id, None)
