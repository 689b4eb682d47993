"""Quantized weights against bf16 in the engine, on the same random weights, in one run (GPU):

    python benchmarks/quant_engine.py [--model random:llama3-8b] [--quantized fp8]
        [--num-prompts 1000] [--kv-cache-dtype auto] [--skip throughput,decode,quality]
        [--batch-rows 1,16,64,256] [--json FILE]

The bf16 engine runs --model (`--quantization none`); the quantized one runs the same model
with `--quantization fp8` (`--quantized fp8`, the default: quantized per output row as the
weights are made; see quantization/random_weights.py) or the model --quantized names, e.g. a
`random:` config file whose fields carry a GPTQ quantization_config over the same preset
(quantization/random_packed.py: the very weights packed as they are made), which 4-bit rows
run with PAGEDSERVE_W4A16_KERNEL=1:

    {"base": "llama3-8b", "quantization_config": {"quant_method": "gptq", "bits": 4,
     "group_size": 128, "sym": true, "desc_act": false}}

For each engine in turn:
- weight memory: the model's parameter and buffer bytes;
- quality (teacher-forced): bf16 greedily continues --quality-prompts random prompts; both
  engines score those continuations (`LLM.score`), giving the mean KL(bf16 || quantized) in
  nats per token and the top-1 agreement (bf16 scored against itself gives 0 and 1: a check);
- throughput: --num-prompts x 128 in / 1,024 out and x 1,024 in / 128 out (`bench
  throughput`'s figures);
- batch rows (--batch-rows): exactly b prompts of 128 tokens, --batch-out tokens each, so that
  b requests run together throughout: output tok/s at each b;
- batch-1 decode: one 128-token prompt, --decode-tokens out: seconds per output token.
A table closes the run with quantized / bf16 for each row. `--model random:llama3-70b` on one
H200: the bf16 engine cannot start (140 GB); pass --skip-bf16 to run the quantized one alone.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench import random_prompts, run_throughput

WORKLOADS = {"128/1024": (128, 1024), "1024/128": (1024, 128)}


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def decode_seconds_per_token(llm: LLM, vocab: int, tokens: int) -> float:
    prompt = random_prompts(1, 128, vocab, seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    prefill = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return (time.perf_counter() - start - prefill) / (tokens - 1)


def kl_and_agreement(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    kl, agree, n = 0.0, 0, 0
    for p, q in zip(ref, got, strict=True):
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        n += p.shape[0]
    return kl / n, agree / n


def quality(llm: LLM, prompts: list[list[int]], tokens: int, continuation: dict
            ) -> tuple[float, float]:
    """Teacher-forced KL and top-1 agreement against the first engine run: it greedily
    continues `prompts` by `tokens` and scores them (its scores the reference, kept in
    `continuation`); a later engine scores the same continuations."""
    if "tokens" not in continuation:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        continuation["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    scores = llm.score(prompts, continuation["tokens"])
    continuation.setdefault("ref", scores)
    return kl_and_agreement(continuation["ref"], scores)


def engine_of(args: argparse.Namespace, which: str) -> tuple[str, str, str | None]:
    """(its label, model, --quantization) of the "bf16" or the "quantized" engine."""
    if which == "bf16":
        return "bf16", args.model, "none"
    if args.quantized == "fp8":
        return "fp8", args.model, "fp8"
    return Path(args.quantized.removeprefix("random:")).stem, args.quantized, None


def measured_row(llm: LLM, row: dict, measure: Callable[[int], None]) -> dict:
    """`row` with the engine's weight bytes and what `measure(vocab)` adds to it, printed as
    JSON; the engine is closed after, whatever happens."""
    try:
        row["weight_gb"] = weight_bytes(llm.engine.runner.model) / 1e9
        measure(llm.engine.vocab_size)
    finally:
        llm.close()
    print(json.dumps(row), flush=True)
    return row


def run(args: argparse.Namespace, which: str, continuation: dict) -> dict:
    label, model, quantization = engine_of(args, which)
    llm = LLM(model=model, quantization=quantization, dtype="bfloat16",
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len)
    row: dict = {"quantization": label}

    def measure(vocab: int) -> None:
        if "quality" not in args.skip:
            row["kl"], row["top1"] = quality(llm, random_prompts(args.quality_prompts, 64, vocab,
                                                                 seed=3),
                                             args.quality_tokens, continuation)
        if "throughput" not in args.skip:
            for name, (n_in, n_out) in WORKLOADS.items():
                prompts = random_prompts(args.num_prompts, n_in, vocab, seed=1)
                row[f"tok_s_{name}"] = run_throughput(llm, prompts, n_out)["output_tokens_per_s"]
        for b in args.batch_rows:
            prompts = random_prompts(b, 128, vocab, seed=2)
            row[f"tok_s_batch{b}"] = run_throughput(llm, prompts, args.batch_out)[
                "output_tokens_per_s"]
        if "decode" not in args.skip:
            row["decode_s_per_token"] = decode_seconds_per_token(llm, vocab, args.decode_tokens)

    return measured_row(llm, row, measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--quantized", default="fp8",
                        help="fp8 (--model under --quantization fp8) or a quantized model")
    parser.add_argument("--batch-rows", default="", help="comma-separated batch sizes")
    parser.add_argument("--batch-out", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--quality-prompts", type=int, default=16)
    parser.add_argument("--quality-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--skip", default="", help="comma-separated: throughput,decode,quality")
    parser.add_argument("--skip-bf16", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    args.batch_rows = [int(b) for b in filter(None, args.batch_rows.split(","))]
    if not torch.cuda.is_available():
        raise SystemExit("quant_engine.py measures the CUDA engine: run it on a GPU")
    print(f"# {torch.cuda.get_device_name()}, {args.model}, kv cache {args.kv_cache_dtype}")
    continuation: dict = {}
    if args.skip_bf16:
        args.skip.add("quality")
    rows = [] if args.skip_bf16 else [run(args, "bf16", continuation)]
    rows.append(run(args, "quantized", continuation))
    keys = [k for k in rows[-1] if k != "quantization"]
    print(f"\n{'':22}" + "".join(f"{r['quantization']:>12}" for r in rows)
          + (f"   {rows[-1]['quantization']}/bf16" if len(rows) == 2 else ""))
    for key in keys:
        values = [r.get(key) for r in rows]
        line = f"{key:22}" + "".join(f"{v:>12.4g}" if v is not None else f"{'-':>12}"
                                     for v in values)
        if len(rows) == 2 and values[0]:
            line += f"   {values[1] / values[0]:9.3f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
