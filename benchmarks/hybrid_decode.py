"""Hybrid (Qwen3-Next) decode throughput: the engine next to transformers `generate` on the same
random Qwen3-Next-shaped model, batch 64, measured in the same run.

    python benchmarks/hybrid_decode.py [--batch 64] [--prompt-len 128] [--output-len 128]
                                       [--mlp dense|moe] [--num-layers 4] [--dtype bfloat16]
                                       [--device cuda|cpu] [--kernels triton|torch]

The default shape is Qwen3-Next's layer widths: hidden 2048, gated attention with 16 query /
2 KV heads of 256 (a quarter rotated), gated delta nets with 16 key / 32 value heads of 128 and
a conv of 4, dense MLPs of 5632 (or `--mlp moe`: 64 experts of 512, top 10, a shared expert of
512); `--num-layers` layers, every fourth full attention. `--device cpu` runs a tiny shape
(hidden 64, a few heads of 16) in float32, for a quick check that the whole path works.

Decode throughput = batch x (output_len - 1) tokens over the time after every request has its
first token (the prefill is timed apart, for both). Prompts are random token ids of one length,
so transformers needs no padding. transformers runs its torch gated delta rule unless
flash-linear-attention / causal-conv1d are installed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

REALISTIC = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10,
                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=512)


def build_model(path: str, args: argparse.Namespace, shape: dict) -> None:
    import transformers

    layers = args.num_layers
    config = transformers.Qwen3NextConfig(
        **shape, num_hidden_layers=layers,
        mlp_only_layers=list(range(layers)) if args.mlp == "dense" else [],
        max_position_embeddings=args.prompt_len + args.output_len + 16,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(path: str, prompts: list[list[int]], args: argparse.Namespace,
               device: torch.device) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of the engine."""
    from pagedserve import LLM, SamplingParams

    memory = "4GiB" if device.type == "cuda" else "64MiB"
    llm = LLM(model=path, dtype=args.dtype, device=str(device), max_num_seqs=len(prompts),
              max_num_batched_tokens=max(2048, len(prompts[0])), kv_cache_memory=memory)
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

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)

    def generate(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    generate(2)  # warm
    prefill = min(generate(1), generate(1))
    return prefill, generate(args.output_len) - prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--mlp", choices=["dense", "moe"], default="dense")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--kernels", choices=["triton", "torch"], default="triton",
                        help="the GDN_ATTN backend's path on CUDA")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if args.kernels == "torch":
        os.environ["PAGEDSERVE_STATE_KERNELS"] = "torch"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    shape = REALISTIC if device.type == "cuda" else TINY

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, shape["vocab_size"], (args.batch, args.prompt_len),
                            generator=g).tolist()
    decode_tokens = args.batch * (args.output_len - 1)
    rows = []
    with tempfile.TemporaryDirectory() as path:
        build_model(path, args, shape)
        prefill_s, decode_s = run_engine(path, prompts, args, device)
        from pagedserve.attention.ops import state_kernels_enabled

        kernels = "triton" if state_kernels_enabled(device) else "torch"
        rows.append((f"pagedserve ({kernels} state kernels)", prefill_s, decode_s))
        if not args.skip_transformers:
            rows.append(("transformers generate", *run_transformers(path, prompts, args,
                                                                    device)))
    print(f"Qwen3-Next-shaped, {args.num_layers} layers, {args.mlp} MLP, hidden "
          f"{shape['hidden_size']}: batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.output_len} new, {args.dtype}, {device}")
    print(f"{'':38s} {'prefill ms':>10s} {'decode s':>9s} {'decode tok/s':>12s}")
    for name, pre, dec in rows:
        print(f"{name:38s} {pre * 1e3:10.0f} {dec:9.2f} {decode_tokens / dec:12.0f}")
    if len(rows) == 2:
        print(f"decode ratio (pagedserve / transformers): {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()
