"""What cache each layer needs, and how many blocks a memory budget holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's cache: K and V pages of `block_size` tokens each."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    # The backend's real bytes per block when its layout is not plain K and V in `dtype`
    # (quantized caches with packed codes and scales); None: computed from the dtype.
    page_bytes: int | None = None
    # V's head size when it differs from K's (the layer's head_size_v); None: the same. Stored
    # as None when equal, so one layer spelled both ways is one spec.
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        if self.head_size_v == self.head_size:
            object.__setattr__(self, "head_size_v", None)

    @property
    def value_head_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer (K and V)."""
        if self.page_bytes is not None:
            return self.page_bytes
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_slot = self.num_kv_heads * (self.head_size + self.value_head_size)
        return self.block_size * per_slot * itemsize


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    pass


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    # Tokens a query sees, itself included (transformers' `sliding_window`).
    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


@dataclass(frozen=True)
class StateTensor:
    """One named tensor a state layer keeps per request slot, e.g. a conv window or an SSM
    state."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """One state layer's cache (Mamba-1/2, gated delta net, short conv, linear attention): a
    slot per running request, not pages per block, holding `tensors`. `backend` names the state
    backend that runs the layer. Recurrent states are usually float32: they accumulate over the
    whole sequence, and transformers' references keep them in float32 too."""

    backend: str
    tensors: tuple[StateTensor, ...]

    @property
    def slot_size_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def bytes_per_slot(specs: list[StateSpec]) -> int:
    """A state slot id indexes every state layer's tensors, so one slot costs the sum over them."""
    return sum(spec.slot_size_bytes for spec in specs)


def bytes_per_block(specs: list[KVCacheSpec]) -> int:
    """Every attention layer keeps its own page for a block id, so one block costs the sum over
    layers."""
    if not specs:
        raise ValueError("the model declares no attention layers")
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"all layers must share one block size, got {sorted(sizes)}")
    return sum(spec.page_size_bytes for spec in specs)


def num_blocks_for_budget(specs: list[KVCacheSpec], budget_bytes: int,
                          block_bytes: int | None = None) -> int:
    """Blocks a budget holds; `block_bytes`: what one block costs when it is not the sum over
    `specs` (KV cache groups sharing tensors: kv_cache/groups.py)."""
    block_bytes = bytes_per_block(specs) if block_bytes is None else block_bytes
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds no block "
            f"({block_bytes} bytes per block): raise the memory budget")
    return int(num_blocks)


def split_budget(block_bytes: int, state: list[StateSpec], budget_bytes: int,
                 max_num_seqs: int, slot_copies: int = 1) -> tuple[int, int]:
    """(attention blocks, state slots) one memory budget holds; `block_bytes`: what one block id
    costs (0 without attention layers). A state slot serves one running request, so there are
    at most max_num_seqs of them (more would sit idle); each is counted with one attention
    block beside it, so a small budget is not all spent on slots whose requests could not hold
    a block. The rest holds attention blocks. Each slot costs `slot_copies` slots' bytes (its
    verify scratch under speculative decoding)."""
    if not state:
        return num_blocks_for_budget([], budget_bytes, block_bytes), 0
    slot_bytes = bytes_per_slot(state) * slot_copies
    num_slots = min(max_num_seqs, budget_bytes // (slot_bytes + block_bytes))
    if num_slots < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds no state slot ({slot_bytes} bytes"
            f" per slot{f' and {block_bytes} per block' if block_bytes else ''}): raise the "
            "memory budget")
    if not block_bytes:
        return 0, int(num_slots)
    return (num_blocks_for_budget([], budget_bytes - num_slots * slot_bytes, block_bytes),
            int(num_slots))


def gpu_kv_cache_budget(total_bytes: int, peak_bytes_in_use: int, utilization: float) -> int:
    """Bytes left for the KV cache on a GPU: the allowed fraction of the device minus what the
    weights and the profiling forward pass (activations at the largest batch) peaked at."""
    budget = int(total_bytes * utilization) - peak_bytes_in_use
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} of {total_bytes / 2**30:.1f}"
            f" GiB is less than the {peak_bytes_in_use / 2**30:.1f} GiB the model peaked at;"
            " raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget
