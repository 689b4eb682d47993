"""Speculative decoding against none, side by side in one run: time per output token at each
batch size, with the acceptance figures and the proposer's share of the core's step time.

    python benchmarks/spec_decode.py [--model M] [--batch-sizes 1 64] \
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, \
                                "prompt_lookup_max": 4, "prompt_lookup_min": 2}']

The default workload is the one n-gram lookup is for: chat prompts that ask the model to
repeat, quote or lightly edit a passage given in the prompt (the answer repeats the prompt).
`--guided-json` asks instead to copy a JSON record given in the prompt under its schema
(guided decoding: the drafts the grammar accepts are verified under a mask per position).
`--random-prompts` uses random token ids instead (for a draft model or a head under
`rejection_sample_method: "synthetic"`, whose acceptance does not depend on the text).
`--random-eagle3-head DRAFT_VOCAB` writes a random-weight EAGLE-3 head of the target's shape
(a draft vocabulary of that many ids, 0: the target's) to a temporary directory and sets it as
the config's `model`, e.g. for the 8B shape at a mean acceptance length of about 3.0 with K=3:

    python benchmarks/spec_decode.py --model random:llama3-8b --random-prompts 128 \
        --random-eagle3-head 32000 --batch-sizes 1 32 --speculative-config \
        '{"method": "eagle3", "num_speculative_tokens": 3, "model": "-", \
          "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.8}'

`--profile` then runs the first batch size once more with speculation under the profilers:
the GPU's busy share a step (torch.profiler, CUDA kernels), the core's top host functions
(cProfile) and the lines of ours that make the host wait for the GPU (torch's sync debug
mode); the engine runs in this process, so both see its steps.

A `random:` DeepSeek target (`--model random:deepseek-v2-lite`) takes `"method": "mtp"` with a
random-weight MTP layer the same way. Each
row runs the engine without speculation, then with it, alternating `--repeats` times; the
figures are the medians. Greedy and EOS ignored, so both runs produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pagedserve import LLM, SamplingParams
from pagedserve.bench import format_spec_decode, random_prompts, spec_decode_figures
from pagedserve.sampling_params import GuidedDecodingParams

PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at dusk, counting the steps as he "
    "went: one hundred and twelve, never more and never fewer. At the top he wiped the salt "
    "from the great lens, trimmed the wick and lit the lamp, then sat by the window with his "
    "logbook open on his knees. Ships passed in the dark, some close enough that he could hear "
    "their engines, others only a faint light on the horizon. He wrote down each one he saw, "
    "the time, the direction and the weather, in the same careful hand his father had used "
    "before him. In the morning, when the first grey light came over the water, he put out "
    "the lamp, closed the logbook and walked down the hundred and twelve steps to sleep.")

# The --guided-json workload: a record to copy, and the schema its answer is held to.
RECORD = {"keeper": "Tomas Ilves", "steps": 112, "lamp": "lit at dusk, out at dawn",
          "ships": [{"time": "21:40", "direction": "north", "weather": "fog"},
                    {"time": "23:05", "direction": "south-west", "weather": "rain"},
                    {"time": "02:15", "direction": "east", "weather": "clear"}]}
SHIP = {"type": "object", "properties": {k: {"type": "string", "maxLength": 16}
                                         for k in ("time", "direction", "weather")},
        "required": ["time", "direction", "weather"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {
    "keeper": {"type": "string", "maxLength": 32}, "steps": {"type": "integer"},
    "lamp": {"type": "string", "maxLength": 40},
    "ships": {"type": "array", "items": SHIP, "maxItems": 4}},
    "required": ["keeper", "steps", "lamp", "ships"], "additionalProperties": False}

TASKS = (
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Quote the passage below in full, then stop.\n\n{p}",
    "Rewrite the passage below with every 'he' replaced by 'she', changing nothing else:\n\n{p}",
    "Copy this text without changes:\n\n{p}",
)


def chat_prompts(llm: LLM, n: int, guided: bool = False) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    out = []
    for i in range(n):
        task = (f"Copy this JSON record exactly:\n\n{json.dumps(RECORD)}" if guided
                else TASKS[i % len(TASKS)].format(p=PASSAGE))
        text = tokenizer.apply_chat_template([{"role": "user", "content": task}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def run(llm: LLM, prompts: list[list[int]], output_len: int, guided: bool = False
        ) -> tuple[float, Any, Any, int]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            guided_decoding=GuidedDecodingParams(json=SCHEMA) if guided
                            else None)
    before = llm.engine.call_utility("stats")
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, before, llm.engine.call_utility("stats"), tokens


def random_head(model: str | None, draft_vocab: int) -> str:
    """A random EAGLE-3 head for `model`'s shape in a temporary directory."""
    import tempfile

    from transformers import AutoConfig

    from pagedserve.models.random_models import RANDOM_PREFIX, random_model_config
    from pagedserve.spec_decode.random_head import write_random_eagle3_head

    if model is None or not (model.startswith(RANDOM_PREFIX) or Path(model).is_dir()):
        raise SystemExit("--random-eagle3-head needs --model random:<preset> or a directory")
    config = (random_model_config(model[len(RANDOM_PREFIX):])
              if model.startswith(RANDOM_PREFIX) else AutoConfig.from_pretrained(model))
    return write_random_eagle3_head(tempfile.mkdtemp(prefix="eagle3-head-"), config,
                                    draft_vocab or None)


def profile_steps(llm: LLM, prompts: list[list[int]], output_len: int, guided: bool) -> None:
    """One run of `prompts` under each profiler (see the module's docstring)."""
    import collections

    import torch
    from step_profile import host_profile, host_syncs, kernel_events, union_seconds
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        elapsed, before, after, _ = run(llm, prompts, output_len, guided)
        torch.cuda.synchronize()
    steps = max(after.num_steps - before.num_steps, 1)
    events = kernel_events(prof)
    busy = union_seconds([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events])
    print(f"profiled: {steps} steps, {elapsed / steps * 1e3:.2f} ms a step; kernels running "
          f"{busy / elapsed:.1%} of it ({busy / steps * 1e3:.2f} ms a step)")
    by_name: collections.Counter = collections.Counter()
    for e in events:
        by_name[e.name()[:64]] += e.duration_ns()
    for name, ns in by_name.most_common(10):
        print(f"  {name:64s} {ns / steps / 1e6:7.3f} ms a step")
    host_profile(lambda: run(llm, prompts, output_len, guided), top=30)
    host_syncs(lambda: run(llm, prompts, min(output_len, 32), guided), top=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--speculative-config", default=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--random-prompts", type=int, default=0, metavar="LEN",
                        help="random prompts of LEN tokens instead of the copy tasks")
    parser.add_argument("--guided-json", action="store_true",
                        help="copy a JSON record under its schema (guided decoding)")
    parser.add_argument("--random-eagle3-head", type=int, default=None, metavar="DRAFT_VOCAB",
                        help="time a random-weight EAGLE-3 head of the target's shape")
    parser.add_argument("--profile", action="store_true",
                        help="then profile the first batch size with speculation (CUDA)")
    parser.add_argument("--engine-args", default="{}",
                        help="more LLM(...) keywords as JSON, e.g. '{\"device\": \"cpu\"}'")
    args = parser.parse_args()
    extra = json.loads(args.engine_args)
    spec = json.loads(args.speculative_config)
    extra.setdefault("gpu_memory_utilization", 0.4)  # two engines side by side
    if args.random_eagle3_head is not None:
        spec["model"] = random_head(args.model, args.random_eagle3_head)
    plain = LLM(model=args.model, **extra)
    fast = LLM(model=args.model, speculative_config=spec, **extra)
    print(f"speculative_config: {json.dumps(spec)}")
    for batch in args.batch_sizes:
        if args.random_prompts:
            prompts = random_prompts(batch, args.random_prompts, plain.engine.vocab_size, 0)
        else:
            prompts = chat_prompts(plain, batch, args.guided_json)
        run(plain, prompts[:1], 4, args.guided_json)  # lazy initialisation, compiles
        run(fast, prompts[:1], 4, args.guided_json)
        tpot: dict[str, list[float]] = {"off": [], "on": []}
        figures: dict[str, Any] = {}
        for _ in range(args.repeats):
            for name, llm in (("off", plain), ("on", fast)):
                elapsed, before, after, tokens = run(llm, prompts, args.output_len,
                                                     args.guided_json)
                tpot[name].append(elapsed / (tokens / batch) * 1e3)
                if name == "on":
                    figures = spec_decode_figures(before, after)
        off, on = statistics.median(tpot["off"]), statistics.median(tpot["on"])
        print(f"batch {batch:>3}: time per output token {off:.3f} ms without, {on:.3f} ms "
              f"with speculation: {off / on:.2f}x")
        if figures:
            print("  " + format_spec_decode(figures))
        else:
            print("  no drafts were proposed")
    if args.profile:
        prompts = (random_prompts(args.batch_sizes[0], args.random_prompts,
                                  plain.engine.vocab_size, 0) if args.random_prompts
                   else chat_prompts(plain, args.batch_sizes[0], args.guided_json))
        plain.close()  # its memory back before the profiled runs
        profile_steps(fast, prompts, args.output_len, args.guided_json)


if __name__ == "__main__":
    main()
