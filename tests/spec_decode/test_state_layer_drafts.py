"""A draft model and EAGLE heads over targets with state layers: the target's states are kept
per draft position (attention/state_verify.py), the draft's or head's attention layers join the
target's KV cache. Float32 on the CPU, tiny random models from transformers' own config classes.

A random draft of a random target hardly ever agrees with it, so the draft models here are the
target's attention-only "twins": the same function as the target once its state mixers' outputs
are scaled by `scale` (Qwen3-Next: every layer full attention, those at the target's gated delta
net layers with o_proj zero; Mamba-2: one Llama layer whose attention and MLP add nothing, over
the target's embedding, final norm and head). With scale 0 the twin is the target itself, so
every draft is kept; with a small scale the target keeps some drafts and rejects others, while
its states still steer its greedy choices. Greedy outputs equal the same engine's without
speculation token for token (which tests/models holds to transformers). EAGLE-3 and EAGLE-1
heads over the hybrid decoders that keep taps: their drafts equal the published forward's over
transformers' own target (hidden states at the taps), and greedy outputs equal no
speculation's; a target whose decoder cannot be tapped is refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.spec_decode.test_eagle import reference_drafts, write_eagle1, write_eagle3
from tests.spec_decode.test_state_layers import (
    OTHER_KINDS,
    PARAMS,
    QWEN3_NEXT,
    VOCAB,
    prompts,
    run,
    save_qwen3_next,
)

K = 3


def draft_spec(path: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def _scale(model: torch.nn.Module, suffix: str, scale: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                p.mul_(scale)


def qwen3_next_and_twin(root, scale: float) -> tuple[str, str]:
    """A random Qwen3-Next (its gated delta nets' out_proj scaled by `scale`) and its
    attention-only twin."""
    target = save_qwen3_next(root / "target")
    _scale(target, "linear_attn.out_proj.weight", scale)
    target.save_pretrained(root / "target")
    config = transformers.Qwen3NextConfig(
        **{**QWEN3_NEXT, "layer_types": ["full_attention"] * QWEN3_NEXT["num_hidden_layers"]})
    torch.manual_seed(7)
    twin = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = twin.load_state_dict(target.state_dict(), strict=False)
    assert all(".linear_attn." in k for k in unexpected)
    with torch.no_grad():
        for i, kind in enumerate(QWEN3_NEXT["layer_types"]):
            if kind == "linear_attention":  # its attention adds nothing to the stream
                assert any(k.startswith(f"model.layers.{i}.self_attn.") for k in missing)
                twin.model.layers[i].self_attn.o_proj.weight.zero_()
    twin.save_pretrained(root / "twin")
    return str(root / "target"), str(root / "twin")


def mamba2_and_twin(root, scale: float) -> tuple[str, str]:
    """A random Mamba-2 (no attention layer; its mixers' out_proj scaled by `scale`) and a
    one-layer Llama that computes norm_f(embedding) through the target's head."""
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(OTHER_KINDS["mamba2"](),
                                                           dtype=torch.float32)
    _scale(target, "mixer.out_proj.weight", scale)
    target.save_pretrained(root / "target")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        rms_norm_eps=target.config.layer_norm_epsilon, tie_word_embeddings=False)
    torch.manual_seed(7)
    twin = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        twin.model.embed_tokens.weight.copy_(target.backbone.embeddings.weight)
        twin.model.norm.weight.copy_(target.backbone.norm_f.weight)
        twin.lm_head.weight.copy_(target.lm_head.weight)
        twin.model.layers[0].self_attn.o_proj.weight.zero_()
        twin.model.layers[0].mlp.down_proj.weight.zero_()
    twin.save_pretrained(root / "twin")
    return str(root / "target"), str(root / "twin")


@pytest.fixture(scope="module")
def qwen3_next_pair(tmp_path_factory):
    return qwen3_next_and_twin(tmp_path_factory.mktemp("qwen3_next_twin"), 0.03)


CASES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(num_gpu_blocks_override=24, block_size=4, kv_cache_memory=None),
    "async": dict(async_scheduling=True),
    # Steps overlap without drafts while 4 or more requests run, and drafting resumes after.
    "overlap": dict(async_scheduling=True),
}


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.slow] if c in ("chunked", "async", "overlap") else [])
    for c in CASES])
def test_draft_model_over_gated_delta_net_equals_no_speculation(qwen3_next_pair, make_llm,
                                                                case):
    target, twin = qwen3_next_pair
    spec = draft_spec(twin) | ({"disable_by_batch_size": 4} if case == "overlap" else {})
    want, _, _ = run(make_llm, target, None, **CASES[case])
    got, stats, runner = run(make_llm, target, spec, **CASES[case])
    assert got == want
    # The draft's layers joined the target's one attention group; slots have K scratch each.
    assert len(runner.kv_layout.groups) == 1
    assert len(runner.attn_layers) == 1 + QWEN3_NEXT["num_hidden_layers"]
    assert runner.state_caches[0]["recurrent"].shape[0] == (1 + K) * runner.num_state_slots
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if case == "preempting":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.slow] if c != "plain" else [])
    for c in ("plain", "preempting")])
def test_draft_model_over_mamba2_equals_no_speculation(tmp_path, make_llm, case):
    """A target without any attention layer: the draft's layers are the cache's only ones."""
    target, twin = mamba2_and_twin(tmp_path, 0.1)
    want, _, _ = run(make_llm, target, None, **CASES[case])
    got, stats, runner = run(make_llm, target, draft_spec(twin), **CASES[case])
    assert got == want
    assert runner.num_blocks > 0 and len(runner.attn_layers) == 1
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if case == "preempting":
        assert stats.num_preemptions > 0


def test_a_draft_equal_to_the_target_keeps_every_draft(tmp_path, make_llm):
    """Acceptance rate exactly 1.0 and mean acceptance length exactly K + 1 (max_tokens = 1 +
    a multiple of K + 1, so no step's drafts are cut short): the draft's K one-token steps
    read and write its K/V at the right slots of the target's block table."""
    target, twin = qwen3_next_and_twin(tmp_path, 0.0)
    params = SamplingParams(temperature=0, max_tokens=1 + 5 * (K + 1), ignore_eos=True)
    outs = {}
    for spec in (None, draft_spec(twin)):
        llm = make_llm(model=target, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                       speculative_config=spec)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts()], params,
                           use_tqdm=False)
        outs[spec is None] = ([o.outputs[0].token_ids for o in got],
                              llm.engine.call_utility("stats"))
    assert outs[False][0] == outs[True][0]
    stats = outs[False][1]
    n = len(prompts())
    assert stats.spec_decode_num_drafts == n * 5
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == n * 5 * K
    assert 1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts == K + 1
    assert stats.spec_decode_num_accepted_tokens_per_pos == [n * 5] * K


def test_a_draft_with_state_layers_is_refused(qwen3_next_pair):
    """Its states would need rolling back past rejected drafts: the target itself as a draft."""
    target, _ = qwen3_next_pair
    with pytest.raises(ValueError, match="has state layers, whose state cannot be rolled back"):
        LLM(model=target, dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config=draft_spec(target))


# ---- EAGLE heads (tests/spec_decode/test_eagle.py writes them; their vocabulary is 97) ----

EAGLE_VOCAB = 97


def hybrid_target(path, kind: str) -> str:
    """A random hybrid of EAGLE_VOCAB ids and hidden size 32 (the heads'), with at least
    three layers for the taps [1, 0, 2]."""
    if kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(**{**QWEN3_NEXT, "vocab_size": EAGLE_VOCAB})
        save_qwen3_next(path, config=config)
        return str(path)
    if kind == "lfm2":
        config = OTHER_KINDS["lfm2"]()
    elif kind == "minimax":
        config = OTHER_KINDS["minimax"]()
        config.num_hidden_layers, config.layer_types = 3, ["linear_attention",
                                                           "full_attention",
                                                           "linear_attention"]
    else:
        config = transformers.BambaConfig(
            vocab_size=EAGLE_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[1],
            mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256,
            initializer_range=0.3)
    config.vocab_size = EAGLE_VOCAB
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval() \
        .save_pretrained(path)
    return str(path)


def record_drafts(monkeypatch) -> list:
    from tests.spec_decode.test_eagle import _record_drafts

    return _record_drafts(monkeypatch)


@pytest.mark.parametrize("kind, method", [
    ("qwen3_next", "eagle3"), ("qwen3_next", "eagle"),
    *[pytest.param(k, "eagle3", marks=pytest.mark.slow) for k in ("lfm2", "minimax", "bamba")]])
def test_eagle_drafts_over_hybrids_equal_the_published_forward(tmp_path, make_llm,
                                                               monkeypatch, kind, method):
    """Drafts kept at rate 0.5 whatever the target says (synthetic), so that the head's pass
    after a verify step covers kept drafts (whose target states were committed from scratch
    slots) as well as single tokens; a small step budget splits prompts into chunks."""
    target_path = hybrid_target(tmp_path / "target", kind)
    head = (write_eagle3(tmp_path / "head", tap_ids=[1, 0, 2]) if method == "eagle3"
            else write_eagle1(tmp_path / "head"))
    seen = record_drafts(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = make_llm(model=target_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                   max_num_batched_tokens=16,
                   speculative_config={"method": method, "model": head,
                                       "num_speculative_tokens": K,
                                       "rejection_sample_method": "synthetic",
                                       "synthetic_acceptance_rate": 0.5})
    llm.generate([{"prompt_token_ids": p} for p in prompts()[:4]], params, use_tqdm=False)
    stats = llm.engine.call_utility("stats")
    assert len(seen) > 10
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_path, attn_implementation="eager", dtype=torch.float32)
    for tokens, drafts in seen:
        assert drafts == reference_drafts(method, head, target, tokens, len(drafts),
                                          (1, 0, 2))[:len(drafts)]


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.slow] if c != "plain" else []) for c in CASES])
def test_eagle3_over_gated_delta_net_equals_no_speculation(tmp_path, make_llm, case):
    target = hybrid_target(tmp_path / "target", "qwen3_next")
    spec = {"method": "eagle3", "model": write_eagle3(tmp_path / "head", tap_ids=[1, 0, 2]),
            "num_speculative_tokens": K}
    if case == "overlap":
        spec["disable_by_batch_size"] = 4
    want, _, _ = run(make_llm, target, None, **CASES[case])
    got, stats, _ = run(make_llm, target, spec, **CASES[case])
    assert got == want
    assert stats.spec_decode_num_drafts > 0
    if case == "preempting":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_eagle_over_a_decoder_without_taps_is_refused(tmp_path, kind):
    """Mamba-1 and -2 keep no taps (nor a Llama-style decoder, nor any attention layer)."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(OTHER_KINDS[kind]()).save_pretrained(
        tmp_path / "target")
    head = write_eagle3(tmp_path / "head", tap_ids=[1, 0, 1])
    with pytest.raises(ValueError, match="method 'eagle3' needs a Llama-style target whose "
                                         "hidden states it can tap"):
        LLM(model=str(tmp_path / "target"), dtype="float32", device="cpu",
            kv_cache_memory="8MiB",
            speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2})


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_on_cuda_equals_no_speculation(tmp_path, make_llm, method):
    """A GPU attention backend and the Triton state kernels under a draft model's or an
    EAGLE-3 head's drafts over Qwen3-Next (float32)."""
    if method == "draft_model":
        target, twin = qwen3_next_and_twin(tmp_path, 0.03)
        spec = draft_spec(twin)
    else:
        target = hybrid_target(tmp_path / "target", "qwen3_next")
        # Heads of 16: compiled flex takes no smaller (the default head's are 8).
        head = write_eagle3(tmp_path / "head", tap_ids=[1, 0, 2], heads=2, kv_heads=2)
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K}
    outs = []
    for s in (None, spec):
        llm = make_llm(model=target, dtype="float32", device="cuda", speculative_config=s,
                       gpu_memory_utilization=0.05,
                       attention_backend="FLEX_ATTENTION")  # heads under 64, float32
        got = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS,
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
    assert outs[0] == outs[1]
