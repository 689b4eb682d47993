"""Qwen3-Next's MTP block (`mtp.*` in the target's checkpoint: fc, pre_fc_norm_embedding,
pre_fc_norm_hidden, layers.0, norm; the target's embedding and head) as the `mtp` method over
a target with gated delta net layers. transformers' Qwen3-Next writes no MTP block, so the test
writes one into the safetensors under the published names: layers.0 is transformers' own
full-attention decoder layer (a sparse MoE here, as the config makes layer 0), the rest random.
Its drafts equal a float32 reference of the published forward (the surroundings in plain
torch, the layer transformers' eager module); greedy outputs equal those without
speculation; a checkpoint without the block is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve import SamplingParams
from tests.spec_decode.test_state_layers import QWEN3_NEXT, prompts, save_qwen3_next

# Layers 0 and 3 sparse (MoE with a shared expert), 1 and 2 dense; the MTP layer sparse.
CONFIG = dict(QWEN3_NEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, mlp_only_layers=[1, 2], norm_topk_prob=True)
H = CONFIG["hidden_size"]
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def write_target_with_mtp(path: Path, mtp: bool = True):
    """The target's checkpoint plus its MTP block. Returns (the transformers target, a one-layer
    transformers model whose layer 0 and rotary serve the reference, the block's own tensors)."""
    config = transformers.Qwen3NextConfig(**CONFIG)
    target = save_qwen3_next(path, config=config)
    layer_config = copy.deepcopy(config)
    layer_config.num_hidden_layers, layer_config.layer_types = 1, ["full_attention"]
    torch.manual_seed(5)
    layer_model = transformers.AutoModelForCausalLM.from_config(
        layer_config, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in layer_model.model.layers[0].named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    own = {"fc.weight": 0.3 * torch.randn(H, 2 * H, generator=g),
           "pre_fc_norm_embedding.weight": 0.2 * torch.randn(H, generator=g),
           "pre_fc_norm_hidden.weight": 0.2 * torch.randn(H, generator=g),
           "norm.weight": 0.2 * torch.randn(H, generator=g)}
    if mtp:
        state = {}
        for shard in sorted(path.glob("*.safetensors")):
            state.update(load_file(shard))
            shard.unlink()
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        state.update({f"mtp.{k}": v.clone() for k, v in own.items()})
        state.update({f"mtp.layers.0.{k}": v.detach().clone()
                      for k, v in layer_model.model.layers[0].state_dict().items()})
        save_file(state, str(path / "model.safetensors"))
    return target, layer_model, own


def _zc_rms(x, w, eps=1e-6):
    """Qwen3-Next's zero-centred RMSNorm: scaled by 1 + w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def reference_drafts(target, layer_model, own, tokens, k):
    """Position i reads the target's final hidden state at i and token i + 1; a draft comes
    from the target's head over norm(layer(fc(...))), which is fed back for the next one."""
    layer, rotary = layer_model.model.layers[0], layer_model.model.rotary_emb
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    with torch.no_grad():
        hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        hidden, inputs, drafts = hidden[:-1], list(tokens[1:]), []
        for _ in range(k):
            n = len(inputs)
            pos = torch.arange(n)
            e = _zc_rms(embed[torch.tensor(inputs)], own["pre_fc_norm_embedding.weight"])
            x = torch.cat([e, _zc_rms(hidden, own["pre_fc_norm_hidden.weight"])], -1) @ \
                own["fc.weight"].T
            mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                 float("-inf"))[None, None]
            out = layer(x[None], position_embeddings=rotary(x[None], pos[None]),
                        attention_mask=mask, position_ids=pos[None])
            out = (out[0] if isinstance(out, tuple) else out)[0, -1]
            last = _zc_rms(out, own["norm.weight"])
            token = int((last @ head.T).argmax())
            drafts.append(token)
            inputs.append(token)
            hidden = torch.cat([hidden, last[None]], 0)
    return drafts


@pytest.fixture(scope="module")
def target_with_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_mtp")
    target, layer_model, own = write_target_with_mtp(path)
    return str(path), target, layer_model, own


def _run(make_llm, path, spec, params, **kwargs):
    kwargs.setdefault("kv_cache_memory", "8MiB")
    llm = make_llm(model=path, dtype="float32", device="cpu", speculative_config=spec,
                   **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.call_utility("stats")


def test_drafts_equal_the_reference(target_with_mtp, make_llm, monkeypatch):
    from tests.spec_decode.test_eagle import _record_drafts

    path, target, layer_model, own = target_with_mtp
    seen = _record_drafts(monkeypatch)
    spec = dict(MTP, rejection_sample_method="synthetic", synthetic_acceptance_rate=0.5)
    _, stats = _run(make_llm, path, spec, SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True),
                    max_num_batched_tokens=16)
    assert len(seen) > 5
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for tokens, drafts in seen:
        assert drafts == reference_drafts(target, layer_model, own, tokens, len(drafts))


CASES = {"plain": {}, "chunked": dict(max_num_batched_tokens=16),
         "preempting": dict(num_gpu_blocks_override=24, block_size=4, kv_cache_memory=None)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c != "plain" else [])
                                  for c in CASES])  # (n-gram's tests run these paths fast)
def test_greedy_equals_no_speculation(target_with_mtp, make_llm, case):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (3, 9, 17, 20, 12)]
    want, _ = _run(make_llm, target_with_mtp[0], None, params, **CASES[case])
    got, stats = _run(make_llm, target_with_mtp[0], MTP, params, **CASES[case])
    assert got == want
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if case == "preempting":
        assert stats.num_preemptions > 0


def test_a_checkpoint_without_the_block_is_refused(tmp_path):
    from pagedserve import LLM

    write_target_with_mtp(tmp_path, mtp=False)
    with pytest.raises(ValueError, match="no MTP block"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config=MTP)


def test_a_random_block_over_a_random_target(tmp_path, make_llm):
    """The timing path: a `random:` Qwen3-Next target gets a random MTP block; under synthetic
    acceptance at rate 1 every step after the prompt's keeps its K drafts."""
    import json

    fields = {k: v for k, v in CONFIG.items() if k != "initializer_range"}
    (tmp_path / "q.json").write_text(json.dumps(dict(
        fields, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])))
    spec = dict(MTP, rejection_sample_method="synthetic", synthetic_acceptance_rate=1.0)
    llm = make_llm(model=f"random:{tmp_path / 'q.json'}", dtype="float32", device="cpu",
                   kv_cache_memory="8MiB", speculative_config=spec)
    llm.generate([{"prompt_token_ids": p} for p in prompts()[:3]],
                 SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.call_utility("stats")
    assert stats.spec_decode_num_drafts == 3 * 2
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == 12
