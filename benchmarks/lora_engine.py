"""LoRA adapters against the base model in the engine, same weights, one run (GPU):

    python benchmarks/lora_engine.py [--model random:llama3-8b] [--num-prompts 1000]
        [--input-len 128] [--output-len 1024] [--rank 16] [--num-adapters 8] [--json FILE]
    python benchmarks/lora_engine.py --smoke     # a tiny shape on the CPU

Writes --num-adapters random rank --rank adapters in PEFT's on-disk format (adapter_config.json
and adapter_model.safetensors, every linear layer of the decoder targeted, B not zero) for the
`random:` model's shape, then runs `bench throughput`'s workload three times: the base engine
(LoRA off), the LoRA engine with every request on one adapter, and with requests spread
uniformly over all adapters (one slot per adapter: --max-loras = --num-adapters). Greedy, EOS
ignored, so every run produces the same number of tokens. A table closes the run with output
tok/s and the ratio to the base (the issue asks >= 0.9 for one adapter, >= 0.8 for eight).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from pagedserve.bench import random_prompts, run_throughput
from pagedserve.engine.llm import LLM
from pagedserve.lora.request import LoRARequest
from pagedserve.models.random_models import RANDOM_PRESETS

# Every linear of a Llama decoder layer, with its (in, out) features from the config.
TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
           "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
           "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
           "mlp.down_proj": ("inter", "hidden")}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False)


def feature_sizes(shape: dict) -> dict[str, int]:
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return {"hidden": shape["hidden_size"], "inter": shape["intermediate_size"],
            "q": shape["num_attention_heads"] * head_dim,
            "kv": shape["num_key_value_heads"] * head_dim}


def write_adapter(path: Path, shape: dict, rank: int, seed: int) -> None:
    """A PEFT-format adapter with random factors (scaled so the product is a small change)."""
    from safetensors.torch import save_file

    sizes = feature_sizes(shape)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for module, (fan_in, fan_out) in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, sizes[fan_in], generator=gen) / sizes[fan_in] ** 0.5
            b = torch.randn(sizes[fan_out], rank, generator=gen) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "bias": "none", "task_type": "CAUSAL_LM", "use_rslora": False,
              "target_modules": sorted({m.split(".")[-1] for m in TARGETS})}
    (path / "adapter_config.json").write_text(json.dumps(config))


def run(args: argparse.Namespace, adapters: list[Path] | None, mode: str) -> dict:
    kwargs = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  device=args.device)
    if adapters is not None:
        kwargs.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank)
    llm = LLM(**kwargs)
    try:
        vocab = llm.engine.loaded.hf_config.vocab_size
        prompts = random_prompts(args.num_prompts, args.input_len, vocab)
        requests = None
        if adapters is not None:
            loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
            requests = ([loras[0]] * len(prompts) if mode == "one"
                        else [loras[i % len(loras)] for i in range(len(prompts))])
        if args.warmup:  # with the run's adapters, so none is read from disk while timed
            warm = len(loras) if adapters is not None else 8
            llm.generate([{"prompt_token_ids": p} for p in prompts[:warm]], use_tqdm=False,
                         lora_request=requests[:warm] if requests else None)
        row = throughput(llm, prompts, args.output_len, requests)
    finally:
        llm.close()
    row["mode"] = mode
    return row


def throughput(llm: LLM, prompts: list[list[int]], output_len: int,
               loras: list[LoRARequest] | None) -> dict:
    if loras is None:
        return run_throughput(llm, prompts, output_len)
    # run_throughput's workload with a LoRA request per prompt.
    original = llm.generate

    def generate(batch, params, **kw):
        return original(batch, params, lora_request=loras, **kw)

    llm.generate = generate
    try:
        return run_throughput(llm, prompts, output_len)
    finally:
        llm.generate = original


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--skip", default="", help="comma list of base,one,mixed")
    p.add_argument("--smoke", action="store_true", help="tiny shape, CPU, few prompts")
    p.add_argument("--json")
    p.add_argument("--lora-tiles", default=None, metavar="JSON",
                   help="the LoRA kernels' launch shapes (kernels.LoRATiles fields; the "
                        "in-process engine reads them), e.g. lora_kernels.py --sweep's best")
    args = p.parse_args()
    if args.lora_tiles:
        from pagedserve.lora import kernels

        kernels.TILES = kernels.LoRATiles(**json.loads(args.lora_tiles))
        print(f"LoRA launch shapes: {kernels.TILES}", flush=True)
    shape = RANDOM_PRESETS[args.model.removeprefix("random:")]
    if args.smoke:
        tiny = Path(tempfile.mkdtemp()) / "tiny.json"
        tiny.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY}))
        args.model, shape = f"random:{tiny}", TINY
        args.device, args.dtype, args.num_prompts, args.output_len = "cpu", "float32", 8, 8
        args.max_model_len = 256
        args.num_adapters = min(args.num_adapters, 3)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"a{i}" for i in range(args.num_adapters)]
        for i, path in enumerate(paths):
            write_adapter(path, shape, args.rank, seed=i)
        rows = []
        skip = set(filter(None, args.skip.split(",")))
        for mode, adapters in (("base", None), ("one", paths), ("mixed", paths)):
            if mode not in skip:
                rows.append(run(args, adapters, mode))
                print(json.dumps(rows[-1]), flush=True)
    base = next((r["output_tokens_per_s"] for r in rows if r["mode"] == "base"), None)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{args.model} {args.num_prompts} x {args.input_len}/{args.output_len}, "
          f"rank {args.rank}, {args.num_adapters} adapters, {device}")
    print(f"{'run':>6} {'out tok/s':>10} {'vs base':>8} {'ms/step':>8}")
    for r in rows:
        ratio = r["output_tokens_per_s"] / base if base else float("nan")
        print(f"{r['mode']:>6} {r['output_tokens_per_s']:>10.0f} {ratio:>8.3f} "
              f"{r['core_ms_per_step']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
