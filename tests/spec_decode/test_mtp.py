"""DeepSeek-V3's multi-token-prediction layer from the target's own checkpoint (layer index
num_hidden_layers: enorm, hnorm, eh_proj, a decoder layer of latent attention and experts,
shared_head): its drafts equal a reference built on transformers' own decoder layer (eager,
float32) with the published layer's surroundings written in plain torch; greedy outputs equal
those without speculation; a checkpoint without the layer is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve import SamplingParams
from tests.spec_decode.test_engine import _assert_same, _prompts, _run

VOCAB = 97
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
              initializer_range=0.3, tie_word_embeddings=False, kv_lora_rank=16,
              q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
              moe_intermediate_size=16, n_routed_experts=4, n_group=2, topk_group=1,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
              routed_scaling_factor=2.5, rope_theta=10000.0)


def write_target_with_mtp(path: Path, mtp: bool = True):
    """A 2-layer DeepSeek-V3 checkpoint whose layer 2 is its MTP layer: a 3-layer model's
    layer 2 (as transformers writes it) plus enorm, hnorm, eh_proj and shared_head. Returns
    the 3-layer model (its layer 2 is the reference's decoder layer) and the extra tensors."""
    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV3Config(**CONFIG), attn_implementation="eager",
        dtype=torch.float32)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    full.eval().save_pretrained(path)
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(shard))
        shard.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    g = torch.Generator().manual_seed(7)
    extra = {"enorm.weight": 1 + 0.2 * torch.randn(32, generator=g),
             "hnorm.weight": 1 + 0.2 * torch.randn(32, generator=g),
             "eh_proj.weight": 0.3 * torch.randn(32, 64, generator=g),
             "shared_head.norm.weight": 1 + 0.2 * torch.randn(32, generator=g),
             "shared_head.head.weight": torch.randn(VOCAB, 32, generator=g),
             "embed_tokens.weight": state["model.embed_tokens.weight"]}
    if mtp:
        state.update({f"model.layers.2.{k}": v.clone() for k, v in extra.items()})
    else:
        state = {k: v for k, v in state.items() if not k.startswith("model.layers.2.")}
    save_file(state, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=2, num_nextn_predict_layers=1 if mtp else 0)
    (path / "config.json").write_text(json.dumps(config))
    return full, extra


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_drafts(full, extra, target, tokens, k):
    """Position i reads the target's final hidden state at i and token i + 1 (its embedding
    zeroed at position 0); later drafts feed back the layer's output."""
    layer, rotary = full.model.layers[2], full.model.rotary_emb
    embed = full.model.embed_tokens.weight
    with torch.no_grad():
        hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        hidden, inputs, drafts = hidden[:-1], list(tokens[1:]), []
        for _ in range(k):
            n = len(inputs)
            pos = torch.arange(n)
            e = embed[torch.tensor(inputs)].masked_fill((pos == 0)[:, None], 0)
            x = torch.cat([_rms(e, extra["enorm.weight"]), _rms(hidden, extra["hnorm.weight"])],
                          -1) @ extra["eh_proj.weight"].T
            mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                 float("-inf"))[None, None]
            out = layer(x[None], attention_mask=mask, position_ids=pos[None],
                        position_embeddings=rotary(x[None], pos[None]))
            last = (out[0] if isinstance(out, tuple) else out)[0, -1]
            logits = _rms(last, extra["shared_head.norm.weight"]) @ \
                extra["shared_head.head.weight"].T
            token = int(logits.argmax())
            drafts.append(token)
            inputs.append(token)
            hidden = torch.cat([hidden, last[None]], 0)
    return drafts


@pytest.fixture(scope="module")
def target_with_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_mtp")
    full, extra = write_target_with_mtp(path)
    return str(path), full, extra


MTP = {"method": "mtp", "num_speculative_tokens": 2}


def test_drafts_equal_the_reference(target_with_mtp, make_llm, monkeypatch):
    from tests.spec_decode.test_eagle import _record_drafts

    path, full, extra = target_with_mtp
    seen = _record_drafts(monkeypatch)
    spec = dict(MTP, rejection_sample_method="synthetic", synthetic_acceptance_rate=0.5)
    _, stats = _run(make_llm, path, _prompts()[:3], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), spec, max_num_batched_tokens=16)
    assert len(seen) > 5
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    target = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32)
    for tokens, drafts in seen:
        assert drafts == reference_drafts(full, extra, target, tokens, len(drafts))


CASES = {"plain": {}, "chunked": dict(max_num_batched_tokens=16),
         "preempting": dict(num_gpu_blocks_override=24, block_size=4, kv_cache_memory=None)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c != "plain" else [])
                                  for c in CASES])  # (the EAGLE tests run these paths fast)
def test_greedy_equals_no_speculation(target_with_mtp, make_llm, case):
    kwargs = CASES[case]
    prompts = _prompts()[:5]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1)
              for m in (3, 9, 17, 20, 12)]
    want, _ = _run(make_llm, target_with_mtp[0], prompts, params, None, **kwargs)
    got, stats = _run(make_llm, target_with_mtp[0], prompts, params, MTP, **kwargs)
    _assert_same(got, want)
    assert stats.spec_decode_num_drafts > 0
    if case == "preempting":
        assert stats.num_preemptions > 0


def test_a_checkpoint_without_the_layer_is_refused(tmp_path):
    from pagedserve import LLM

    write_target_with_mtp(tmp_path, mtp=False)
    with pytest.raises(ValueError, match="no num_nextn_predict_layers"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config=MTP)


def test_seeded_sampling_reproduces(target_with_mtp, make_llm):
    prompts = _prompts()[:4]
    params = [SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=15, ignore_eos=True)
              for s, (t, k) in enumerate([(0.5, 5), (1.0, 0), (0.3, 20), (0.8, 0)])]
    first, stats = _run(make_llm, target_with_mtp[0], prompts, params, MTP)
    second, _ = _run(make_llm, target_with_mtp[0], prompts[::-1], params[::-1], MTP)
    _assert_same(second[::-1], first)
    assert stats.spec_decode_num_draft_tokens > 0


def test_a_random_layer_over_a_random_target(tmp_path, make_llm):
    """The timing path: `random:` DeepSeek targets get a random MTP layer; under synthetic
    acceptance at rate 1 every step after the prompt's keeps its K drafts."""
    fields = {k: v for k, v in CONFIG.items() if k != "initializer_range"}
    (tmp_path / "ds.json").write_text(json.dumps(dict(fields, model_type="deepseek_v3",
                                                      num_hidden_layers=2)))
    spec = dict(MTP, rejection_sample_method="synthetic", synthetic_acceptance_rate=1.0)
    _, stats = _run(make_llm, f"random:{tmp_path / 'ds.json'}", _prompts()[:3], SamplingParams(
        temperature=0, max_tokens=7, ignore_eos=True), spec)
    assert stats.spec_decode_num_drafts == 3 * 2
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == 12

