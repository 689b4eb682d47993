"""Drafts still on the device when a step completes (`Drafts.pending`): the scheduler keeps
them until the next schedule(), waits for them there once, and gives them only to requests
still running; the wait counts in the proposal's time."""

import numpy as np

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache import KVCacheManager
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Request, RequestStatus, Scheduler
from pagedserve.spec_decode.proposer import Drafts


def test_pending_drafts_arrive_at_the_next_schedule():
    kv = KVCacheManager(100, 16, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 512,
                      num_speculative_tokens=2, draft_has_kv=True)
    a, b = (Request(name, [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
            for name in "ab")
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    calls = []

    def place() -> None:  # what a proposer's copy from the device fills in
        calls.append(len(calls))
        drafts.token_ids[:] = [[5, 6], [8, 9]]

    drafts = Drafts(np.zeros((2, 2), dtype=np.int64), np.array([2, 2], dtype=np.int32),
                    pending=place)
    sched.update_from_output(first, np.array([4, 7]), drafts)
    assert not calls and a.spec_token_ids == [] == b.spec_token_ids  # not waited for yet
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    second = sched.schedule()
    assert calls == [0]  # waited for once, as the step started
    assert second.requests == [a] and second.draft_token_ids == [[5, 6]]
    assert second.num_scheduled_tokens.tolist() == [3] and b.spec_token_ids == []
    assert drafts.pending is None and sched.spec_stats.propose_seconds >= 0
