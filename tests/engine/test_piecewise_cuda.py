"""GPU: prefill and mixed steps replayed from piecewise CUDA graphs (engine/piecewise_graphs.py)
give the greedy tokens of an engine without graphs, on small random bf16 models (a dense Llama
and a Qwen3-MoE, heads of 64); every captured size has one piece per attention layer and one
more, and the steps replay them."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine.test_cuda_graphs import assert_same_greedy

pytestmark = pytest.mark.gpu

PROMPT_LENS = (7, 30, 150, 300, 61)  # 300: chunked at 256 tokens a step
NEW_TOKENS = 16
# A near-tie's logprob gap after bf16 rounding; a Mixture of Experts may flip an expert on a
# token-count-dependent rounding, which moves a logit further.
TIE = {"llama": 0.05, "qwen3_moe": 0.25}
QWEN3_MOE_TINY = dict(base="qwen3-30b-a3b", vocab_size=512, hidden_size=256,
                      intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)


def _model(tmp_path, family: str) -> str:
    if family == "llama":
        return "random:tiny"
    import yaml

    spec = tmp_path / "qwen3_moe_tiny.yaml"
    spec.write_text(yaml.safe_dump(QWEN3_MOE_TINY))
    return f"random:{spec}"


def _greedy(model: str, piecewise: bool) -> tuple[list[list[int]], list, dict, dict, int]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench import random_prompts

    llm = LLM(model=model, dtype="bfloat16", device="cuda", max_num_seqs=8,
              max_num_batched_tokens=256, gpu_memory_utilization=0.05, seed=0,
              enforce_eager=not piecewise, piecewise_cuda_graphs=piecewise,
              enable_prefix_caching=True)
    prompts = [random_prompts(1, n, 512, seed=n)[0] for n in PROMPT_LENS]
    prompts.append(prompts[3][:200] + prompts[0])  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=None if piecewise else 2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.engine.runner
    graphs = runner.piecewise
    pieces = graphs.num_pieces if graphs is not None else {}
    replays = dict(graphs.replays) if graphs is not None else {}
    layers = len(runner.attn_layers)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    del llm, runner, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logprobs, pieces, replays, layers


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_piecewise_graphs_match_eager(tmp_path, family: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model(tmp_path, family)
    eager, logprobs, pieces, replays, _ = _greedy(model, piecewise=False)
    assert not pieces and not replays
    graphed, _, pieces, replays, layers = _greedy(model, piecewise=True)
    assert pieces, "piecewise capture failed (see the warning in the log); the engine fell back"
    assert sorted(pieces) == [64, 128, 192, 256]
    assert set(pieces.values()) == {layers + 1}
    assert replays.get(256, 0) > 0 and sum(replays.values()) > 1, replays
    assert_same_greedy(graphed, eager, logprobs, TIE[family])

def test_non_owning_view_on_cuda() -> None:
    """The recorded tensors' views: the same device memory, not kept by the allocator."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedserve.engine.piecewise_graphs import non_owning_view

    base = torch.randn(6, 10, device="cuda", dtype=torch.bfloat16)
    strided = base[1:, 2:8]
    view = non_owning_view(strided)
    assert view.data_ptr() == strided.data_ptr() and view.stride() == strided.stride()
    torch.testing.assert_close(view, strided, rtol=0, atol=0)
    view.fill_(3.0)
    assert bool((base[1:, 2:8] == 3.0).all())
    before = torch.cuda.memory_allocated()
    del base, strided
    assert torch.cuda.memory_allocated() < before  # the view did not keep the block
