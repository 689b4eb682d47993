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
# A near-tie's logprob gap: two bf16 roundings of a logit of a few units; float32's, far less.
BF16_TIE, FLOAT32_TIE = 0.05, 1e-4


def _greedy(backend: str, enforce_eager: bool) -> tuple[list[list[int]], dict[int, int], bool,
                                                        list]:
    from pagedserve import LLM
    from pagedserve.bench import random_prompts

    llm = LLM(model="random:tiny", dtype="bfloat16", device="cuda", attention_backend=backend,
              max_num_seqs=8, num_gpu_blocks_override=64, enforce_eager=enforce_eager)
    prompts = [random_prompts(1, n, 512, seed=n)[0] for n in PROMPT_LENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(enforce_eager),
                        use_tqdm=False)
    graphs = llm.engine.runner.decode_graphs
    # Every size with its head's graph too (greedy steps sample there).
    captured = (graphs is not None and bool(graphs.graphs)
                and graphs.head is not None
                and graphs.head.greedy.keys() == graphs.head.logits.keys() == graphs.graphs.keys())
    replays = dict(graphs.replays) if graphs is not None else {}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays, captured, logprobs


def _params(eager: bool):
    """Greedy; the eager run also keeps each position's top two logprobs (a graphed run asks
    for none: its greedy steps then sample in the head's graph)."""
    from pagedserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                          logprobs=2 if eager else None)


def assert_same_greedy(graphed: list[list[int]], eager: list[list[int]], logprobs: list,
                        tol: float) -> None:
    """Graphed greedy tokens equal the eager ones, but for a near-tie: the head's graph
    projects the padded batch, whose GEMM may round differently from the eager step's. Where a
    sequence first parts from the eager one, its token must be the eager step's runner-up
    within `tol` of the best logprob; it is compared no further."""
    for i, (g, e, lps) in enumerate(zip(graphed, eager, logprobs, strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        if first is None:
            continue
        top = lps[first]
        gap = top[e[first]].logprob - top[g[first]].logprob if g[first] in top else float("inf")
        assert gap <= tol, (f"request {i}: graphed tokens differ from eager from position "
                            f"{first}: {g[first:]} vs {e[first:]} (logprob gap {gap:.3g})")


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
    eager, replays, captured, logprobs = _greedy(backend, enforce_eager=True)
    assert not captured and not replays
    graphed, replays, captured, _ = _greedy(backend, enforce_eager=False)
    assert captured, "graph capture failed (see the warning in the log); the engine fell back"
    assert replays.get(4, 0) > 0, f"3 decodes should replay the size-4 graph: {replays}"
    assert_same_greedy(graphed, eager, logprobs, BF16_TIE)


# A DeepSeek-V2-shaped tiny model: MLA with no low-rank query (16 heads would do as well; 4 keep
# it small), DeepSeek's latent widths 512 + 64 (FLASHINFER_MLA's kernels need them), nope and
# v 128, YaRN; layer 0 dense, then 8 experts top-2 with a shared one.
DEEPSEEK_V2_TINY = dict(base="deepseek-v2-lite", vocab_size=512, hidden_size=256,
                        intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2)


def _mla_greedy(tmp_path, backend: str, dtype: str, enforce_eager: bool
                ) -> tuple[list[list[int]], dict[int, int], bool, list]:
    import yaml

    from pagedserve import LLM
    from pagedserve.bench import random_prompts

    spec = tmp_path / "deepseek_v2_tiny.yaml"
    spec.write_text(yaml.safe_dump(DEEPSEEK_V2_TINY))
    llm = LLM(model=f"random:{spec}", dtype=dtype, device="cuda", attention_backend=backend,
              max_num_seqs=8, num_gpu_blocks_override=64, enforce_eager=enforce_eager, seed=0)
    assert llm.engine.runner.backend.get_name() == backend
    prompts = [random_prompts(1, n, 512, seed=n)[0] for n in PROMPT_LENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(enforce_eager),
                        use_tqdm=False)
    graphs = llm.engine.runner.decode_graphs
    captured = graphs is not None and bool(graphs.graphs)
    replays = dict(graphs.replays) if graphs is not None else {}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays, captured, logprobs


@pytest.mark.parametrize("backend,dtype", [("TRITON_MLA", "float32"),
                                           ("FLASHINFER_MLA", "bfloat16")])
def test_mla_cuda_graph_decode_matches_eager(tmp_path, backend: str, dtype: str) -> None:
    """MLA decode steps through engine/cuda_graphs.py: greedy tokens of a DeepSeek-V2-shaped
    tiny model with graphs equal those without (TRITON_MLA in float32; FLASHINFER_MLA, whose
    kernels take no float32, in bf16, as the GQA backends above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedserve.attention.registry import get_backend_cls

    ok, why = get_backend_cls(backend).is_available()
    if not ok:
        pytest.skip(f"{backend}: {why}")
    eager, replays, captured, logprobs = _mla_greedy(tmp_path, backend, dtype,
                                                     enforce_eager=True)
    assert not captured and not replays
    graphed, replays, captured, _ = _mla_greedy(tmp_path, backend, dtype, enforce_eager=False)
    assert captured, "graph capture failed (see the warning in the log); the engine fell back"
    assert replays.get(4, 0) > 0, f"3 decodes should replay the size-4 graph: {replays}"
    assert_same_greedy(graphed, eager, logprobs,
                        FLOAT32_TIE if dtype == "float32" else BF16_TIE)
