"""The scheduler's host time per step with N requests decoding, no model at all:

    python benchmarks/scheduler_step.py [--num-requests 256] [--steps 300] [--caching]
                                        [--evict-mb 64]

The real Scheduler and KVCacheManager; each step's samples are applied one step late, as with
async scheduling (a step is scheduled before the previous one's tokens are back). The first
20 steps (admission and the prompts' prefill) are left out. Prints the best of three runs of
`schedule` and `update_from_output`, ms per step.

`--evict-mb N` writes an N MB buffer between steps, as the rest of an engine step (the
forward's launch, metadata, outputs) does to the CPU's caches: the requests' state is then
read from memory, as in the engine (2026-12-02, 256 requests on the 2-core machine, best of
three: schedule 0.144 ms warm against 0.245 ms with 64 MB written between steps,
update_from_output 0.063 against 0.139).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.config import SchedulerConfig  # noqa: E402
from pagedserve.kv_cache import KVCacheManager  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.scheduler import Request, Scheduler  # noqa: E402

WARMUP_STEPS = 20


def run(num_requests: int, steps: int, caching: bool, evict_mb: int = 0
        ) -> tuple[float, float]:
    kv = KVCacheManager(num_requests * 160, 16, enable_prefix_caching=caching)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num_requests,
                                          max_num_batched_tokens=1 << 16), kv, 4096)
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        scheduler.add_request(Request(str(i), rng.integers(0, 40000, 128).tolist(), params,
                                      eos_token_id=2))
    prev = None
    schedule_s = update_s = 0.0
    sweep = np.zeros(evict_mb << 17)  # float64: 8 bytes each
    for step in range(steps + WARMUP_STEPS):
        sweep += 1
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        if prev is not None:
            scheduler.update_from_output(prev, np.full(prev.num_reqs, 7, np.int64))
        t2 = time.perf_counter()
        if step >= WARMUP_STEPS:
            schedule_s += t1 - t0
            update_s += t2 - t1
        prev = out
    return schedule_s / steps * 1e3, update_s / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--caching", action="store_true", help="prefix caching on")
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="MB written between steps to evict the CPU's caches")
    args = parser.parse_args()
    schedule_ms, update_ms = min((run(args.num_requests, args.steps, args.caching,
                                      args.evict_mb) for _ in range(3)), key=sum)
    print(f"{args.num_requests} requests decoding: schedule {schedule_ms:.3f} ms, "
          f"update_from_output {update_ms:.3f} ms per step")


if __name__ == "__main__":
    main()
