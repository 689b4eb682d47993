"""Qwen3-Next through the engine against transformers' Qwen3NextForCausalLM (float32, CPU, greedy,
eager reference): gated delta net layers on the GDN_ATTN state backend beside gated full
attention layers on paged K/V, with dense MLPs everywhere and with sparse MoE layers (shared
expert and its sigmoid gate). Token ids equal for prompts of length 1 up to past the ops'
chunk sizes, also with chunked prefill and with preemption forced by a small block pool; prompt
logprobs within 1e-4 relative; every block and slot free after each test. The engine on the
GDN_ATTN Triton path in the interpreter, and (the `gpu` test) on CUDA against transformers.
The ops themselves: tests/attention/test_linear_attention_ops.py."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.utils.paged import check_prompt_logprobs, hf_greedy

NUM_NEW = 12
# 1: a prompt that runs as a decode without a state; 70: past the torch op's chunk of 64 and
# two of the Triton kernel's chunks of 32.
PROMPT_LENS = [3, 17, 1, 70, 8]
COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=256,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, initializer_range=0.2,
              tie_word_embeddings=False)


def _configs() -> dict[str, transformers.Qwen3NextConfig]:
    # Layers: linear, linear, linear, full (full_attention_interval 4), then in the second
    # config a full layer first as well.
    return {
        "dense": transformers.Qwen3NextConfig(**COMMON, mlp_only_layers=[0, 1, 2, 3]),
        # Layers 0, 2, 3 sparse, 1 dense; top-2 of 4 renormalised; attention first and last.
        "moe": transformers.Qwen3NextConfig(
            **COMMON, mlp_only_layers=[1], norm_topk_prob=True,
            layer_types=["full_attention", "linear_attention", "linear_attention",
                         "full_attention"]),
        # Every second layer sparse, weights not renormalised, a tied head.
        "moe_step2_tied": transformers.Qwen3NextConfig(
            **{**COMMON, "tie_word_embeddings": True}, decoder_sparse_step=2,
            norm_topk_prob=False),
    }


def _save(config: transformers.Qwen3NextConfig, path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # the gated norm scales by its weight itself
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred norms start at 0: away from it, so a norm
                p.copy_(0.2 * torch.randn_like(p))  # read as plain RMSNorm shows
            elif "dt_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "A_log" in name:
                # Moderate decays: with transformers' A up to 16 its own float32 is 2e-4 off
                # float64 on the long prompt, past the 1e-4 the logprobs are held to.
                p.copy_(torch.empty_like(p).uniform_(0.1, 1.0).log())
    model.eval().save_pretrained(path)
    return model


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


class _Models(dict):
    """Each config saved, with its prompts and transformers' greedy tokens, on first use (the
    reference is the slow part)."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str):
        seed = list(_configs()).index(name)
        config = _configs()[name]
        path = self.tmp_path_factory.mktemp(f"qwen3_next_{name}")
        hf = _save(config, path, seed=seed)
        prompts = _prompts(config.vocab_size, seed=100 + seed)
        expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
        self[name] = (str(path), hf, prompts, expected)
        return self[name]


@pytest.fixture(scope="module")
def qwen3_next_models(tmp_path_factory):
    return _Models(tmp_path_factory)


def _greedy(llm, prompts: list[list[int]], max_tokens: int = NUM_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_all_free(llm) -> None:
    kv = llm.engine.kv_cache
    assert llm.engine.check_blocks_free()
    assert kv.state_slots.num_free == kv.state_slots.num_slots


VARIANTS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 30 blocks of 4 tokens: the 70-token prompt and its new tokens take 22 of them.
    "preemption": {"num_gpu_blocks_override": 30, "block_size": 4},
}


# Chunked prefill on the MoE configs (the dense one covers it) and the third config: slow.
CASES = [("dense", v) for v in VARIANTS] + [("moe", "default"), ("moe", "preemption")] + [
    pytest.param(name, variant, marks=pytest.mark.slow)
    for name, variant in [("moe", "chunked_prefill"), *(("moe_step2_tied", v) for v in VARIANTS)]]


@pytest.mark.parametrize("name,variant", CASES)
def test_greedy_matches_transformers(qwen3_next_models, make_llm, name, variant):
    path, _, prompts, expected = qwen3_next_models[name]
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   **VARIANTS[variant])
    assert _greedy(llm, prompts) == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_free(llm)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_prompt_logprobs_match_transformers(qwen3_next_models, make_llm, name):
    path, hf, prompts, _ = qwen3_next_models[name]
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_prompt_logprobs(hf, prompts, outputs, top=5)
    _assert_all_free(llm)


def test_layers_bind_their_backends(qwen3_next_models, make_llm):
    """GDN_ATTN is listed and chosen for the gated delta net layers on its own; the attention
    layers get the CPU backend; each kind is indexed among itself; a slot holds the conv window
    in the model dtype and the recurrent state in float32."""
    from pagedserve.attention import backend_status
    from pagedserve.attention.backends.gdn import GDNImpl
    from pagedserve.kv_cache.specs import StateSpec, StateTensor

    assert backend_status()["GDN_ATTN"][0]
    path = qwen3_next_models["moe"][0]
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   max_num_seqs=3)
    runner = llm.engine.runner
    assert runner.backend.get_name() == "CPU"
    assert [m.layer_idx for m in runner.attn_layers] == [0, 1]
    assert [m.layer_idx for m in runner.state_layers] == [0, 1]
    assert all(isinstance(m.impl, GDNImpl) and not m.impl.use_triton
               for m in runner.state_layers)
    conv_dim = 2 * 2 * 8 + 4 * 12
    assert runner.state_specs[0] == StateSpec("GDN_ATTN", (
        StateTensor("conv", (conv_dim, 3), torch.float32),
        StateTensor("recurrent", (4, 8, 12), torch.float32)))
    assert runner.state_caches[1]["recurrent"].shape == (3, 4, 8, 12)


def test_engine_on_triton_path_in_interpreter(qwen3_next_models, make_llm, monkeypatch):
    """GDN_ATTN's Triton dispatch (the conv kernel, the chunked kernel for prefills, the
    recurrent one for decodes) through the engine, run by the interpreter on the CPU: a few
    tokens of two short prompts, one chunked."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from pagedserve.engine import model_runner

    monkeypatch.setattr(model_runner, "state_kernels_enabled", lambda device: True)
    path, _, prompts, expected = qwen3_next_models["dense"]
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   max_num_batched_tokens=8)
    assert llm.engine.runner.state_layers[0].impl.use_triton
    # 17 tokens: chunks of 8 and 8 continue the state, the last runs as a decode; the
    # one-token prompt is a decode without an initial state.
    picked = [1, 2]
    assert _greedy(llm, [prompts[i] for i in picked], 3) == [expected[i][:3] for i in picked]
    _assert_all_free(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_on_cuda_matches_transformers(tmp_path, name):
    """float32 on the GPU (GDN_ATTN's Triton kernels, the Triton MoE kernel, TRITON attention)
    against transformers' float32 tokens on the CPU, and against our CPU path; heads of 64,
    the smallest TRITON runs."""
    config = _configs()[name]
    config.head_dim = 64
    hf = _save(config, tmp_path, seed=7)
    prompts = _prompts(config.vocab_size, seed=8)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", attention_backend="TRITON",
              gpu_memory_utilization=0.2, max_num_batched_tokens=16)
    try:
        assert llm.engine.runner.state_layers[0].impl.use_triton
        got = _greedy(llm, prompts)
        assert llm.engine.check_blocks_free()
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert got == expected
