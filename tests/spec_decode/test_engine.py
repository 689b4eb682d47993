"""Speculative decoding through the whole engine, n-gram and draft model: greedy outputs (and
their logprobs) equal those without speculation token for token, over chunked prefill,
preemption, prefix-cache hits, async scheduling, n > 1, stop tokens and the FLEX_ATTENTION
backend; a draft identical to the target keeps every draft; seeded sampling reproduces; the
acceptance counters add up. Prompts repeat themselves so that lookups find matches, and the
draft model is another random model, so that verify steps keep some drafts and reject
others."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams

VOCAB = 97
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _tiny(path, seed: int, hidden: int, layers: int, heads: int = 4) -> str:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
        rope_theta=10000.0)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("tiny_spec"), 0, 32, 2)


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory):
    """Another model of the target's vocabulary: other sizes (its own cache pages), other
    weights, with the same greedy choice as the target now and then."""
    return _tiny(tmp_path_factory.mktemp("tiny_draft"), 3, 16, 1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = []
    for length, repeats in ((5, 4), (9, 2), (3, 6), (17, 1), (6, 3), (2, 9)):
        piece = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        prompts.append(piece * repeats)
    return prompts + [prompts[0] + [7, 8], prompts[0][:12]]  # shared prefixes


def _params() -> list[SamplingParams]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (1, 2, 5, 16, 21, 28)]
    params += [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[11, 12, 13]),
               SamplingParams(temperature=0, n=2, max_tokens=14, ignore_eos=True)]
    return params


def _run(make_llm, path, prompts, params, spec, **kwargs):
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("device", "cpu")
    llm = make_llm(model=path, dtype="float32", speculative_config=spec, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [[(c.token_ids, c.finish_reason,
             None if c.logprobs is None else [{t: lp.logprob for t, lp in pos.items()}
                                              for pos in c.logprobs])
            for c in o.outputs] for o in outs]
    return got, llm.engine.call_utility("stats")


def _assert_same(got, want):
    assert [[c[:2] for c in o] for o in got] == [[c[:2] for c in o] for o in want]
    for o_got, o_want in zip(got, want, strict=True):
        for c_got, c_want in zip(o_got, o_want, strict=True):
            assert (c_got[2] is None) == (c_want[2] is None)
            for pos_got, pos_want in zip(c_got[2] or [], c_want[2] or [], strict=True):
                assert pos_got.keys() == pos_want.keys()
                assert all(abs(pos_got[t] - pos_want[t]) < 1e-4 for t in pos_want)


CASES = {
    "plain": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempting": dict(num_gpu_blocks_override=20, block_size=4, kv_cache_memory=None),
    "prefix-caching": dict(enable_prefix_caching=True, block_size=4),
    "async": dict(async_scheduling=True),
    "context-limit": dict(max_model_len=40),  # drafts cut at the end of the context
    "flex": dict(attention_backend="FLEX_ATTENTION", block_size=4),
}


# FLEX_ATTENTION with a draft model runs both its verify steps and the draft's decode steps;
# n-gram's verify steps on it, chunked and async with a draft model repeat paths run elsewhere.
SLOW = {("flex", "ngram"), ("chunked", "draft_model"), ("async", "draft_model"),
        ("context-limit", "ngram")}


@pytest.mark.parametrize("case, method", [
    pytest.param(case, method, marks=[pytest.mark.slow] if (case, method) in SLOW else [],
                 id=f"{case}-{method}")
    for case in CASES for method in ("ngram", "draft_model")])
def test_greedy_equals_no_speculation(tiny_path, draft_path, make_llm, case, method):
    prompts, params = _prompts(), _params()
    if case in ("chunked", "flex"):  # the slowest: fewer requests (n > 1 kept)
        prompts, params = prompts[5:], params[5:]
    if case == "context-limit":  # every request runs to max_model_len
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=1)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": draft_path,
                                            "num_speculative_tokens": 3}
    want, _ = _run(make_llm, tiny_path, prompts, params, None, **CASES[case])
    got, stats = _run(make_llm, tiny_path, prompts, params, spec, **CASES[case])
    _assert_same(got, want)
    # Verify steps ran, and both kept and rejected drafts.
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if case == "preempting":
        assert stats.num_preemptions > 0
    if case == "prefix-caching":
        assert stats.prefix_cache_hits > 0


def test_a_draft_identical_to_the_target_keeps_every_draft(tiny_path, make_llm):
    """Acceptance rate exactly 1.0 and mean acceptance length exactly K + 1 (max_tokens = 1 +
    a multiple of K + 1, so no step's drafts are cut short)."""
    k = 3
    spec = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": k}
    params = SamplingParams(temperature=0, max_tokens=1 + 6 * (k + 1), ignore_eos=True)
    prompts = _prompts()[:5]
    want, _ = _run(make_llm, tiny_path, prompts, params, None)
    got, stats = _run(make_llm, tiny_path, prompts, params, spec)
    _assert_same(got, want)
    assert stats.spec_decode_num_drafts == 5 * 6
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == 5 * 18
    assert 1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts == k + 1
    assert stats.spec_decode_num_accepted_tokens_per_pos == [30, 30, 30]


def test_counters_add_up(tiny_path, make_llm):
    _, stats = _run(make_llm, tiny_path, _prompts(), _params(), NGRAM)
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos[0] <= stats.spec_decode_num_drafts
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))  # nested events
    assert stats.spec_decode_num_draft_tokens <= 3 * stats.spec_decode_num_drafts
    # Verify steps' tokens are no prompt tokens.
    assert stats.prompt_tokens == stats.prefix_cache_queries - stats.prefix_cache_hits


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_reproduces(tiny_path, draft_path, make_llm, method):
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": draft_path,
                                            "num_speculative_tokens": 3}
    prompts = _prompts()
    params = [SamplingParams(temperature=t, top_k=k, top_p=0.9, seed=s, max_tokens=25,
                             ignore_eos=True, logprobs=1)
              for s, (t, k) in enumerate([(0.5, 5), (1.0, 0), (0.3, 20)] * 3)][:len(prompts)]
    first, stats = _run(make_llm, tiny_path, prompts, params, spec)
    # Another batch order: a seeded request's draws come from its own generator, as many as
    # its own drafts (a step budget that cut its drafts short would change them).
    second, _ = _run(make_llm, tiny_path, prompts[::-1], params[::-1], spec)
    _assert_same(second[::-1], first)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_penalties_and_min_tokens_equal_no_speculation(tiny_path, make_llm):
    """Penalties count the drafts before each verified position; min_tokens bans end tokens
    by each position."""
    prompts = _prompts()[:4]
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.4,
                             presence_penalty=0.2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=12,
                             stop_token_ids=[11, 12, 13, 14, 15]),
              SamplingParams(temperature=0, max_tokens=20, logit_bias={5: 3.0, 6: -2.0})]
    want, _ = _run(make_llm, tiny_path, prompts, params, None)
    got, stats = _run(make_llm, tiny_path, prompts, params, NGRAM)
    _assert_same(got, want)
    assert stats.spec_decode_num_drafts > 0


def test_synthetic_acceptance_rate_one_keeps_every_draft(tiny_path, make_llm):
    spec = dict(NGRAM, rejection_sample_method="synthetic", synthetic_acceptance_rate=1.0)
    _, stats = _run(make_llm, tiny_path, _prompts(), _params(), spec)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "mtp", "num_speculative_tokens": 2},
     "'mtp' is implemented for DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, "
     "Qwen3NextForCausalLM; the target is LlamaForCausalLM"),
    (dict(NGRAM, draft_tensor_parallel_size=2), "draft_tensor_parallel_size 2"),
])
def test_refused_at_start_up(tiny_path, spec, message):
    """(A draft of another vocabulary: test_draft_of_another_vocabulary_is_refused.)"""
    from pagedserve import LLM

    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config=spec)


def test_guided_requests_beside_verify_steps(tmp_path, make_llm, monkeypatch):
    """Guided requests beside unguided ones in verify steps: the grammars' mask rows land on
    the guided requests' own logits rows (tests/spec_decode/test_guided.py has guided requests
    with drafts alone). Both kinds equal their outputs without speculation."""
    pytest.importorskip("xgrammar")
    from pagedserve.sampling_params import GuidedDecodingParams
    from tests.utils.paged import tiny_chat_model

    model = str(tiny_chat_model(tmp_path, init_std=0.2))
    prompts = _prompts()[:4]
    guided = [GuidedDecodingParams(choice=["yes", "no", "maybe so"]),
              GuidedDecodingParams(regex="[a-c]{20,30}")]
    params = [SamplingParams(temperature=0, max_tokens=24, guided_decoding=g) for g in guided]
    params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2
    from pagedserve.spec_decode import rejection_sampler

    mixed = []  # verify steps that also masked guided rows
    expand = rejection_sampler.expand_metadata

    def spy(meta, layout):
        mixed.append(meta.token_bitmask is not None and layout.drafts.shape[1] > 0)
        return expand(meta, layout)

    monkeypatch.setattr(rejection_sampler, "expand_metadata", spy)
    want, _ = _run(make_llm, model, prompts, params, None)
    got, stats = _run(make_llm, model, prompts, params, NGRAM)
    _assert_same(got, want)
    assert stats.spec_decode_num_drafts > 0 and any(mixed)


@pytest.mark.parametrize("positions", [256, 128])
def test_draft_of_another_vocabulary_is_refused(tiny_path, tmp_path, positions):
    """Also where its context is shorter than the target's too: the vocabulary is what rules
    it out (the error named only --max-model-len, and the next start the vocabulary)."""
    from pagedserve import LLM

    config = transformers.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=16,
                                      intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=positions)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 98 tokens, the target 97"):
        LLM(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2})


def test_draft_of_a_shorter_context_names_the_flag_that_fits_it(tiny_path, tmp_path):
    from pagedserve import LLM

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len 256 is larger than the model's "
                                         r"max_position_embeddings 128: .*--max-model-len 128"):
        LLM(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2})


def test_draft_model_beside_cache_groups_is_refused(tmp_path):
    """A target whose layers form KV cache groups of two kinds (full and sliding), its own
    draft. (A draft whose pages have other shapes puts every layer in one group, which works.)"""
    from pagedserve import LLM

    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=8, max_window_layers=1, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="KV cache groups of several kinds"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
            speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2})


def test_prompt_logprobs_and_scoring_beside_verify_steps(tiny_path, make_llm):
    """Requests that keep more logits than their sample (prompt logprobs, scoring) get no
    drafts and read their own rows of a verify step's logits."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             prompt_logprobs=2 if i % 3 == 0 else None)
              for i in range(len(prompts))]
    results = []
    for spec in (None, NGRAM):
        # A small step budget staggers the prefills, so prompt chunks meet verify steps.
        llm = make_llm(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                       speculative_config=spec, max_num_batched_tokens=24)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        scores = llm.score(prompts[:2], [prompts[2][:5], prompts[3][:4]])
        results.append(([o.outputs[0].token_ids for o in outs],
                        [[{t: lp.logprob for t, lp in pos.items()} if pos else None
                          for pos in o.prompt_logprobs or []] for o in outs], scores))
    (want_ids, want_lp, want_scores), (got_ids, got_lp, got_scores) = results
    assert got_ids == want_ids
    for o_got, o_want in zip(got_lp, want_lp, strict=True):
        for pos_got, pos_want in zip(o_got, o_want, strict=True):
            assert (pos_got is None) == (pos_want is None)
            if pos_want:
                assert pos_got.keys() == pos_want.keys()
                assert all(abs(pos_got[t] - pos_want[t]) < 1e-4 for t in pos_want)
    for s_got, s_want in zip(got_scores, want_scores, strict=True):
        assert torch.allclose(s_got, s_want, atol=1e-4)


def test_disable_by_batch_size_switches_between_overlap_and_drafts(tiny_path, make_llm,
                                                                    monkeypatch):
    """Above the size the steps overlap without drafts; as requests finish, drafts resume
    (each step then completed before the next). Outputs equal those without speculation."""
    from pagedserve.engine.core import EngineCore

    overlapped = []
    step = EngineCore.step

    def spy(self):
        out = step(self)
        overlapped.append(self._in_flight is not None)
        return out

    monkeypatch.setattr(EngineCore, "step", spy)
    prompts, params = _prompts(), _params()
    spec = dict(NGRAM, disable_by_batch_size=4)
    want, _ = _run(make_llm, tiny_path, prompts, params, None, async_scheduling=True)
    overlapped.clear()
    got, stats = _run(make_llm, tiny_path, prompts, params, spec, async_scheduling=True)
    _assert_same(got, want)
    assert any(overlapped) and not all(overlapped)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow),
                                    "draft_model"])  # the draft model's run both kinds of step
def test_triton_backend_in_the_interpreter(tmp_path, make_llm, method):
    """TRITON's kernels (Triton's interpreter on the CPU) over verify steps and a draft
    model's steps; its head sizes start at 64."""
    pytest.importorskip("triton")
    path = _tiny(tmp_path, 0, 128, 1, heads=2)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": path,
                                            "num_speculative_tokens": 2}
    n = 6 if method == "ngram" else 3  # (the n-gram lookups need more chances to match)
    prompts, params = _prompts()[:n], SamplingParams(temperature=0, max_tokens=16,
                                                     ignore_eos=True)
    want, _ = _run(make_llm, path, prompts, params, None, attention_backend="TRITON")
    got, stats = _run(make_llm, path, prompts, params, spec, attention_backend="TRITON")
    _assert_same(got, want)
    assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "FLEX_ATTENTION"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_cuda_greedy_equals_no_speculation(tmp_path, make_llm, backend, method):
    """On CUDA in float32 (backends that take it): verify steps beside decode steps replayed
    from graphs (TRITON's uniform verify steps from verify graphs too), and a draft model's
    engine eagerly."""
    path = _tiny(tmp_path, 0, 128, 2, heads=2)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": path,
                                            "num_speculative_tokens": 3}
    kwargs = dict(device="cuda", attention_backend=backend, engine_core_process=False)
    # Both engines live until the test ends; each one's budget is its own fraction.
    want, _ = _run(make_llm, path, _prompts(), _params(), None, gpu_memory_utilization=0.05,
                   **kwargs)
    got, stats = _run(make_llm, path, _prompts(), _params(), spec, gpu_memory_utilization=0.05,
                      **kwargs)
    _assert_same(got, want)
    # The draft model is the target: every draft is kept. This random model's greedy text
    # never repeats its prompts (H200, 2026-12-07): n-gram drafts are made and all rejected.
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0 or method == "ngram"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rejection_kernel_gives_the_torch_paths_tokens(tiny_path, tmp_path, make_llm,
                                                       monkeypatch, device):
    """Seeded random rows (filters, logprobs) beside greedy ones, n-gram drafts: the rejection
    sampler's Triton kernel (the interpreter on the CPU) keeps and samples the tokens its
    torch path does (a seeded request's draws are its own, whichever path runs)."""
    import os

    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel on the CPU needs TRITON_INTERPRET=1")
    # CUDA's TRITON kernels take heads of 64 and more: a model of the same vocabulary
    path = tiny_path if device == "cpu" else _tiny(tmp_path, 0, 128, 2, heads=2)
    prompts = _prompts()[:6]
    params = [SamplingParams(temperature=0.8, top_k=12, top_p=0.95, seed=s, max_tokens=20,
                             ignore_eos=True, logprobs=1) for s in range(4)]
    params += [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)] * 2
    kwargs = {} if device == "cpu" else dict(device="cuda", attention_backend="TRITON",
                                             engine_core_process=False)
    monkeypatch.setenv("PAGEDSERVE_REJECTION_SAMPLER", "torch")
    want, _ = _run(make_llm, path, prompts, params, NGRAM,
                   **kwargs, **({} if device == "cpu" else {"gpu_memory_utilization": 0.05}))
    monkeypatch.setenv("PAGEDSERVE_REJECTION_SAMPLER", "triton")
    got, stats = _run(make_llm, path, prompts, params, NGRAM,
                      **kwargs, **({} if device == "cpu" else {"gpu_memory_utilization": 0.05}))
    _assert_same(got, want)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
