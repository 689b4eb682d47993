"""LoRA through the engine (CPU, float32): one generate call mixing the base and three PEFT
adapters gives each PeftModel's greedy tokens and logprobs; adapters from --lora-modules and
added later; no prefix-cache block shared across adapters; the per-step adapter cap."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.lora import LoRARequest
from tests.lora.adapters import ADAPTERS, save_adapter, save_base

NEW = 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = save_base(root / "base")
    refs = {name: save_adapter(base, root / name, rank, alpha, rslora, seed=i + 1)
            for i, (name, (rank, alpha, rslora)) in enumerate(ADAPTERS.items())}
    return root, base, refs


def _engine(make_llm, root, **kwargs):
    kwargs = {"max_lora_rank": 32, **kwargs}
    return make_llm(model=str(root / "base"), dtype="float32", device="cpu", enable_lora=True,
                    enable_prefix_caching=True, **kwargs)


def _hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1:].float()
    return out[0, len(prompt):].tolist(), torch.log_softmax(logits, -1)


def test_one_batch_mixes_base_and_adapters(make_llm, saved):
    root, base, refs = saved
    # r8 from --lora-modules (id 1), the others named first by requests (ids 2, 3)
    llm = _engine(make_llm, root, lora_modules=[f"r8={root / 'r8'}"], max_loras=3)
    requests = {"r8": LoRARequest("r8", 1, str(root / "r8")),
                "r16": LoRARequest("r16", 2, str(root / "r16")),
                "r32": LoRARequest("r32", 3, str(root / "r32"))}
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (6, 19, 11, 23)]
    names = [None, "r8", "r16", "r32"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in names])
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        ref = base if name is None else refs[name]
        tokens, logprobs = _hf_greedy(ref, prompt)
        assert out.outputs[0].token_ids == tokens, name
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens,
                                                             strict=True)])
        want = logprobs[torch.arange(NEW), tokens]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_adapters_never_share_prefix_blocks_and_take_turns(make_llm, saved):
    root, base, refs = saved
    llm = _engine(make_llm, root, max_loras=1, block_size=16)
    prompt = list(range(3, 3 + 40))  # two full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    r8, r16 = LoRARequest("r8", 1, str(root / "r8")), LoRARequest("r16", 2, str(root / "r16"))
    llm.generate([prompt], params, use_tqdm=False, lora_request=r8)
    hits = llm.engine.call_utility("stats").prefix_cache_hits
    # the same prompt through another adapter and the base: no block found in the cache
    outs = llm.generate([prompt, prompt], params, use_tqdm=False, lora_request=[r16, None])
    assert llm.engine.call_utility("stats").prefix_cache_hits == hits
    # ... through the same adapter again: its two full blocks are
    llm.generate([prompt], params, use_tqdm=False, lora_request=r8)
    assert llm.engine.call_utility("stats").prefix_cache_hits == hits + 32
    # two adapters with one slot: served in turn, each as its PeftModel
    for name, out in zip(("r16", None), outs, strict=True):
        ref = base if name is None else refs[name]
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want


def test_lora_requests_are_checked(make_llm, saved, tmp_path):
    root, *_ = saved
    llm = _engine(make_llm, root, max_lora_rank=16)
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="rank 32, over --max-lora-rank 16"):
        llm.generate([[5, 6]], params, use_tqdm=False,
                     lora_request=LoRARequest("r32", 3, str(root / "r32")))
    with pytest.raises(FileNotFoundError, match="no directory"):
        llm.generate([[5, 6]], params, use_tqdm=False,
                     lora_request=LoRARequest("gone", 4, str(tmp_path / "gone")))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([[5, 6]], params, use_tqdm=False, lora_request=[None, None])


def test_more_adapters_than_slots_are_scheduled_in_turn(make_llm, saved):
    """Three adapters and the base in one call with --max-loras 1: each step holds at most one
    adapter (the runner refuses more), every request ends, each with its PeftModel's tokens."""
    root, base, refs = saved
    llm = _engine(make_llm, root, max_loras=1)
    core = llm.engine.core
    seen = []
    schedule = core.scheduler.schedule

    def spy():
        batch = schedule()
        seen.append({r.lora_int_id for r in batch.requests} - {0})
        return batch

    core.scheduler.schedule = spy
    names = ["r8", None, "r16", "r32"]
    reqs = [LoRARequest(n, i + 1, str(root / n)) if n else None for i, n in enumerate(names)]
    prompt = [7, 30, 12, 99, 4]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * 4, params, use_tqdm=False, lora_request=reqs)
    assert max(len(s) for s in seen) == 1 and set().union(*seen) == {1, 3, 4}
    for name, out in zip(names, outs, strict=True):
        ref = base if name is None else refs[name]
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want, name
