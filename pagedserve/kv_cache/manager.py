"""KVCacheManager, the coordinator of the cache groups: which blocks each request holds in each
group (kv_cache/groups.py), admission over all groups at once, and the prefix-cache lookups."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.kv_cache.single_type import OUT_OF_WINDOW, FullAttentionManager, make_manager
from pagedserve.kv_cache.state_slots import StateSlotPool

NONE_HASH = b"\x00" * 32
# A request's blocks per cache group (a tuple with one entry per group).
GroupBlocks = tuple[Sequence[KVCacheBlock], ...]

__all__ = ["OUT_OF_WINDOW", "GroupBlocks", "KVCacheManager", "NONE_HASH", "hash_block"]


class CacheableRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    lora_int_id: int  # 0: the base model
    skip_prefix_cache: bool
    state_slot: int
    mm_features: list  # multimodal.MultiModalFeature; [] for a text prompt


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: str | None) -> bytes:
    """SHA-256 of a full block, chained from its parent's hash so equal token blocks at
    different positions (or after different prefixes) never collide. The salt keeps tenants'
    prefixes apart. Hashed bytes: parent hash, token ids as little-endian int64, salt."""
    return _sha256(parent_hash + _pack_int64(list(token_ids)) + _salt_bytes(extra_key)).digest()


def _salt_bytes(extra_key: str | None) -> bytes:
    return b"\x01salt:" + extra_key.encode() if extra_key else b""


def _lora_bytes(lora_int_id: int) -> bytes:
    """An adapter's blocks hash apart from the base's and each other's (K/V differ). Fixed
    width and a tag byte of its own, so no cache_salt can spell the same bytes."""
    return b"\x02lora:" + lora_int_id.to_bytes(8, "little") if lora_int_id else b""


def _image_keys(features: list, first: int, end: int, block_size: int) -> list[bytes]:
    """For blocks first..end-1, the identifiers of the images whose placeholder span touches
    each one: the same tokens with another image must not share the block's K/V (an image's
    tokens are all the same placeholder id)."""
    keys = [b""] * (end - first)
    for feature in features:
        p = feature.placeholder
        lo = max(p.offset // block_size, first)
        hi = min((p.end - 1) // block_size + 1, end)
        tag = b"\x03mm:" + feature.identifier.encode()
        for block in range(lo, hi):
            keys[block - first] += tag
    return keys


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
    """The coordinator of a model's cache groups (one per attention kind, `windows`: each
    group's sliding window or None for full attention; one group by default). Every group of a
    request holds the same number of block entries, so one count serves all of them: a request
    is admitted only when every group's new blocks fit in the one shared pool together, and
    gives all of them back together. With state layers (attention/state.py) it also hands out
    state slots: a request is admitted only when both its blocks and a slot are free. A model
    without attention layers has no blocks (`num_blocks` 0), only slots. Prefix caching needs
    every layer's cache per block, so it is off with state slots: a state sums up the whole
    prefix, it is not kept per block (the engine says so once)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, sliding_window: int | None = None,
                 windows: Sequence[int | None] | None = None) -> None:
        self.block_size = block_size
        if windows is None:  # one group; `sliding_window` when every layer slides
            windows = (sliding_window,)
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.enable_prefix_caching = enable_prefix_caching and self.state_slots is None
        # A model of state layers only has no blocks: a one-block pool keeps the accounting
        # total, and no request ever takes from it.
        self.pool = BlockPool(max(num_blocks, 1), enable_caching=self.enable_prefix_caching)
        self.has_blocks = num_blocks > 0
        self.groups: list[FullAttentionManager] = [
            make_manager(self.pool, block_size, g, w) for g, w in enumerate(windows)]
        self._sliding = [m for m in self.groups if m.sliding_window is not None]
        self._first_group_blocks = self.groups[0].req_to_blocks
        # What allocate_slots returns when the request's blocks have room (most decodes): one
        # shared tuple of empty lists, never appended to (the scheduler passes it on as the
        # step's new block ids).
        self.no_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in self.groups)
        self.req_to_hashes: dict[str, list[bytes]] = {}
        # Blocks of each request published so far (the same in every group).
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Blocks published since `begin_step`: a step that writes them is still being planned,
        # so a request that hits one reads K/V the same step writes.
        self._published_in_step: set[int] = set()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def sliding_window(self) -> int | None:
        """The window when there is one group and it slides."""
        return self.groups[0].sliding_window if len(self.groups) == 1 else None

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """The first group's blocks of each request (all of them with one group)."""
        return self.groups[0].req_to_blocks

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

    def blocks_needed(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """Blocks of all groups that a request of `num_tokens` tokens may hold at once, its
        prompt computed in chunks of at most `max_chunk` tokens (None: all at once). A sliding
        group holds the window before a step's first query and the step's blocks, plus one a
        step late to be published (async scheduling)."""
        if not self.has_blocks:
            return 0
        full = cdiv(num_tokens, self.block_size)
        chunk = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
        total = 0
        for manager in self.groups:
            window = manager.sliding_window
            total += full if window is None else min(
                full, cdiv(window - 1 + chunk, self.block_size) + 2)
        return total

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """A request's block ids in one group; a placeholder (a block it does not hold) is page
        0: masked out, never written, but a valid page to read."""
        return [max(b.block_id, 0) for b in self.groups[group].req_to_blocks.get(request_id, ())]

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(self.block_ids(request_id, g) for g in range(len(self.groups)))

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
        salt = _lora_bytes(request.lora_int_id) + _salt_bytes(request.cache_salt)
        # One conversion for all new blocks (per-block conversions cost more than SHA-256),
        # then hash_block's digest per block.
        data = _pack_int64(request.all_token_ids[start * bs:num_full_blocks * bs])
        width = bs * 8
        features = getattr(request, "mm_features", None)  # (test stand-ins may lack it)
        images = _image_keys(features, start, num_full_blocks, bs) if features else None
        for i, offset in enumerate(range(0, len(data), width)):
            key = salt if images is None else salt + images[i]
            parent = _sha256(parent + data[offset:offset + width] + key).digest()
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: CacheableRequest) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of a request about to be admitted, in whole blocks, and its
        blocks per group; `()` when there is none. Every full group has the prefix cached, and
        every sliding group the blocks of the last window before its end (placeholders before
        them). The last token is always left to compute, so the step has logits to sample."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return (), 0
        num_tokens = len(request.all_token_ids)
        # Hash every full block now (one pass), also a last one that cannot be a hit: the
        # admission step fills it and publishes it under this hash.
        hashes = self._block_hashes(request, num_tokens // self.block_size)
        limit = (num_tokens - 1) // self.block_size
        hits = [manager.find_hit(hashes, limit) for manager in self.groups]
        if len(hits) > 1:
            # Agree on one length: shorter hits of one group can break a sliding group's
            # window, so narrow until every group holds the same length.
            while True:
                limit = min(len(h) for h in hits)
                stale = [g for g, h in enumerate(hits) if len(h) != limit]
                if not stale:
                    break
                for g in stale:
                    manager = self.groups[g]
                    hits[g] = (hits[g][:limit] if manager.sliding_window is None
                               else manager.find_hit(hashes, limit))
        if not hits[0]:
            return (), 0
        return tuple(hits), len(hits[0]) * self.block_size

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a lookup that fails to allocate is retried later)."""
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, request: CacheableRequest, num_new_tokens: int,
                     new_computed_blocks: GroupBlocks = ()) -> bool:
        """Whether `allocate_slots` would succeed; it never says yes when that would fail (it
        does not count the blocks that call would free out of a window first)."""
        if self._needs_slot(request) and not self.state_slots.num_free:
            return False
        return self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks) is not None

    def _needs_slot(self, request: CacheableRequest) -> bool:
        return self.state_slots is not None and request.state_slot < 0

    def _num_blocks_to_take(self, request: CacheableRequest, num_new_tokens: int,
                            new_computed_blocks: GroupBlocks) -> int | None:
        """New blocks per group (the same in every group), or None when all groups' together
        and the evictable hits do not fit in the free pool."""
        if not self.has_blocks:
            return 0
        num_hits = len(new_computed_blocks[0]) if new_computed_blocks else 0
        held = len(self.groups[0].req_to_blocks.get(request.request_id, ())) + num_hits
        total = request.num_computed_tokens + num_hits * self.block_size
        num_new_blocks = max(0, cdiv(total + num_new_tokens, self.block_size) - held)
        # A cache hit on an evictable block takes it off the free queue too.
        evictable_hits = (sum(1 for hits in new_computed_blocks for b in hits
                              if b.ref_cnt == 0 and b is not OUT_OF_WINDOW)
                          if new_computed_blocks else 0)
        if num_new_blocks * len(self.groups) + evictable_hits > self.pool.num_free_blocks:
            return None
        return num_new_blocks

    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       new_computed_blocks: GroupBlocks = ()) -> GroupBlocks | None:
        """Make room for `num_new_tokens` more tokens (after `new_computed_blocks`, the prefix
        hits found on admission). Returns the blocks appended to the request in each group,
        cache hits first, or None when the pool cannot supply them (nothing changes then, but
        for blocks freed that no query will see again)."""
        if self.state_slots is not None:
            return self._allocate_with_slot(request, num_new_tokens)
        request_id = request.request_id
        caching = self.enable_prefix_caching and not request.skip_prefix_cache
        if self._sliding:
            published = self.num_cached_blocks.get(request_id, 0) if caching else 1 << 62
            for manager in self._sliding:
                manager.free_out_of_window(request_id, request.num_computed_tokens, published)
        held = self._first_group_blocks.get(request_id)
        if held is not None and not new_computed_blocks:
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(held) * self.block_size:
                # Room in the blocks it holds (most decode steps): no pool work at all. The
                # step fills a block when a multiple of block_size lies in (computed, end]:
                # when end % block_size < num_new_tokens (most decodes fill none).
                if end % self.block_size < num_new_tokens and caching:
                    self._cache_full_blocks(request, end)
                return self.no_blocks
        num_new_blocks = self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks)
        if num_new_blocks is None:
            return None
        if new_computed_blocks:
            # Every group's hits leave the free queue before any group takes new blocks: an
            # evictable hit of one group must not be handed to another as a fresh block.
            for hits in new_computed_blocks:
                self.pool.touch(b for b in hits if b is not OUT_OF_WINDOW)
        appended = []
        for g, manager in enumerate(self.groups):
            blocks = manager.req_to_blocks.setdefault(request_id, [])
            if new_computed_blocks:
                added = list(new_computed_blocks[g]) + self.pool.allocate(num_new_blocks)
            else:
                added = self.pool.allocate(num_new_blocks)
            blocks.extend(added)
            appended.append(added)
        num_hits = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if num_hits:  # hits are published already (a sliding group's placeholders are not)
            self.num_cached_blocks[request_id] = num_hits
        end = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        if end % self.block_size < num_new_tokens and caching:
            self._cache_full_blocks(request, end)
        return tuple(appended)

    def _allocate_with_slot(self, request: CacheableRequest,
                            num_new_tokens: int) -> GroupBlocks | None:
        """allocate_slots with state layers (no prefix caching): a request without a slot
        takes one together with its blocks, or neither."""
        needs_slot = self._needs_slot(request)
        if needs_slot and not self.state_slots.num_free:
            return None
        appended: list[list[KVCacheBlock]] = [[] for _ in self.groups]
        if self.has_blocks:
            if self._sliding:
                for manager in self._sliding:
                    manager.free_out_of_window(request.request_id, request.num_computed_tokens,
                                               1 << 62)
            num_new_blocks = self._num_blocks_to_take(request, num_new_tokens, ())
            if num_new_blocks is None:
                return None
            for g, manager in enumerate(self.groups):
                appended[g] = self.pool.allocate(num_new_blocks)
                manager.req_to_blocks.setdefault(request.request_id, []).extend(appended[g])
        if needs_slot:
            request.state_slot = self.state_slots.take()
        return tuple(appended)

    def _cache_full_blocks(self, request: CacheableRequest, num_tokens: int) -> None:
        """Publish the blocks this step fills completely (their K/V is written by the step), in
        every group."""
        request_id = request.request_id
        num_known = len(request.all_token_ids)  # with async scheduling, tokens can lag
        num_full = (num_tokens if num_tokens < num_known else num_known) // self.block_size
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for manager in self.groups:
            fresh = manager.publish(manager.req_to_blocks[request_id], hashes, start, num_full)
            self._published_in_step.update(b.block_id for b in fresh)
        self.num_cached_blocks[request_id] = num_full

    def begin_step(self) -> None:
        """A new step is being planned: blocks published before now are written by steps
        already planned (queued on the device before any step planned from here)."""
        self._published_in_step.clear()

    def written_in_step(self, hits: GroupBlocks) -> bool:
        """Whether any of these prefix hits is published by the step being planned: its K/V
        is written by that same step, so attention must see the step's writes first."""
        published = self._published_in_step
        return bool(published) and any(b.block_id in published for group in hits for b in group)

    def cache_computed_blocks(self, request: CacheableRequest) -> None:
        """After a sampled token is appended: publish a block that this token completes when
        its K/V is already scheduled (with async scheduling the step that writes a token's
        K/V is scheduled before the token is known, so `allocate_slots` could not hash it)."""
        num_tokens = len(request.all_token_ids)
        # The block-boundary test first: it is the one that fails on most tokens.
        if (num_tokens % self.block_size or not self.enable_prefix_caching
                or request.skip_prefix_cache or request.num_computed_tokens < num_tokens):
            return
        if request.request_id in self.groups[0].req_to_blocks:
            self._cache_full_blocks(request, request.num_computed_tokens)

    def cache_verified_blocks(self, request: CacheableRequest) -> None:
        """After a verify step's kept tokens are appended and its rejected drafts rolled back:
        publish the blocks that its verified K/V fills (drafts' K/V is never published: the
        hashes cover known tokens only)."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return
        full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if (full > self.num_cached_blocks.get(request.request_id, 0)
                and request.request_id in self.groups[0].req_to_blocks):
            self._cache_full_blocks(request, request.num_computed_tokens)

    def free(self, request: CacheableRequest) -> None:
        """Release a finished, aborted or preempted request's blocks in every group and its
        state slot."""
        for manager in self.groups:
            manager.free(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        if self.state_slots is not None and request.state_slot >= 0:
            self.state_slots.give_back(request.state_slot)
            request.state_slot = -1

    def forget(self, request: CacheableRequest) -> None:
        """Drop a finished request's hash list (kept across preemption, since its tokens stay)."""
        self.req_to_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
