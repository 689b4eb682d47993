"""KV cache groups: attention layers of one kind (full, or a sliding window of one size) share a
block table, so each kind frees what it no longer needs.

When every attention layer has the same kind there is one group and every layer keeps its own
cache tensor: a block id costs the sum of the layers' pages (the plain layout). When kinds mix
(Gemma 2/3, gpt-oss) every kind's layers are cut into groups of the same size G and layer j of
every group uses the j-th of G shared cache tensors: a block id belongs to one group at a time,
costs G pages, and one pool holds every group's blocks with nothing set aside per kind. That
needs every layer's page to have one shape; when they differ the plain layout is kept (windowed
layers then keep every block, which is right, only not as frugal).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.kv_cache.specs import KVCacheSpec, SlidingWindowSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheGroup:
    """Attention layers that share one block table. `sliding_window`: the window of every layer
    in it (blocks before it are freed while a request runs), None for full attention."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding window {self.sliding_window}"


@dataclass(frozen=True)
class KVCacheLayout:
    """Which group each attention layer is in and which cache tensor it writes."""

    groups: tuple[KVCacheGroup, ...]
    # Layer i (its layer_idx) reads and writes cache tensor tensor_of_layer[i].
    tensor_of_layer: tuple[int, ...]
    # The spec each cache tensor is shaped by (one per tensor).
    tensor_specs: tuple[KVCacheSpec, ...]
    # What one block id costs over the tensors it indexes.
    bytes_per_block: int

    @property
    def windows(self) -> list[int | None]:
        return [group.sliding_window for group in self.groups]

    @property
    def group_of_layer(self) -> list[int]:
        owner = [0] * len(self.tensor_of_layer)
        for g, group in enumerate(self.groups):
            for layer in group.layer_ids:
                owner[layer] = g
        return owner

    def describe(self) -> str:
        """One line per group: its kind and layers."""
        return "; ".join(f"group {g}: {group.kind}, layers {list(group.layer_ids)}"
                         for g, group in enumerate(self.groups))


def _kind(spec: KVCacheSpec) -> int | None:
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def _page_shape(spec: KVCacheSpec) -> tuple:
    return (spec.block_size, spec.num_kv_heads, spec.head_size, spec.value_head_size,
            spec.dtype, spec.page_size_bytes)


def choose_group_size(counts: list[int]) -> int:
    """G for kinds of `counts` layers each. A short last group of a kind still costs G pages
    per block, and every group costs host work per step (its block table, slot mapping and
    backend metadata): the largest G that pads at most a tenth of the layers, else the one that
    pads fewest. Gemma 2 (23 + 23 layers): 23; Gemma 3 27B (52 + 10): 6, 11 groups."""
    def waste(g: int) -> int:
        return sum(-(-n // g) * g - n for n in counts)

    sizes = range(min(counts), 0, -1)
    for g in sizes:
        if waste(g) * 10 <= sum(counts):
            return g
    return min(sizes, key=waste)


def plain_layout(specs: list[KVCacheSpec], window: int | None = None) -> KVCacheLayout:
    """One group of every layer, each with a tensor of its own (`window`: the one window every
    layer shares, else None: no block is freed before its request ends)."""
    n = len(specs)
    return KVCacheLayout((KVCacheGroup(tuple(range(n)), window),), tuple(range(n)), tuple(specs),
                         sum(spec.page_size_bytes for spec in specs))


def plan_kv_cache_groups(specs: list[KVCacheSpec]) -> KVCacheLayout:
    """The groups and cache tensors of a model's attention layers (`specs` by layer_idx)."""
    if not specs:
        raise ValueError("the model declares no attention layers")
    kinds: dict[int | None, list[int]] = {}
    for i, spec in enumerate(specs):
        kinds.setdefault(_kind(spec), []).append(i)
    if len(kinds) == 1:
        (window,) = kinds
        return plain_layout(specs, window)
    if len({_page_shape(spec) for spec in specs}) != 1:
        logger.info("KV cache groups off: the attention layers' pages differ in shape, so "
                    "windowed and full layers cannot share cache tensors; every layer keeps "
                    "every block of a request")
        return plain_layout(specs)
    size = choose_group_size([len(layers) for layers in kinds.values()])
    groups: list[KVCacheGroup] = []
    tensor_of_layer = [0] * len(specs)
    for window, layers in kinds.items():
        for start in range(0, len(layers), size):
            members = tuple(layers[start:start + size])
            groups.append(KVCacheGroup(members, window))
            for j, layer in enumerate(members):
                tensor_of_layer[layer] = j
    return KVCacheLayout(tuple(groups), tuple(tensor_of_layer), (specs[0],) * size,
                         size * specs[0].page_size_bytes)
