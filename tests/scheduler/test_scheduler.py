"""Scheduler invariants under random workloads, chunked prefill and forced preemption."""

import random

import numpy as np
import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache import KVCacheManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, RequestStatus, Scheduler


def Params(max_tokens: int) -> SamplingParams:  # noqa: N802
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _run(seed, num_blocks, block_size, max_seqs, budget, num_reqs=40, caching=False,
         overlap=False):
    """A random workload to the end. With `overlap` the next step is scheduled before the
    previous one's samples are applied (async scheduling: one step in flight)."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv,
                      max_model_len=512)
    requests = []
    for i in range(num_reqs):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
        requests.append(Request(f"r{i}", prompt, Params(rng.randint(1, 30))))
    pending = list(requests)
    steps = 0
    in_flight = None
    while pending or sched.has_unfinished_requests() or in_flight is not None:
        # Requests arrive over time.
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        out = sched.schedule()
        steps += 1
        assert steps < 5000
        if in_flight is not None:
            prev, in_flight = in_flight, None
            sched.update_from_output(prev, np.array([rng.randrange(1000) for _ in prev.requests]))
        if out.is_empty:
            assert not sched.running or overlap
            continue
        n = out.num_scheduled_tokens
        assert n.sum() <= budget and len(out.requests) <= max_seqs
        assert (n >= 1).all()
        # Prefills (more than one new token) first, then decodes.
        assert list(n > 1) == sorted(n > 1, reverse=True)
        assert out.num_prefills == int((n > 1).sum())
        for req, c, k, sampling in zip(out.requests, out.num_computed_tokens, n,
                                       out.will_sample, strict=True):
            if req.is_finished:  # stopped by the previous step's sample (overlap only)
                assert overlap
                continue
            # Scheduled tokens count as computed at once; a step that reaches the sequence's
            # end leaves a placeholder for its sample (num_tokens + placeholders is unchanged
            # when a sample replaces its placeholder).
            end = req.num_tokens + req.num_output_placeholders
            if req.status == RequestStatus.RUNNING:
                assert c + k == req.num_computed_tokens
                assert len(kv.req_to_blocks[req.request_id]) * block_size >= c + k
            assert c + k == end - 1 if sampling else c + k < end
        ids = [b for r in sched.running for b in kv.block_ids(r.request_id)]
        if not caching:
            assert len(ids) == len(set(ids))  # no block in two requests
        if overlap:
            in_flight = out
        else:
            sched.update_from_output(out, np.array([rng.randrange(1000) for _ in out.requests]))
    for req in requests:
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens == req.max_tokens
        assert req.num_tokens == req.num_prompt_tokens + req.max_tokens
    assert kv.num_free_blocks == num_blocks
    assert not kv.req_to_blocks
    return sched


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_roomy(seed):
    sched = _run(seed, num_blocks=400, block_size=16, max_seqs=8, budget=64)
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_preempts_and_resumes(seed):
    # 96 tokens of KV for requests up to 90 tokens: preemption is certain.
    sched = _run(seed, num_blocks=24, block_size=4, max_seqs=16, budget=32)
    assert sched.num_preemptions > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_with_prefix_caching(seed):
    _run(seed, num_blocks=30, block_size=4, max_seqs=6, budget=24, caching=True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["roomy", "preempting", "caching"])
def test_random_workload_with_a_step_in_flight(seed, kind):
    """Async scheduling: every request still ends with exactly max_tokens outputs, nothing
    is scheduled past its limit, and every block comes back."""
    args = {"roomy": dict(num_blocks=400, block_size=16, max_seqs=8, budget=64),
            "preempting": dict(num_blocks=24, block_size=4, max_seqs=16, budget=32),
            "caching": dict(num_blocks=30, block_size=4, max_seqs=6, budget=24, caching=True)}
    _run(seed, overlap=True, **args[kind])


def test_chunked_prefill_keeps_decodes_going():
    kv = KVCacheManager(100, 16, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv, 512)
    a = Request("a", [1] * 5, Params(20))
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, np.array([7]))
    b = Request("b", list(range(40)), Params(5))  # longer than the budget
    sched.add_request(b)
    chunks = []
    while b.num_output_tokens == 0:
        out = sched.schedule()
        assert out.requests[-1] is a  # the decode runs every step
        chunks.append(dict(zip([r.request_id for r in out.requests],
                               out.num_scheduled_tokens.tolist(), strict=True))["b"])
        sched.update_from_output(out, np.array([3] * len(out.requests)))
    assert chunks == [15, 15, 10]
    assert a.num_output_tokens == 4


def test_abort_frees_blocks_and_unknown_ids_are_ignored():
    kv = KVCacheManager(10, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=128), kv, 512)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1, 2, 3, 4, 5], Params(4)))
    sched.schedule()
    finished = sched.finish_requests(["r0", "r2", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["r0", "r2"]
    assert kv.num_free_blocks == 10 - 2
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 10 and not sched.has_unfinished_requests()


def test_request_larger_than_pool_is_refused():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=128), kv, 512)
    with pytest.raises(ValueError, match="pool holds only 16"):
        sched.add_request(Request("big", [1] * 10, Params(10)))


def test_max_num_seqs_default_follows_the_device() -> None:
    """vLLM's GPU default (256), the CPU's 128; a value given is kept on either."""
    from pagedserve.config import EngineConfig

    assert EngineConfig(device="cpu").scheduler.max_num_seqs == 128
    assert EngineConfig(device="cuda").scheduler.max_num_seqs == 256
    assert EngineConfig.from_kwargs(device="cuda", max_num_seqs=64).scheduler.max_num_seqs == 64
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seqs=0)


def test_decode_steps_keep_batch_order_and_placeholders() -> None:
    """A step mixing a new prompt and running decodes lists the prefill first; every decode
    takes one placeholder and counts its token as computed, and the arrays follow the order."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, 512)
    for i in range(3):
        sched.add_request(Request(str(i), list(range(10 * i, 10 * i + 5)), Params(8)))
    first = sched.schedule()
    sched.update_from_output(first, np.arange(3))
    sched.add_request(Request("late", list(range(100, 106)), Params(8)))
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == ["late", "0", "1", "2"]
    assert step.num_prefills == 1
    assert step.num_scheduled_tokens.tolist() == [6, 1, 1, 1]
    assert step.num_computed_tokens.tolist() == [0, 5, 5, 5]
    assert step.will_sample.tolist() == [True] * 4
    assert [r.num_computed_tokens for r in step.requests] == [6, 6, 6, 6]
    assert [r.num_output_placeholders for r in step.requests] == [1, 1, 1, 1]
