"""DeepSeek-V3 and -V2 at two tensor-parallel ranks (gloo, float32, CPU) against transformers'
eager forward: greedy tokens equal and top-5 logprobs within 1e-4. Each rank holds two of the
four query heads (q_b_proj / q_proj and kv_b_proj by heads, o_proj by its inputs with its bias
added once), the whole latent projections and cache, half of every routed expert and of the
dense layer's MLP, the shared expert whole, and half of an odd vocabulary. Prompts of 7 and 40
tokens in chunks of 16."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import (
    ENGINE,
    _no_workers_left,
    assert_equal_transformers,
)
from tests.models.test_families import DEEPSEEK, MLA_COMMON, _save

CONFIGS = {
    # Low-rank queries, sigmoid routing over groups, YaRN, biases on the latent and output
    # projections.
    "v3": lambda: transformers.DeepseekV3Config(
        **MLA_COMMON, **DEEPSEEK, q_lora_rank=32, norm_topk_prob=True, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    # A whole-rank query projection and group-limited softmax routing: slow, the first
    # covers the split.
    "v2": lambda: transformers.DeepseekV2Config(
        **MLA_COMMON, **DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
        norm_topk_prob=False),
}
NUM_NEW = 6


@pytest.mark.parametrize("name", ["v3", pytest.param("v2", marks=pytest.mark.slow)])
def test_two_ranks_equal_transformers(tmp_path, name):
    config = CONFIGS[name]()
    _save(config, tmp_path, seed=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (7, 40)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.runner.world_size == 2
        attn = llm.engine.runner.model.model.layers[0].self_attn  # rank 0's: two heads
        assert attn.num_heads == 2
        assert attn.attn.kv_b_proj.weight.shape == (2 * (16 + 12), 24)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert llm.engine.check_blocks_free()
    finally:
        llm.engine.shutdown()
    assert_equal_transformers(str(tmp_path), prompts, outputs, NUM_NEW)
    _no_workers_left()

