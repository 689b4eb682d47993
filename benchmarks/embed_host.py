"""The host's work in `LLM.embed` at a GPU's step shape, on the CPU: a tiny random BERT (CLS
pooling) whose forward is replaced by a stub that returns a fixed [T, H] tensor, so what is
timed is everything else a step does (adding requests, scheduling, building the step's
inputs, pooling, outputs), with async scheduling on as on CUDA:

    python benchmarks/embed_host.py [--num-texts 10000] [--tokens 256] \\
        [--step-tokens 16384] [--texts] [--profile 30]

Prints texts/s, ms a step and each phase's ms a step (core: the engine core's step; front:
adding requests and turning a step's rows into outputs), and the cyclic collector's runs
during the call. `--texts` embeds texts (tokenized on a thread beside the engine, which on a
machine of few cores competes with the engine thread) instead of token ids; `--profile N`
prints the N functions of most own time (cProfile).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import gc
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embed_throughput import NUM_WORDS, save_embedder  # noqa: E402

from pagedserve import LLM  # noqa: E402


def wrap(owner: Any, name: str, label: str, totals: collections.Counter) -> None:
    """Time every call of owner.name into totals[label] (seconds)."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-texts", type=int, default=10000)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per text, CLS/SEP too")
    parser.add_argument("--step-tokens", type=int, default=16384,
                        help="max_num_batched_tokens (pooling.config's CUDA default)")
    parser.add_argument("--texts", action="store_true", help="embed texts, not token ids")
    parser.add_argument("--profile", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(0, NUM_WORDS, args.tokens - 2))
             for _ in range(args.num_texts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "embedder"
        save_embedder(path, "bert-tiny", max(args.tokens, 512))
        with LLM(str(path), device="cpu", dtype="float32", max_model_len=args.tokens,
                 max_num_batched_tokens=args.step_tokens, max_num_seqs=256,
                 async_scheduling=True) as llm:
            engine = llm.engine
            core, runner = engine.core, engine.runner
            hidden = torch.randn(args.step_tokens, engine.pooler_config.hidden_size)
            runner.model.forward = lambda ids, positions, **kw: hidden[:ids.shape[0]]
            prompts = texts if args.texts else [
                list(ids) for ids in engine.tokenizer(texts)["input_ids"]]
            llm.embed(prompts[:512])  # warm-up
            totals: collections.Counter = collections.Counter()
            for owner, name, label in (
                    (engine, "add_pooling_request", "front: add requests (core's part too)"),
                    (engine, "_process", "front: outputs"),
                    (core, "step", "core: step"),
                    (core.scheduler, "schedule", "core:   schedule"),
                    (runner.input_batch, "update", "core:   input rows"),
                    (runner, "_forward", "core:   inputs + stub forward"),
                    (runner.pooler, "launch", "core:   pooling"),
                    (core, "_complete", "core:   complete the last step")):
                wrap(owner, name, label, totals)
            collections_run: collections.Counter = collections.Counter()
            started: list[float] = []

            def on_gc(phase: str, info: dict[str, Any]) -> None:
                if phase == "start":
                    started.append(time.perf_counter())
                else:
                    collections_run[info["generation"]] += 1
                    collections_run["seconds"] += time.perf_counter() - started.pop()

            gc.callbacks.append(on_gc)
            before = core.num_steps
            t0 = time.perf_counter()
            llm.embed(prompts)
            wall = time.perf_counter() - t0
            gc.callbacks.remove(on_gc)
            steps = core.num_steps - before
            print(f"LLM.embed of {len(prompts)} {'texts' if args.texts else 'token-id prompts'}"
                  f" x {args.tokens} tokens: {wall:.2f} s, {len(prompts) / wall:,.0f} texts/s, "
                  f"{steps} steps, {wall / steps * 1e3:.2f} ms a step")
            for label, seconds in totals.items():
                print(f"  {label:40s} {seconds / steps * 1e3:7.3f} ms a step")
            print(f"  collector: {dict(collections_run)}")
            if args.profile:
                profile = cProfile.Profile()
                profile.runcall(llm.embed, prompts)
                pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
