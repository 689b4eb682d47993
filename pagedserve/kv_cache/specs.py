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

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer (K and V)."""
        if self.page_bytes is not None:
            return self.page_bytes
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    pass


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    # Tokens a query sees, itself included (transformers' `sliding_window`).
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


def bytes_per_block(specs: list[KVCacheSpec]) -> int:
    """Every layer keeps its own page for a block id, so one block costs the sum over layers."""
    if not specs:
        raise ValueError("the model declares no KV cache layers")
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"all layers must share one block size, got {sorted(sizes)}")
    return sum(spec.page_size_bytes for spec in specs)


def num_blocks_for_budget(specs: list[KVCacheSpec], budget_bytes: int) -> int:
    num_blocks = budget_bytes // bytes_per_block(specs)
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds no block "
            f"({bytes_per_block(specs)} bytes per block): raise the memory budget")
    return int(num_blocks)


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
