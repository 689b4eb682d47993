"""Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3, Phi-3 and OLMo-2 through the engine against
transformers on the same weights (float32, CPU, greedy, eager reference): token ids equal with
chunked prefill and forced preemption too, prompt logprobs within 1e-4 relative (the only check
a final-logit soft-cap cannot pass by being monotonic), windows shorter than the prompts. The
Mixture-of-Experts layer itself against transformers' own sparse blocks; the expert weights
from both checkpoint layouts (one tensor per expert, or stacked)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.models import get_model_cls, load_model
from pagedserve.models.loader import build_model
from pagedserve.models.moe import SparseMoeBlock
from tests.utils.paged import check_prompt_logprobs, hf_greedy

NUM_NEW = 24
PROMPT_LENS = [3, 17, 8, 40, 1, 25]
COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, router_jitter_noise=0.0)
# Local layers slide over 12 keys; the prompts run to 40.
GEMMA = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             sliding_window=12, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")
# MLA's heads all come from the latent: no grouped K/V heads, no head_dim of their own.
MLA_COMMON = {**{k: v for k, v in COMMON.items() if k != "head_dim"},
              "num_key_value_heads": COMMON["num_attention_heads"]}
DEEPSEEK = dict(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5)
# LongRoPE: the engine serves up to the original 64 positions (short factors, as transformers
# uses for every sequence within them); the factor of 4 still scales cos/sin.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "qwen3": transformers.Qwen3Config(**COMMON),
        # Layers 1 and 2 slide over 12 keys; the prompts run to 40.
        "qwen3_window": transformers.Qwen3Config(**COMMON, use_sliding_window=True,
                                                 sliding_window=12, max_window_layers=1),
        # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; top-2 renormalised.
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **COMMON, **MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1], decoder_sparse_step=1),
        # Every second layer sparse (layer 1), weights not renormalised.
        "qwen3_moe_step2": transformers.Qwen3MoeConfig(
            **COMMON, **MOE, num_experts=6, moe_intermediate_size=32, norm_topk_prob=False,
            mlp_only_layers=[], decoder_sparse_step=2),
        "mixtral_window": transformers.MixtralConfig(**COMMON, **MOE, num_local_experts=4,
                                                     sliding_window=12),
        # Soft caps low enough to bite on these logits; a tied head.
        "gemma2": transformers.Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, **GEMMA,
                                            attn_logit_softcapping=2.0,
                                            final_logit_softcapping=3.0),
        # Global layers rotate with their own base and a linear scaling; q/k norms.
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, **GEMMA, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}}),
        "phi3_window": transformers.Phi3Config(
            **COMMON, original_max_position_embeddings=64, rope_parameters=LONGROPE,
            sliding_window=12, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "olmo2": transformers.Olmo2Config(**COMMON, pad_token_id=0),
        # Sinks, biases everywhere, top-2 of 4 clamped-SwiGLU experts, YaRN, local/global.
        "gpt_oss": transformers.GptOssConfig(
            **COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
            layer_types=GEMMA["layer_types"], swiglu_limit=1.5, rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False}),
        # Multi-head latent attention with a low-rank query, YaRN, interleaved rope; layer 0
        # dense, then 8 experts in 4 groups (2 kept), top-2, one shared expert.
        "deepseek_v3": transformers.DeepseekV3Config(
            **MLA_COMMON, **DEEPSEEK, q_lora_rank=32, norm_topk_prob=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                             "original_max_position_embeddings": 128, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
        # Rotate-half rope instead of DeepSeek's interleaved pairs.
        "deepseek_v3_no_q_lora": transformers.DeepseekV3Config(
            **MLA_COMMON, **DEEPSEEK, q_lora_rank=None, norm_topk_prob=False,
            rope_interleave=False),
        "deepseek_v2": transformers.DeepseekV2Config(
            **MLA_COMMON, **DEEPSEEK, q_lora_rank=None,
            topk_method="group_limited_greedy", norm_topk_prob=False),
    }


def _save(config: transformers.PretrainedConfig, path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():  # norms away from 1, so a q/k norm that is skipped shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in name or "sinks" in name:  # transformers starts them at zero
                p.copy_(0.5 * torch.randn_like(p))
    # Sharded with an index, as real checkpoints are.
    model.eval().save_pretrained(path, max_shard_size="200KB")
    return model


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    models = {}
    for i, (name, config) in enumerate(_configs().items()):
        path = tmp_path_factory.mktemp(name)
        hf = _save(config, path, seed=i)
        assert (path / "model.safetensors.index.json").is_file()
        g = torch.Generator().manual_seed(100 + i)
        prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
                   for n in PROMPT_LENS]
        expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
        models[name] = (str(path), hf, prompts, expected)
    return models


# Per-config engine settings.
ENGINE_ARGS = {"phi3_window": {"max_model_len": 64}}

VARIANTS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_gpu_blocks_override": 20, "block_size": 4},
}


# Models mixing windowed and full layers keep a block table per kind (KV cache groups): a
# block id then holds one layer's page instead of three, so three times the ids hold the
# memory the plain layout's 20 held.
GROUPED = ("qwen3_window", "gemma2", "gemma3", "gpt_oss")


def _variant(name: str, variant: str) -> dict:
    if variant == "preemption" and name in GROUPED:
        return {**VARIANTS[variant], "num_gpu_blocks_override": 60}
    return VARIANTS[variant]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(_configs()))
def test_greedy_matches_transformers(family_models, make_llm, name, variant):
    path, _, prompts, expected = family_models[name]
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   **ENGINE_ARGS.get(name, {}),
                   **_variant(name, variant))
    if name in GROUPED:
        assert llm.engine.kv_cache.num_groups == 3
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("layout", ["gathered", pytest.param("physical", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_greedy_through_flex_attention(family_models, make_llm, monkeypatch, name, layout):
    """FLEX_ATTENTION's score and mask mods (soft-cap and windows: Gemma 2; sinks and windows:
    gpt-oss) against transformers, with chunked prefill; "physical": the CUDA layout (the
    cache as keys; Gemma 2's grouped cache holds page 0 before its windows) forced on the
    CPU, with a small cache since eager flex scores every slot."""
    path, _, prompts, expected = family_models[name]
    small = {}
    if layout == "physical":
        from pagedserve.attention.backends.flex_attention import FlexAttentionMetadataBuilder

        monkeypatch.setattr(FlexAttentionMetadataBuilder, "physical_kv", True)
        small = {"num_gpu_blocks_override": 128}
    llm = make_llm(model=path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   attention_backend="FLEX_ATTENTION", max_num_batched_tokens=16, **small)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [
    *((name, "TRITON") for name in ("qwen3_moe", "mixtral_window", "gpt_oss", "gemma2",
                                    "gemma3")),
    # FLEX_ATTENTION's physical layout: sinks, soft-caps, windows over grouped caches whose
    # sliding groups hold page 0 before the window.
    *((name, "FLEX_ATTENTION") for name in ("gpt_oss", "gemma2", "gemma3"))])
def test_greedy_on_cuda_matches_transformers(tmp_path, name, backend):
    """The CUDA path (the Triton MoE kernel, TRITON's soft-caps, windows and sinks, CUDA
    graphs; or compiled FLEX_ATTENTION) in float32 against transformers' float32 tokens on the
    CPU; heads of 64, the smallest TRITON runs."""
    config = _configs()[name]
    config.head_dim = 64
    hf = _save(config, tmp_path, seed=7)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    # Our CPU path, which CI checks against the transformers version the project requires: the
    # GPU machine may carry an older transformers whose gpt-oss ignores swiglu_limit.
    cpu = LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    on_cpu = [o.outputs[0].token_ids for o in cpu.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    del cpu
    # A small share of the GPU, and freed before the next case profiles its memory.
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", attention_backend=backend,
              gpu_memory_utilization=0.2, max_num_batched_tokens=16)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.check_blocks_free()
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert got == on_cpu
    if name != "gpt_oss" or hasattr(transformers.GptOssConfig(), "swiglu_alpha"):
        assert got == expected


@pytest.mark.parametrize("name", list(_configs()))
def test_prompt_logprobs_match_transformers(family_models, make_llm, name):
    path, hf, prompts, _ = family_models[name]
    llm = make_llm(model=path, dtype="float32", device="cpu", max_num_batched_tokens=16,
                   kv_cache_memory="16MiB", **ENGINE_ARGS.get(name, {}))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_prompt_logprobs(hf, prompts, outputs, top=5)


def test_layers_follow_the_config(family_models):
    def layout(name):
        model = load_model(family_models[name][0], torch.float32, torch.device("cpu"),
                           None).model
        return ([type(layer.mlp).__name__ for layer in model.model.layers],
                [a.sliding_window for a in model.attention_layers()])

    dense, sparse = "LlamaMLP", "SparseMoeBlock"
    assert layout("qwen3") == ([dense] * 3, [None] * 3)
    assert layout("qwen3_window") == ([dense] * 3, [None, 12, 12])
    assert layout("qwen3_moe") == ([sparse, dense, sparse], [None] * 3)
    assert layout("qwen3_moe_step2") == ([dense, sparse, dense], [None] * 3)
    assert layout("mixtral_window") == ([sparse] * 3, [12] * 3)
    assert layout("gemma2") == ([dense] * 3, [12, None, 12])
    assert layout("gemma3") == ([dense] * 3, [12, None, 12])
    assert layout("phi3_window") == ([dense] * 3, [12] * 3)
    assert layout("olmo2") == ([dense] * 3, [None] * 3)
    assert layout("gpt_oss") == ([sparse] * 3, [12, None, 12])
    assert layout("deepseek_v3") == ([dense, sparse, sparse], [None] * 3)


@pytest.mark.parametrize("max_model_len", [64, 256])
def test_longrope_factors_follow_the_served_length(max_model_len):
    """Within the original 64 positions every position rotates with the short factors; an
    engine serving past them rotates every position with the long ones (one set per engine,
    so relative positions hold): transformers' rotary over a sequence of that length."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pagedserve.models.layers import RotaryEmbedding

    config = _configs()["phi3_window"]
    ours = RotaryEmbedding(config, 16)
    ours.build_cache(torch.device("cpu"), torch.float32, max_model_len)
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, 1, 16),
                                           torch.arange(max_model_len)[None])
    torch.testing.assert_close(ours.cos_sin_cache[:max_model_len, :8], cos[0, :, :8])
    torch.testing.assert_close(ours.cos_sin_cache[:max_model_len, 8:], sin[0, :, :8])


def test_engine_picks_longrope_factors_by_max_model_len(family_models):
    path = family_models["phi3_window"][0]
    tables = [load_model(path, torch.float32, torch.device("cpu"), n).model.model.rotary_emb
              .cos_sin_cache[1] for n in (64, 65)]
    assert not torch.equal(*tables)


def test_deepseek_checkpoints_outside_what_is_served(family_models):
    """The multi-token-prediction layer after the decoder is skipped; FP8 scales without a
    quantization_config and int8 quantization are refused by name."""
    from safetensors.torch import load_file

    path = family_models["deepseek_v3"][0]
    config = transformers.AutoConfig.from_pretrained(path)
    state = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(shard))
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(2, 2),
             "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(2, 2)}
    get_model_cls(config)(config).load_weights([*state.items(), *extra.items()])
    fp8 = {**state, "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv": torch.ones(1)}
    with pytest.raises(ValueError, match="weight_scale_inv.*no quantization_config"):
        get_model_cls(config)(config).load_weights(fp8.items())
    with pytest.raises(ValueError, match="int8 weight-only quantization is not supported"):
        build_model(config, torch.float32, torch.device("cpu"), iter(state.items()), "int8")


# ---- the Mixture-of-Experts layer ----------------------------------------------------------

def _hf_block(config: transformers.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))


def _our_block(hf_block: torch.nn.Module, renormalize: bool, float32_weights: bool,
               dtype: torch.dtype = torch.float32) -> SparseMoeBlock:
    experts = hf_block.experts
    num_experts, two_i, hidden = experts.gate_up_proj.shape
    ours = SparseMoeBlock.softmax_top_k(hidden, num_experts, hf_block.gate.top_k, two_i // 2,
                                        renormalize, float32_weights)
    ours.load_state_dict(hf_block.state_dict())
    return ours.to(dtype)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_step2", "mixtral_window"])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_block_matches_transformers(kind, tokens):
    config = _configs()[kind]
    hf_block = _hf_block(config)
    renormalize = getattr(config, "norm_topk_prob", True)
    ours = _our_block(hf_block, renormalize, float32_weights="mixtral" in kind)
    x = torch.randn(1, tokens, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_block(x)[0]
        got = ours(x[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_moe_block_bfloat16_against_float32_reference():
    """bf16 weights and activations: the same experts are chosen for tokens whose top-k is not
    a near tie, and the outputs agree with the float32 computation to bf16 rounding."""
    config = _configs()["qwen3_moe"]
    hf_block = _hf_block(config)
    ours32 = _our_block(hf_block, True, False)
    ours16 = _our_block(hf_block, True, False, torch.bfloat16)
    x = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ours32(x)
        got = ours16(x.bfloat16()).float()
        _, ids32 = ours32.gate(x)
        _, ids16 = ours16.gate(x.bfloat16())
    same = (ids32.sort(-1).values == ids16.sort(-1).values).all(-1)
    assert same.float().mean() > 0.9
    err = (got[same] - ref[same]).abs().max() / ref.abs().max()
    assert err < 2e-2


def test_experts_load_one_by_one_or_stacked():
    config = _configs()["qwen3_moe"]
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stacked = dict(hf.state_dict())  # transformers' in-memory layout: experts stacked
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    per_expert = {k: v for k, v in stacked.items() if ".mlp.experts." not in k}
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up = stacked[f"{prefix}.gate_up_proj"].chunk(2, dim=1)
        for e in range(config.num_experts):
            per_expert[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
            per_expert[f"{prefix}.{e}.up_proj.weight"] = up[e]
            per_expert[f"{prefix}.{e}.down_proj.weight"] = stacked[f"{prefix}.down_proj"][e]
    for state in (stacked, per_expert):
        model = get_model_cls(config)(config)
        model.load_weights(state.items())
        got = model.model.layers[2].mlp.experts.gate_up_proj
        torch.testing.assert_close(got, stacked["model.layers.2.mlp.experts.gate_up_proj"])

    del per_expert["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers.2.mlp.experts:5:up"):
        get_model_cls(config)(config).load_weights(per_expert.items())
    per_expert["model.layers.2.mlp.experts.5.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"expert 5's up weight has shape \(3, 3\)"):
        get_model_cls(config)(config).load_weights(per_expert.items())
