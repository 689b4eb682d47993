"""Mamba-1 through the engine against transformers' MambaForCausalLM (float32, CPU, greedy):
token ids equal for prompts of different lengths, also with chunked prefill, with fewer state
slots than requests and with forced preemption; prompt logprobs within 1e-4 relative. State slot
accounting; the CLI on a Mamba directory; the engine on the Triton path, in the interpreter and
(the `gpu` test) on CUDA against transformers on the same GPU. The state ops themselves:
tests/attention/test_mamba_ops.py."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.kv_cache.specs import StateSpec, StateTensor
from pagedserve.scheduler import Request
from tests.utils.paged import hf_greedy

CUDA = torch.device("cuda")
NUM_NEW = 32
PROMPT_LENS = [3, 17, 8, 40, 1, 25, 12, 33]


def _config(tie: bool) -> transformers.MambaConfig:
    # max_position_embeddings: Mamba configs have none; the loader reads it for max_model_len.
    return transformers.MambaConfig(
        vocab_size=211, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, time_step_rank=8, use_bias=not tie, use_conv_bias=True,
        tie_word_embeddings=tie, max_position_embeddings=256)


def _save(config: transformers.MambaConfig, path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # wider weights than the default init: varied greedy tokens
        for name, p in model.named_parameters():
            if "embeddings" in name:
                p.normal_(0, 0.3)
            elif "out_proj.weight" in name:
                p.normal_(0, 3.0 / p.shape[-1] ** 0.5)
            elif name.endswith(("in_proj.weight", "x_proj.weight", "lm_head.weight")):
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def mamba_models(tmp_path_factory):
    models = {}
    for i, (name, tie) in enumerate([("untied", False), ("tied", True)]):
        path = tmp_path_factory.mktemp(f"mamba_{name}")
        hf = _save(_config(tie), path, seed=i)
        prompts = _prompts(211, seed=100 + i)
        expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
        models[name] = (str(path), hf, prompts, expected)
    return models


def _make(make_llm, path: str, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    return make_llm(model=path, dtype="float32", device="cpu", **kwargs)


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_slots_free(llm) -> None:
    kv = llm.engine.kv_cache
    assert kv.all_free(), "state slots leaked"
    assert kv.state_slots.num_free == kv.state_slots.num_slots


# ---- greedy tokens and logprobs against transformers --------------------------------------

@pytest.mark.parametrize("name,async_scheduling", [("untied", False), ("tied", False),
                                                   ("untied", True)])
def test_greedy_matches_transformers(mamba_models, make_llm, name, async_scheduling):
    path, _, prompts, expected = mamba_models[name]
    llm = _make(make_llm, path, async_scheduling=async_scheduling)
    assert llm.engine.runner.backend.get_name() == "MAMBA"
    assert _greedy(llm, prompts) == expected
    _assert_slots_free(llm)


def test_chunked_prefill_matches_transformers(mamba_models, make_llm):
    path, _, prompts, expected = mamba_models["untied"]
    llm = _make(make_llm, path, max_num_batched_tokens=16)
    assert max(PROMPT_LENS) > 16  # long prompts continue from a saved state chunk by chunk
    assert _greedy(llm, prompts) == expected
    _assert_slots_free(llm)


def test_few_state_slots_matches_transformers(mamba_models, make_llm):
    """A budget of 3 slots for 8 prompts: requests wait for a slot to free up."""
    path, _, prompts, expected = mamba_models["untied"]
    slot_bytes = 2 * _mamba_spec(torch.float32).slot_size_bytes  # 2 layers
    budget = 3 * slot_bytes + 100
    llm = _make(make_llm, path, kv_cache_memory=budget, max_num_batched_tokens=24)
    assert llm.engine.kv_cache.state_slots.num_slots == 3
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got, most_running = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 3
    assert [got[str(i)] for i in range(len(prompts))] == expected
    _assert_slots_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forced_preemption_matches_transformers(mamba_models, make_llm, async_scheduling):
    """A running request's slot never runs out, so a pure Mamba model is preempted only by
    force: every few steps the newest running request is preempted (recompute), as the
    scheduler does when blocks run out. Its slot is freed and it restarts from zero state;
    with async scheduling its step may still be in flight then."""
    path, _, prompts, expected = mamba_models["untied"]
    llm = _make(make_llm, path, max_num_seqs=4, max_num_batched_tokens=20,
                async_scheduling=async_scheduling)
    engine, sched = llm.engine, llm.engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        step += 1
        if step % 7 == 0 and sched.running:
            free_before = engine.kv_cache.state_slots.num_free
            sched._preempt(sched.running.pop())
            assert engine.kv_cache.state_slots.num_free == free_before + 1
    assert sched.num_preemptions > 0
    assert [got[str(i)] for i in range(len(prompts))] == expected
    _assert_slots_free(llm)


def test_prompt_logprobs_match_transformers(mamba_models, make_llm):
    path, hf, prompts, _ = mamba_models["untied"]
    llm = _make(make_llm, path, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = hf_logprobs(hf, prompt)
        assert len(output.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(output.prompt_logprobs[1:], start=1):
            assert prompt[pos] in entry
            for token_id, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[pos - 1, token_id].item(), rel=1e-4,
                                                   abs=1e-5)
            assert set(ref[pos - 1].topk(5).indices.tolist()) <= set(entry)
    _assert_slots_free(llm)


def test_teacher_forced_scoring_matches_transformers(mamba_models, make_llm):
    path, hf, prompts, _ = mamba_models["tied"]
    g = torch.Generator().manual_seed(7)
    continuations = [torch.randint(3, 211, (10,), generator=g).tolist() for _ in prompts]
    llm = _make(make_llm, path, max_num_batched_tokens=16)
    for mode in ("decode", "prefill"):
        scores = llm.score(prompts, continuations, mode=mode)
        for prompt, cont, got in zip(prompts, continuations, scores, strict=True):
            ref = hf_logprobs(hf, prompt + cont)[len(prompt) - 1:-1]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    _assert_slots_free(llm)


def test_prefix_caching_off_and_aborts_free_slots(mamba_models, make_llm):
    path, _, prompts, expected = mamba_models["untied"]
    llm = _make(make_llm, path, enable_prefix_caching=True)
    assert not llm.engine.kv_cache.enable_prefix_caching
    # The same prompt twice: with per-block prefix hits it would skip the state it needs.
    assert _greedy(llm, [prompts[3], prompts[3]]) == [expected[3], expected[3]]
    engine = llm.engine
    engine.add_request("a", prompts[7], SamplingParams(max_tokens=NUM_NEW))
    engine.step()
    slots = engine.kv_cache.state_slots
    assert slots.num_free == slots.num_slots - 1
    engine.abort_request("a")
    _assert_slots_free(llm)


def test_cli_generate_on_mamba_directory(mamba_models, tmp_path, capsys):
    from pagedserve.cli import main

    path, _, prompts, expected = mamba_models["untied"]
    lines = [{"prompt": p, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True}
             for p in prompts[:3]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rc = main(["generate", "--model", path, "--input", str(tmp_path / "in.jsonl"), "--output",
               str(tmp_path / "out.jsonl"), "--dtype", "float32", "--device", "cpu",
               "--kv-cache-memory", "16MiB"])
    assert rc == 0
    records = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in records] == expected[:3]


# ---- slots, specs, backend ----------------------------------------------------------------

def _mamba_spec(dtype: torch.dtype) -> StateSpec:
    return StateSpec("MAMBA", (StateTensor("conv", (128, 3), dtype),
                               StateTensor("ssm", (128, 8), torch.float32)))


def test_state_slot_sizing(mamba_models, make_llm):
    spec = _mamba_spec(torch.bfloat16)
    assert spec.slot_size_bytes == 128 * 3 * 2 + 128 * 8 * 4
    path = mamba_models["untied"][0]
    llm = _make(make_llm, path, max_num_seqs=5)
    runner = llm.engine.runner
    assert runner.state_specs[0] == _mamba_spec(torch.float32)  # the layer's own spec
    assert llm.engine.kv_cache.num_blocks == 0  # no attention layers: slots only
    assert llm.engine.kv_cache.state_slots.num_slots == 5  # one per running request
    conv, ssm = runner.state_caches[0]["conv"], runner.state_caches[0]["ssm"]
    assert conv.shape == (5, 128, 3) and ssm.shape == (5, 128, 8) and ssm.dtype == torch.float32
    with pytest.raises(ValueError, match="state slot"):
        _make(make_llm, path, kv_cache_memory=1000)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _make(make_llm, path, kv_cache_dtype="fp8")


def test_slot_manager_one_slot_per_request():
    kv = KVCacheManager(0, 16, enable_prefix_caching=True, num_state_slots=2)
    assert not kv.enable_prefix_caching  # a state is not kept per block
    reqs = [Request(str(i), list(range(1, 41)), SamplingParams()) for i in range(3)]
    assert kv.allocate_slots(reqs[0], 40) == ([],)  # a slot, no blocks
    reqs[0].num_computed_tokens = 40
    assert kv.allocate_slots(reqs[0], 20) == ([],)  # growing takes no second slot
    assert kv.allocate_slots(reqs[1], 40) == ([],)
    assert sorted([reqs[0].state_slot, reqs[1].state_slot]) == [0, 1]
    assert not kv.can_allocate(reqs[2], 40)
    assert kv.allocate_slots(reqs[2], 40) is None  # admission waits for a slot
    freed = reqs[0].state_slot
    kv.free(reqs[0])
    assert reqs[0].state_slot == -1
    assert kv.allocate_slots(reqs[2], 40) == ([],) and reqs[2].state_slot == freed
    assert kv.get_computed_blocks(reqs[2]) == ((), 0)
    kv.free(reqs[1])
    kv.free(reqs[2])
    assert kv.all_free()


def test_hybrid_manager_takes_blocks_and_a_slot_together():
    """With attention and state layers a request is admitted only when both its blocks and a
    slot are free; a failed allocation takes neither."""
    kv = KVCacheManager(4, 16, num_state_slots=2)
    a, b, c = (Request(str(i), list(range(1, 41)), SamplingParams()) for i in range(3))
    assert len(kv.allocate_slots(a, 40)[0]) == 3 and a.state_slot >= 0
    assert kv.allocate_slots(b, 40) is None  # one block left: no slot taken either
    assert b.state_slot == -1 and kv.state_slots.num_free == 1
    assert len(kv.allocate_slots(b, 10)[0]) == 1 and b.state_slot >= 0
    assert kv.allocate_slots(c, 1) is None  # no slot left
    kv.free(a)
    kv.free(b)
    assert kv.all_free()


def test_mamba_backend_registered_but_not_for_attention():
    from pagedserve.attention import AttentionLayerConfig, backend_status, get_backend_cls

    ok, _ = backend_status()["MAMBA"]
    assert ok
    layer = AttentionLayerConfig(4, 2, 64, torch.float32)
    assert get_backend_cls("MAMBA").validate_configuration(layer, 16, torch.device("cpu"))


# ---- the Triton path through the engine ---------------------------------------------------

def test_engine_on_triton_path_in_interpreter(mamba_models, make_llm, monkeypatch):
    """The MAMBA impl's Triton dispatch (prefill/decode split, mixed chunked batches) through the
    engine, its kernels run by the interpreter on the CPU: a few tokens of three prompts."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from pagedserve.engine import model_runner

    monkeypatch.setattr(model_runner, "state_kernels_enabled", lambda device: True)
    path, _, prompts, expected = mamba_models["untied"]
    llm = _make(make_llm, path, max_num_batched_tokens=8)
    assert llm.engine.runner.state_layers[0].impl.use_triton
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # 17 tokens: chunks of 8 and 8 continue the state, the last token runs as a decode; a
    # one-token prompt is a decode without an initial state.
    picked = [1, 4]
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in picked], params,
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected[i][:3] for i in picked]
    _assert_slots_free(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 16}])
def test_engine_greedy_matches_transformers_on_gpu(tmp_path, make_llm, variant):
    """float32 on the GPU, the Triton path, against transformers' Mamba on the same GPU."""
    from pagedserve.attention.ops import state_kernels_enabled

    hf = _save(_config(tie=False), tmp_path, seed=0).to(CUDA)
    prompts = _prompts(211, seed=100)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in prompts]  # on the GPU
    assert expected[0] == hf_greedy(hf.cpu(), prompts[0], NUM_NEW)  # the GPU reference is sane
    llm = make_llm(model=str(tmp_path), dtype="float32", device="cuda", **variant)
    assert state_kernels_enabled(CUDA)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
