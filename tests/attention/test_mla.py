"""Multi-head latent attention's cache and selection: one latent row per token and layer (the
bytes the formula says), MLA layers only on MLA backends and nothing else on those, refusals
naming the layers. Its numerics are checked end to end against transformers in
tests/models/test_families.py (DeepSeek-V2/V3, chunked prefill and preemption)."""

from __future__ import annotations

import pytest
import torch
import yaml

from pagedserve import LLM, SamplingParams
from pagedserve.attention import AttentionLayerConfig, BackendSelectionError, select_backend
from pagedserve.attention.mla import MLALayerConfig

CPU = torch.device("cpu")
DEEPSEEK = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                max_position_embeddings=256)


def _mla(layers: int = 3) -> list[AttentionLayerConfig]:
    return [MLALayerConfig(4, 1, 32, torch.float32, kv_lora_rank=24, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=12)] * layers


def test_cache_holds_one_latent_row_per_token_and_layer(tmp_path):
    spec = tmp_path / "deepseek.yaml"
    spec.write_text(yaml.safe_dump(DEEPSEEK))
    llm = LLM(model=f"random:{spec}", dtype="float32", device="cpu", kv_cache_memory="4MiB")
    assert llm.engine.runner.backend.get_name() == "CPU_MLA"
    # (kv_lora_rank + qk_rope_head_dim) x 4 bytes x 3 layers; a GQA cache of the same heads
    # would hold 2 x 4 heads x 24 (nope + rope) values per layer.
    assert llm.engine.kv_cache_bytes_per_token() == (24 + 8) * 4 * 3
    assert llm.engine.runner.kv_caches[0].shape[1:] == (16, 32)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.check_blocks_free()


def test_mla_layers_run_only_on_mla_backends():
    with pytest.raises(BackendSelectionError,
                       match="all 3 layers: multi-head latent attention not supported"):
        select_backend("CPU", CPU, _mla(), 16)
    assert select_backend(None, CPU, _mla(), 16).get_name() == "CPU_MLA"
    plain = [AttentionLayerConfig(4, 2, 64, torch.float32)]
    with pytest.raises(BackendSelectionError,
                       match="layer 0: runs multi-head latent attention layers only"):
        select_backend("CPU_MLA", CPU, plain, 16)


def test_mla_backend_is_listed_with_its_feature():
    from pagedserve.attention import get_backend_cls

    assert "mla" in get_backend_cls("CPU_MLA").features()
    assert "mla" not in get_backend_cls("CPU").features()
