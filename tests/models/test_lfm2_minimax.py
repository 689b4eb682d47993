"""The hybrid state-layer families through the engine against transformers (float32, CPU,
greedy, `attn_implementation="eager"` references): LFM2 (short convolutions on the SHORT_CONV
backend + attention) and MiniMax-Text-01 (lightning attention on the LINEAR_ATTN backend +
attention, MoE MLPs, alpha/beta residual factors away from 1). Greedy tokens equal with default
settings, chunked prefill and forced preemption (few blocks of 4 tokens); prompt logprobs within
1e-4 relative; every block and slot free after each test. Prompts of 1 token and, for MiniMax,
one longer than the torch op's block (256) and the kernel's (64). The Triton path in the
interpreter, and (the `gpu` test) on CUDA. The state ops themselves:
tests/attention/test_ssm_ops.py and test_linear_attention_ops.py."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.attention import backend_status, get_backend_cls
from pagedserve.attention.layer import AttentionLayerConfig
from tests.utils.paged import check_prompt_logprobs, hf_greedy

NUM_NEW = 12
SHORT_LENS = [3, 17, 1, 40, 25]
# MiniMax also gets a prompt across the lightning ops' blocks (torch 256, Triton 64).
LONG_LENS = {"lfm2": [], "minimax": [300]}
STATE_BACKEND = {"lfm2": "SHORT_CONV", "minimax": "LINEAR_ATTN"}
FAMILIES = list(STATE_BACKEND)


def _config(name: str, head_dim: int | None = None) -> transformers.PretrainedConfig:
    if name == "lfm2":
        heads = 4 if head_dim is None else 2
        return transformers.Lfm2Config(
            vocab_size=211, hidden_size=(head_dim or 16) * heads, intermediate_size=96,
            num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=2,
            max_position_embeddings=512, block_multiple_of=16, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv", "conv"])
    # Layer 0 is a lightning layer (its qkv is no fused q/k/v), factors away from 1, a
    # transformers block (16) that the prompts cross.
    return transformers.MiniMaxConfig(
        vocab_size=211, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim or 16,
        num_local_experts=4, num_experts_per_tok=2, block_size=16,
        max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention"],
        full_attn_alpha_factor=0.9, full_attn_beta_factor=1.1, linear_attn_alpha_factor=1.2,
        linear_attn_beta_factor=0.8, mlp_alpha_factor=0.7, mlp_beta_factor=1.3)


def _save(config: transformers.PretrainedConfig, path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():  # wider than the default init: varied greedy tokens
        for name, p in model.named_parameters():
            if "norm" in name:  # away from 1, so a skipped norm shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0, 0.3)
            elif "conv.conv" in name:
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def _prompts(name: str, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 211, (n,), generator=g).tolist()
            for n in SHORT_LENS + LONG_LENS[name]]


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    models = {}
    for i, name in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(name)
        hf = _save(_config(name), path, seed=i)
        prompts = _prompts(name, seed=100 + i)
        expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
        models[name] = (str(path), hf, prompts, expected)
    return models


def _make(make_llm, path: str, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    return make_llm(model=path, dtype="float32", device="cpu", **kwargs)


def _greedy(llm, prompts, num_new: int = NUM_NEW):
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_all_free(llm) -> None:
    kv = llm.engine.kv_cache
    assert llm.engine.check_blocks_free()
    assert kv.all_free(), "blocks or state slots leaked"
    assert kv.state_slots.num_free == kv.state_slots.num_slots


# ---- greedy tokens and logprobs against transformers --------------------------------------

VARIANTS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 20 blocks of 4 tokens for prompts of up to 40 + 12 tokens: running requests are
    # preempted and recompute their state from their tokens.
    "preemption": {"num_gpu_blocks_override": 20, "block_size": 4},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(hybrid_models, make_llm, name, variant):
    path, _, prompts, expected = hybrid_models[name]
    if variant != "default":  # the long prompt crosses the ops' blocks only in one chunk (and
        # would not fit in 20 blocks at all)
        prompts, expected = prompts[:len(SHORT_LENS)], expected[:len(SHORT_LENS)]
    llm = _make(make_llm, path, **VARIANTS[variant])
    runner = llm.engine.runner
    assert runner.backend.get_name() == "CPU"  # the attention layers
    assert {spec.backend for spec in runner.state_specs} == {STATE_BACKEND[name]}
    assert _greedy(llm, prompts) == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_free(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_logprobs_match_transformers(hybrid_models, make_llm, name):
    path, hf, prompts, _ = hybrid_models[name]
    llm = _make(make_llm, path, max_num_batched_tokens=64)  # 40 tokens and 300 in chunks
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_prompt_logprobs(hf, prompts, outputs, top=5)
    _assert_all_free(llm)


# ---- layers, slots, backends --------------------------------------------------------------

def test_state_specs_and_layer_indices(hybrid_models, make_llm):
    """Conv layers 0, 2, 3 of LFM2 are its state layers 0, 1, 2 and its attention layer 1 is
    attention layer 0; each slot holds the conv window [hidden, L - 1] in the model dtype or
    the float32 kv state [H, D, D]."""
    llm = _make(make_llm, hybrid_models["lfm2"][0], max_num_seqs=3)
    runner = llm.engine.runner
    assert len(runner.attn_layers) == 1 and len(runner.state_layers) == 3
    assert [s.tensors[0].shape for s in runner.state_specs] == [(64, 2)] * 3
    assert runner.state_caches[0]["conv"].shape == (3, 64, 2)
    assert llm.engine.kv_cache.state_slots.num_slots == 3

    llm = _make(make_llm, hybrid_models["minimax"][0], max_num_seqs=3)
    runner = llm.engine.runner
    assert len(runner.attn_layers) == 1 and len(runner.state_layers) == 3
    kv = runner.state_caches[2]["kv"]
    assert kv.shape == (3, 4, 16, 16) and kv.dtype == torch.float32
    # Each lightning layer decays at its own depth's rate (decoder layers 0, 2, 3).
    from pagedserve.attention.linear.lightning_torch import slope_rate

    for layer, depth in zip(runner.state_layers, [0, 2, 3], strict=True):
        torch.testing.assert_close(layer.slope, slope_rate(4, depth, 4), rtol=0, atol=0)


def test_state_backends_listed_and_not_for_attention():
    status = backend_status()
    layer = AttentionLayerConfig(4, 2, 64, torch.float32)
    for name in STATE_BACKEND.values():
        assert status[name][0]
        assert get_backend_cls(name).validate_configuration(layer, 16, torch.device("cpu"))


# ---- the Triton path through the engine ---------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_engine_on_triton_path_in_interpreter(hybrid_models, make_llm, monkeypatch, name):
    """The state impl's Triton dispatch through the engine, its kernels run by the interpreter
    on the CPU: 17 tokens in chunks of 8 (continuing a saved state), a one-token prompt (a
    decode without an initial state), then decodes."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from pagedserve.engine import model_runner

    monkeypatch.setattr(model_runner, "state_kernels_enabled", lambda device: True)
    path, _, prompts, expected = hybrid_models[name]
    llm = _make(make_llm, path, max_num_batched_tokens=8)
    assert all(layer.impl.use_triton for layer in llm.engine.runner.state_layers)
    picked = [SHORT_LENS.index(17), SHORT_LENS.index(1)]
    assert _greedy(llm, [prompts[i] for i in picked], 3) == [expected[i][:3] for i in picked]
    _assert_all_free(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 16}])
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_matches_transformers_on_gpu(tmp_path, make_llm, name, variant):
    """float32 on the GPU (the state layers' Triton kernels, heads of 64 for the attention
    backends) against transformers' float32 tokens on the CPU."""
    from pagedserve.attention.ops import state_kernels_enabled

    hf = _save(_config(name, head_dim=64), tmp_path, seed=7)
    prompts = _prompts(name, seed=8)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    llm = make_llm(model=str(tmp_path), dtype="float32", device="cuda", **variant)
    assert state_kernels_enabled(torch.device("cuda"))
    assert _greedy(llm, prompts) == expected
