"""BlockPool: fixed-size KV blocks, a free queue, reference counts and the prefix-hash map.

A block whose reference count drops to zero goes to the tail of the free queue. If it holds a
prefix hash it stays findable there (an "evictable" cached block) until it reaches the head and
is taken for new tokens, which is when its hash is dropped: the queue is the LRU order of
eviction. Every operation is O(1) per block.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Links of the doubly linked free queue; None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """A doubly linked list of blocks with O(1) pop from the head, push to the tail and removal
    from the middle (a cache hit takes an evictable block out of the queue)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_blocks += 1

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first n blocks, unlinked in one pass and one splice (n <= num_blocks)."""
        if n > self.num_blocks:
            raise ValueError(f"cannot take {n} blocks, only {self.num_blocks} free")
        if n <= 0:
            return []
        out = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_blocks -= n
        return out

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """Append blocks to the tail in order, with one splice."""
        if not blocks:
            return
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_blocks += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones and evictable cached ones)."""
        return self.free_queue.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` fresh blocks from the head of the free queue (least recently freed
        first), evicting the prefix hash of any cached block taken."""
        if num_blocks > self.free_queue.num_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only "
                             f"{self.free_queue.num_blocks} free")
        out = self.free_queue.popleft_n(num_blocks)
        # A block holding a hash is the one the map publishes under it (cache_block publishes
        # a block only under a hash not yet taken), so eviction is a plain delete.
        cached = self.cached_blocks
        for block in out:
            if block.block_hash is not None:
                del cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks that reach zero join the free queue's tail
        in the order given (so callers pass the blocks they would rather keep cached last)."""
        released: list[KVCacheBlock] = []
        try:
            for block in blocks:
                if block.ref_cnt <= 0:
                    raise ValueError(f"double free of block {block.block_id}")
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    released.append(block)
        finally:  # the blocks released before a double free still join the queue
            self.free_queue.extend(released)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to cached blocks found by a prefix lookup; an evictable one leaves
        the free queue so it can no longer be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full block under its prefix hash. If an equal block is already published
        (two requests computed the same prefix at once) the first one stays the cached copy."""
        if (self.enable_caching and block.block_hash is None
                and self.cached_blocks.setdefault(block_hash, block) is block):
            block.block_hash = block_hash

    def cache_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes], start: int,
                     end: int) -> None:
        """cache_block(blocks[i], block_hashes[i]) for i in range(start, end), in one call."""
        if not self.enable_caching:
            return
        setdefault = self.cached_blocks.setdefault
        for i in range(start, end):
            block = blocks[i]
            # Published unless an equal block already is (that one stays the cached copy).
            if block.block_hash is None and setdefault(block_hashes[i], block) is block:
                block.block_hash = block_hashes[i]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
