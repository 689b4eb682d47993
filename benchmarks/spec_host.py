"""The host's work in one speculative engine step (EAGLE-3, synthetic acceptance) on the CPU:
what a verify step costs besides its model passes, which on a GPU are graph replays and
kernels while this work is serial with them (the engine completes each verify step before
it schedules the next).

    python benchmarks/spec_host.py [--batch-sizes 1 32] [--output-len 96] [--k 3] \
        [--rate 0.8] [--profile 30]

A small random Llama target (`random:` preset, float32, one thread) and a random EAGLE-3
head of its shape (spec_decode/random_head.py) run in this process. Each step's wall time is
split (in this thread's CPU time, which other jobs on the machine barely move) into the time
inside the model passes (the target's forward, its logits, the head's
forward and logits: device work on a GPU, eager here) and the rest, the host work: the
scheduler with drafts, the verify layout, the rejection sampler's bookkeeping, the draft
loop's metadata and launches, update_from_output. Prints the host work per step at each batch
size, by phase (the run of least host work of `--repeats`), and with `--profile N` the N
functions of most own time (cProfile) in one more run of the first batch size.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# One thread: the model passes are tiny, and the engine's default (a thread per core) spins
# against whatever else the machine runs, which swamps the host work measured.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pagedserve import LLM, SamplingParams  # noqa: E402

TARGET = {"base": "tiny", "num_hidden_layers": 4,  # head size 64, as TRITON needs
          "vocab_size": 512, "max_position_embeddings": 2048}
DEVICE_WORK = "model passes (device work on a GPU)"
# (owner attribute path from the engine, method, label): the phases timed (nested ones are
# included in their callers' figures; the model passes are subtracted from the host work).
PHASES = [
    ("core.scheduler", "schedule", "schedule (with drafts)"),
    ("core.scheduler", "update_from_output", "update_from_output"),
    ("core", "_record", "compact step outputs"),
    ("core.runner", "launch", "launch (inputs, forward, sampling)"),
    ("core.runner.input_batch", "update", "  row bookkeeping"),
    ("core.runner.input_batch", "write_drafts", "  drafts into the token table"),
    ("core.runner.sampling", "metadata", "  sampling parameters"),
    ("core.runner.speculator", "layout", "  verify layout"),
    ("core.runner.speculator", "sample", "  rejection sampler"),
    ("core.runner", "_record_samples", "samples to the token table"),
    ("core.runner.speculator", "propose_after", "proposer (catch-up + draft loop)"),
]


def timed(totals: collections.Counter, label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - start
    return wrapper


def owner(engine: Any, path: str) -> Any:
    obj = engine
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def instrument(llm: LLM, totals: collections.Counter) -> None:
    """Time the phases, and every model pass (outermost calls only) under DEVICE_WORK."""
    engine = llm.engine
    for path, method, label in PHASES:
        obj = owner(engine, path)
        setattr(obj, method, timed(totals, label, getattr(obj, method)))
    runner = engine.core.runner
    depth = [0]

    def device(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    totals[DEVICE_WORK] += time.thread_time() - start
        return wrapper

    head = runner.speculator.proposer.head
    for module in (runner.model, head):
        module.forward = device(module.forward)
    runner.model.compute_logits = device(runner.model.compute_logits)
    for name in ("logits", "draft_ids"):
        setattr(head, name, device(getattr(head, name)))
    core = engine.core
    core.step = timed(totals, "whole step", core.step)


def padded_graph_paths() -> None:
    """Engines built from here on run the CUDA graphs' host path on the CPU: the target's
    decode and verify steps and the head's draft steps padded to captured sizes (1, 2, 4, ...)
    into the graphs' buffers, then run eagerly (`capture=False`), as the GPU's steps are
    prepared before their replays."""
    from pagedserve.engine import runner_warmup
    from pagedserve.engine.cuda_graphs import DecodeGraphs
    from pagedserve.spec_decode.eagle import EagleProposer

    def setup(inputs: Any, backend: Any, config: Any, max_model_len: int) -> DecodeGraphs:
        n = config.scheduler.max_num_seqs
        sizes = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
        q = 1 + config.speculative.num_speculative_tokens
        verify = DecodeGraphs(inputs, sizes[1:] or sizes, capture=False, query_len=q)
        return DecodeGraphs(inputs, sizes, capture=False, verify=verify)

    setup_graphs = EagleProposer.setup_graphs
    runner_warmup.setup_decode_graphs = setup
    runner_warmup.setup_verify_graphs = lambda *args: None
    EagleProposer.setup_graphs = (lambda self, runner, capture=True:  # type: ignore[method-assign]
                                  setup_graphs(self, runner, False))


def make_llm(target: str, head: str, k: int, rate: float, max_num_seqs: int,
             backend: str | None = None) -> LLM:
    spec = {"method": "eagle3", "num_speculative_tokens": k, "model": head,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rate}
    return LLM(model=target, dtype="float32", device="cpu", speculative_config=spec,
               max_num_seqs=max_num_seqs, kv_cache_memory="64MiB", engine_core_process=False,
               async_scheduling=True, attention_backend=backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--rate", type=float, default=0.8, help="synthetic acceptance rate")
    parser.add_argument("--eager", action="store_true",
                        help="plain eager steps (default: the CUDA graphs' padded host path)")
    parser.add_argument("--attention-backend", default=None,
                        help="e.g. TRITON (needs TRITON_INTERPRET=1 on the CPU; slow passes)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs per batch size; the one of least host work is shown (a "
                             "shared machine's stolen time inflates some)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="first, one more run of the first batch size under cProfile")
    args = parser.parse_args()
    # Random weights drift towards denormal floats over a long generation: flushed, so that
    # the model passes do not slow down by orders of magnitude as it goes.
    torch.set_flush_denormal(True)
    from pagedserve.models.random_models import random_model_config
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    tmp = Path(tempfile.mkdtemp(prefix="spec-host-"))
    (tmp / "target.json").write_text(json.dumps(TARGET))
    target = f"random:{tmp / 'target.json'}"
    head = write_random_eagle3_head(tmp / "head", random_model_config(str(tmp / "target.json")),
                                    dtype=torch.float32)
    if not args.eager:
        padded_graph_paths()
    llm = make_llm(target, head, args.k, args.rate, max(args.batch_sizes),
                   args.attention_backend)
    totals: collections.Counter = collections.Counter()
    instrument(llm, totals)
    vocab = llm.engine.core.runner.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.prompt_len).tolist()}
                   for _ in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        best: tuple[float, int, dict[str, float]] | None = None
        for repeat in range(args.repeats):
            totals.clear()
            core = llm.engine.core
            steps_before = core.num_steps
            profile = (cProfile.Profile() if args.profile and batch == args.batch_sizes[0]
                       and repeat == 0 else None)
            if profile:
                profile.enable()
            llm.generate(prompts, params, use_tqdm=False)
            if profile:
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
                continue  # (cProfile's own cost is not the engine's)
            steps = core.num_steps - steps_before
            host = (totals["whole step"] - totals[DEVICE_WORK]) / steps
            if best is None or host < best[0]:
                best = host, steps, dict(totals)
        if best is None:
            continue
        host, steps, spent = best
        print(f"batch {batch}: {steps} steps, {spent['whole step'] / steps * 1e3:.3f} ms a "
              f"step, of which model passes {spent[DEVICE_WORK] / steps * 1e3:.3f} ms, host "
              f"work {host * 1e3:.3f} ms (the least of {args.repeats} runs)")
        for _, _, label in PHASES:
            print(f"  {label:40s} {spent.get(label, 0.0) / steps * 1e3:8.3f} ms a step")

if __name__ == "__main__":
    main()
