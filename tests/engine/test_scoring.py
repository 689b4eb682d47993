"""LLM.score(mode="prefill"): teacher-forced scoring through a prefill of prompt + continuation
(float32, CPU) against decode-mode scoring and transformers' own forward; also with chunked
prefill, preemption mid-prefill, prefix-cache hits bypassed and bad input."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve import SamplingParams

PROMPT_LENS = [3, 17, 8, 40, 1]
CONT_LENS = [12, 5, 20, 9, 1]
VOCAB = 211


def _configs() -> dict[str, transformers.PretrainedConfig]:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, tie_word_embeddings=False)
    return {
        "llama_gqa": transformers.LlamaConfig(**common, rope_theta=10000.0),
        "mistral_window": transformers.MistralConfig(**common, sliding_window=24),
    }


@torch.no_grad()
def _hf_scores(hf: torch.nn.Module, prompt: list[int], cont: list[int]) -> torch.Tensor:
    logits = hf(torch.tensor([prompt + cont])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (path, transformers model, prompts, continuations, transformers' scores)."""
    models = {}
    for i, (name, config) in enumerate(_configs().items()):
        path = tmp_path_factory.mktemp(name)
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        hf.eval()
        hf.save_pretrained(path)
        g = torch.Generator().manual_seed(200 + i)
        prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
        conts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in CONT_LENS]
        ref = [_hf_scores(hf, p, c) for p, c in zip(prompts, conts, strict=True)]
        models[name] = (str(path), hf, prompts, conts, ref)
    return models


def _llm(make_llm, path: str, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    return make_llm(model=path, dtype="float32", device="cpu", **kwargs)


def _assert_scores_close(got: list[torch.Tensor], ref: list[torch.Tensor],
                         atol: float = 1e-4) -> None:
    assert [g.shape for g in got] == [r.shape for r in ref]
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        torch.testing.assert_close(g, r, rtol=1e-4, atol=atol)
        assert torch.equal(g.argmax(-1), r.argmax(-1))


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
def test_prefill_scoring_matches_decode_and_transformers(tiny, make_llm, name):
    path, _, prompts, conts, ref = tiny[name]
    llm = _llm(make_llm, path)
    prefill = llm.score(prompts, conts, mode="prefill")
    decode = llm.score(prompts, conts, mode="decode")
    assert [p.shape for p in prefill] == [(n, VOCAB) for n in CONT_LENS]
    _assert_scores_close(prefill, decode)
    _assert_scores_close(prefill, ref)
    _assert_scores_close(decode, ref)
    default = llm.score(prompts[:1], conts[:1])  # decode stays the default mode
    _assert_scores_close(default, decode[:1])


def test_prefill_scoring_chunked_prefill(tiny, make_llm):
    path, _, prompts, conts, ref = tiny["llama_gqa"]
    llm = _llm(make_llm, path, max_num_batched_tokens=16)
    got = llm.score(prompts, conts, mode="prefill")
    _assert_scores_close(got, ref)


def test_prefill_scoring_bypasses_prefix_cache(tiny, make_llm):
    """A prefix-cache hit would skip positions whose logits are wanted: scoring computes the
    whole sequence even when its blocks are cached."""
    path, _, prompts, conts, ref = tiny["llama_gqa"]
    llm = _llm(make_llm, path, block_size=4)
    seqs = [{"prompt_token_ids": p + c} for p, c in zip(prompts, conts, strict=True)]
    llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    stats = llm.engine.stats()
    got = llm.score(prompts, conts, mode="prefill")
    after = llm.engine.stats()
    assert after.prefix_cache_hits == stats.prefix_cache_hits
    _assert_scores_close(got, ref)
    # The same sequences generated again do hit the cache (so it was there to be bypassed).
    llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits > after.prefix_cache_hits


def test_prefill_scoring_preempted_mid_prefill(tiny, make_llm):
    """Scoring requests share a tiny KV pool with two growing generations: one is preempted
    after its first chunks were scored, recomputes from position 0 and resends positions
    already received, which must be neither duplicated nor lost."""
    path, hf, _, _, _ = tiny["llama_gqa"]
    llm = _llm(make_llm, path, num_gpu_blocks_override=24, block_size=4,
               max_num_batched_tokens=16)
    engine = llm.engine
    sent: dict[str, list[tuple[int, int]]] = {}
    collect = engine.runner.collect

    def spy(pending):
        out = collect(pending)
        for request_id, (first, rows) in out.score_logprobs.items():
            sent.setdefault(request_id, []).append((first, first + rows.shape[0]))
        return out

    engine.runner.collect = spy
    g = torch.Generator().manual_seed(5)
    ids = []
    for i in range(2):
        prompt = torch.randint(3, VOCAB, (36,), generator=g).tolist()
        engine.add_request(f"gen{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                           stream=False)
        ids.append(f"gen{i}")
    prompts = [torch.randint(3, VOCAB, (2,), generator=g).tolist() for _ in range(3)]
    conts = [torch.randint(3, VOCAB, (30,), generator=g).tolist() for _ in range(3)]
    for i, (p, c) in enumerate(zip(prompts, conts, strict=True)):
        engine.add_scoring_request(f"score{i}", p, c, mode="prefill")
        ids.append(f"score{i}")
    outputs = llm.wait_for(ids, use_tqdm=False)[2:]
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    resent = [rid for rid, spans in sent.items()
              if any(spans[k][0] < max(end for _, end in spans[:k]) for k in range(1, len(spans)))]
    assert resent, f"no scoring request recomputed scored positions: {sent}"
    expected = [_hf_scores(hf, p, c) for p, c in zip(prompts, conts, strict=True)]
    _assert_scores_close([o.outputs[0].forced_logprobs for o in outputs], expected)


def test_scoring_bad_input(tiny, make_llm):
    path, _, prompts, conts, _ = tiny["llama_gqa"]
    llm = _llm(make_llm, path, max_model_len=64)
    for mode in ("decode", "prefill"):
        # 30 + 34 = 64 tokens: no room in a 64-token context (63 is the most that fits).
        with pytest.raises(ValueError, match="max_model_len=64"):
            llm.score([prompts[3][:30]], [list(range(3, 37))], mode=mode)
        # A good request first, then a bad one: the good one is aborted, nothing leaks.
        with pytest.raises(ValueError, match="context length"):
            llm.score([prompts[0], prompts[3][:30]], [conts[0], list(range(3, 37))], mode=mode)
        with pytest.raises(ValueError, match="continuation 1 is empty"):
            llm.score(prompts[:2], [conts[0], []], mode=mode)
        with pytest.raises(ValueError, match="prompt 0 is empty"):
            llm.score([[]], [conts[0]], mode=mode)
        # Exactly at the limit works.
        got = llm.score([prompts[3][:30]], [list(range(3, 36))], mode=mode)
        assert got[0].shape == (33, VOCAB)
    engine = llm.engine
    for mode in ("decode", "prefill"):
        with pytest.raises(ValueError, match="continuation to score is empty"):
            engine.add_scoring_request("x", [5, 6, 7], [], mode=mode)
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.add_scoring_request("x", [], [8], mode=mode)
        with pytest.raises(ValueError, match="out of range"):
            engine.add_scoring_request("x", [5, 6, 7], [VOCAB], mode=mode)
    with pytest.raises(ValueError, match="'prefil'"):
        engine.add_scoring_request("x", [5, 6, 7], [8], mode="prefil")
    assert not engine.has_unfinished_requests()


def test_score_unknown_mode(tiny, make_llm):
    path, _, prompts, conts, _ = tiny["llama_gqa"]
    llm = _llm(make_llm, path)
    with pytest.raises(ValueError, match="'prefil'"):
        llm.score(prompts, conts, mode="prefil")
