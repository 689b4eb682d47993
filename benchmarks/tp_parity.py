"""Tensor parallelism against one rank on the same prompts: the share of identical greedy
tokens, and the teacher-forced KL divergence between the two (both score one rank's greedy
continuations, so their distributions are compared position by position on the same text).

The two engines run one after the other in this process (one TP group per process); the
first is shut down and its memory freed before the second starts.

    python benchmarks/tp_parity.py --model random:llama3-8b --dtype bfloat16 --tp 2   # 2 GPUs
    python benchmarks/tp_parity.py --model random:tiny --dtype float32 --device cpu \\
        --num-prompts 4 --output-len 16 --kv-cache-memory 64MiB                   # dry run
"""

from __future__ import annotations

import argparse
import random

import torch

from pagedserve import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size to compare with 1")
    p.add_argument("--executor", default="mp", help="distributed executor backend: mp or ray")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-memory", default=None, help="CPU cache budget, e.g. 64MiB")
    p.add_argument("--enforce-eager", action="store_true")
    return p.parse_args()


def run(args: argparse.Namespace, tp: int, prompts: list[list[int]],
        continuations: list[list[int]] | None
        ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of `prompts` with `tp` ranks, and the teacher-forced
    log-distributions of `continuations` (this run's own greedy tokens when None)."""
    engine_args = dict(dtype=args.dtype, tensor_parallel_size=tp,
                       enforce_eager=args.enforce_eager or None)
    if tp > 1:
        engine_args["distributed_executor_backend"] = args.executor
    if args.device:
        engine_args["device"] = args.device
    if args.kv_cache_memory:
        engine_args["kv_cache_memory"] = args.kv_cache_memory
    with LLM(model=args.model, **engine_args) as llm:  # closed before the next one starts
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        greedy = [list(o.outputs[0].token_ids) for o in outs]
        return greedy, llm.score(prompts, continuations or greedy)


def main() -> None:
    args = parse_args()
    rng = random.Random(0)
    vocab = _vocab_size(args.model)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    one, one_scores = run(args, 1, prompts, None)
    many, many_scores = run(args, args.tp, prompts, one)
    same = sum(a == b for x, y in zip(one, many, strict=True)
               for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in one)
    identical = sum(x == y for x, y in zip(one, many, strict=True))
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(one, many, strict=True)]
    kl = torch.cat([(a.exp() * (a - b)).sum(-1)
                    for a, b in zip(one_scores, many_scores, strict=True)])
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float()
                      for a, b in zip(one_scores, many_scores, strict=True)])
    print(f"{args.model}, {args.dtype}, TP={args.tp} ({args.executor}) against TP=1, "
          f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out")
    print(f"identical greedy tokens: {same}/{total} ({same / total:.1%}); whole sequences "
          f"identical: {identical}/{len(one)}; first divergence at "
          f"{sorted(d for d in first_diff if d is not None)[:8]}")
    print(f"teacher-forced on TP=1's tokens: KL(TP1 || TP{args.tp}) mean {kl.mean():.2e}, "
          f"max {kl.max():.2e}; top-1 agreement {top1.mean():.2%}")


def _vocab_size(model: str) -> int:
    """The vocabulary to draw prompt ids from (random models: their preset's)."""
    if model.startswith("random:"):
        from pagedserve.models.random_models import random_model_config

        return int(random_model_config(model.split(":", 1)[1]).vocab_size)
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).vocab_size)


if __name__ == "__main__":
    main()
