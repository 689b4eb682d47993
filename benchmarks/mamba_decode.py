"""Mamba decode throughput: the engine next to transformers `generate` on the same random
Mamba-1 model (mamba-130m shaped by default), batch 64, measured in the same run.

    python benchmarks/mamba_decode.py [--batch 64] [--prompt-len 128] [--output-len 128]
                                      [--dtype bfloat16] [--kernels triton|torch]

Decode throughput = batch x (output_len - 1) tokens over the time after every request has its
first token (the prefill is timed apart, for both). Prompts are random token ids of one length,
so transformers needs no padding. On CUDA transformers runs its torch Mamba path unless the
mamba-ssm / causal-conv1d kernels are installed; the line printed says which ran.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def build_model(path: str, args: argparse.Namespace) -> None:
    import transformers

    config = transformers.MambaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, state_size=args.state_size,
        num_hidden_layers=args.num_layers, expand=2, conv_kernel=4,
        max_position_embeddings=args.prompt_len + args.output_len + 16)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(path: str, prompts: list[list[int]], args: argparse.Namespace,
               device: torch.device) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of the engine."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=path, dtype=args.dtype, device=str(device), max_num_seqs=len(prompts),
              max_num_batched_tokens=max(2048, len(prompts[0])), kv_cache_memory="4GiB")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    sync(device)
    start = time.perf_counter()
    first = None
    tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and all(r.num_output_tokens >= 1 for r in engine.scheduler.running) \
                and not engine.scheduler.waiting:
            sync(device)
            first = time.perf_counter()
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in outputs)
    sync(device)
    end = time.perf_counter()
    assert tokens == len(prompts) * args.output_len, tokens
    return first - start, end - first


@torch.inference_mode()
def run_transformers(path: str, prompts: list[list[int]], args: argparse.Namespace,
                     device: torch.device) -> tuple[float, float]:
    import transformers

    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    ids = torch.tensor(prompts, device=device)

    def generate(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    generate(2)  # warm
    prefill = generate(1)
    return prefill, generate(args.output_len) - prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--state-size", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=50280)
    parser.add_argument("--kernels", choices=["triton", "torch"], default="triton",
                        help="the MAMBA backend's path on CUDA")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if args.kernels == "torch":
        os.environ["PAGEDSERVE_STATE_KERNELS"] = "torch"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, args.vocab_size, (args.batch, args.prompt_len),
                            generator=g).tolist()
    decode_tokens = args.batch * (args.output_len - 1)
    with tempfile.TemporaryDirectory() as path:
        build_model(path, args)
        prefill_s, decode_s = run_engine(path, prompts, args, device)
        ours = decode_tokens / decode_s
        from pagedserve.attention.ops import state_kernels_enabled

        kernels = "triton" if state_kernels_enabled(device) else "torch"
        print(f"pagedserve ({kernels} kernels): prefill {prefill_s * 1e3:.0f} ms, decode "
              f"{decode_tokens} tokens in {decode_s:.2f} s = {ours:.0f} tok/s")
        if args.skip_transformers:
            return
        hf_prefill_s, hf_decode_s = run_transformers(path, prompts, args, device)
    theirs = decode_tokens / hf_decode_s
    print(f"transformers generate: prefill {hf_prefill_s * 1e3:.0f} ms, decode {decode_tokens} "
          f"tokens in {hf_decode_s:.2f} s = {theirs:.0f} tok/s")
    print(f"decode ratio (pagedserve / transformers): {ours / theirs:.2f}x [batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.output_len} new, {args.dtype}, {device}]")


if __name__ == "__main__":
    main()
