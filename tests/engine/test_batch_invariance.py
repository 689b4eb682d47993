"""The CPU default (int8 weights with bfloat16 products, float32 activations, attention in
float64) is batch-invariant: a request's greedy tokens and their logprobs are the same bits
whether it runs alone, beside requests that arrive at other steps, or in chunked prefill."""

from __future__ import annotations

import torch

from pagedserve import SamplingParams
from pagedserve.quantization.int8_cpu import INT8

QUESTIONS = ["What divides 21?", "Tell me a story about a dragon.", "The capital of France is",
             "List three colors:", "Explain gravity in one sentence.",
             "Write a haiku about rain.", "2+2=", "Name a famous scientist."]
# 24 tokens (40 took 22 s): the chat prompts (34-38 tokens) are past MIN_KEYS before the
# first step, and the batch-variant settings tried (MIN_ROWS and MIN_KEYS of 1, bfloat16
# activations) changed a logprob at the first generated token already.
PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=0)

Result = tuple[list[int], list[float]]


def result(output) -> Result:
    seq = output.outputs[0]
    return list(seq.token_ids), [next(iter(d.values())).logprob for d in seq.logprobs]


def chat_prompts(llm) -> list[str]:
    return [llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS]


def run_staggered(llm, prompts: list[str], every: int) -> list[Result]:
    """Each prompt added `every` steps after the one before, so prefills run beside decodes
    of other lengths."""
    engine, done, step = llm.engine, {}, 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, PARAMS)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = result(out)
        step += 1
    return [done[i] for i in range(len(prompts))]


def test_default_cpu_settings_are_batch_invariant(make_llm) -> None:
    llm = make_llm(kv_cache_memory="64MiB")
    assert llm.engine.runner.model.lm_head.quant_method is INT8  # the default's int8 path
    assert llm.engine.runner.dtype == torch.float32
    prompts = chat_prompts(llm)
    alone = [result(llm.generate(p, PARAMS, use_tqdm=False)[0]) for p in prompts]
    together = [result(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert together == alone
    # Staggered by 3 steps (by 2 as well found nothing more, and took as long again).
    assert run_staggered(llm, prompts, 3) == alone
    # A 16-token budget: every prompt's prefill in chunks, beside other requests' decodes.
    chunked = make_llm(kv_cache_memory="64MiB", max_num_batched_tokens=16,
                       enable_prefix_caching=False)
    assert [result(o) for o in chunked.generate(prompts, PARAMS, use_tqdm=False)] == alone


def test_short_sequences_are_batch_invariant(make_llm) -> None:
    """Raw prompts of a few tokens: every request's keys stay below a vector register's 16
    floats for its first steps, beside longer ones (the softmax's short-row order)."""
    llm = make_llm(kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    prompts = ["2+2=", "Hi", "The capital of France is", "Once upon a time, in a land far away,"]
    alone = [result(llm.generate(p, params, use_tqdm=False)[0]) for p in prompts]
    together = [result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
