"""Decode speed on the CPU with the bundled SmolLM2 GGUF: one request x 128 new tokens and 8
requests x 64, the engine's default CPU settings beside its exact float32 path, transformers
float32 `generate` and, where `llama-cpp-python` imports, llama.cpp on the same file, all in
one run:

    python benchmarks/cpu_decode.py [--repeats 3] [--skip-llama-cpp]

Greedy, EOS ignored, so every request makes exactly its tokens. Each figure is the best of
--repeats runs after a warm-up (the machine's other load only ever slows a run down).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import default_model_path

PROMPT = "The capital of France is"
EIGHT = [f"Story {i}: once upon a time, in a land far away," for i in range(8)]


def best_rate(run: Callable[[], int], repeats: int) -> float:
    """Tokens per second of the fastest of `repeats` runs (`run` returns its token count)."""
    run()  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - start))
    return max(rates)


def engine_rates(repeats: int, **engine_args: object) -> tuple[float, float]:
    llm = LLM(**engine_args)
    one = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    eight = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    single = best_rate(lambda: len(llm.generate(PROMPT, one, use_tqdm=False)[0]
                                   .outputs[0].token_ids), repeats)
    batch = best_rate(lambda: sum(len(o.outputs[0].token_ids)
                                  for o in llm.generate(EIGHT, eight, use_tqdm=False)), repeats)
    return single, batch


@torch.inference_mode()
def transformers_rates(repeats: int) -> tuple[float, float]:
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.padding_side = "left"
    tok.pad_token = tok.eos_token
    model.generation_config.eos_token_id = None  # generate exactly the tokens asked for

    def generate(prompts: list[str], new: int) -> int:
        batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**batch, max_new_tokens=new, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)

    return (best_rate(lambda: generate([PROMPT], 128), repeats),
            best_rate(lambda: generate(EIGHT, 64), repeats))


def llama_cpp_rates(repeats: int) -> tuple[float, float] | str:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        return f"llama-cpp-python not importable ({exc})"
    llm = Llama(model_path=str(default_model_path()), n_ctx=2048,
                n_threads=torch.get_num_threads(), verbose=False)

    def generate(prompt: str, new: int) -> int:
        llm.reset()  # no prefix reuse between runs
        made = 0
        for _ in llm.generate(llm.tokenize(prompt.encode()), temp=0.0, top_k=1):
            made += 1  # greedy, and past EOS: the loop stops it
            if made == new:
                break
        return made

    # Its high-level API runs one sequence at a time: the eight requests run in turn.
    return (best_rate(lambda: generate(PROMPT, 128), repeats),
            best_rate(lambda: sum(generate(p, 64) for p in EIGHT), repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()

    rows: dict[str, tuple[float, float] | str] = {}
    rows["pagedserve, default CPU settings"] = engine_rates(args.repeats)
    rows["pagedserve, float32 (--dtype float32)"] = engine_rates(args.repeats, dtype="float32")
    rows["transformers float32 generate"] = transformers_rates(args.repeats)
    if not args.skip_llama_cpp:
        rows["llama.cpp (llama-cpp-python), same GGUF"] = llama_cpp_rates(args.repeats)

    base = rows["transformers float32 generate"]
    print(f"\nthreads: {torch.get_num_threads()}; output tok/s, best of {args.repeats}")
    print(f"| {'':42} | 1 x 128 | x transformers | 8 x 64 | x transformers |")
    print("| --- | --- | --- | --- | --- |")
    for name, rates in rows.items():
        if isinstance(rates, str):
            print(f"| {name:42} | {rates} | | | |")
            continue
        print(f"| {name:42} | {rates[0]:.1f} | {rates[0] / base[0]:.2f}x | {rates[1]:.1f} | "
              f"{rates[1] / base[1]:.2f}x |")


if __name__ == "__main__":
    main()
