"""One cache group's blocks per request: full attention keeps them all, a sliding window frees
those no query can see any more. The coordinator (manager.py) drives one of these per group over
a shared BlockPool; every group of a request has the same number of entries in its list (a
sliding group's freed or never-needed ones are the OUT_OF_WINDOW placeholder)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock

# Stands in a request's block list for a block it does not hold: freed because it fell out of
# the group's sliding window, or before the window of a prefix hit. Never in the pool, never
# read (those positions are masked out); the runner's block table shows it as page 0.
OUT_OF_WINDOW = KVCacheBlock(-1)


class FullAttentionManager:
    """Blocks of a group of full-attention layers: every block a request has computed."""

    sliding_window: int | None = None

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Group 0 publishes under the plain block hash (the one-group case costs nothing
        # extra); other groups under the hash with their id, so a key names its group.
        self._key_suffix = b"" if group_id == 0 else b"\x02group:" + str(group_id).encode()

    def key(self, block_hash: bytes) -> bytes:
        return block_hash + self._key_suffix if self._key_suffix else block_hash

    def find_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most `max_blocks` blocks."""
        lookup = self.pool.cached_blocks.get
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = lookup(self.key(hashes[i]))
            if block is None:
                break
            hits.append(block)
        return hits

    def num_skipped(self, first_query: int) -> int:
        """Blocks before the first key a query at `first_query` sees (none: it sees all)."""
        return 0

    def free_out_of_window(self, request_id: str, first_query: int, num_published: int
                           ) -> None:
        """Nothing leaves a full-attention group before the request ends."""

    def publish(self, blocks: list[KVCacheBlock], hashes: Sequence[bytes], start: int,
                end: int) -> list[KVCacheBlock]:
        """Publish blocks [start, end) under this group's keys; the ones newly published."""
        fresh = [b for b in blocks[start:end] if b.block_hash is None]
        if self._key_suffix:
            keys = [self.key(h) for h in hashes[start:end]]
            self.pool.cache_blocks(blocks[start:end], keys, 0, end - start)
        else:
            self.pool.cache_blocks(blocks, list(hashes), start, end)
        return [b for b in fresh if b.block_hash is not None]

    def free(self, request_id: str) -> None:
        """Give back the request's blocks, the tail first, so under pressure a prompt's last
        blocks are evicted before its first ones (which more requests are likely to share)."""
        self.pool.free(reversed(self.req_to_blocks.pop(request_id, ())))


class SlidingWindowManager(FullAttentionManager):
    """Blocks of a group of layers with a sliding window of `sliding_window` tokens (a query at
    p sees keys p - window + 1 .. p): blocks before a step's first visible key are freed while
    the request runs, so a long request holds about window / block_size blocks."""

    def __init__(self, pool: BlockPool, block_size: int, group_id: int,
                 sliding_window: int) -> None:
        super().__init__(pool, block_size, group_id)
        self.sliding_window = sliding_window
        self.num_out_of_window: dict[str, int] = {}

    def num_skipped(self, first_query: int) -> int:
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def find_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most `max_blocks` blocks whose last window is cached: blocks
        [skipped, L) where the first query after the hit, at L * block_size, sees from
        `skipped` on; placeholders before them. Scans from the right, each block once."""
        lookup: Callable[[bytes], KVCacheBlock | None] = self.pool.cached_blocks.get
        end, run = max_blocks, 0
        found: list[KVCacheBlock] = []  # blocks [end - run, end), right to left
        while True:
            first = self.num_skipped(end * self.block_size)
            if end - first <= run:
                kept = found[:end - first][::-1]
                return [OUT_OF_WINDOW] * first + kept
            block = lookup(self.key(hashes[end - run - 1]))
            if block is not None:
                found.append(block)
                run += 1
            else:
                end, run = end - run - 1, 0
                found = []

    def free_out_of_window(self, request_id: str, first_query: int, num_published: int
                           ) -> None:
        """Free the blocks before the first key the step's queries (from `first_query` on) can
        see. A step still in flight may read them, but its kernels run before any later step's
        writes (one stream), so handing them out again is safe. With prefix caching a block
        leaves only once published (`num_published`: with async scheduling a block's last
        token can be known a step late), so its hash outlives it as an evictable cache entry."""
        held = self.req_to_blocks.get(request_id)
        if held is None:
            return
        num_out = min(self.num_skipped(first_query), len(held), num_published)
        done = self.num_out_of_window.get(request_id, 0)
        if num_out <= done:
            return
        freed = [b for b in held[done:num_out] if b is not OUT_OF_WINDOW]
        held[done:num_out] = [OUT_OF_WINDOW] * (num_out - done)
        self.pool.free(reversed(freed))
        self.num_out_of_window[request_id] = num_out

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_out_of_window.pop(request_id, None)
        self.pool.free(reversed([b for b in blocks if b is not OUT_OF_WINDOW]))


def make_manager(pool: BlockPool, block_size: int, group_id: int,
                 sliding_window: int | None) -> FullAttentionManager:
    if sliding_window is None:
        return FullAttentionManager(pool, block_size, group_id)
    return SlidingWindowManager(pool, block_size, group_id, sliding_window)
