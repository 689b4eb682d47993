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
class MambaSpec:
    """One Mamba layer's cache: a state slot per running request (not per block) holding the
    conv state [d_inner, conv_kernel - 1] (the last inputs the causal conv still needs) and the
    SSM state [d_inner, state_size]. The SSM state is float32 by default: it accumulates over
    the whole sequence, and transformers' reference keeps it in float32 too."""

    d_inner: int
    conv_kernel: int
    state_size: int
    dtype: torch.dtype  # conv state (the model dtype)
    ssm_dtype: torch.dtype = torch.float32

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.d_inner, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int]:
        return (self.d_inner, self.state_size)

    @property
    def slot_size_bytes(self) -> int:
        conv = self.d_inner * (self.conv_kernel - 1) * torch.empty((), dtype=self.dtype).itemsize
        ssm = self.d_inner * self.state_size * torch.empty((), dtype=self.ssm_dtype).itemsize
        return conv + ssm


def bytes_per_slot(specs: list[MambaSpec]) -> int:
    """A state slot id indexes every Mamba layer's state, so one slot costs the sum over them."""
    return sum(spec.slot_size_bytes for spec in specs)


def bytes_per_block(specs: list[KVCacheSpec] | list[MambaSpec]) -> int:
    """Every layer keeps its own page for a block id, so one block costs the sum over layers.
    For a pure Mamba model the unit the manager hands out is a state slot (its bytes)."""
    if not specs:
        raise ValueError("the model declares no KV cache layers")
    if all(isinstance(spec, MambaSpec) for spec in specs):
        return bytes_per_slot(specs)
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise ValueError(f"all layers must share one block size, got {sorted(sizes)}")
    return sum(spec.page_size_bytes for spec in specs)


def num_blocks_for_budget(specs: list[KVCacheSpec] | list[MambaSpec], budget_bytes: int) -> int:
    num_blocks = budget_bytes // bytes_per_block(specs)
    if num_blocks < 1:
        unit = "state slot" if isinstance(specs[0], MambaSpec) else "block"
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds no {unit} "
            f"({bytes_per_block(specs)} bytes per {unit}): raise the memory budget")
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
