"""The default warm-up steps of CUDA backends (Triton compiles per class of integer argument at
a kernel's first launch): they run through the whole model at start-up and leave no trace."""

from __future__ import annotations

import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.attention.backend import CUDA_WARMUP_STEPS, AttentionBackend
from pagedserve.attention.backends.cpu import CPUAttentionBackend
from pagedserve.engine.model_runner import ModelRunner
from tests.utils.paged import hf_greedy, tiny_chat_model


def test_default_warmup_steps_are_cuda_only():
    assert AttentionBackend.warmup_steps(torch.device("cpu")) == []  # CPU engines start fast
    steps = AttentionBackend.warmup_steps(torch.device("cuda"))
    assert steps == list(CUDA_WARMUP_STEPS)
    # Prefills of token counts that are a multiple of 16 and that are not, with and without
    # cached context, and eager decodes of both kinds of batch size.
    totals = {n * new for n, new, _ in steps if new > 1}
    assert any(t % 16 == 0 for t in totals) and any(t % 16 for t in totals)
    assert any(new > 1 and ctx for _, new, ctx in steps)
    assert {n % 16 == 0 for n, new, _ in steps if new == 1} == {True, False}


def test_cuda_warmup_steps_leave_no_trace(tmp_path, monkeypatch):
    """Run on the CPU backend: each step goes through the model once at start-up, and greedy
    tokens afterwards are transformers' (what the steps wrote in the cache is never read)."""
    path = tiny_chat_model(tmp_path, init_std=0.2)
    monkeypatch.setattr(CPUAttentionBackend, "warmup_steps",
                        classmethod(lambda cls, device: list(CUDA_WARMUP_STEPS)))
    ran = []
    real = ModelRunner._dummy_forward
    monkeypatch.setattr(ModelRunner, "_dummy_forward",
                        lambda self, *shape: ran.append(shape) or real(self, *shape))
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory="8MiB")
    assert ran == list(CUDA_WARMUP_STEPS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 6) for p in prompts]
