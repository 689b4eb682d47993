"""Offline throughput on the bundled SmolLM2: the engine next to transformers `generate` on the
same prompts, measured in the same run.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128] [--dtype float32]

Prompts are random token ids of varied lengths (a fixed seed), EOS is ignored so every request
produces exactly --output-len tokens. transformers runs the same prompts batched and
left-padded (`--hf-batch-size`, default all at once).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import default_model_path


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for length in lens]


@torch.inference_mode()
def run_transformers(prompts: list[list[int]], output_len: int, dtype: torch.dtype,
                     batch_size: int) -> float:
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=dtype)
    model.eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=16)
    parser.add_argument("--max-input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.num_prompts,
              max_num_batched_tokens=4096, kv_cache_memory="4GiB")
    vocab = llm.engine.runner.vocab_size
    prompts = make_prompts(args.num_prompts, args.min_input_len, args.max_input_len, vocab, 0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine_s = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert out_tokens == args.num_prompts * args.output_len
    engine_tps = out_tokens / engine_s
    print(f"pagedserve:   {out_tokens} tokens in {engine_s:.1f} s = {engine_tps:.1f} output tok/s")
    if args.skip_transformers:
        return
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    hf_s = run_transformers(prompts, args.output_len, dtype,
                            args.hf_batch_size or args.num_prompts)
    hf_tps = out_tokens / hf_s
    print(f"transformers: {out_tokens} tokens in {hf_s:.1f} s = {hf_tps:.1f} output tok/s")
    print(f"ratio (pagedserve / transformers): {engine_tps / hf_tps:.2f}x "
          f"[{args.num_prompts} prompts x {args.output_len} new tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads]")


if __name__ == "__main__":
    main()
