"""Paged KV cache: block pool, per-request block accounting, layer specs and memory sizing."""

from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.kv_cache.groups import KVCacheGroup, KVCacheLayout, plan_kv_cache_groups
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.kv_cache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    bytes_per_block,
    num_blocks_for_budget,
)

__all__ = [
    "BlockPool",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "bytes_per_block",
    "num_blocks_for_budget",
    "plan_kv_cache_groups",
]
