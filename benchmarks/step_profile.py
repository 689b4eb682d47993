"""Where a CUDA engine step's time goes: the wall time per step, how much of it a kernel was
running (the union of the kernels' intervals, from torch.profiler: CUDA-event spans around a
step count the gaps inside it as busy), the kernels that take it, and the caching allocator's
synchronising events (a `cudaFree` after a failed allocation waits for the device).

    python benchmarks/step_profile.py --config qwen3-30b-a3b-random \
        [--num-prompts 400] [--input-len 1024] [--output-len 128] [--top 15]

The engine runs in this process (`--no-engine-core-process`) with its CUDA defaults (async
scheduling, decode graphs). The timed generation runs twice: once plain for the wall time and
the step count, once under the profiler (CUDA activity only) for the kernels.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedserve import LLM, SamplingParams

ALLOCATOR_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                  "num_device_free")


def union_seconds(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by at least one of the [start, end) nanosecond intervals."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered / 1e9


def kernel_events(prof) -> list:
    """The profiled run's device-side kernel and copy events."""
    return [e for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]


def host_syncs(fn: Callable[[], Any], top: int = 8) -> None:
    """Run `fn()` under torch's sync debug mode and print the lines of ours that made the host
    wait for the GPU, most frequent first."""
    import traceback
    import warnings

    where: collections.Counter = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        ours = [f for f in traceback.extract_stack()[:-1] if "pagedserve" in f.filename]
        frame = ours[-1] if ours else None
        where[f"{frame.filename.split('pagedserve')[-1]}:{frame.lineno} {frame.line}"
              if frame else f"{filename}:{lineno}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"host syncs: {sum(where.values())}")
    for place, n in where.most_common(top):
        print(f"  {n:6d}  {place}")


def host_profile(fn: Callable[[], Any], top: int = 25, sort: str = "tottime") -> None:
    """`fn()` under cProfile: the calling thread's top functions (an in-process engine's
    core step included)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    pstats.Stats(prof).sort_stats(sort).print_stats(top)


def timed_generation(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, int]:
    """Wall seconds and engine steps of one generation."""
    steps_before = llm.engine.core.num_steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, llm.engine.core.num_steps - steps_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-30b-a3b-random")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="default: the config's (an H100 needs 0.95 for the 30B shape)")
    args = parser.parse_args()

    overrides = ({} if args.gpu_memory_utilization is None
                 else {"gpu_memory_utilization": args.gpu_memory_utilization})
    llm = LLM(config=args.config, engine_core_process=False, **overrides)
    vocab = llm.engine.core.runner.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:64], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    before = torch.cuda.memory_stats()
    wall, steps = timed_generation(llm, prompts, params)
    after = torch.cuda.memory_stats()
    print(f"plain: {wall:.2f} s, {steps} steps, {wall / steps * 1e3:.2f} ms a step, "
          f"{args.num_prompts * args.output_len / wall:.0f} output tok/s")
    print("allocator during it: " + ", ".join(
        f"{k} {after.get(k, 0) - before.get(k, 0)}" for k in ALLOCATOR_KEYS))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, steps = timed_generation(llm, prompts, params)
    events = kernel_events(prof)
    busy = union_seconds([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events])
    total = sum(e.duration_ns() for e in events) / 1e9
    print(f"profiled: {wall:.2f} s, {steps} steps, {wall / steps * 1e3:.2f} ms a step; "
          f"kernels running {busy / wall:.1%} of it ({busy / steps * 1e3:.2f} ms a step; "
          f"summed durations {total / steps * 1e3:.2f} ms)")
    by_name: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in events:
        by_name[e.name()[:60]] += e.duration_ns()
        counts[e.name()[:60]] += 1
    print(f"  {'kernel':60s} {'calls/step':>10s} {'ms/step':>8s} {'share':>6s}")
    for name, ns in by_name.most_common(args.top):
        print(f"  {name:60s} {counts[name] / steps:10.1f} {ns / steps / 1e6:8.3f} "
              f"{ns / 1e9 / total:6.1%}")
    llm.close()


if __name__ == "__main__":
    main()
