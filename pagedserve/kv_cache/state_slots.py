"""State slots of the state layers (Mamba, gated delta net, ...): one per running request."""

from __future__ import annotations


class StateSlotPool:
    """Slot ids 0..num_slots-1. A request takes one when it is admitted (or readmitted after a
    preemption: its state is recomputed from its tokens) and gives it back when it finishes or
    is preempted. A slot's tensors are not cleared: a request without computed tokens starts
    from zeros whatever its slot holds (`StateMetadata.has_initial_state`)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
