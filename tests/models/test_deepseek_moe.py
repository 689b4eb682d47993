"""DeepSeek-V2/V3 Mixture-of-Experts blocks (`SparseMoeBlock.deepseek`) against transformers'
own blocks on the same weights, in float32: V3's sigmoid router with the correction bias and
group masking, V2's softmax router greedy and group-limited, shared experts added to the routed
sum. The configs keep fewer groups than there are, a nonzero bias and a scaling factor, and
`test_fixtures_exercise_every_rule` checks that dropping any of them changes the result here,
so the comparisons would catch it."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from pagedserve.models.moe import (
    GroupedTopKRouter,
    GroupLimitedSoftmaxRouter,
    SparseMoeBlock,
    SwiGLUMLP,
)

COMMON = dict(hidden_size=64, moe_intermediate_size=32, routed_scaling_factor=2.5)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        # 16 experts in 4 groups, 2 groups kept, top-3; two shared experts.
        "v3": transformers.DeepseekV3Config(**COMMON, n_routed_experts=16, n_group=4,
                                            topk_group=2, num_experts_per_tok=3,
                                            n_shared_experts=2, norm_topk_prob=True),
        "v2_greedy": transformers.DeepseekV2Config(**COMMON, n_routed_experts=8,
                                                   num_experts_per_tok=2, n_shared_experts=1,
                                                   topk_method="greedy"),
        # 12 experts in 4 groups, 2 kept, top-3.
        "v2_group_limited": transformers.DeepseekV2Config(
            **COMMON, n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3,
            n_shared_experts=2, topk_method="group_limited_greedy"),
    }


def _hf_block(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """transformers' own MoE block, every weight random (the correction bias too: it starts
    at zero, where it would change nothing)."""
    block = (DeepseekV3MoE if config.model_type == "deepseek_v3" else DeepseekV2Moe)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in block.state_dict().values():
            t.copy_(0.2 * torch.randn(t.shape, generator=g))
    return block.eval()


def _our_block(hf_block: torch.nn.Module) -> SparseMoeBlock:
    """Ours from `SparseMoeBlock.deepseek`, filled from the HF block's tensors the way a
    model's load_weights does: the shared gate/up into their rows of the fused projection,
    everything else by its own name."""
    ours = SparseMoeBlock.deepseek(hf_block.config)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in hf_block.state_dict().items():
            if name.startswith("shared_experts.") and ".down_proj." not in name:
                shard = "gate" if ".gate_proj." in name else "up"
                ours.shared_experts.gate_up_shard(shard).copy_(tensor)
            else:
                params[name].copy_(tensor)
    return ours


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, COMMON["hidden_size"], generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(_configs()))
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_block_matches_transformers(kind, tokens):
    hf_block = _hf_block(_configs()[kind])
    ours = _our_block(hf_block)
    x = _tokens(tokens)
    with torch.no_grad():
        expected = hf_block(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(_configs()))
def test_router_matches_transformers(kind):
    """The same experts in the same slots, and the same float32 weights."""
    hf_block = _hf_block(_configs()[kind])
    ours = _our_block(hf_block)
    x = _tokens(256, seed=5)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_block.gate(x)
        weights, ids = ours.gate(x)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype == torch.float32
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=0)


def _ids(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return gate(x)[1].sort(dim=-1).values


def test_fixtures_exercise_every_rule():
    """Each rule changes the outcome on these weights and tokens: the comparisons above fail
    if group masking, the correction bias, the scaling factor or the shared experts go."""
    x = _tokens(64)
    for kind in ("v3", "v2_group_limited"):
        ours = _our_block(_hf_block(_configs()[kind]))
        chosen = _ids(ours.gate, x)
        ours.gate.topk_group = ours.gate.n_group  # every group kept
        if kind == "v2_group_limited":
            ours.gate.group_limited = False
        assert not torch.equal(_ids(ours.gate, x), chosen), kind
    v3 = _our_block(_hf_block(_configs()["v3"])).gate
    chosen = _ids(v3, x)
    with torch.no_grad():
        v3.e_score_correction_bias.zero_()
    assert not torch.equal(_ids(v3, x), chosen)
    for kind in _configs():
        ours = _our_block(_hf_block(_configs()[kind]))
        with torch.no_grad():
            full = ours(x)
            weights, ids = ours.gate(x)
            routed = ours.experts(x, weights, ids)
            unscaled = ours.experts(x, weights / 2.5, ids)
        assert (full - routed).abs().max() > 0.05, kind  # the shared experts' share
        assert (routed - unscaled).abs().max() > 0.05, kind


def test_parameter_names_follow_the_checkpoint():
    """Every name is the checkpoint's (relative to `mlp.`) but the shared experts' gate_proj
    and up_proj, which are rows of one fused gate_up_proj."""
    for kind, config in _configs().items():
        hf_names = set(_hf_block(config).state_dict())
        fused = {n for n in hf_names if n.startswith("shared_experts.")
                 and (".gate_proj." in n or ".up_proj." in n)}
        ours = set(dict(SparseMoeBlock.deepseek(config).named_parameters()))
        assert ours == (hf_names - fused) | {"shared_experts.gate_up_proj.weight"}, kind


def test_router_stays_float32_in_a_bfloat16_model():
    """As transformers keeps DeepSeek's gate in float32: a model-wide cast, also the loader's
    meta -> dtype -> to_empty path, leaves the router's weight and correction bias float32
    (the bias a frozen parameter, so load_weights can fill it) while the experts follow."""
    config = _configs()["v3"]
    with torch.device("meta"):
        built = SparseMoeBlock.deepseek(config)
    built = built.to(torch.bfloat16).to_empty(device="cpu")
    assert built.gate.weight.dtype == built.gate.e_score_correction_bias.dtype == torch.float32
    assert built.experts.gate_up_proj.dtype == torch.bfloat16
    assert not built.gate.e_score_correction_bias.requires_grad

    ours = _our_block(_hf_block(config))
    bias = ours.gate.e_score_correction_bias.detach().clone()
    ours.to(torch.bfloat16)
    assert torch.equal(ours.gate.e_score_correction_bias, bias)  # not rounded on the way
    ref = _our_block(_hf_block(config))
    x = _tokens(64)
    with torch.no_grad():
        weights, _ = ours.gate(x.bfloat16())
        got = ours(x.bfloat16())
        expected = ref(x)
    assert weights.dtype == torch.float32 and got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max() / expected.abs().max() < 3e-2


def test_v2_norm_topk_prob_renormalises_instead_of_scaling():
    """DeepSeek's own V2 rule (transformers ignores the flag for V2): with norm_topk_prob the
    chosen weights sum to one and are not scaled; the same experts are chosen."""
    config = _configs()["v2_group_limited"]
    plain = _our_block(_hf_block(config))
    config.norm_topk_prob = True
    normed = _our_block(_hf_block(config))
    x = _tokens(32)
    with torch.no_grad():
        w_plain, ids_plain = plain.gate(x)
        w_normed, ids_normed = normed.gate(x)
    assert torch.equal(ids_plain, ids_normed)
    expected = w_plain / w_plain.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(w_normed, expected)


def test_deepseek_picks_the_router_from_the_config():
    v3 = _configs()["v3"]
    assert isinstance(SparseMoeBlock.deepseek(v3).gate, GroupedTopKRouter)
    v3.topk_method, v3.scoring_func = "noaux_tc", "sigmoid"  # as V3 checkpoints spell it
    assert isinstance(SparseMoeBlock.deepseek(v3).gate, GroupedTopKRouter)
    v3.n_shared_experts = 0
    assert SparseMoeBlock.deepseek(v3).shared_experts is None
    v2 = _configs()["v2_greedy"]
    block = SparseMoeBlock.deepseek(v2)
    assert isinstance(block.gate, GroupLimitedSoftmaxRouter)
    assert isinstance(block.shared_experts, SwiGLUMLP)
    assert block.shared_experts.intermediate_size == 32
    v2.topk_method = "noaux_tc"  # V3's method with V2's softmax scores
    v2.scoring_func = "softmax"
    with pytest.raises(ValueError, match="not supported"):
        SparseMoeBlock.deepseek(v2)
    v3.topk_group = 5
    with pytest.raises(ValueError, match="n_group=4"):
        SparseMoeBlock.deepseek(v3)
