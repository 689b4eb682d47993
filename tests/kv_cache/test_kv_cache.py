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
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.request import Request


def _req(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


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


def test_batched_allocate_and_free_keep_the_queue_in_lru_order():
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    hashes = [bytes([i]) * 32 for i in range(6)]
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache_block(block, block_hash)
    pool.free(blocks[3:])
    # A double free raises with the blocks before it freed and the queue still linked.
    with pytest.raises(ValueError, match="double free"):
        pool.free([blocks[0], blocks[1], blocks[1]])
    assert [b.block_id for b in pool.free_queue] == [3, 4, 5, 0, 1]
    assert pool.num_free_blocks == 5 and blocks[2].ref_cnt == 1
    taken = pool.allocate(4)  # from the head; each cached block taken loses its hash
    assert taken == [blocks[3], blocks[4], blocks[5], blocks[0]]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in taken)
    assert pool.num_evictions == 4
    assert pool.cached_blocks == {hashes[1]: blocks[1], hashes[2]: blocks[2]}
    assert [b.block_id for b in pool.free_queue] == [1] and pool.num_free_blocks == 1
    pool.free(taken)
    assert [b.block_id for b in pool.free_queue] == [1, 3, 4, 5, 0]
    assert pool.allocate(2) == [blocks[1], blocks[3]]
    assert pool.num_evictions == 5 and pool.cached_blocks == {hashes[2]: blocks[2]}
    assert [b.block_id for b in pool.free_queue] == [4, 5, 0] and pool.num_free_blocks == 3
    assert pool.allocate(0) == [] and pool.num_free_blocks == 3


def test_cache_blocks_keeps_the_first_published_copy():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    hashes = [bytes([i]) * 32 for i in range(3)]
    pool.cache_blocks([a, b], hashes, 0, 2)
    # c holds b's prefix (b stays the cached copy); a is published already (keeps its hash).
    pool.cache_blocks([c, a], [hashes[1], hashes[2]], 0, 2)
    assert pool.lookup(hashes[1]) is b and c.block_hash is None
    assert a.block_hash == hashes[0] and pool.lookup(hashes[2]) is None
    pool.cache_block(c, hashes[1])
    assert c.block_hash is None
    off = BlockPool(2, enable_caching=False)
    d, e = off.allocate(2)
    off.cache_blocks([d, e], hashes[:2], 0, 2)
    off.cache_block(d, hashes[2])
    assert not off.cached_blocks and d.block_hash is None and e.block_hash is None


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
    assert kv.get_computed_blocks(a) == ((), 0)
    (blocks_a,) = kv.allocate_slots(a, 10)  # one cache group
    assert len(blocks_a) == 3
    a.num_computed_tokens = 10
    b = _req("b", prompt + [99])
    hits, num = kv.get_computed_blocks(b)
    assert num == 8 and hits == (blocks_a[:2],)
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
    assert num == 4 and len(hits[0]) == 1


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


def test_diff_kv_spec_sizes_k_and_v_apart():
    # Values of their own head size: K and V rows of each slot, nothing padded.
    spec = FullAttentionSpec(16, 4, 192, torch.bfloat16, head_size_v=128)
    assert spec.value_head_size == 128
    assert spec.page_size_bytes == 16 * 4 * (192 + 128) * 2
    window = SlidingWindowSpec(16, 4, 192, torch.bfloat16, head_size_v=128, sliding_window=64)
    assert window.page_size_bytes == spec.page_size_bytes
    # An equal value head size is the plain layer: one spec, one size.
    assert FullAttentionSpec(16, 4, 128, torch.float32, head_size_v=128) == \
        FullAttentionSpec(16, 4, 128, torch.float32)


@pytest.mark.parametrize("backend_name", ["CPU", "TRITON"])
def test_diff_kv_cache_sizing_and_allocation(backend_name):
    """bytes per block = block_size * Hkv * (D + D_v) * dtype bytes * layers, in the specs the
    budget divides and in the tensors allocated."""
    from pagedserve.attention import AttentionLayerConfig, get_backend_cls
    from pagedserve.engine.kv_cache_setup import allocate_kv_caches, attention_specs

    backend = get_backend_cls(backend_name)
    num_layers, bs, hkv, d, dv = 3, 16, 4, 192, 128
    layers = [AttentionLayerConfig(16, hkv, d, torch.bfloat16, head_size_v=dv)] * num_layers
    specs = attention_specs(backend, layers, bs, torch.bfloat16)
    per_block = bs * hkv * (d + dv) * 2 * num_layers
    assert bytes_per_block(specs) == per_block
    assert backend.get_page_size_bytes(bs, hkv, d, torch.bfloat16, head_size_v=dv) == \
        per_block // num_layers
    num_blocks = num_blocks_for_budget(specs, 10 * per_block + 1)
    assert num_blocks == 10
    caches = allocate_kv_caches(backend, specs, num_blocks, torch.bfloat16,
                                torch.device("cpu"))
    assert sum(c.numel() * c.element_size() for c in caches) == num_blocks * per_block
    k, v = backend.kv_cache_views(caches[0], head_size_v=dv)
    assert k.shape == (num_blocks, bs, hkv, d) and v.shape == (num_blocks, bs, hkv, dv)
    assert k.stride() == v.stride()  # one set of strides serves both in the kernels
    # Equal sizes keep the K/V-outermost layout and its size.
    plain = attention_specs(backend, [AttentionLayerConfig(16, hkv, d, torch.bfloat16)], bs,
                            torch.bfloat16)
    assert plain[0].page_size_bytes == 2 * bs * hkv * d * 2
    (cache,) = allocate_kv_caches(backend, plain, 2, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (2, 2, bs, hkv, d)
