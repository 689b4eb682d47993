"""KVCacheManager: which blocks each request holds, and the prefix-cache lookups on admission."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock

NONE_HASH = b"\x00" * 32


class CacheableRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    skip_prefix_cache: bool


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: str | None) -> bytes:
    """SHA-256 of a full block, chained from its parent's hash so equal token blocks at
    different positions (or after different prefixes) never collide. The salt keeps tenants'
    prefixes apart."""
    token_bytes = np.asarray(token_ids, dtype=np.int64).tobytes()
    return _chain_hash(parent_hash, token_bytes, _salt_bytes(extra_key))


def _salt_bytes(extra_key: str | None) -> bytes:
    return b"\x01salt:" + extra_key.encode() if extra_key else b""


def _chain_hash(parent_hash: bytes, token_bytes: bytes, salt: bytes) -> bytes:
    h = hashlib.sha256(parent_hash)
    h.update(token_bytes)
    h.update(salt)
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @classmethod
    def for_state_slots(cls, num_slots: int, max_model_len: int) -> KVCacheManager:
        """The manager of a model whose layers keep per-request state (Mamba) instead of K/V
        pages. Each block is a state slot spanning a whole request (block_size =
        max_model_len), so a request takes exactly one on admission and holds it until it
        finishes or is preempted; admission waits while none is free, and its block id is its
        slot index (the runner's block table carries it). Prefix caching is off: the state sums
        up the whole prefix, it is not kept per block."""
        return cls(num_slots, max_model_len, enable_prefix_caching=False)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _block_hashes(self, request: CacheableRequest, num_full_blocks: int) -> list[bytes]:
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        start = len(hashes)
        if num_full_blocks <= start:
            return hashes
        bs = self.block_size
        # One conversion for all new blocks: per-block numpy calls cost more than SHA-256.
        data = np.asarray(request.all_token_ids[start * bs:num_full_blocks * bs],
                          dtype=np.int64).tobytes()
        salt = _salt_bytes(request.cache_salt)
        parent = hashes[-1] if hashes else NONE_HASH
        width = bs * 8
        for offset in range(0, len(data), width):
            parent = _chain_hash(parent, data[offset:offset + width], salt)
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request about to be admitted, in whole blocks. The
        last token is always left to compute, so the step has logits to sample from."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return [], 0
        num_tokens = len(request.all_token_ids)
        hashes = self._block_hashes(request, (num_tokens - 1) // self.block_size)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a lookup that fails to allocate is retried later)."""
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, request: CacheableRequest, num_new_tokens: int,
                     new_computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        return self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks) is not None

    def _num_blocks_to_take(self, request: CacheableRequest, num_new_tokens: int,
                            new_computed_blocks: Sequence[KVCacheBlock]) -> int | None:
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_new_blocks = max(0, self.blocks_needed(total + num_new_tokens) - held)
        # A cache hit on an evictable block takes it off the free queue too.
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + evictable_hits > self.pool.num_free_blocks:
            return None
        return num_new_blocks

    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens (after `new_computed_blocks`, the prefix
        hits found on admission). Returns the blocks appended to the request, cache hits first,
        or None when the pool cannot supply them (nothing changes then)."""
        held = self.req_to_blocks.get(request.request_id)
        if (not new_computed_blocks and held is not None
                and request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size):
            # Room in the blocks it holds (most decode steps): no pool work at all.
            self._maybe_cache_full_blocks(request, held, request.num_computed_tokens,
                                          num_new_tokens)
            return []
        num_new_blocks = self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks)
        if num_new_blocks is None:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.pool.touch(new_computed_blocks)
        appended = list(new_computed_blocks) + self.pool.allocate(num_new_blocks)
        blocks.extend(appended)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        self._maybe_cache_full_blocks(request, blocks, total, num_new_tokens)
        return appended

    def _maybe_cache_full_blocks(self, request: CacheableRequest, blocks: list[KVCacheBlock],
                                 num_computed: int, num_new_tokens: int) -> None:
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return
        end = num_computed + num_new_tokens
        # Most steps are decodes that fill no block: skip the bookkeeping for them.
        if end // self.block_size > num_computed // self.block_size:
            self._cache_full_blocks(request, blocks, end)

    def _cache_full_blocks(self, request: CacheableRequest, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        """Publish the blocks this step fills completely (their K/V is written by the step)."""
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: CacheableRequest) -> None:
        """Release a finished, aborted or preempted request's blocks. The tail goes to the free
        queue first, so under pressure a prompt's last blocks are evicted before its first ones
        (which more requests are likely to share)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)

    def forget(self, request: CacheableRequest) -> None:
        """Drop a finished request's hash list (kept across preemption, since its tokens stay)."""
        self.req_to_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
