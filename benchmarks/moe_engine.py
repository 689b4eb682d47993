"""Mixture-of-Experts serving on the GPU in one run: the Qwen3-30B-A3B-shaped random bf16 model
(the `qwen3-30b-a3b-random` config: 48 layers, 128 experts, top-8) through `bench throughput`
on N x 1,024 in / 128 out and N x 128 in / 1,024 out, each next to transformers' batched greedy
`generate` on the engine's own weights (shared storage, no copy; a subset of the prompts in one
batch, its output capped) in the same process:

    python benchmarks/moe_engine.py [--num-prompts 1000] [--hf-num-prompts 64] [--json FILE]
    python benchmarks/moe_engine.py --model random:deepseek-v2-lite \
        --attention-backend TRITON_MLA --skip-hf --workloads 128/1024

The ratio compares output tokens per second. The KV cache's capacity is reported in tokens and
bytes per token; for a model with multi-head latent attention (DeepSeek) also what the same
memory would hold as per-head K and V. A compact table closes the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedserve import LLM  # noqa: E402
from pagedserve.bench import random_prompts, run_throughput  # noqa: E402

ROWS: list[tuple[str, str, str]] = []


def row(what: str, measured: str, ref: str = "") -> None:
    ROWS.append((what, measured, ref))
    print(f"  {what}: {measured}  {ref}", flush=True)


def hf_model(llm: LLM) -> torch.nn.Module:
    """transformers' Qwen3-MoE over the engine's parameters (views, no copy)."""
    import transformers

    from pagedserve.models.checkpoint_loading import hf_state_dict

    cfg = llm.engine.loaded.hf_config
    device = llm.engine.runner.device
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = hf.load_state_dict(hf_state_dict(llm.engine.runner.model),
                                             strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"weights do not line up: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}")
    with torch.device(device):  # its inv_freq buffer was left on the meta device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    return hf.eval()


def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of one batched greedy generate of exactly `output_len` tokens."""
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  max_new_tokens=output_len, min_new_tokens=output_len)
    with torch.inference_mode():
        short = ids[:, :16]
        hf.generate(short, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                              "attention_mask": torch.ones_like(short)})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / wall


def kv_capacity(llm: LLM) -> None:
    """Tokens the KV cache holds and bytes per token; for MLA, next to per-head K and V."""
    engine = llm.engine
    per_token = engine.kv_cache_bytes_per_token()
    tokens = engine.runner.num_blocks * engine.runner.block_size
    row("KV cache", f"{tokens:,} tokens", f"{per_token:,} bytes per token over all layers")
    cfg = engine.loaded.hf_config
    if getattr(cfg, "kv_lora_rank", None):
        dtype_bytes = torch.empty((), dtype=engine.runner.dtype).element_size()
        heads = cfg.num_attention_heads * cfg.num_hidden_layers
        per_head_kv = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                               + cfg.v_head_dim) * dtype_bytes
        row("KV cache as per-head K and V", f"{tokens * per_token // per_head_kv:,} tokens",
            f"{per_head_kv:,} bytes per token: MLA holds {per_head_kv / per_token:.1f}x more")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-30b-a3b-random",
                        help="engine config preset or file")
    parser.add_argument("--model", default=None, help="override the config's model, e.g. "
                        "random:deepseek-v2-lite")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--attention-backend", default="TRITON",
                        help="TRITON_MLA for a model with multi-head latent attention")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.75,
                        help="leaves room for transformers' activations and cache")
    parser.add_argument("--hf-num-prompts", type=int, default=64)
    parser.add_argument("--hf-max-output-len", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--workloads", default="1024/128,128/1024",
                        help="comma-separated input/output lengths")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"settings: {vars(args)}", flush=True)

    t0 = time.perf_counter()
    overrides = {"model": args.model} if args.model else {}
    llm = LLM(config=args.config, attention_backend=args.attention_backend,
              gpu_memory_utilization=args.gpu_memory_utilization, **overrides)
    runner = llm.engine.runner
    row("start-up (weights, profile, KV, graphs)", f"{time.perf_counter() - t0:.1f} s",
        f"graphs: {'on' if runner.decode_graphs else 'OFF'}, {runner.num_blocks} KV blocks")
    kv_capacity(llm)
    run_throughput(llm, random_prompts(4, 64, runner.vocab_size, 0), 8)  # warm the kernels
    hf = None if args.skip_hf else hf_model(llm)
    for workload in args.workloads.split(","):
        in_len, out_len = map(int, workload.split("/"))
        prompts = random_prompts(args.num_prompts, in_len, runner.vocab_size,
                                 seed=in_len + out_len)
        r = run_throughput(llm, prompts, out_len)
        name = f"{args.num_prompts}x{in_len}/{out_len}"
        row(f"engine {name}", f"{r['output_tokens_per_s']:,.0f} out tok/s, "
            f"{r['total_tokens_per_s']:,.0f} tot tok/s", f"{r['elapsed_s']:.1f} s")
        if hf is None:
            continue
        m, hf_out = args.hf_num_prompts, min(out_len, args.hf_max_output_len)
        try:
            tps = hf_generate(hf, prompts[:m], hf_out)
        except Exception as exc:  # the engine's figures still count
            row(f"transformers {name}", f"failed: {type(exc).__name__}: {exc}")
            gc.collect()
            torch.cuda.empty_cache()
            continue
        row(f"transformers {m}x{in_len}/{hf_out}", f"{tps:,.0f} out tok/s",
            f"engine / transformers = {r['output_tokens_per_s'] / tps:.1f}x")
        gc.collect()
        torch.cuda.empty_cache()

    print(f"\n== summary ({time.perf_counter() - t0:.0f} s, {torch.cuda.get_device_name()})")
    width = max(len(w) for w, _, _ in ROWS)
    for what, measured, ref in ROWS:
        print(f"{what:<{width}}  {measured}  {ref}")
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
