"""The KV cache coordinator over groups of one attention kind each (a full-attention group and
sliding-window groups): admission over all groups at once, out-of-window freeing per group,
preemption, prefix hits that every group agrees on. Every test ends with the pool all free."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.kv_cache import KVCacheManager
from pagedserve.kv_cache.single_type import OUT_OF_WINDOW
from pagedserve.scheduler import Request

BLOCK, WINDOW = 4, 8


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=32))


def _held(kv: KVCacheManager, group: int, rid: str) -> list[int]:
    return [b.block_id for b in kv.groups[group].req_to_blocks.get(rid, ())
            if b is not OUT_OF_WINDOW]


def _run_chunks(kv: KVCacheManager, request: Request, chunks: list[int]) -> list[int]:
    """Allocate and 'compute' each chunk; the last group's blocks held after each."""
    peaks = []
    for chunk in chunks:
        assert kv.allocate_slots(request, chunk) is not None
        peaks.append(len(_held(kv, len(kv.groups) - 1, request.request_id)))
        request.num_computed_tokens += chunk
    return peaks


def test_admission_counts_every_group_against_the_one_pool():
    kv = KVCacheManager(10, BLOCK, windows=[None, WINDOW])
    a = _req("a", list(range(20)))  # 5 blocks in each group: 10 in all
    blocks = kv.allocate_slots(a, 20)
    assert [len(g) for g in blocks] == [5, 5] and kv.num_free_blocks == 0
    assert not {b.block_id for b in blocks[0]} & {b.block_id for b in blocks[1]}
    b = _req("b", [1])
    assert not kv.can_allocate(b, 1) and kv.allocate_slots(b, 1) is None
    assert "b" not in kv.groups[0].req_to_blocks and kv.num_free_blocks == 0
    kv.free(a)
    assert kv.all_free()
    # 6 blocks per group do not fit 10 together, even though each group alone would.
    assert kv.allocate_slots(_req("c", list(range(24))), 24) is None
    assert kv.all_free()


def test_sliding_group_frees_out_of_window_blocks_the_full_group_keeps_them():
    kv = KVCacheManager(200, BLOCK, enable_prefix_caching=False, windows=[None, WINDOW])
    request = _req("r", list(range(1, 101)))
    peaks = _run_chunks(kv, request, [16] * 6 + [4])
    # The full group holds every block of the 100 tokens; the lists stay the same length.
    assert len(_held(kv, 0, "r")) == 25
    assert len(kv.groups[1].req_to_blocks["r"]) == 25
    # The sliding group: the window before a chunk's first query and the chunk's blocks.
    assert max(peaks) <= (16 + WINDOW) // BLOCK + 1
    first_visible = (request.num_computed_tokens - 4 - WINDOW + 1) // BLOCK
    assert _held(kv, 1, "r") == [b.block_id for b in
                                 kv.groups[1].req_to_blocks["r"][first_visible:]]
    for _ in range(12):  # decodes
        request.append_output_token(7)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        assert len(_held(kv, 1, "r")) <= WINDOW // BLOCK + 1
    assert kv.num_free_blocks == 200 - len(_held(kv, 0, "r")) - len(_held(kv, 1, "r"))
    kv.free(request)
    assert kv.all_free()


def test_freed_window_blocks_make_room_for_the_same_step():
    """A running request's out-of-window blocks are freed before its new ones are counted."""
    kv = KVCacheManager(10, BLOCK, enable_prefix_caching=False, windows=[None, WINDOW])
    request = _req("r", list(range(1, 41)))
    # 4 + 4 blocks, then 2 + 2 more with 2 free: the sliding group's first two left first.
    _run_chunks(kv, request, [16, 8])
    assert kv.num_free_blocks == 0
    # 4 more tokens: one block per group, none free; the sliding group frees two first.
    assert kv.allocate_slots(request, 4) is not None
    assert kv.num_free_blocks == 0
    kv.free(request)
    assert kv.all_free()


def test_preemption_frees_every_group_and_readmission_starts_over():
    kv = KVCacheManager(40, BLOCK, windows=[None, WINDOW, WINDOW])
    request = _req("r", list(range(1, 61)))
    _run_chunks(kv, request, [16, 16, 8])
    kv.free(request)  # preempted: recompute from scratch
    assert kv.all_free()
    request.num_computed_tokens = 0
    blocks = kv.allocate_slots(request, 16)
    assert [len(g) for g in blocks] == [4, 4, 4]
    assert all(b is not OUT_OF_WINDOW for g in blocks for b in g)
    kv.free(request)
    assert kv.all_free()


def test_blocks_needed_counts_a_window_per_sliding_group():
    kv = KVCacheManager(100, BLOCK, windows=[None, WINDOW])
    assert kv.blocks_needed(100) == 25 + 25  # the whole prompt in one step
    # Chunks of 16: the sliding group holds the window, the chunk and one late block.
    assert kv.blocks_needed(100, 16) == 25 + -(-(WINDOW - 1 + 16) // BLOCK) + 2


def _computed(kv: KVCacheManager, rid: str, prompt: list[int], chunk: int) -> Request:
    """A request whose whole prompt was computed (and published) in chunks, then finished."""
    request = _req(rid, prompt)
    chunks = [chunk] * (len(prompt) // chunk) + ([len(prompt) % chunk] if len(prompt) % chunk
                                                  else [])
    _run_chunks(kv, request, chunks)
    return request


@pytest.mark.parametrize("windows", [[None, WINDOW], [WINDOW, None, WINDOW], [WINDOW]])
def test_prefix_hit_keeps_the_window_before_it_in_sliding_groups(windows):
    kv = KVCacheManager(64, BLOCK, windows=windows)
    prompt = list(range(1, 42))  # 10 full blocks and one token
    a = _computed(kv, "a", prompt, 8)
    kv.free(a)
    assert kv.all_free()
    b = _req("b", prompt + [5, 6, 7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 40 and len(hits) == len(windows)
    first = (40 - WINDOW + 1) // BLOCK  # the first block a query at 40 sees
    for window, group_hits in zip(windows, hits, strict=True):
        assert len(group_hits) == 10
        if window is None:
            assert OUT_OF_WINDOW not in group_hits
        else:  # placeholders before the window; the window's blocks are real hits
            assert group_hits[:first] == [OUT_OF_WINDOW] * first
            assert OUT_OF_WINDOW not in group_hits[first:]
    free_before = kv.num_free_blocks
    blocks = kv.allocate_slots(b, 4, hits)
    assert blocks is not None
    # Hits taken off the free queue plus one new block per group; placeholders take nothing.
    real_hits = sum(1 for g in hits for blk in g if blk is not OUT_OF_WINDOW)
    assert kv.num_free_blocks == free_before - real_hits - len(windows)
    assert kv.group_block_ids("b")[windows.index(WINDOW)][:first] == [0] * first
    kv.free(b)
    assert kv.all_free()


def test_prefix_hit_shrinks_until_every_group_agrees():
    kv = KVCacheManager(64, BLOCK, windows=[None, WINDOW])
    prompt = list(range(1, 42))
    kv.free(_computed(kv, "a", prompt, 8))
    hashes = kv.req_to_hashes["a"]
    full, sliding = kv.groups
    def evict(key: bytes) -> None:
        kv.pool.cached_blocks.pop(key).block_hash = None

    # The sliding group loses block 9 (the last of the window before 40): the longest hit
    # whose window it still holds ends at block 9 (a query at 36 sees blocks 7 and 8).
    evict(sliding.key(hashes[9]))
    hits, num_hit = kv.get_computed_blocks(_req("b", prompt))
    assert num_hit == 36 and [len(g) for g in hits] == [9, 9]
    # The full group loses block 5: at most 5 blocks; the sliding group holds blocks 3 and 4.
    evict(full.key(hashes[5]))
    hits, num_hit = kv.get_computed_blocks(_req("c", prompt))
    assert num_hit == 20 and hits[1][:3] == [OUT_OF_WINDOW] * 3
    # The sliding group also loses block 4: no window ends at 5 blocks; 4 (blocks 2, 3) does.
    evict(sliding.key(hashes[4]))
    hits, num_hit = kv.get_computed_blocks(_req("d", prompt))
    assert num_hit == 16 and hits[1][2:] == [kv.pool.cached_blocks[sliding.key(hashes[i])]
                                             for i in (2, 3)]
    # A group's key carries the group: the other group's blocks never answer for it.
    assert full.key(hashes[0]) != sliding.key(hashes[0])
    assert kv.all_free()


def test_window_blocks_leave_only_once_published():
    """With prefix caching a sliding group's block is freed only after it is published, so a
    block whose last token is not known yet (async scheduling) stays until it is."""
    kv = KVCacheManager(64, BLOCK, windows=[None, WINDOW])
    request = _req("r", list(range(1, 13)))
    assert kv.allocate_slots(request, 12) is not None
    request.num_computed_tokens = 12
    # Decodes whose tokens arrive a step late: scheduled tokens run ahead of known ones.
    for _ in range(16):
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        published = kv.num_cached_blocks.get("r", 0)
        held = kv.groups[1].req_to_blocks["r"]
        assert all(b is not OUT_OF_WINDOW for b in held[published:])
        request.append_output_token(3)
        kv.cache_computed_blocks(request)
    assert kv.groups[1].num_out_of_window["r"] > 0
    kv.free(request)
    assert kv.all_free()


def test_one_groups_new_blocks_never_take_another_groups_hits():
    """Every group's hits leave the free queue before any group takes a fresh block: an
    evictable hit at the queue's head must not be handed out as another group's new block."""
    kv = KVCacheManager(8, BLOCK, windows=[None, WINDOW])
    prompt = list(range(1, 13))
    a = _req("a", prompt)
    kv.allocate_slots(a, 12)  # 3 blocks per group, published
    c = _req("c", [1])
    kv.allocate_slots(c, 1)  # the two blocks no one used yet
    # a's second group's blocks go back head first: the free queue starts with its hits.
    kv.pool.free(kv.groups[1].req_to_blocks.pop("a"))
    kv.pool.free(reversed(kv.groups[0].req_to_blocks.pop("a")))
    kv.num_cached_blocks.pop("a")
    b = _req("b", prompt[:8] + [99] * 4)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and hits[1][0] is kv.pool.free_queue._head.next_free
    blocks = kv.allocate_slots(b, 4, hits)
    ids = [blk.block_id for group in blocks for blk in group]
    assert len(set(ids)) == len(ids) == 6
    assert all(blk.ref_cnt == 1 for group in blocks for blk in group)
    kv.free(b)
    kv.free(c)
    assert kv.all_free()
