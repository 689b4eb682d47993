"""Host work of a Mixture-of-Experts model's steps on CUDA, before and after a change, in one
process on one loaded model (the H200's host varies from machine to machine, so two runs in
two calls do not compare):

    python benchmarks/moe_host.py [--config qwen3-30b-a3b-random] [--prefill-tokens 8192]
        [--num-prompts 1000] [--input-len 1024] [--output-len 128] [--rounds 2] [--piecewise]

1. One eager prefill step of `--prefill-tokens` tokens: the host's time to launch the model's
   forward (the device queue drained first, nothing waits inside it), split by module class
   from forward hooks (inclusive times: a decoder layer contains its attention), and the
   device's time for the same forward.
2. `bench throughput`-style generation of N x input/output with the device timer on: output
   tok/s, wall ms a step, ms a step the engine waited for the device, the host's ms a step
   (the rest), and the device's busy share.

Each runs under every variant of `--variants`, alternating, for `--rounds` rounds:
- `before`: the torch-op alignment that `models/moe_align.py` replaced and the launch-shape
  table before the sweep (both in `moe_before.py`);
- `align`: the Triton alignment, the table before the sweep;
- `after`: both as they are now;
- `eager` / `piecewise` (issue #47 item 5): the kernels as now, on an engine started with
  `--piecewise-cuda-graphs`, its prefill and mixed steps run eagerly (the piecewise graphs set
  aside) or replayed from the piecewise graphs (engine/piecewise_graphs.py). `--piecewise`
  picks these two.

The launch column is the host time inside the model's forward (eager) or inside the piecewise
graphs' run (the pieces' replays and the eager attention calls between them), measured without
the module hooks; the module breakdown comes from a second step with them (none for
`piecewise`: its forward calls no module).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("PAGEDSERVE_DEVICE_TIMING", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_before import TILES_16BIT_BEFORE, align_by_expert_torch_ops  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.models import moe_kernels  # noqa: E402

ALIGN_NOW, TILES_NOW = moe_kernels.align_by_expert, moe_kernels._TILES_16BIT

@contextmanager
def module_host_times(model: torch.nn.Module) -> Iterator[collections.Counter]:
    """Host seconds spent inside each module class's forward while the context is open."""
    spent: collections.Counter = collections.Counter()
    started: dict[int, float] = {}

    def pre(module, _args):
        started[id(module)] = time.perf_counter()

    def post(module, _args, _out):
        spent[type(module).__name__] += time.perf_counter() - started.pop(id(module))

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre),
                                                   m.register_forward_hook(post))]
    try:
        yield spent
    finally:
        for h in handles:
            h.remove()


def use_variant(name: str, runner, piecewise) -> None:
    moe_kernels.align_by_expert = (align_by_expert_torch_ops if name == "before"
                                   else ALIGN_NOW)
    moe_kernels._TILES_16BIT = (TILES_NOW if name in ("after", "eager", "piecewise")
                                else TILES_16BIT_BEFORE)
    runner.piecewise = piecewise if name == "piecewise" else None


@contextmanager
def launch_time(runner) -> Iterator[list]:
    """Host seconds inside the model's forward and the piecewise graphs' run while open (the
    instances' methods wrapped; no module hooks)."""
    spent = [0.0]
    wrapped = [(obj, "forward" if obj is runner.model else "run")
               for obj in (runner.model, runner.piecewise) if obj is not None]

    def timed(method):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return call

    for obj, name in wrapped:
        setattr(obj, name, timed(getattr(obj, name)))
    try:
        yield spent
    finally:
        for obj, name in wrapped:
            delattr(obj, name)  # the class's method again


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()}
            for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_step(llm: LLM, tokens: int, vocab: int, seed: int, hooks: bool = True
                 ) -> tuple[float, collections.Counter]:
    """One step of `tokens` prompt tokens (8 requests of tokens / 8): the host seconds of its
    forward's launch, and (`hooks`) a second such step's split by module class."""
    runner = llm.engine.core.runner
    params = SamplingParams(temperature=0.0, max_tokens=1)
    sync()
    with launch_time(runner) as launch:
        llm.generate(prompts_of(8, tokens // 8, vocab, seed), params, use_tqdm=False)
    sync()
    spent: collections.Counter = collections.Counter()
    if hooks:
        with module_host_times(runner.model) as spent:
            llm.generate(prompts_of(8, tokens // 8, vocab, seed + 1), params, use_tqdm=False)
        sync()
    return launch[0], spent


def generation(llm: LLM, args, seed: int) -> dict:
    core = llm.engine.core
    prompts = prompts_of(args.num_prompts, args.input_len, core.runner.vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    before = core.stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = core.stats()
    steps = after.num_steps - before.num_steps
    step_s = after.step_seconds - before.step_seconds
    wait_s = after.wait_seconds - before.wait_seconds
    busy_s = after.device_seconds - before.device_seconds
    return dict(tok_s=args.num_prompts * args.output_len / wall, steps=steps,
                step_ms=step_s / steps * 1e3, wait_ms=wait_s / steps * 1e3,
                host_ms=(step_s - wait_s) / steps * 1e3, busy=busy_s / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-30b-a3b-random")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="before,align,after")
    parser.add_argument("--piecewise", action="store_true",
                        help="the variants eager,piecewise (an engine with piecewise graphs)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--model", default=None, help="instead of the config's (a smoke test)")
    args = parser.parse_args()
    variants = ["eager", "piecewise"] if args.piecewise else args.variants.split(",")

    overrides: dict = ({} if args.gpu_memory_utilization is None
                       else {"gpu_memory_utilization": args.gpu_memory_utilization})
    if args.model:
        overrides["model"] = args.model
    if "piecewise" in variants:
        overrides["piecewise_cuda_graphs"] = True
    t0 = time.perf_counter()
    llm = LLM(config=args.config, engine_core_process=False, **overrides)
    runner = llm.engine.core.runner
    piecewise = runner.piecewise
    print(f"engine started in {time.perf_counter() - t0:.0f} s; piecewise graphs: "
          f"{piecewise.num_pieces if piecewise is not None else None}", flush=True)
    if "piecewise" in variants and piecewise is None:
        sys.exit("piecewise graphs were not captured (see the log)")
    vocab = runner.vocab_size
    llm.generate(prompts_of(64, 64, vocab, 0), SamplingParams(max_tokens=4), use_tqdm=False)

    results: dict[str, list] = {a: [] for a in variants}
    for r in range(args.rounds):
        for v, name in enumerate(variants):
            use_variant(name, runner, piecewise)
            # Prompts of their own in every run: none finds another's blocks in the prefix cache.
            seed = 10 * (r * len(variants) + v)
            prefill_step(llm, args.prefill_tokens, vocab, seed=seed + 1, hooks=False)  # warm
            launch, spent = prefill_step(llm, args.prefill_tokens, vocab, seed=seed + 2,
                                         hooks=name != "piecewise")
            gen = generation(llm, args, seed=seed + 4)
            results[name].append((launch, gen))
            top = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in spent.most_common(8))
            print(f"round {r} {name}: prefill {args.prefill_tokens} tokens, forward launch "
                  f"{launch * 1e3:.1f} host ms; by module (inclusive, hooked): {top}",
                  flush=True)
            print(f"round {r} {name}: {gen['tok_s']:.0f} output tok/s, {gen['steps']} "
                  f"steps, {gen['step_ms']:.1f} ms a step, waiting {gen['wait_ms']:.1f}, host "
                  f"{gen['host_ms']:.1f}, device busy {gen['busy']:.1%}", flush=True)

    print(f"\n| variant | prefill forward launch, host ms ({args.prefill_tokens} tokens) | "
          f"output tok/s | ms a step | host ms a step | device busy |")
    print("|---|---|---|---|---|---|")
    for name in variants:
        runs = results[name]
        launch = np.median([s for s, _ in runs]) * 1e3
        med = {k: np.median([g[k] for _, g in runs]) for k in runs[0][1]}
        print(f"| {name} | {launch:.1f} | {med['tok_s']:.0f} | {med['step_ms']:.1f} | "
              f"{med['host_ms']:.1f} | {med['busy']:.1%} |")


if __name__ == "__main__":
    main()
