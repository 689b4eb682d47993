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

On a GPU the model passes run as graph replays, but each torch op the host queues outside
them costs a launch: a last run at each batch size counts them (outside the padded path's
replays), by phase.
"""

from __future__ import annotations

import os

# One thread, set before torch loads its thread pools: the model passes are tiny, and a
# second thread's spin-waits against whatever else the machine runs swamp the host work.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import collections
import cProfile
import functools
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


class OpCounter(TorchDispatchMode):
    """The torch ops the host queues outside graph replays, by phase: on a GPU each is a
    kernel launch (and its dispatch), of some microseconds of host time each; a replay of the
    padded path (capture off here) counts as one."""

    def __init__(self, by_line: bool = False) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        # (phase, the innermost line of ours and the op) when asked: slow, a traceback each
        self.lines: collections.Counter | None = collections.Counter() if by_line else None
        self.labels = ["between the phases"]
        self.in_replay = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not self.in_replay and not func.is_view:  # (a view launches nothing)
            self.counts[self.labels[-1]] += 1
            if self.lines is not None:
                self.lines[self.labels[-1], _our_line(func)] += 1
        return func(*args, **(kwargs or {}))

    def phase(self, label: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.labels.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.labels.pop()
        return wrapper

    def replay(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.in_replay:
                self.counts[self.labels[-1]] += 1
                if self.lines is not None:
                    self.lines[self.labels[-1], _our_line(fn.__qualname__)] += 1
            self.in_replay += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_replay -= 1
        return wrapper


def _our_line(what: Any) -> str:
    import traceback

    ours = [f for f in traceback.extract_stack()[:-2]
            if "pagedserve" in f.filename and "spec_host" not in f.filename]
    at = f"{ours[-1].filename.split('pagedserve/')[-1]}:{ours[-1].lineno}" if ours else "?"
    return f"{at} {what}"


def instrument(llm: LLM, totals: collections.Counter, ops: OpCounter) -> None:
    """Time the phases, and every model pass (outermost calls only) under DEVICE_WORK."""
    engine = llm.engine
    for path, method, label in PHASES:
        obj = owner(engine, path)
        setattr(obj, method, timed(totals, label, ops.phase(label, getattr(obj, method))))
    from pagedserve.engine.cuda_graphs import DecodeGraphs
    from pagedserve.engine.head_graphs import HeadGraphs

    DecodeGraphs.replay = ops.replay(DecodeGraphs.replay)  # type: ignore[method-assign]
    for name in ("greedy_tokens", "head_logits"):  # the head's graphs after a replay
        setattr(HeadGraphs, name, ops.replay(getattr(HeadGraphs, name)))
    # Host-to-device copies are no ops on the CPU: each call of the copy helpers counts one
    # (on a GPU a pinned staging copy and a launch), wherever they were imported.
    for module in list(sys.modules.values()):
        for name in ("array_to_device", "arrays_to_device", "to_device_async"):
            fn = getattr(module, name, None) if (module.__name__ or "").startswith(
                "pagedserve") else None
            if fn is not None:
                setattr(module, name, ops.replay(fn))
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
    parser.add_argument("--ops-by-line", type=int, default=0, metavar="N",
                        help="the N lines of ours that queue the most ops a step")
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
    torch.set_num_threads(1)  # (whatever the engine chose)
    totals: collections.Counter = collections.Counter()
    ops = OpCounter(bool(args.ops_by_line))
    instrument(llm, totals, ops)
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
        ops.counts.clear()
        if ops.lines is not None:
            ops.lines.clear()
        with ops:
            llm.generate(prompts, params, use_tqdm=False)
        for _, _, label in PHASES:
            print(f"  {label:40s} {spent.get(label, 0.0) / steps * 1e3:8.3f} ms a step "
                  f"{ops.counts[label] / steps:7.1f} ops a step")
        print(f"  torch ops queued outside graph replays: {ops.counts.total() / steps:.1f} a "
              "step (the phases' own; nested phases counted in theirs alone)")
        if ops.lines is not None:
            for (label, line), n in ops.lines.most_common(args.ops_by_line):
                print(f"    {n / steps:6.2f}  {label.strip():24s} {line}")

if __name__ == "__main__":
    main()
