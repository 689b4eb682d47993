"""Qwen3-Next at two tensor-parallel ranks (gloo, float32, CPU) against transformers' eager
forward: greedy tokens equal and top-5 logprobs within 1e-4. Its gated delta nets split by
key-head groups (the fused in_proj rows of a rank's groups, conv1d's q/k/v channels, dt_bias,
A_log, out_proj's columns; each rank's state slots of its own heads), the gated attention with
each query head's gate on the rank of its head, the experts inside FusedMoE, the shared expert
whole; an odd vocabulary (rank 1's last head row is padding). Prompts of 7 and 70 tokens in
chunks of 16 (prefill continues each rank's conv window and recurrent state across chunks; 70
passes the delta rule's chunk of 64)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import (
    ENGINE,
    _no_workers_left,
    assert_equal_transformers,
)
from tests.models.test_qwen3_next import COMMON, _save

# Layers: attention, then gated delta nets; layer 1 dense, the others sparse with the shared
# expert; two key heads of two value heads each, one per rank.
CONFIGS = {
    "moe": lambda: transformers.Qwen3NextConfig(
        **COMMON, mlp_only_layers=[1], norm_topk_prob=True,
        layer_types=["full_attention", "linear_attention", "linear_attention",
                     "full_attention"]),
    # A tied head (the embedding's rows per rank, the logits gathered), one K/V head (on
    # both ranks), four key heads (two per rank): slow, the first covers the split.
    "tied_one_kv_head": lambda: transformers.Qwen3NextConfig(
        **{**COMMON, "tie_word_embeddings": True, "num_key_value_heads": 1,
           "linear_num_key_heads": 4, "linear_num_value_heads": 8}, decoder_sparse_step=2),
}
NUM_NEW = 6
# The slow case also preempts (20 blocks of 4 for 7 + 6 and 70 + 6 tokens: each rank rebuilds
# its heads' states from the tokens) with a step in flight.
VARIANT = {"tied_one_kv_head": {"kv_cache_memory": None, "num_gpu_blocks_override": 20,
                                "async_scheduling": True}}


@pytest.mark.parametrize("name", ["moe", pytest.param("tied_one_kv_head",
                                                      marks=pytest.mark.slow)])
def test_two_ranks_equal_transformers(tmp_path, name):
    _save(CONFIGS[name](), tmp_path, seed=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (7, 70)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, **{**ENGINE, **VARIANT.get(name, {})})
    try:
        assert llm.engine.runner.world_size == 2
        # Each rank's state slot holds its half of the heads.
        recurrent = llm.engine.runner.state_specs[0].tensors[1]
        assert recurrent.shape[0] == CONFIGS[name]().linear_num_value_heads // 2
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert llm.engine.check_blocks_free()
        if name in VARIANT:
            assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()
    assert_equal_transformers(str(tmp_path), prompts, outputs, NUM_NEW)
    _no_workers_left()


@pytest.mark.slow
def test_ngram_at_two_ranks_equals_no_speculation(tmp_path):
    """Verify steps over split gated delta nets: each rank keeps its heads' scratch states per
    draft position and copies the kept one back; tokens equal the same ranks' without drafts,
    with drafts both kept and rejected."""
    from tests.spec_decode.test_state_layers import NGRAM

    _save(CONFIGS["moe"](), tmp_path, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 211, (n,), generator=g).tolist() * r}
               for n, r in ((5, 4), (9, 2), (3, 6))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for spec in (None, NGRAM):
        llm = LLM(model=str(tmp_path), tensor_parallel_size=2, speculative_config=spec,
                  **ENGINE)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[spec is None] = [o.outputs[0].token_ids for o in outs]
            stats = llm.engine.call_utility("stats")
            assert llm.engine.check_blocks_free()
        finally:
            llm.engine.shutdown()
        if spec is not None:
            assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert tokens[False] == tokens[True]
    _no_workers_left()


def test_random_weights_at_two_ranks_equal_one(tmp_path):
    """`random:` at N ranks draws the one-rank model's weights and hands each rank its part
    through the checkpoint's layout (the fused projections split back out, in_proj_qkvz and
    in_proj_ba regrouped per key head): tokens of two ranks equal one rank's."""
    fields = {**COMMON, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
              "mlp_only_layers": [1], "layer_types": ["linear_attention", "full_attention",
                                                      "linear_attention", "linear_attention"]}
    spec = tmp_path / "qwen3_next.json"
    spec.write_text(json.dumps(fields))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(model=f"random:{spec}", tensor_parallel_size=tp, **ENGINE)
        try:
            tokens[tp] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
    assert tokens[1] == tokens[2]
    assert len(set(tokens[1][0])) > 1  # not a degenerate repeat of one token
    _no_workers_left()


def test_heads_that_do_not_split_are_refused_by_name(monkeypatch):
    from pagedserve.distributed import parallel_state
    from pagedserve.models.qwen3_next import Qwen3NextAttention, Qwen3NextGatedDeltaNet

    monkeypatch.setattr(parallel_state, "_world_size", 2)
    config = transformers.Qwen3NextConfig(**{**COMMON, "linear_num_key_heads": 1,
                                             "num_attention_heads": 3})
    with torch.device("meta"):
        with pytest.raises(ValueError, match="linear-attention key heads divisible by 2, got 1"):
            Qwen3NextGatedDeltaNet(config, 0)
        with pytest.raises(ValueError, match="attention heads divisible by 2, got 3"):
            Qwen3NextAttention(config, 0)


@pytest.mark.gpu
def test_two_gpus_match_one(tmp_path):
    """On CUDA (the GDN_ATTN Triton kernels over each rank's heads, decode graphs of the
    attention layers): greedy tokens of two ranks equal one rank's in float32."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    _save(CONFIGS["moe"](), tmp_path, seed=0)
    engine = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_model_len=128,
                  max_num_batched_tokens=32)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 211, (n,), generator=g).tolist()}
               for n in (7, 70)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(model=str(tmp_path), tensor_parallel_size=tp, **engine)
        try:
            tokens[tp] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert tokens[1] == tokens[2]
