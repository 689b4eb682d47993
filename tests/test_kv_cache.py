"""BlockPool and KVCacheManager: allocation, reference counts, prefix hashes and LRU eviction."""

import pytest
import torch

from pagedserve.kv_cache import (
    BlockPool,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    bytes_per_block,
    num_blocks_for_budget,
)
from pagedserve.kv_cache.manager import NONE_HASH, hash_block
from pagedserve.scheduler.request import Request


def _req(rid, tokens, salt=None):
    return Request(rid, tokens, None, cache_salt=salt)


def test_allocate_and_free_ref_counts():
    pool = BlockPool(8, enable_caching=False)
    a = pool.allocate(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 5
    pool.touch(a[:1])
    assert a[0].ref_cnt == 2
    pool.free(a)
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 7
    pool.free(a[:1])
    assert pool.num_free_blocks == 8
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.allocate(9)


def test_free_queue_order_is_lru():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    # Least recently freed is evicted first; its hash is dropped.
    first = pool.allocate(1)[0]
    assert first is blocks[2] and first.block_hash is None
    assert pool.lookup(bytes([2]) * 32) is None
    assert pool.lookup(bytes([0]) * 32) is blocks[0]
    assert pool.num_evictions == 1


def test_hash_chaining_and_salt():
    h1 = hash_block(NONE_HASH, [1, 2, 3, 4], None)
    assert h1 == hash_block(NONE_HASH, [1, 2, 3, 4], None)
    assert hash_block(h1, [1, 2, 3, 4], None) != h1  # same tokens after a prefix differ
    assert hash_block(NONE_HASH, [1, 2, 3, 4], "tenant-a") != h1
    assert hash_block(NONE_HASH, [1, 2, 3, 5], None) != h1


def test_prefix_hit_shares_blocks_and_survives_while_in_use():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    a = _req("a", prompt)
    assert kv.get_computed_blocks(a) == ([], 0)
    blocks_a = kv.allocate_slots(a, 10)
    assert len(blocks_a) == 3
    a.num_computed_tokens = 10
    b = _req("b", prompt + [99])
    hits, num = kv.get_computed_blocks(b)
    assert num == 8 and hits == blocks_a[:2]
    assert kv.allocate_slots(b, 3, hits) is not None
    assert [blk.ref_cnt for blk in blocks_a[:2]] == [2, 2]
    # Fill the pool: the shared blocks are in use and cannot be evicted.
    c = _req("c", list(range(100, 108)))
    assert kv.allocate_slots(c, 8) is None  # 1 free block left, 2 needed
    kv.free(a)
    assert [blk.ref_cnt for blk in blocks_a[:2]] == [1, 1]
    assert kv.allocate_slots(c, 8) is not None  # took a's last (unhashed) block and one free
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks == kv.num_blocks


def test_salt_separates_identical_prompts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    a = _req("a", prompt, salt="x")
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(_req("b", prompt, salt="y"))[1] == 0
    assert kv.get_computed_blocks(_req("c", prompt, salt="x"))[1] == 8
    assert kv.get_computed_blocks(_req("d", prompt))[1] == 0


def test_last_token_is_never_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    kv.allocate_slots(_req("a", prompt), 8)
    hits, num = kv.get_computed_blocks(_req("b", prompt))
    assert num == 4 and len(hits) == 1


def test_specs_and_budget():
    full = FullAttentionSpec(16, 3, 64, torch.float32)
    assert full.page_size_bytes == 2 * 16 * 3 * 64 * 4
    window = SlidingWindowSpec(16, 3, 64, torch.bfloat16, sliding_window=128)
    assert bytes_per_block([full, window]) == full.page_size_bytes + window.page_size_bytes
    assert num_blocks_for_budget([full] * 30, 30 * full.page_size_bytes * 10 + 5) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget([full], 10)
    with pytest.raises(ValueError, match="one block size"):
        bytes_per_block([full, FullAttentionSpec(32, 3, 64, torch.float32)])
