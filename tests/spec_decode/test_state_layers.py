"""Speculative decoding over a target with state layers (attention/state_verify.py): a tiny
random Qwen3-Next (gated delta nets beside gated full attention), float32 on the CPU, n-gram
drafts. Greedy outputs equal the same engine's without speculation token for token (which
tests/models/test_qwen3_next.py holds to transformers), with drafts both kept and rejected,
over plain steps, chunked prefill, preemption and async scheduling; every slot and block free
after. The same for Mamba-2, Mamba-1, LFM2 short convs and MiniMax lightning attention."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams

VOCAB = 61
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  max_position_embeddings=256, num_experts=0, mlp_only_layers=[0, 1, 2, 3],
                  initializer_range=0.3, tie_word_embeddings=False,
                  layer_types=["linear_attention", "full_attention", "linear_attention",
                               "linear_attention"])


def save_qwen3_next(path, seed: int = 0, config: transformers.Qwen3NextConfig | None = None
                    ) -> transformers.PreTrainedModel:
    """A random Qwen3-Next (QWEN3_NEXT unless `config`) whose norms and decays are away from
    their initial values."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config or transformers.Qwen3NextConfig(**QWEN3_NEXT), attn_implementation="eager",
        dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif "dt_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(0.1, 1.0).log())
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def qwen3_next_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_spec")
    save_qwen3_next(path)
    return str(path)


def prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that lookups find matches."""
    g = torch.Generator().manual_seed(1)
    out = []
    for length, repeats in ((5, 4), (9, 2), (3, 6), (17, 1), (2, 9)):
        out.append(torch.randint(3, VOCAB, (length,), generator=g).tolist() * repeats)
    return out


PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
          for m in (2, 9, 20, 24, 30)]


def run(make_llm, path, spec, **kwargs):
    kwargs.setdefault("kv_cache_memory", "8MiB")
    llm = make_llm(model=path, dtype="float32", device="cpu", speculative_config=spec,
                   **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs], llm.engine.call_utility("stats"),
            llm.engine.runner)


CASES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(num_gpu_blocks_override=24, block_size=4, kv_cache_memory=None),
    "async": dict(async_scheduling=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ngram_over_gated_delta_net_equals_no_speculation(qwen3_next_path, make_llm, case):
    want, _, _ = run(make_llm, qwen3_next_path, None, **CASES[case])
    got, stats, runner = run(make_llm, qwen3_next_path, NGRAM, **CASES[case])
    assert got == want
    # Each state slot with its K scratch slots.
    assert runner.state_caches[0]["recurrent"].shape[0] == 4 * runner.num_state_slots
    # Verify steps ran, and kept some drafts and rejected others.
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if case == "preempting":
        assert stats.num_preemptions > 0


# The other state layer kinds, through the same mechanism: Mamba-2 (conv + SSD, no attention
# layer at all), Mamba-1 (conv + selective scan), LFM2 (short conv beside attention), MiniMax
# (lightning attention beside attention).
OTHER_KINDS = {
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, n_groups=2, state_size=8,
        num_hidden_layers=2, conv_kernel=4, chunk_size=8, max_position_embeddings=256,
        initializer_range=0.3),
    "mamba": lambda: transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4,
        expand=2, initializer_range=0.3),
    "lfm2": lambda: transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        block_multiple_of=16, conv_L_cache=3, layer_types=["conv", "full_attention", "conv"],
        initializer_range=0.3),
    "minimax": lambda: transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, block_size=16, max_position_embeddings=256,
        layer_types=["linear_attention", "full_attention"], initializer_range=0.3),
}


@pytest.mark.parametrize("kind", list(OTHER_KINDS))
def test_ngram_over_other_state_layers_equals_no_speculation(tmp_path, make_llm, kind):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        OTHER_KINDS[kind](), dtype=torch.float32).eval().save_pretrained(tmp_path)
    want, _, _ = run(make_llm, str(tmp_path), None)
    got, stats, _ = run(make_llm, str(tmp_path), NGRAM)
    assert got == want
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


# Long (13 s in the interpreter): the torch path's n-gram case above runs by default, and
# the GDN kernels' own interpreter tests cover the Triton path.
@pytest.mark.slow
def test_ngram_on_the_triton_path_in_the_interpreter(qwen3_next_path, make_llm, monkeypatch):
    """The verify positions run through GDN_ATTN's Triton decode kernels (the conv kernel and
    the recurrent delta rule; the interpreter on the CPU): three prompts, a few tokens."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from pagedserve.engine import model_runner

    monkeypatch.setattr(model_runner, "state_kernels_enabled", lambda device: True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for spec in (None, NGRAM):
        llm = make_llm(model=qwen3_next_path, dtype="float32", device="cpu",
                       kv_cache_memory="8MiB", speculative_config=spec)
        assert llm.engine.runner.state_layers[0].impl.use_triton
        got = llm.generate([{"prompt_token_ids": p} for p in prompts()[:3]], params,
                           use_tqdm=False)
        outs[spec is None] = ([o.outputs[0].token_ids for o in got],
                              llm.engine.call_utility("stats"))
    assert outs[False][0] == outs[True][0]
    assert 0 < outs[False][1].spec_decode_num_accepted_tokens < \
        outs[False][1].spec_decode_num_draft_tokens


def test_the_memory_split_counts_the_scratch_slots():
    """A slot costs 1 + K slots' bytes under speculation: fewer slots, as many blocks."""
    from pagedserve.kv_cache.specs import StateSpec, StateTensor, split_budget

    specs = [StateSpec("GDN_ATTN", (StateTensor("recurrent", (10,), torch.float32),))]
    assert split_budget(10, specs, 1000, 100) == (20, 20)  # 20 * (40 + 10) bytes
    assert split_budget(10, specs, 1000, 100, slot_copies=4) == (20, 5)  # 5 * (160 + 10)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [NGRAM, {"method": "mtp", "num_speculative_tokens": 2}],
                         ids=["ngram", "mtp"])
def test_on_cuda_equals_no_speculation(tmp_path, make_llm, spec):
    """The Triton state kernels and a GPU attention backend under verification (float32)."""
    if spec["method"] == "mtp":
        from tests.spec_decode.test_qwen3_next_mtp import write_target_with_mtp

        write_target_with_mtp(tmp_path)
    else:
        save_qwen3_next(tmp_path)
    outs = []
    for s in (None, spec):
        llm = make_llm(model=str(tmp_path), dtype="float32", device="cuda",
                       speculative_config=s, gpu_memory_utilization=0.05,
                       attention_backend="FLEX_ATTENTION")  # heads under 64, float32
        got = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS,
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
    assert outs[0] == outs[1]
