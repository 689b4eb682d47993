"""GPU: LoRA with CUDA graphs on. Decode steps that mix the base model and three PEFT adapters
replay their graphs (the LoRA kernels over every block a step of the graph's rows can have,
read from fixed buffers, padding rows in none) and give each PeftModel's greedy tokens and
logprobs (float32, within 1e-3 of the CPU reference); an eager run agrees too."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.lora import LoRARequest
from tests.lora.adapters import ADAPTERS, save_adapter, save_base

pytestmark = pytest.mark.gpu

NEW = 8
NAMES = [None, "r8", "r16", "r32", "r16"]  # five requests: a decode graph of size 8 pads 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_graphs")
    base = save_base(root / "base", hidden_size=256)  # heads of 64 for TRITON on CUDA
    refs = {name: save_adapter(base, root / name, rank, alpha, rslora, seed=i + 1)
            for i, (name, (rank, alpha, rslora)) in enumerate(ADAPTERS.items())}
    return root, base, refs


def _reference(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1:].float()
    return out[0, len(prompt):].tolist(), torch.log_softmax(logits, -1)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_lora_decode_graphs_match_peft(saved, enforce_eager):
    from pagedserve import LLM

    root, base, refs = saved
    requests = {name: LoRARequest(name, i + 1, str(root / name))
                for i, name in enumerate(ADAPTERS)}
    llm = LLM(model=str(root / "base"), dtype="float32", device="cuda",
              attention_backend="TRITON", enable_lora=True, max_loras=3, max_lora_rank=32,
              max_num_seqs=8, num_gpu_blocks_override=64, enforce_eager=enforce_eager)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (6, 19, 11, 23, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in NAMES])
    graphs = llm.engine.runner.decode_graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.replays[8] >= NEW - 1, graphs and graphs.replays
    for name, prompt, out in zip(NAMES, prompts, outs, strict=True):
        tokens, logprobs = _reference(base if name is None else refs[name], prompt)
        assert out.outputs[0].token_ids == tokens, name
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens,
                                                             strict=True)])
        torch.testing.assert_close(got, logprobs[torch.arange(NEW), tokens], rtol=1e-3,
                                   atol=1e-3)
    llm.engine.shutdown()
