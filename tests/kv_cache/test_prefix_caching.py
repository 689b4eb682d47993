"""Automatic prefix caching.

Unit level: chained block hashes, LRU eviction of cached blocks, reference counts of blocks shared
by running requests, in-use blocks never evicted, salts, and a simulated KV cache that checks every
request reads exactly its own tokens under random shared-prefix workloads with chunked prefill and
preemption. End to end on tiny random-weight models: greedy tokens (and prompt logprobs) equal
with and without caching and equal transformers', while the cache is really hit, both on blocks of
finished requests (evictable) and on blocks of running ones.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.config import SchedulerConfig
from pagedserve.engine.stats_log import maybe_log_stats
from pagedserve.kv_cache import KVCacheManager
from pagedserve.kv_cache.manager import NONE_HASH, hash_block
from pagedserve.scheduler import Request, RequestStatus, Scheduler


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tiny models gain nothing from a second thread, and on a busy 2-core machine the
    threads' hand-offs cost 10-100x the work itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def Params(max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:  # noqa: N802
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                          prompt_logprobs=prompt_logprobs)


def _req(rid: str, tokens: list[int], salt: str | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, tokens, Params(max_tokens), cache_salt=salt)


def _hashes(kv: KVCacheManager, request: Request) -> list[bytes]:
    return kv._block_hashes(request, request.num_tokens // kv.block_size)


# ---- hashes ---------------------------------------------------------------------------------

def test_hash_is_sha256_chained_over_whole_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(14)))  # three full blocks and a partial one
    b = _req("b", list(range(8)) + [99, 9, 10, 11, 12, 13])  # differs in block 2 only
    ha, hb = _hashes(kv, a), _hashes(kv, b)
    assert len(ha) == 3 and all(len(h) == 32 for h in ha)  # SHA-256 digests, no partial block
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # Every hash depends on all blocks before it: equal tokens after a different first block
    # give different hashes.
    c = _req("c", [7] + list(range(1, 14)))
    assert all(x != y for x, y in zip(ha, _hashes(kv, c), strict=True))
    # The chain is block by block: block i's hash is hash_block(hash of block i-1, its tokens).
    assert ha[0] == hash_block(NONE_HASH, [0, 1, 2, 3], None)
    assert ha[2] == hash_block(ha[1], [8, 9, 10, 11], None)
    assert hash_block(ha[1], [8, 9, 10, 11], None) != hash_block(ha[0], [8, 9, 10, 11], None)


def test_salt_changes_every_hash_of_the_chain():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    plain = _hashes(kv, _req("a", prompt))
    salted = _hashes(kv, _req("b", prompt, salt="tenant-1"))
    other = _hashes(kv, _req("c", prompt, salt="tenant-2"))
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert salted == _hashes(kv, _req("d", prompt, salt="tenant-1"))


def _chain(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """hash_block's chain over the full blocks of `tokens`."""
    hashes, parent = [], NONE_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], salt)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("salt", [None, "tenant-1"])
@pytest.mark.parametrize("overlap", [False, True])
def test_blocks_filled_by_decodes_are_published_under_the_chain(salt, overlap):
    """The prompt's blocks are hashed in one pass on admission; blocks that decodes fill, one
    at a time, take the per-block path (in allocate_slots, or once the sample is back when
    the next step is scheduled before it: `overlap`). Both give hash_block's chain, published
    as soon as the block is full."""
    sched, kv = _scheduler(num_blocks=64, block_size=4, budget=64)
    request = _req("a", list(range(10)), salt, max_tokens=15)
    sched.add_request(request)
    tokens = iter(range(100, 200))
    pending, steps = None, 0
    while True:
        out = sched.schedule()
        if not overlap:
            pending = out
        if pending is not None and not pending.is_empty:
            sched.update_from_output(pending, np.array([next(tokens) for _ in pending.requests]))
        pending = out
        steps += 1
        assert steps < 100
        if not request.is_finished:  # every full block of known, computed tokens is published
            known = request.all_token_ids[:min(request.num_computed_tokens, request.num_tokens)]
            assert all(kv.pool.lookup(h) is not None for h in _chain(known, 4, salt))
        elif pending.is_empty:
            break
    assert request.num_output_tokens == 15
    computed = request.all_token_ids[:-1]  # the last sample is never fed back
    expected = _chain(computed, 4, salt)
    assert len(expected) == 6  # two prompt blocks, one the decodes finish, three of decodes
    published = [kv.pool.lookup(h) for h in expected]
    assert all(b is not None and b.block_hash == h for b, h in zip(published, expected,
                                                                    strict=True))
    assert len({b.block_id for b in published}) == 6
    assert kv.get_computed_blocks(_req("b", computed + [7], salt))[1] == 24


# ---- block pool through the manager -----------------------------------------------------------

def _run_prompt(kv: KVCacheManager, rid: str, prompt: list[int], salt: str | None = None):
    """Admit a request the way the scheduler does; returns it with its prefix hit in tokens."""
    request = _req(rid, prompt, salt)
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(prompt) - num_hit, hits) is not None
    request.num_computed_tokens = len(prompt)
    return request, num_hit


def _hit(kv: KVCacheManager, prompt: list[int]) -> int:
    """Tokens a new request with this prompt would find cached (the lookup has no effect)."""
    probe = _req(f"probe-{len(kv.req_to_hashes)}", prompt)
    num_hit = kv.get_computed_blocks(probe)[1]
    kv.forget(probe)
    return num_hit


def test_partial_blocks_are_never_shared():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, _ = _run_prompt(kv, "a", list(range(10)))
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, False]
    _, num_hit = _run_prompt(kv, "b", list(range(10)) + [50, 51])
    assert num_hit == 8  # the third block of a holds only two tokens


def test_ref_counts_of_blocks_shared_by_running_requests():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(8))
    reqs = [_run_prompt(kv, f"r{i}", prefix + [100 + i] * 3)[0] for i in range(3)]
    shared = kv.req_to_blocks["r0"][:2]
    assert all(kv.req_to_blocks[r.request_id][:2] == shared for r in reqs)
    assert [b.ref_cnt for b in shared] == [3, 3]
    assert kv.num_free_blocks == 16 - 2 - 3  # two shared blocks plus one own block each
    kv.free(reqs[0])
    kv.free(reqs[2])
    assert [b.ref_cnt for b in shared] == [1, 1] and kv.num_free_blocks == 16 - 3
    kv.free(reqs[1])
    assert kv.num_free_blocks == 16
    # Free but still findable: the next request with this prefix takes them back.
    _, num_hit = _run_prompt(kv, "late", prefix + [7])
    assert num_hit == 8 and [b.ref_cnt for b in shared] == [1, 1]


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, _ = _run_prompt(kv, "a", [1, 2, 3, 4, 5])  # blocks 0 [1,2] 1 [3,4] 2 [5]
    b, _ = _run_prompt(kv, "b", [6, 7, 8, 9, 10])  # blocks 3, 4, 5
    kv.free(b)  # freed first: b's blocks are the least recently used ...
    kv.free(a)
    # ... and a request's tail joins the queue first, so shared heads live longest.
    assert [blk.block_id for blk in kv.pool.free_queue] == [5, 4, 3, 2, 1, 0]
    c, _ = _run_prompt(kv, "c", [20, 21, 22, 23])  # two blocks: b's partial one and b's tail
    assert kv.pool.num_evictions == 1
    assert _hit(kv, [6, 7, 8, 9, 10]) == 2  # b's head survives
    assert _hit(kv, [1, 2, 3, 4, 5]) == 4  # a untouched
    kv.free(c)
    d, _ = _run_prompt(kv, "d", [30, 31, 32, 33, 34, 35])  # b's head, a's partial, a's tail
    assert kv.pool.num_evictions == 3
    assert _hit(kv, [6, 7, 8, 9, 10]) == 0
    assert _hit(kv, [1, 2, 3, 4, 5]) == 2
    assert _hit(kv, [20, 21, 22, 23, 0]) == 4  # c was freed last
    kv.free(d)


def test_hit_on_evictable_block_is_taken_out_of_the_queue():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, _ = _run_prompt(kv, "a", list(range(9)))
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = _req("b", list(range(9)) + [1, 2, 3])  # hits two evictable blocks, needs one fresh
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and all(h.ref_cnt == 0 for h in hits[0])
    assert kv.allocate_slots(b, 4, hits) is not None
    assert [h.ref_cnt for h in hits[0]] == [1, 1] and kv.num_free_blocks == 0
    assert kv.pool.num_evictions == 0  # the fresh block was a's unhashed tail
    # A request that would need the hit blocks to be free cannot be placed.
    c = _req("c", [70, 71, 72])
    assert not kv.can_allocate(c, 3) and kv.allocate_slots(c, 3) is None
    assert [h.block_hash is not None for h in hits[0]] == [True, True]
    kv.free(b)


def test_can_allocate_counts_evictable_hits_against_the_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, _ = _run_prompt(kv, "a", list(range(9)))  # blocks 0, 1 cached, 2 partial
    kv.free(a)
    filler, _ = _run_prompt(kv, "f", list(range(90, 98)))  # the unused block and a's partial
    assert kv.pool.num_evictions == 0 and kv.num_free_blocks == 2
    b = _req("b", list(range(9)) + [50, 51, 52])
    hits, _ = kv.get_computed_blocks(b)
    assert len(hits[0]) == 2 and all(h.ref_cnt == 0 for h in hits[0])
    # One fresh block is needed and two are free, but both free ones are the hits themselves.
    assert not kv.can_allocate(b, 4, hits) and kv.allocate_slots(b, 4, hits) is None
    assert [h.ref_cnt for h in hits[0]] == [0, 0] and kv.num_free_blocks == 2
    kv.free(filler)
    assert kv.allocate_slots(b, 4, hits) is not None
    assert kv.pool.num_evictions == 1 and _hit(kv, list(range(90, 99))) == 4  # filler's tail
    kv.free(b)
    assert kv.num_free_blocks == 4


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, _ = _run_prompt(kv, "a", list(range(9)))
    _, num_hit = _run_prompt(kv, "b", list(range(9)))
    assert num_hit == 0 and not kv.pool.cached_blocks
    kv.free(a)


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _run_prompt(kv, "a", list(range(9)))
    b = Request("b", list(range(9)), Params(4, prompt_logprobs=1))
    assert kv.get_computed_blocks(b) == ((), 0)


# ---- scheduler admission ---------------------------------------------------------------------

def _scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv, max_model_len=512), kv


def _step(sched: Scheduler, token: int = 5):
    out = sched.schedule()
    sched.update_from_output(out, np.full(len(out.requests), token))
    return out


def test_admission_schedules_only_the_uncached_rest():
    sched, kv = _scheduler()
    sched.add_request(_req("a", list(range(10))))
    _step(sched)
    sched.add_request(_req("b", list(range(10)) + [40, 41, 42]))
    sched.add_request(_req("c", list(range(8))))  # all cached; its last block reruns for logits
    out = sched.schedule()
    sizes = dict(zip([r.request_id for r in out.requests], out.num_scheduled_tokens.tolist(),
                     strict=True))
    computed = dict(zip([r.request_id for r in out.requests], out.num_computed_tokens.tolist(),
                        strict=True))
    assert sizes == {"b": 5, "a": 1, "c": 4}
    assert computed["b"] == 8 and computed["c"] == 4
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 13 + 8, 8 + 4)


def test_a_hit_on_blocks_the_same_step_writes_is_flagged():
    # "b" arrives with "a" and hits the blocks a's prefill publishes while this very step is
    # planned: attention must see the step's K/V writes first. A hit on blocks written by an
    # earlier step is not flagged.
    sched, kv = _scheduler()
    sched.add_request(_req("a", list(range(10))))
    sched.add_request(_req("b", list(range(10)) + [50]))
    out = _step(sched)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_computed_tokens.tolist() == [0, 8] and out.context_written_in_step
    sched.add_request(_req("c", list(range(10)) + [60]))
    out = _step(sched)
    assert out.num_computed_tokens[[r.request_id for r in out.requests].index("c")] == 8
    assert not out.context_written_in_step


def test_chunked_prefill_continues_after_a_hit():
    sched, kv = _scheduler(budget=6)
    prefix = list(range(12))
    sched.add_request(_req("a", prefix + [90]))
    while sched.requests["a"].num_output_tokens == 0:
        _step(sched)
    sched.add_request(_req("b", prefix + list(range(60, 74))))  # 26 tokens, 12 cached
    chunks = []
    while sched.requests["b"].num_output_tokens == 0:
        out = sched.schedule()
        row = [r.request_id for r in out.requests].index("b")
        chunks.append((int(out.num_computed_tokens[row]), int(out.num_scheduled_tokens[row])))
        sched.update_from_output(out, np.full(len(out.requests), 5))
    assert chunks == [(12, 5), (17, 5), (22, 4)]  # a's decode takes one token of each step


# ---- random workloads over a simulated KV cache -----------------------------------------------

def _simulate(seed: int, num_blocks: int, block_size: int, budget: int, max_seqs: int):
    """Drive the scheduler with shared-prefix requests arriving over time. A fake KV cache
    records which token each slot holds; every step first writes the scheduled tokens (as the
    attention layers do) and then checks each scheduled request sees exactly its own tokens in
    its blocks, i.e. a prefix hit never hands out a block with other contents."""
    rng = random.Random(seed)
    sched, kv = _scheduler(num_blocks, block_size, budget, max_seqs)
    slots = np.full(num_blocks * block_size, -1, dtype=np.int64)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    requests = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(0, 9))]
        salt = rng.choice([None, None, "tenant"])
        requests.append(Request(f"r{i}", prompt, Params(rng.randint(1, 12)), cache_salt=salt))
    pending, steps = list(requests), 0
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        out = sched.schedule()
        steps += 1
        assert steps < 3000
        for req, start, n in zip(out.requests, out.num_computed_tokens.tolist(),
                                 out.num_scheduled_tokens.tolist(), strict=True):
            ids = np.array(kv.block_ids(req.request_id))
            pos = np.arange(start, start + n)
            slots[ids[pos // block_size] * block_size + pos % block_size] = \
                req.all_token_ids[start:start + n]
        for req, start, n in zip(out.requests, out.num_computed_tokens.tolist(),
                                 out.num_scheduled_tokens.tolist(), strict=True):
            ids = np.array(kv.block_ids(req.request_id))
            pos = np.arange(start + n)
            seen = slots[ids[pos // block_size] * block_size + pos % block_size]
            assert seen.tolist() == req.all_token_ids[:start + n], req.request_id
        _check_pool(kv)
        sched.update_from_output(out, np.array([rng.randrange(1000) for _ in out.requests]))
    for req in requests:
        assert req.status == RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == num_blocks and not kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    return sched, kv


def _check_pool(kv: KVCacheManager) -> None:
    """Reference counts equal the number of requests holding a block; held blocks are out of
    the free queue and, when cached, still published (never evicted while in use)."""
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    in_queue = {b.block_id for b in kv.pool.free_queue}
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.block_id in in_queue) == (block.ref_cnt == 0)
        if block.block_hash is not None:
            assert kv.pool.lookup(block.block_hash) is block
    assert all(kv.pool.cached_blocks[h].block_hash == h for h in kv.pool.cached_blocks)


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefixes_roomy(seed):
    _, kv = _simulate(seed, num_blocks=200, block_size=4, budget=48, max_seqs=8)
    assert kv.prefix_hits > 0 and kv.pool.cached_blocks


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefixes_preempt_and_evict(seed):
    sched, kv = _simulate(seed, num_blocks=14, block_size=4, budget=16, max_seqs=6)
    assert sched.num_preemptions > 0 and kv.pool.num_evictions > 0 and kv.prefix_hits > 0


# ---- end to end on tiny random-weight models --------------------------------------------------

NUM_NEW = 12
BLOCK_SIZE = 4

VARIANTS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_gpu_blocks_override": 22},
}


def _tiny_config(name: str) -> transformers.PretrainedConfig:
    # head_dim 64: a size every GPU backend supports (the GPU tests reuse these models).
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
    if name == "mistral_window":
        return transformers.MistralConfig(**common, sliding_window=24)
    return transformers.LlamaConfig(**common, rope_theta=10000.0)


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Greedy tokens from transformers' forward over the whole sequence at each step (no KV
    cache, so nothing in the reference resembles the code under test; `generate`'s per-call
    overhead is larger than these tiny models' work)."""
    ids = torch.tensor([prompt])
    for _ in range(NUM_NEW):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@torch.no_grad()
def _hf_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _rounds(vocab: int, seed: int) -> list[list[tuple[list[int], int | None]]]:
    """Four batches of (prompt, prompt_logprobs). Prefix lengths are not all block multiples;
    some prompts are exactly a prefix or repeat an earlier prompt (all but the last token hit).
    Batch 2 shares prefixes with the finished batch 1; batch 4 shares with batch 3, which is
    still running when batch 4 arrives."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    p = [rand(n) for n in (21, 8, 35, 26)]
    first = [(p[0] + rand(5), None), (p[1] + rand(1), None), (p[2] + rand(9), 3),
             (p[0] + rand(12), None), (p[1], None), (p[2] + rand(3), None)]
    second = [(p[0] + rand(7), None), (first[3][0], None), (p[2] + rand(2), 2),
              (p[1] + rand(10), None), (first[5][0] + rand(4), None), (p[2], None)]
    third = [(p[3] + rand(6), None), (p[3] + rand(11), None), (p[1] + rand(3), None)]
    fourth = [(p[3] + rand(2), None), (third[0][0], None), (p[3] + rand(9), 2),
              (p[1] + rand(3), None)]
    return [first, second, third, fourth]


class HitCounter:
    """Counts prefix hits by the state of the hit block: evictable (a finished request's) or
    in use (a running request's)."""

    def __init__(self, pool) -> None:
        self.evictable = self.in_use = 0
        self._touch = pool.touch
        pool.touch = self.touch

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        self.evictable += sum(b.ref_cnt == 0 for b in blocks)
        self.in_use += sum(b.ref_cnt > 0 for b in blocks)
        self._touch(blocks)


def _run_rounds(llm, rounds):
    """Round 1 and 2 run to completion one after the other; round 4 is added two steps after
    round 3, while round 3 runs. Returns outputs by (round, index) and hit counts per round."""
    engine = llm.engine
    counter = HitCounter(engine.kv_cache.pool)
    outputs, hits = {}, []

    def add(r: int) -> None:
        for i, (prompt, prompt_lp) in enumerate(rounds[r]):
            params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True,
                                    prompt_logprobs=prompt_lp)
            engine.add_request(f"{r}-{i}", prompt, params)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                r, i = map(int, out.request_id.split("-"))
                outputs[r, i] = out

    def drain() -> None:
        while engine.has_unfinished_requests():
            step()

    for r in (0, 1):
        before = (counter.evictable, counter.in_use)
        add(r)
        drain()
        hits.append((counter.evictable - before[0], counter.in_use - before[1]))
    add(2)
    step()
    step()
    before = (counter.evictable, counter.in_use)
    add(3)
    drain()
    hits.append((counter.evictable - before[0], counter.in_use - before[1]))
    return outputs, hits


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    models = {}
    for seed, name in enumerate(["llama", "mistral_window"]):
        config = _tiny_config(name)
        path = tmp_path_factory.mktemp(name)
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        hf.eval()
        hf.save_pretrained(path)
        rounds = _rounds(config.vocab_size, seed=50 + seed)
        expected = {(r, i): _hf_greedy(hf, prompt) for r, batch in enumerate(rounds)
                    for i, (prompt, _) in enumerate(batch)}
        models[name] = (str(path), hf, rounds, expected)
    return models


def _make(make_llm, path: str, caching: bool, **kwargs):
    return make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="4MiB",
                    block_size=BLOCK_SIZE, enable_prefix_caching=caching, **kwargs)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_outputs_equal_with_and_without_caching(tiny_model, make_llm, name, variant):
    path, hf, rounds, expected = tiny_model[name]
    cached_llm = _make(make_llm, path, True, **VARIANTS[variant])
    plain_llm = _make(make_llm, path, False, **VARIANTS[variant])
    cached, hits = _run_rounds(cached_llm, rounds)
    plain, no_hits = _run_rounds(plain_llm, rounds)

    for key, tokens in expected.items():
        assert cached[key].outputs[0].token_ids == tokens, key
        assert plain[key].outputs[0].token_ids == tokens, key
    for (r, i), (prompt, prompt_lp) in [((r, i), x) for r, b in enumerate(rounds)
                                        for i, x in enumerate(b)]:
        if prompt_lp is None:
            continue
        ref = _hf_prompt_logprobs(hf, prompt)
        for out in (cached[r, i], plain[r, i]):
            assert out.num_cached_tokens == 0  # prompt logprobs need every position's logits
            assert len(out.prompt_logprobs) == len(prompt)
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                assert prompt[pos] in entry
                for token_id, lp in entry.items():
                    assert lp.logprob == pytest.approx(ref[pos - 1, token_id].item(), rel=1e-4,
                                                       abs=1e-5)

    on, off = cached_llm.engine.stats(), plain_llm.engine.stats()
    assert on.prefix_cache_hits > 0 and off.prefix_cache_hits == 0
    assert on.prefix_cache_queries == off.prefix_cache_queries or variant == "preemption"
    assert on.prompt_tokens < off.prompt_tokens
    assert hits[1][0] > 0, "round 2 should hit blocks left by the finished round 1"
    assert hits[2][1] > 0, "round 4 should hit blocks of running round-3 requests"
    assert no_hits == [(0, 0)] * 3
    assert any(cached[key].num_cached_tokens > 0 for key in expected)
    if variant == "preemption":
        assert on.num_preemptions > 0 and off.num_preemptions > 0
    # Afterwards nothing is held, the cached blocks stay findable (evictable).
    pool = cached_llm.engine.kv_cache.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.cached_blocks
    assert pool.num_free_blocks == pool.num_blocks


def test_cache_salt_separates_tenants_end_to_end(tiny_model, make_llm):
    path, hf, rounds, _ = tiny_model["llama"]
    prompt = rounds[0][3][0]  # 33 tokens: 8 full blocks
    expected = _hf_greedy(hf, prompt)
    engine = _make(make_llm, path, True).engine
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)

    def run(rid: str, salt: str | None):
        hits_before = engine.stats().prefix_cache_hits
        engine.add_request(rid, prompt, params, cache_salt=salt)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        assert final.outputs[0].token_ids == expected
        assert final.num_cached_tokens == engine.stats().prefix_cache_hits - hits_before
        return final.num_cached_tokens

    assert run("a", "tenant-a") == 0
    assert run("b", "tenant-b") == 0  # same prompt, other salt: nothing shared
    assert run("c", None) == 0
    assert run("d", "tenant-a") == 32
    assert run("e", None) == 32


def test_stats_log_line_and_cli_switch(tiny_model, make_llm, caplog):
    from pagedserve.arg_utils import engine_kwargs
    from pagedserve.cli import build_parser
    from pagedserve.config import EngineConfig

    path, _, rounds, _ = tiny_model["llama"]
    engine = _make(make_llm, path, True).engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, (prompt, _) in enumerate(rounds[0][:2] * 2):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    engine.core.log_stats = True
    with caplog.at_level("INFO", logger="pagedserve.engine.core"):
        maybe_log_stats(engine.core, interval=0.0)
    rate = 100 * stats.prefix_cache_hits / stats.prefix_cache_queries
    assert f"prefix cache hit rate {rate:.1f}%" in caplog.text

    def caching(*flags: str) -> bool:
        args = build_parser().parse_args(["generate", "--prompt", "hi", *flags])
        return EngineConfig.from_kwargs(**engine_kwargs(args)).cache.enable_prefix_caching

    assert caching() and not caching("--no-enable-prefix-caching")


def test_prompt_logprobs_survive_preemption(tiny_model, make_llm):
    path, _, rounds, _ = tiny_model["llama"]
    llm = _make(make_llm, path, False, num_gpu_blocks_override=22)
    params = [SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True,
                             prompt_logprobs=lp) for _, lp in rounds[0]]
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in rounds[0]], params,
                           use_tqdm=False)
    preempted = [o for o in outputs if o.prompt_logprobs and o.metrics.num_preemptions]
    assert preempted, "the workload no longer preempts the prompt-logprobs request"
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in preempted)


# ---- GPU: every CUDA backend over cached prefixes (run on the H200) ---------------------------

def _gpu_llm(make_llm, path: str, backend: str, dtype: str, caching: bool,
             enforce_eager: bool = True):
    from pagedserve.attention import backend_status

    ok, why = backend_status()[backend]
    if not ok:
        pytest.skip(f"{backend} unavailable: {why}")
    return make_llm(model=path, dtype=dtype, device="cuda", attention_backend=backend,
                    num_gpu_blocks_override=512, enable_prefix_caching=caching,
                    enforce_eager=enforce_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_triton_float32_rounds_match_transformers(tiny_model, make_llm, enforce_eager):
    """A fully cached prompt is admitted as a one-token step: with CUDA graphs on, it may run
    in a captured decode graph next to real decodes."""
    path, _, rounds, expected = tiny_model["llama"]
    for caching in (True, False):
        llm = _gpu_llm(make_llm, path, "TRITON", "float32", caching, enforce_eager)
        outputs, hits = _run_rounds(llm, rounds)
        assert {k: o.outputs[0].token_ids for k, o in outputs.items()} == expected
        if caching:
            assert hits[1][0] > 0 and hits[2][1] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON", "FLASH_ATTN"])
def test_gpu_bf16_caching_costs_no_accuracy(tiny_model, make_llm, backend):
    """Teacher-forced over transformers' float32 greedy continuations, in two batches (the
    second hits blocks the first left behind): with caching the bf16 engine stays as close to
    float32 transformers as without it."""
    path, hf, rounds, expected = tiny_model["llama"]
    keys = [(r, i) for r, batch in enumerate(rounds) for i in range(len(batch))]
    prompts = [rounds[r][i][0] for r, i in keys]
    continuations = [expected[k] for k in keys]
    ref = [_hf_prompt_logprobs(hf, p + c)[len(p) - 1:-1]
           for p, c in zip(prompts, continuations, strict=True)]
    half = len(rounds[0]) + len(rounds[1])
    kl, top1 = {}, {}
    for caching in (True, False):
        llm = _gpu_llm(make_llm, path, backend, "bfloat16", caching)
        got = (llm.score(prompts[:half], continuations[:half])
               + llm.score(prompts[half:], continuations[half:]))
        assert (llm.engine.stats().prefix_cache_hits > 0) == caching
        kl[caching] = torch.cat([(r.exp() * (r - g.float())).sum(-1)
                                 for r, g in zip(ref, got, strict=True)]).mean().item()
        top1[caching] = np.mean([(r.argmax(-1) == g.argmax(-1)).float().mean().item()
                                 for r, g in zip(ref, got, strict=True)])
    print(f"\n{backend} bf16 vs transformers float32: KL {kl[True]:.2e} with caching, "
          f"{kl[False]:.2e} without; top-1 {top1[True]:.3f} / {top1[False]:.3f}")
    assert kl[True] <= 1.5 * kl[False] + 1e-5
    assert top1[True] >= top1[False] - 0.02
