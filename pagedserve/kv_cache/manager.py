"""KVCacheManager: which blocks each request holds, and the prefix-cache lookups on admission."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.kv_cache.state_slots import StateSlotPool

NONE_HASH = b"\x00" * 32
# Stands in a request's block list for a block freed because it fell out of every layer's
# sliding window; never in the pool, never read (those positions are masked out).
OUT_OF_WINDOW = KVCacheBlock(-1)


class CacheableRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    skip_prefix_cache: bool
    state_slot: int


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: str | None) -> bytes:
    """SHA-256 of a full block, chained from its parent's hash so equal token blocks at
    different positions (or after different prefixes) never collide. The salt keeps tenants'
    prefixes apart. Hashed bytes: parent hash, token ids as little-endian int64, salt."""
    return _sha256(parent_hash + _pack_int64(list(token_ids)) + _salt_bytes(extra_key)).digest()


def _salt_bytes(extra_key: str | None) -> bytes:
    return b"\x01salt:" + extra_key.encode() if extra_key else b""


_sha256 = hashlib.sha256
_PACKERS: dict[int, struct.Struct] = {}


def _pack_int64(token_ids: list[int]) -> bytes:
    """The same bytes as np.asarray(token_ids, "<i8").tobytes() for a list of Python ints, at
    half the cost; one compiled Struct per length (block multiples up to max_model_len)."""
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
    return packer.pack(*token_ids)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Which blocks each request holds, and with state layers (attention/state.py) which state
    slot: a request is admitted only when both its blocks and a slot are free, and gives both
    back together. A model without attention layers has no blocks (`num_blocks` 0), only
    slots. Prefix caching needs every layer's cache per block, so it is off with state slots:
    a state sums up the whole prefix, it is not kept per block (the engine says so once)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        # When every attention layer has a sliding window (the largest of them here), blocks
        # whose tokens no query can see any more are freed while the request runs.
        self.sliding_window = sliding_window
        self.num_out_of_window: dict[str, int] = {}
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.enable_prefix_caching = enable_prefix_caching and self.state_slots is None
        # A model of state layers only has no blocks: a one-block pool keeps the accounting
        # total, and no request ever takes from it.
        self.pool = BlockPool(max(num_blocks, 1), enable_caching=self.enable_prefix_caching)
        self.has_blocks = num_blocks > 0
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Blocks published since `begin_step`: a step that writes them is still being planned,
        # so a request that hits one reads K/V the same step writes.
        self._published_in_step: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks if self.has_blocks else 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        if self.state_slots is None:
            return self.pool.usage
        slots = 1 - self.state_slots.num_free / self.state_slots.num_slots
        return max(slots, self.pool.usage) if self.has_blocks else slots

    def all_free(self) -> bool:
        """No request holds a block or a state slot (cached blocks count as free)."""
        slots_free = (self.state_slots is None
                      or self.state_slots.num_free == self.state_slots.num_slots)
        return slots_free and self.pool.num_free_blocks == self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size) if self.has_blocks else 0

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _block_hashes(self, request: CacheableRequest, num_full_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended to its first `num_full_blocks` blocks.
        Hashes are computed once per block and kept until the request is forgotten."""
        hashes = self.req_to_hashes.get(request.request_id)
        if hashes is None:
            hashes = self.req_to_hashes[request.request_id] = []
        start = len(hashes)
        if num_full_blocks <= start:
            return hashes
        bs = self.block_size
        parent = hashes[-1] if start else NONE_HASH
        salt = _salt_bytes(request.cache_salt)
        # One conversion for all new blocks (per-block conversions cost more than SHA-256),
        # then hash_block's digest per block.
        data = _pack_int64(request.all_token_ids[start * bs:num_full_blocks * bs])
        width = bs * 8
        for offset in range(0, len(data), width):
            parent = _sha256(parent + data[offset:offset + width] + salt).digest()
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request about to be admitted, in whole blocks. The
        last token is always left to compute, so the step has logits to sample from."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return [], 0
        num_tokens = len(request.all_token_ids)
        # Hash every full block now (one pass), also a last one that cannot be a hit: the
        # admission step fills it and publishes it under this hash.
        hashes = self._block_hashes(request, num_tokens // self.block_size)
        lookup = self.pool.cached_blocks.get
        hits: list[KVCacheBlock] = []
        for i in range((num_tokens - 1) // self.block_size):
            block = lookup(hashes[i])
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
        if self._needs_slot(request) and not self.state_slots.num_free:
            return False
        return self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks) is not None

    def _needs_slot(self, request: CacheableRequest) -> bool:
        return self.state_slots is not None and request.state_slot < 0

    def _num_blocks_to_take(self, request: CacheableRequest, num_new_tokens: int,
                            new_computed_blocks: Sequence[KVCacheBlock]) -> int | None:
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_new_blocks = max(0, self.blocks_needed(total + num_new_tokens) - held)
        # A cache hit on an evictable block takes it off the free queue too.
        evictable_hits = (sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
                          if new_computed_blocks else 0)
        if num_new_blocks + evictable_hits > self.pool.num_free_blocks:
            return None
        return num_new_blocks

    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens (after `new_computed_blocks`, the prefix
        hits found on admission). Returns the blocks appended to the request, cache hits first,
        or None when the pool cannot supply them (nothing changes then)."""
        if self.state_slots is not None:
            return self._allocate_with_slot(request, num_new_tokens)
        # The step fills a block when a multiple of block_size lies in (computed, end]: when
        # end % block_size < num_new_tokens. Most decode steps fill none and skip all caching
        # work on that one test (done first: it is as cheap with caching on as off).
        held = self.req_to_blocks.get(request.request_id)
        if held is not None and self.sliding_window is not None:
            self._free_out_of_window(request, held)
        if held is not None and not new_computed_blocks:
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(held) * self.block_size:
                # Room in the blocks it holds (most decode steps): no pool work at all.
                if (end % self.block_size < num_new_tokens and self.enable_prefix_caching
                        and not request.skip_prefix_cache):
                    self._cache_full_blocks(request, held, end)
                return []
        num_new_blocks = self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks)
        if num_new_blocks is None:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            appended = list(new_computed_blocks) + self.pool.allocate(num_new_blocks)
        else:
            appended = self.pool.allocate(num_new_blocks)
        blocks.extend(appended)
        end = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
               + num_new_tokens)
        if (end % self.block_size < num_new_tokens and self.enable_prefix_caching
                and not request.skip_prefix_cache):
            self._cache_full_blocks(request, blocks, end)
        return appended

    def _free_out_of_window(self, request: CacheableRequest, held: list[KVCacheBlock]) -> None:
        """Free the blocks before the first key this step's queries can see: query p sees keys
        p - window + 1 .. p, and the step's first query is at num_computed_tokens. A step still
        in flight may read them, but its kernels run before any later step's writes (one
        stream), so handing them out again is safe."""
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        num_out = min(max(0, first_visible // self.block_size), len(held))
        if self.enable_prefix_caching and not request.skip_prefix_cache:
            # A block leaves only once published (with async scheduling a block's last token
            # can be known a step late), so its hash outlives it as an evictable cache entry.
            num_out = min(num_out, self.num_cached_blocks.get(request.request_id, 0))
        done = self.num_out_of_window.get(request.request_id, 0)
        if num_out <= done:
            return
        freed = held[done:num_out]
        held[done:num_out] = [OUT_OF_WINDOW] * (num_out - done)
        self.pool.free(reversed(freed))
        self.num_out_of_window[request.request_id] = num_out

    def _allocate_with_slot(self, request: CacheableRequest,
                            num_new_tokens: int) -> list[KVCacheBlock] | None:
        """allocate_slots with state layers (no prefix caching): a request without a slot
        takes one together with its blocks, or neither."""
        needs_slot = self._needs_slot(request)
        if needs_slot and not self.state_slots.num_free:
            return None
        appended: list[KVCacheBlock] = []
        if self.has_blocks:
            num_new_blocks = self._num_blocks_to_take(request, num_new_tokens, ())
            if num_new_blocks is None:
                return None
            appended = self.pool.allocate(num_new_blocks)
            self.req_to_blocks.setdefault(request.request_id, []).extend(appended)
        if needs_slot:
            request.state_slot = self.state_slots.take()
        return appended

    def _cache_full_blocks(self, request: CacheableRequest, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        """Publish the blocks this step fills completely (their K/V is written by the step)."""
        request_id = request.request_id
        num_known = len(request.all_token_ids)  # with async scheduling, tokens can lag
        num_full = (num_tokens if num_tokens < num_known else num_known) // self.block_size
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        unpublished = [b for b in blocks[start:num_full] if b.block_hash is None]
        self.pool.cache_blocks(blocks, hashes, start, num_full)
        self._published_in_step.update(b.block_id for b in unpublished
                                       if b.block_hash is not None)
        self.num_cached_blocks[request_id] = num_full

    def begin_step(self) -> None:
        """A new step is being planned: blocks published before now are written by steps
        already planned (queued on the device before any step planned from here)."""
        self._published_in_step.clear()

    def written_in_step(self, blocks: Sequence[KVCacheBlock]) -> bool:
        """Whether any of these prefix hits is published by the step being planned: its K/V
        is written by that same step, so attention must see the step's writes first."""
        published = self._published_in_step
        return bool(published) and any(b.block_id in published for b in blocks)

    def cache_computed_blocks(self, request: CacheableRequest) -> None:
        """After a sampled token is appended: publish a block that this token completes when
        its K/V is already scheduled (with async scheduling the step that writes a token's
        K/V is scheduled before the token is known, so `allocate_slots` could not hash it)."""
        num_tokens = len(request.all_token_ids)
        # The block-boundary test first: it is the one that fails on most tokens.
        if (num_tokens % self.block_size or not self.enable_prefix_caching
                or request.skip_prefix_cache or request.num_computed_tokens < num_tokens):
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)

    def free(self, request: CacheableRequest) -> None:
        """Release a finished, aborted or preempted request's blocks. The tail goes to the free
        queue first, so under pressure a prompt's last blocks are evicted before its first ones
        (which more requests are likely to share)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if self.num_out_of_window.pop(request.request_id, 0):
            blocks = [b for b in blocks if b is not OUT_OF_WINDOW]
        self.pool.free(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        if self.state_slots is not None and request.state_slot >= 0:
            self.state_slots.give_back(request.state_slot)
            request.state_slot = -1

    def forget(self, request: CacheableRequest) -> None:
        """Drop a finished request's hash list (kept across preemption, since its tokens stay)."""
        self.req_to_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
