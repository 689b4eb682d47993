"""Offline embedding throughput beside sentence-transformers, same inputs, same process: a
random-weight decoder embedder of Qwen3-Embedding-0.6B's shape (or a tiny one) saved with
sentence-transformers' files (last-token pooling, Normalize) and a word-level tokenizer, so
every text is exactly --tokens tokens; sentence-transformers at each --st-batch-sizes (its
best is the baseline), then LLM.embed over the same texts. Prints texts/s, the ratio and the
largest difference between the two embeddings.

    python benchmarks/embed_throughput.py --device cuda --dtype bfloat16 \\
        --shape qwen3-0.6b --num-texts 10000 --tokens 256 --st-batch-sizes 32,64,128,256 \\
        --serve-batch 16   # and /v1/embeddings at 16 texts a request, beside LLM.embed
    python benchmarks/embed_throughput.py --device cpu --shape tiny --num-texts 256
    python benchmarks/embed_throughput.py --shape bge-base ...  # a BERT encoder, CLS pooling
    ... --profile  # and LLM.embed again under torch.profiler: the GPU's busy share, top kernels
    ... --phases   # where LLM.embed's host time goes: the tokenizer alone, LLM.embed of texts
                   # and of token ids with the engine's step figures, a cProfile of the former
                   # (with PAGEDSERVE_DEVICE_TIMING=1 the device's busy ms a step too)
    ... --engine-core-process  # the engine core in its own process, beside the front
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
# Encoder shapes (BertModel, CLS pooling, as bge-base-en-v1.5 ships).
BERT_SHAPES = {
    "bge-base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12),
    "bert-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4),
}
NUM_WORDS = 1000


def save_embedder(path: Path, shape: str, max_len: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    bert = shape in BERT_SHAPES
    vocab = {"[PAD]": 0, "[UNK]": 1, "<eos>": 2, "[CLS]": 3,
             **{f"w{i}": i + 4 for i in range(NUM_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # --tokens counts the special tokens: BERT's [CLS] .. <eos> (its [SEP]), the decoder's <eos>.
    template = "[CLS] $A <eos>" if bert else "$A <eos>"
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<eos>", 2), ("[CLS]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                            eos_token="<eos>", cls_token="[CLS]", sep_token="<eos>",
                            padding_side="right").save_pretrained(path)
    torch.manual_seed(0)
    if bert:
        config = BertConfig(vocab_size=len(vocab), max_position_embeddings=max_len,
                            pad_token_id=0, **BERT_SHAPES[shape])
        BertModel(config, add_pooling_layer=False).save_pretrained(path)
    else:
        config = Qwen3Config(vocab_size=len(vocab), max_position_embeddings=max_len,
                             eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                             **SHAPES[shape])
        Qwen3Model(config).save_pretrained(path)
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
               for i, (p, k) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                           ("2_Normalize", "Normalize")])]
    (path / "modules.json").write_text(json.dumps(modules))
    for folder in ("1_Pooling", "2_Normalize"):
        (path / folder).mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size,
         "pooling_mode_cls_token" if bert else "pooling_mode_lasttoken": True}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=[*SHAPES, *BERT_SHAPES])
    parser.add_argument("--num-texts", type=int, default=10000)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per text, end included")
    parser.add_argument("--st-batch-sizes", default="32,64,128")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--serve-batch", type=int, default=0,
                        help="also time /v1/embeddings at this many texts a request")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--profile", action="store_true",
                        help="LLM.embed again under torch.profiler (CUDA): where its time goes")
    parser.add_argument("--phases", action="store_true",
                        help="LLM.embed's host phases: tokenizer, texts against ids, cProfile")
    parser.add_argument("--engine-core-process", action="store_true",
                        help="LLM's engine core in a process of its own (the front's work, "
                             "tokenizing and outputs, then runs beside the core's steps)")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM

    rng = np.random.default_rng(0)
    words = args.tokens - (2 if args.shape in BERT_SHAPES else 1)  # the special tokens' room
    texts = [" ".join(f"w{i}" for i in rng.integers(0, NUM_WORDS, words))
             for _ in range(args.num_texts)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "embedder"
        save_embedder(path, args.shape, max(args.tokens, 512))
        dtype = getattr(torch, args.dtype)
        st = SentenceTransformer(str(path), device=args.device, local_files_only=True,
                                 model_kwargs={"dtype": dtype})
        best, reference = 0.0, None
        for batch_size in [int(b) for b in args.st_batch_sizes.split(",")]:
            st.encode(texts[:batch_size * 2], batch_size=batch_size)  # warm-up
            _sync(args.device)
            t0 = time.perf_counter()
            reference = st.encode(texts, batch_size=batch_size, convert_to_numpy=True)
            _sync(args.device)
            rate = len(texts) / (time.perf_counter() - t0)
            print(f"sentence-transformers batch {batch_size}: {rate:,.0f} texts/s")
            best = max(best, rate)
        del st
        if args.device == "cuda":
            torch.cuda.empty_cache()
        with LLM(str(path), device=args.device, dtype=args.dtype, max_model_len=args.tokens,
                 max_num_batched_tokens=args.max_num_batched_tokens,
                 engine_core_process=args.engine_core_process or None) as llm:
            llm.embed(texts[:256])  # warm-up
            t0 = time.perf_counter()
            outputs = llm.embed(texts)
            rate = len(texts) / (time.perf_counter() - t0)
            if args.profile:
                profile_embed(llm, texts, args.device)
            if args.phases:
                embed_phases(llm, texts, args.device)
        got = np.stack([o.outputs.data for o in outputs])
        print(f"pagedserve LLM.embed: {rate:,.0f} texts/s = {rate / best:.2f}x the best "
              f"sentence-transformers batch; max |difference| {np.abs(got - reference).max():.2e}")
        if args.serve_batch:
            served = serve_rate(path, args, texts)
            print(f"pagedserve /v1/embeddings, {args.serve_batch} texts a request, "
                  f"{args.concurrency} at a time: {served:,.0f} texts/s = "
                  f"{served / rate:.2f}x LLM.embed")


def profile_embed(llm, texts: list[str], device: str, top: int = 12) -> None:
    """LLM.embed of `texts` under the profiler: how much of the wall time a kernel ran (the
    union of their intervals), and the kernels that take it."""
    import collections

    from step_profile import kernel_events, union_seconds
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.embed(texts)
        _sync(device)
        wall = time.perf_counter() - t0
    events = kernel_events(prof)
    busy = union_seconds([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events])
    total = sum(e.duration_ns() for e in events) / 1e9
    print(f"profiled LLM.embed: {wall:.2f} s, kernels running {busy / wall:.1%} of it")
    by_name: collections.Counter = collections.Counter()
    for e in events:
        by_name[e.name()[:70]] += e.duration_ns()
    for name, ns in by_name.most_common(top):
        print(f"  {name:70s} {ns / 1e9:7.3f} s {ns / 1e9 / total:6.1%}")


def embed_phases(llm, texts: list[str], device: str) -> None:
    """Where LLM.embed's wall time goes: the tokenizer over every text at once, LLM.embed of
    the texts and of their token ids (steps, the core's host ms a step, its ms waiting for the
    device), then the texts' call under cProfile (the calling thread's top functions)."""
    from step_profile import host_profile, host_syncs

    from pagedserve.pooling.front import tokenize_inputs

    t0 = time.perf_counter()
    ids = tokenize_inputs(llm.engine.tokenizer, texts)
    print(f"phases: tokenizer alone {time.perf_counter() - t0:.2f} s for {len(texts)} texts")
    for name, prompts in (("texts", texts), ("token ids", ids)):
        before = llm.engine.call_utility("stats")
        t0 = time.perf_counter()
        llm.embed(prompts)
        _sync(device)
        wall = time.perf_counter() - t0
        after = llm.engine.call_utility("stats")
        steps = max(after.num_steps - before.num_steps, 1)
        core = (after.step_seconds - before.step_seconds) / steps * 1e3
        wait = (after.wait_seconds - before.wait_seconds) / steps * 1e3
        dev = (after.device_seconds - before.device_seconds) / steps * 1e3
        print(f"phases: LLM.embed({name}) {wall:.2f} s, {steps} steps, {wall / steps * 1e3:.1f} "
              f"ms a step: core {core:.1f} ms (waiting {wait:.1f}), device {dev:.1f} ms")
    host_profile(lambda: (llm.embed(texts), _sync(device)), top=18)
    if device == "cuda":
        print(f"in LLM.embed of {min(len(texts), 1024)} texts:")
        host_syncs(lambda: llm.embed(texts[:1024]))


def serve_rate(path: Path, args: argparse.Namespace, texts: list[str]) -> float:
    """Texts/s through a `pagedserve serve` of the same model (base64, as the openai client
    asks), `args.concurrency` requests of `args.serve_batch` texts in flight."""
    import asyncio
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", str(path),
                             "--device", args.device, "--dtype", args.dtype,
                             "--max-model-len", str(args.tokens), "--port", str(port),
                             "--max-num-batched-tokens", str(args.max_num_batched_tokens)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(1)
        batches = [texts[i:i + args.serve_batch]
                   for i in range(0, len(texts), args.serve_batch)]

        async def run() -> float:
            queue = list(reversed(batches))
            async with httpx.AsyncClient(timeout=600) as client:
                async def worker() -> None:
                    while queue:
                        body = {"input": queue.pop(), "encoding_format": "base64"}
                        r = await client.post(url + "/v1/embeddings", json=body)
                        r.raise_for_status()

                t0 = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(args.concurrency)))
                return len(texts) / (time.perf_counter() - t0)

        asyncio.run(run())  # warm-up
        return asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(60)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
