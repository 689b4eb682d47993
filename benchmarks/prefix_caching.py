"""Prefix caching: TTFT and throughput with and without it in the same run, and what it costs when
nothing is shared.

    python benchmarks/prefix_caching.py --device cuda     # vLLM's prefix-repetition defaults
    python benchmarks/prefix_caching.py --num-prompts 8 --num-prefixes 2 --suffix-len 64 \
        --output-len 16 --threads 1                       # a busy 2-core CPU: a few minutes

Workload "shared": --num-prefixes prefixes of --prefix-len random tokens; each prompt is one of
them (round robin, shuffled) plus its own --suffix-len random suffix, then --output-len generated
tokens (EOS ignored). Workload "unique": the same lengths with nothing shared (0% hits), where
caching can only cost time (hashing, lookups, evicting old cached blocks).

One engine runs each workload with caching on and off (switched between runs; --two-engines
builds a second engine with enable_prefix_caching=False instead), --repeats times in alternating
order (on/off, off/on, ...), so a noisy neighbour hits both alike. Each repeat draws fresh
prompts, so nothing is left to hit from the one before. All requests arrive at once: TTFT
(first_token_time - arrival_time) includes queueing. The scheduler's own time (schedule +
update_from_output, where every hash, lookup and eviction happens) is timed separately: it is
the overhead that machine noise cannot hide.

--scheduler-only: no model, deterministic. The scheduler and KV cache manager alone run the
workloads with fake samples, caching on and off, each run on a pool that an untimed round of other
prompts left full (of cached blocks when caching is on, so taking fresh blocks evicts). It reports
the CPU time of the timed round (best of --repeats) and the extra time per request with caching:
what the engine's "extra scheduler time" line measures, without the model or machine noise.
--overlap schedules each step before the previous one's samples are back (async scheduling).

    python benchmarks/prefix_caching.py --scheduler-only      # unique: ~5 s on a 2-core CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import SchedulerConfig, resolve_dtype
from pagedserve.kv_cache import KVCacheManager
from pagedserve.scheduler import Request, Scheduler


@dataclass
class RunResult:
    workload: str
    caching: bool
    repeat: int
    seconds: float
    cpu_seconds: float  # this process's CPU time: less sensitive to busy neighbours
    output_tokens: int
    prompt_tokens: int
    prompt_tokens_computed: int
    hit_rate: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    scheduler_seconds: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


class SchedulerTimer:
    """Wall time inside the engine's scheduler calls; optionally cProfile just those calls."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        self.profiler: cProfile.Profile | None = None
        scheduler = llm.engine.scheduler
        scheduler.schedule = self._timed(scheduler.schedule)
        scheduler.update_from_output = self._timed(scheduler.update_from_output)

    def _timed(self, fn):
        def call(*args, **kwargs):
            if self.profiler is not None:
                self.profiler.enable()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                if self.profiler is not None:
                    self.profiler.disable()
        return call


def make_prompts(workload: str, args: argparse.Namespace, vocab: int,
                 seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    n, prefix_len, suffix_len = args.num_prompts, args.prefix_len, args.suffix_len

    def rand(length: int) -> list[int]:
        return rng.integers(100, vocab, length).tolist()

    if workload == "unique":
        return [rand(prefix_len + suffix_len) for _ in range(n)]
    prefixes = [rand(prefix_len) for _ in range(args.num_prefixes)]
    prompts = [prefixes[i % len(prefixes)] + rand(suffix_len) for i in range(n)]
    return [prompts[i] for i in rng.permutation(n)]


def set_prefix_caching(llm: LLM, enabled: bool) -> None:
    """Switch caching on one idle engine, so both settings share weights, KV memory and warmed
    kernels and differ only in the caching work. Switching off first forgets every cached
    block, so the uncached run does no eviction work either."""
    kv = llm.engine.kv_cache
    if not enabled:
        assert kv.reset_prefix_cache(), "the engine still holds blocks"
    kv.enable_prefix_caching = kv.pool.enable_caching = enabled


def run_once(llm: LLM, timer: SchedulerTimer, prompts: list[list[int]], output_len: int,
             workload: str, caching: bool, repeat: int) -> RunResult:
    engine = llm.engine
    before = engine.stats()
    sched_before = timer.seconds
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    after = engine.stats()
    ttft = np.array([o.metrics.first_token_time - o.metrics.arrival_time for o in outputs])
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert out_tokens == len(prompts) * output_len
    return RunResult(
        workload=workload, caching=caching, repeat=repeat, seconds=seconds,
        cpu_seconds=cpu_seconds,
        output_tokens=out_tokens, prompt_tokens=sum(len(p) for p in prompts),
        prompt_tokens_computed=after.prompt_tokens - before.prompt_tokens,
        hit_rate=hits / queries if queries else 0.0, ttft_mean=float(ttft.mean()),
        ttft_p50=float(np.median(ttft)), ttft_p90=float(np.percentile(ttft, 90)),
        scheduler_seconds=timer.seconds - sched_before)


def print_run(r: RunResult) -> None:
    print(f"  {r.workload:6} caching={'on ' if r.caching else 'off'} rep {r.repeat}: "
          f"{r.seconds:7.2f} s (cpu {r.cpu_seconds:7.2f} s)  {r.output_tps:8.1f} out tok/s  "
          f"{r.total_tps:9.1f} total tok/s  "
          f"TTFT mean {r.ttft_mean * 1e3:8.1f} ms p50 {r.ttft_p50 * 1e3:8.1f} "
          f"p90 {r.ttft_p90 * 1e3:8.1f}  hit {100 * r.hit_rate:5.1f}%  "
          f"prefill {r.prompt_tokens_computed}/{r.prompt_tokens}  "
          f"sched {r.scheduler_seconds * 1e3:7.1f} ms", flush=True)


def summarize(results: list[RunResult], workload: str) -> dict[str, float]:
    on = sorted((r for r in results if r.workload == workload and r.caching),
                key=lambda r: r.repeat)
    off = sorted((r for r in results if r.workload == workload and not r.caching),
                 key=lambda r: r.repeat)
    ratios = [a.total_tps / b.total_tps for a, b in zip(on, off, strict=True)]
    cpu_ratios = [b.cpu_seconds / a.cpu_seconds for a, b in zip(on, off, strict=True)]
    ttft_ratios = [a.ttft_mean / b.ttft_mean for a, b in zip(on, off, strict=True)]
    sched_cost = [(a.scheduler_seconds - b.scheduler_seconds) / a.seconds
                  for a, b in zip(on, off, strict=True)]

    def med(values):
        return statistics.median(values)

    print(f"{workload}: throughput on/off median {med(ratios):.3f} "
          f"(repeats {', '.join(f'{x:.3f}' for x in ratios)}); by CPU time "
          f"{med(cpu_ratios):.3f} ({', '.join(f'{x:.3f}' for x in cpu_ratios)})")
    print(f"{workload}: TTFT on/off median {med(ttft_ratios):.3f} "
          f"(repeats {', '.join(f'{x:.3f}' for x in ttft_ratios)})")
    print(f"{workload}: on  {med([r.output_tps for r in on]):.1f} out tok/s, TTFT mean "
          f"{med([r.ttft_mean for r in on]) * 1e3:.1f} ms, hit rate "
          f"{100 * med([r.hit_rate for r in on]):.1f}%")
    print(f"{workload}: off {med([r.output_tps for r in off]):.1f} out tok/s, TTFT mean "
          f"{med([r.ttft_mean for r in off]) * 1e3:.1f} ms")
    print(f"{workload}: extra scheduler time with caching = "
          f"{100 * med(sched_cost):+.3f}% of the run (repeats "
          f"{', '.join(f'{100 * x:+.3f}%' for x in sched_cost)})")
    return {"throughput_ratio_median": med(ratios), "throughput_ratio_min": min(ratios),
            "throughput_ratio_max": max(ratios),
            "cpu_time_ratio_median": med(cpu_ratios), "ttft_ratio_median": med(ttft_ratios),
            "scheduler_overhead_median": med(sched_cost)}


def drive_scheduler(sched: Scheduler, requests: list[Request], sampled: np.ndarray,
                    overlap: bool = False) -> int:
    """Run requests to completion through schedule/update_from_output with fake samples; with
    `overlap`, each step is scheduled before the previous one's samples are back (as async
    scheduling does)."""
    for request in requests:
        sched.add_request(request)
    steps, in_flight = 0, None
    while True:
        out = sched.schedule()
        done = in_flight if overlap else out
        if done is not None and not done.is_empty:
            offset = (steps * 131) % (len(sampled) // 2)  # fake samples, varied per step
            sched.update_from_output(done, sampled[offset:offset + len(done.requests)])
        elif out.is_empty:
            if not sched.has_unfinished_requests():
                return steps
            raise RuntimeError("the scheduler makes no progress")
        in_flight = out
        steps += 1


def scheduler_only_run(args: argparse.Namespace, workload: str, caching: bool, repeat: int,
                       num_blocks: int, profiler: cProfile.Profile | None = None
                       ) -> tuple[float, float]:
    """(wall, cpu) seconds of one round of `workload` through a bare scheduler, after an
    untimed round of other unique prompts has left the pool full."""
    vocab = 50000
    kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens)
    sched = Scheduler(config, kv, max_model_len=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sampled = np.random.default_rng(7).integers(100, vocab, 2 * args.max_num_seqs + 4096)

    def requests(name: str, prompts: list[list[int]]) -> list[Request]:
        return [Request(f"{name}{i}", p, params) for i, p in enumerate(prompts)]

    # The same prompts for caching on and off in a repeat.
    before = make_prompts("unique", args, vocab, seed=500 + repeat)
    timed = make_prompts(workload, args, vocab, seed=1000 + repeat)
    drive_scheduler(sched, requests("w", before), sampled, args.overlap)
    reqs = requests("r", timed)
    if profiler is not None:
        profiler.enable()
    start, cpu_start = time.perf_counter(), time.process_time()
    drive_scheduler(sched, reqs, sampled, args.overlap)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if profiler is not None:
        profiler.disable()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(r.num_output_tokens == args.output_len for r in reqs)
    return seconds, cpu_seconds


def scheduler_only(args: argparse.Namespace) -> None:
    bs = args.block_size
    per_request = -(-(args.prefix_len + args.suffix_len + args.output_len) // bs)
    num_blocks = args.num_blocks or (args.num_prompts * per_request
                                     + args.num_prefixes * -(-args.prefix_len // bs) + 16)
    print(f"scheduler only: {args.num_prompts} prompts of {args.prefix_len + args.suffix_len} "
          f"tokens, {args.output_len} output tokens; {num_blocks} blocks of {bs}; "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}", flush=True)
    summary = {}
    for workload in args.workloads.split(","):
        times: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(args.repeats):
            for caching in (True, False) if repeat % 2 == 0 else (False, True):
                wall, cpu = scheduler_only_run(args, workload, caching, repeat, num_blocks)
                times[caching].append(cpu)
                print(f"  {workload:6} caching={'on ' if caching else 'off'} rep {repeat}: "
                      f"{wall * 1e3:8.1f} ms (cpu {cpu * 1e3:8.1f} ms)", flush=True)
        on, off = min(times[True]), min(times[False])
        diffs = [a - b for a, b in zip(times[True], times[False], strict=True)]
        per_req = 1e6 / args.num_prompts
        print(f"{workload}: cpu time (best of {args.repeats}) on {on * 1e3:.1f} ms, off "
              f"{off * 1e3:.1f} ms; per request on {on * per_req:.1f} us, off "
              f"{off * per_req:.1f} us, extra {(on - off) * per_req:+.1f} us "
              f"(median of paired differences {statistics.median(diffs) * per_req:+.1f} us, "
              f"{100 * (on - off) / off:+.1f}%)", flush=True)
        summary[workload] = {"on_seconds": on, "off_seconds": off,
                             "extra_us_per_request": (on - off) * per_req}
    if args.profile:
        profiler = cProfile.Profile()
        scheduler_only_run(args, "unique", True, 0, num_blocks, profiler)
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(20)
        print("scheduler calls with caching on, 'unique' workload:\n" + stream.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: 100 on cuda, 8 on cpu")
    parser.add_argument("--num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=None,
                        help="default: 3 (15 with --scheduler-only)")
    parser.add_argument("--workloads", default=None,
                        help="default: shared,unique (unique with --scheduler-only)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks; default: the whole workload plus its prefixes")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--two-engines", action="store_true",
                        help="build a second engine with enable_prefix_caching=False instead of "
                             "toggling caching on one engine between runs")
    parser.add_argument("--profile", action="store_true",
                        help="afterwards, cProfile the scheduler calls of one more 'unique' run "
                             "(with --scheduler-only: of one scheduler-only run)")
    parser.add_argument("--json", default=None, help="write every run and the summary here")
    parser.add_argument("--scheduler-only", action="store_true",
                        help="no model: time the scheduler and KV cache manager alone, caching "
                             "on and off (default --workloads unique, --num-prompts 100, "
                             "--repeats 15)")
    parser.add_argument("--overlap", action="store_true",
                        help="with --scheduler-only: schedule each step before the previous "
                             "one's samples are back, as async scheduling does")
    args = parser.parse_args()
    if args.scheduler_only:
        args.num_prompts = 100 if args.num_prompts is None else args.num_prompts
        args.workloads = "unique" if args.workloads is None else args.workloads
        args.repeats = 15 if args.repeats is None else args.repeats
        scheduler_only(args)
        return
    if args.num_prompts is None:
        args.num_prompts = 100 if args.device == "cuda" else 8
    args.workloads = "shared,unique" if args.workloads is None else args.workloads
    args.repeats = 3 if args.repeats is None else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    bs = args.block_size
    per_request = -(-(args.prefix_len + args.suffix_len + args.output_len) // bs)
    num_blocks = args.num_blocks or (args.num_prompts * per_request
                                     + args.num_prefixes * -(-args.prefix_len // bs) + 16)
    engine_args = dict(model=args.model, device=args.device, dtype=args.dtype, block_size=bs,
                       num_gpu_blocks_override=num_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens)
    cached_llm = LLM(enable_prefix_caching=True, **engine_args)
    llms = {True: cached_llm, False: cached_llm}
    if args.two_engines:
        llms[False] = LLM(enable_prefix_caching=False, **engine_args)
    timers = {True: SchedulerTimer(cached_llm)}
    timers[False] = SchedulerTimer(llms[False]) if args.two_engines else timers[True]
    vocab = cached_llm.engine.runner.vocab_size
    dtype = resolve_dtype(args.dtype, torch.device(args.device))
    print(f"{args.num_prompts} prompts = {args.num_prefixes} prefixes x {args.prefix_len} + "
          f"{args.suffix_len} suffix tokens, {args.output_len} output tokens; {num_blocks} "
          f"blocks of {bs}; {args.device} {dtype}, {torch.get_num_threads()} threads; "
          f"{'two engines' if args.two_engines else 'one engine, caching toggled'}", flush=True)

    def run(caching: bool, prompts: list[list[int]], output_len: int, workload: str,
            repeat: int) -> RunResult:
        if not args.two_engines:
            set_prefix_caching(cached_llm, caching)
        return run_once(llms[caching], timers[caching], prompts, output_len, workload, caching,
                        repeat)

    warm = make_prompts("unique", argparse.Namespace(**{**vars(args), "num_prompts": 2}),
                        vocab, seed=0)
    for caching in (True, False):
        run(caching, warm, 4, "warmup", 0)

    results: list[RunResult] = []
    workloads = args.workloads.split(",")
    for repeat in range(args.repeats):
        for w, workload in enumerate(workloads):
            prompts = make_prompts(workload, args, vocab, seed=1000 * (w + 1) + repeat)
            for caching in (True, False) if repeat % 2 == 0 else (False, True):
                results.append(run(caching, prompts, args.output_len, workload, repeat))
                print_run(results[-1])

    print()
    summary = {workload: summarize(results, workload) for workload in workloads}
    if args.profile:  # a separate run: the profiler's own cost stays out of the figures above
        timers[True].profiler = profiler = cProfile.Profile()
        run(True, make_prompts("unique", args, vocab, seed=999), args.output_len, "profile", 0)
        timers[True].profiler = None
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(15)
        print("scheduler calls with caching on, 'unique' workload:\n" + stream.getvalue())
    for llm in set(llms.values()):
        assert llm.engine.check_blocks_free()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary,
                       "runs": [asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
