"""Guided decoding with grammar worker processes against the engine's own matchers, on any
device and without the bundled GGUF (a random model with a tokenizer directory): the share of
identical requests, every JSON output validated and every regex output matched.

Two comparisons, each two engines one after the other in this process: N workers with async
scheduling against none step by step; and N workers against none, both async, on a KV cache
small enough to preempt (`--blocks`).

    python benchmarks/guided_parity.py --tokenizer DIR [--workers 2] [--device cuda]
        [--model random:smollm2-135m] [--blocks 120]
"""

from __future__ import annotations

import argparse
import json
import re

import jsonschema

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import GuidedDecodingParams

SCHEMA = {"type": "object",
          "properties": {"unit": {"enum": ["g", "kg", "ml", "l"]},
                         "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3}},
          "required": ["unit", "qty", "ok", "tags"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
PROMPT = "List the ingredients of a cake as JSON:"
NUM_JSON, NUM_REGEX, NUM_PLAIN = 40, 8, 16


def requests() -> list[SamplingParams]:
    guided = GuidedDecodingParams(json=SCHEMA)
    return ([SamplingParams(temperature=0.8, seed=i, max_tokens=200, guided_decoding=guided)
             for i in range(NUM_JSON)]
            + [SamplingParams(n=2, temperature=1.0, seed=100 + i, max_tokens=40,
                              guided_decoding=GuidedDecodingParams(regex=REGEX))
               for i in range(NUM_REGEX)]
            + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
               for _ in range(NUM_PLAIN)])


def run(args: argparse.Namespace, workers: int, async_scheduling: bool, blocks: int | None
        ) -> tuple[list, int]:
    """Every request's outputs, and the scheduler's preemptions."""
    llm = LLM(model=args.model, tokenizer=args.tokenizer, device=args.device,
              gpu_memory_utilization=0.5, kv_cache_memory="512MiB", max_num_seqs=128,
              engine_core_process=False, async_scheduling=async_scheduling,
              guided_decoding_workers=workers, num_gpu_blocks_override=blocks)
    params = requests()
    with llm:  # closed, its memory given back, before the next engine starts
        outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        return outs, llm.engine.scheduler.num_preemptions


def check(outs: list) -> tuple[int, bool]:
    """Valid JSON outputs (jsonschema raises on an invalid one), and whether every regex
    output matches."""
    for out in outs[:NUM_JSON]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    regex_ok = all(re.fullmatch(REGEX, c.text)
                   for out in outs[NUM_JSON:NUM_JSON + NUM_REGEX] for c in out.outputs)
    return NUM_JSON, regex_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--device", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=120,
                        help="KV blocks of the preempting comparison")
    args = parser.parse_args()
    for label, reference, blocks in [("async vs step by step", False, None),
                                     ("both async, preempting", True, args.blocks)]:
        ref, ref_preempted = run(args, 0, reference, blocks)
        outs, preempted = run(args, args.workers, True, blocks)
        same = sum([c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
                   for a, b in zip(outs, ref, strict=True))
        valid, regex_ok = check(outs)
        print(f"{args.workers} workers against 0, {label}: {same}/{len(outs)} requests "
              f"identical, {valid}/{NUM_JSON} valid JSON, regex outputs match: {regex_ok}, "
              f"preemptions {preempted} (reference {ref_preempted})")


if __name__ == "__main__":
    main()
