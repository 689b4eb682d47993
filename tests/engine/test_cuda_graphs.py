"""GPU: decode steps replayed from CUDA graphs give the same greedy tokens as eager steps, for
every graph-capable backend available (TRITON, FLASHINFER, FLASH_ATTN with a paged kernel), on a
small random bf16 model; three running requests pad to the captured size 4."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT_LENS = (7, 30, 19)
NEW_TOKENS = 24


def _greedy(backend: str, enforce_eager: bool) -> tuple[list[list[int]], dict[int, int], bool]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench import random_prompts

    llm = LLM(model="random:tiny", dtype="bfloat16", device="cuda", attention_backend=backend,
              max_num_seqs=8, num_gpu_blocks_override=64, enforce_eager=enforce_eager)
    prompts = [random_prompts(1, n, 512, seed=n)[0] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    graphs = llm.engine.runner.decode_graphs
    captured = graphs is not None and bool(graphs.graphs)
    replays = dict(graphs.replays) if graphs is not None else {}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays, captured


@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER", "FLASH_ATTN"])
def test_cuda_graph_decode_matches_eager(backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedserve.attention.registry import get_backend_cls

    ok, why = get_backend_cls(backend).is_available()
    if not ok:
        pytest.skip(f"{backend}: {why}")
    if not get_backend_cls(backend).can_capture_cuda_graphs(16):
        pytest.skip(f"{backend}: {why}: runs eagerly")
    eager, replays, captured = _greedy(backend, enforce_eager=True)
    assert not captured and not replays
    graphed, replays, captured = _greedy(backend, enforce_eager=False)
    assert captured, "graph capture failed (see the warning in the log); the engine fell back"
    assert replays.get(4, 0) > 0, f"3 decodes should replay the size-4 graph: {replays}"
    assert graphed == eager
