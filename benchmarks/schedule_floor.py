"""The engine's schedule for a `bench throughput` workload, and its floors, without a GPU:

    python benchmarks/schedule_floor.py [--num-prompts 1000] [--input-len 1024]
        [--output-len 128] [--max-num-seqs 256] [--max-num-batched-tokens 8192]

Runs the real `Scheduler` and `KVCacheManager` over N random prompts (EOS ignored; samples come
back one step late, as with async scheduling) and prints the step count, how many steps only
decode, and the floors `benchmarks/gpu_engine.py` prints for the same steps on the 8B-shaped
model (the llama3-8b-random preset), at a given matmul rate and copy bandwidth. The step
counts match the H200 runs (545 and 4,102 steps for the issue's two workloads at 1,000 prompts),
so scheduler settings can be compared here before spending device time on them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_engine import Shape  # noqa: E402

from pagedserve.config import SchedulerConfig  # noqa: E402
from pagedserve.kv_cache import KVCacheManager  # noqa: E402
from pagedserve.models.random_models import random_model_config  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.scheduler.request import Request  # noqa: E402
from pagedserve.scheduler.scheduler import Scheduler  # noqa: E402


def model_shape(spec: str) -> Shape:
    """The floors' per-token costs of a `random:` preset, from a bf16 model on `meta`."""
    import transformers

    cfg = random_model_config(spec)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return Shape(cfg, model)


def schedule_log(num_prompts: int, input_len: int, output_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, num_blocks: int, block_size: int = 16,
                 max_model_len: int = 8192) -> list[tuple[np.ndarray, np.ndarray, int, bool]]:
    """(num_computed, num_scheduled, num_prefills, decode only) of every step."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens),
                          kv, max_model_len)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(num_prompts):
        scheduler.add_request(Request(str(i), rng.integers(0, 1 << 16, input_len).tolist(),
                                      params))
    log, in_flight = [], []
    while scheduler.has_unfinished_requests() or in_flight:
        batch = scheduler.schedule()
        if not batch.is_empty:
            n = batch.num_scheduled_tokens
            log.append((batch.num_computed_tokens.copy(), n.copy(), batch.num_prefills,
                        bool((n == 1).all())))
            in_flight.append(batch)
        # Samples reach the scheduler one step late, or at once when nothing else could run.
        if len(in_flight) > 1 or (batch.is_empty and in_flight):
            done = in_flight.pop(0)
            scheduler.update_from_output(done, np.zeros(done.num_reqs, dtype=np.int64))
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-blocks", type=int, default=60000,
                        help="KV blocks of 16 tokens (an H200 holds ~50,000 for the 8B model)")
    parser.add_argument("--model", default="llama3-8b", help="a `random:` preset or file")
    parser.add_argument("--matmul-tflops", type=float, default=800.0)
    parser.add_argument("--copy-tbps", type=float, default=4.24)
    args = parser.parse_args()
    log = schedule_log(args.num_prompts, args.input_len, args.output_len, args.max_num_seqs,
                       args.max_num_batched_tokens, args.num_blocks)
    shape = model_shape(args.model)
    rates = (args.matmul_tflops * 1e12, args.copy_tbps * 1e12)
    decode_only = sum(1 for *_, only in log if only)
    print(f"{args.num_prompts} x {args.input_len}/{args.output_len}, max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}: "
          f"{len(log)} steps, {decode_only} decode only")
    print(f"  issue's floor {shape.issue_floor_s(log, *rates):.1f} s, serial floor "
          f"{shape.serial_floor_s(log, *rates):.1f} s, strict floor "
          f"{shape.floor_s(log, *rates):.1f} s (matmul {args.matmul_tflops:.0f} TFLOP/s, "
          f"copy {args.copy_tbps:.2f} TB/s)")


if __name__ == "__main__":
    main()
