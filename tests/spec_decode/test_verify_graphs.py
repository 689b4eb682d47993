"""Verify steps through CUDA graphs' padding (engine/verify_graphs.py): a uniform step of 1+K
tokens a request padded to a captured size gives the real rows of the unpadded eager forward
(CPU, and TRITON in Triton's interpreter); speculation with the padded verify path on equals
the plain engine and transformers token for token; on CUDA the verify graphs are captured,
replayed and give the eager engine's tokens."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.engine.cuda_graphs import DecodeGraphs
from tests.spec_decode.test_engine import NGRAM, _assert_same, _prompts, _run, _tiny

K = NGRAM["num_speculative_tokens"]
Q = 1 + K  # tokens a request in a uniform verify step


@pytest.fixture(scope="module")
def tiny64_path(tmp_path_factory):
    """Head size 64 (TRITON's smallest), one layer."""
    return _tiny(tmp_path_factory.mktemp("tiny_verify"), 0, 128, 1, heads=2)


def _graphs(runner) -> DecodeGraphs:
    """Decode graphs of sizes 1, 2, 4, 8 whose verify graphs (q = 1+K) pad to 2, 4 or 8
    requests (at most the engine's max_num_seqs), run eagerly on the padded metadata (capture
    off), as the runner's graph path runs them."""
    inputs = runner.graph_inputs()
    sizes = [s for s in (1, 2, 4, 8) if s <= runner.max_num_reqs]
    verify = DecodeGraphs(inputs, sizes[1:], capture=False, query_len=Q)
    return DecodeGraphs(inputs, sizes, capture=False, verify=verify)


@pytest.mark.parametrize("backend", ["CPU", "TRITON"])
def test_padded_verify_step_equals_the_unpadded_forward(tiny64_path, make_llm, backend):
    """Three requests of 1+K new tokens over contexts of 5, 37 and 18 tokens (request 0's
    pages start at block 0, the page padding requests read: a stray write there would show),
    padded to 8 requests: their hidden states, logits and greedy tokens equal those of the
    same step run eagerly without padding."""
    if backend == "TRITON":
        pytest.importorskip("triton")
    llm = make_llm(model=tiny64_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                   attention_backend=backend, speculative_config=NGRAM)
    runner = llm.engine.runner
    graphs = _graphs(runner)
    with torch.inference_mode():
        graphs.run(graphs.dummy_decode(3))  # a decode step first: the head's rows are its
        assert graphs.greedy_tokens(3) is not None
    commons = graphs.verify.dummy_decode(3, [5, 37, 18])
    assert commons[0].num_actual_tokens == 3 * Q and commons[0].num_prefills == 3
    ids = torch.randint(0, runner.vocab_size, (3 * Q,), generator=torch.Generator().manual_seed(0))
    runner.input_ids.device[:3 * Q].copy_(ids)
    eager_md = {key: b.build(commons[0]) for key, b in runner.builders.items()}
    with torch.inference_mode():
        eager = runner.run_model(eager_md, 3 * Q).clone()
        padded = graphs.run(commons)  # handed to the verify graphs
        eager_logits = runner.model.compute_logits(eager)
        padded_logits = runner.model.compute_logits(padded)
    assert graphs.replays == {4: 1} and graphs.verify.replays == {4: 1}  # 3 requests pad to 4
    # A verify step samples from its logits rows (the rejection sampler), never from the
    # decode head's: the runner reads none after it.
    assert graphs.greedy_tokens(3) is None and graphs.head_logits(3) is None
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(padded_logits.argmax(-1), eager_logits.argmax(-1))


def _hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation (float32, eager attention)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
    return out


def _outputs(outs) -> list:
    return [[(c.token_ids, c.finish_reason,
              [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs])
             for c in o.outputs] for o in outs]


@pytest.mark.parametrize("backend", ["CPU", pytest.param("TRITON", marks=pytest.mark.slow)])
def test_speculation_through_padded_verify_steps(tiny64_path, make_llm, backend):
    """n-gram speculation with the runner's graph path on (capture off: the padded steps run
    eagerly). One prompt at a time, three greedy sequences each: their drafts are alike, so
    every verify step is uniform, 3 requests of 1+K tokens padded to 4. The greedy tokens equal
    transformers' and the plain engine's, logprobs included."""
    if backend == "TRITON":
        pytest.importorskip("triton")
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0, n=3, max_tokens=16, ignore_eos=True, logprobs=2)
    kwargs = dict(attention_backend=backend, max_num_seqs=4)
    want, _ = _run(make_llm, tiny64_path, prompts, params, None, **kwargs)
    llm = make_llm(model=tiny64_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                   speculative_config=NGRAM, **kwargs)
    graphs = llm.engine.runner.decode_graphs = _graphs(llm.engine.runner)
    got = [_outputs(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False))[0]
           for p in prompts]
    _assert_same(got, want)
    assert [g[0][0] for g in got] == _hf_greedy(tiny64_path, prompts, 16)
    stats = llm.engine.call_utility("stats")
    assert stats.spec_decode_num_accepted_tokens > 0
    assert graphs.verify.replays[4] > 0, "no uniform verify step was padded"
    assert graphs.replays[4] > 0  # decode steps beside them


def test_a_step_of_unequal_queries_is_not_replayed(tiny64_path, make_llm):
    """Requests of 1+K and fewer tokens (a cut-short draft), or q tokens but another q than
    the graphs', run eagerly: prepare refuses them."""
    llm = make_llm(model=tiny64_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                   speculative_config=NGRAM)
    runner = llm.engine.runner
    graphs = _graphs(runner)
    cb = runner.common_builder
    table = np.arange(4 * cb.max_blocks_per_seq, dtype=np.int32).reshape(4, -1)
    rows = np.arange(2)

    def step(scheduled: list[int]):
        return [cb.build(rows, np.array([8, 20], np.int32), np.array(scheduled, np.int32),
                         2, table)]

    assert graphs.prepare(step([Q, Q - 1])) is None
    assert graphs.prepare(step([Q + 1, Q + 1])) is None
    assert graphs.prepare(step([Q, Q])) == 2 and graphs._replaying is graphs.verify


def test_failed_verify_check_keeps_decode_graphs(tiny64_path, make_llm, monkeypatch, caplog):
    """setup_verify_graphs: a backend that declares no verify graphs, a layer configuration
    whose builder declines them, or q past the block size, gets none (logged); a failing
    start-up check drops them, the decode graphs stay."""
    from pagedserve.attention.registry import get_backend_cls
    from pagedserve.engine import verify_graphs

    llm = make_llm(model=tiny64_path, dtype="float32", device="cpu", kv_cache_memory="8MiB",
                   speculative_config=NGRAM, block_size=16)
    runner = llm.engine.runner
    decode = DecodeGraphs(runner.graph_inputs(), [1, 2], capture=False)
    triton, flash_attn = get_backend_cls("TRITON"), get_backend_cls("FLASH_ATTN")
    assert triton.can_capture_verify(16) and not flash_attn.can_capture_verify(16)
    assert get_backend_cls("FLASHINFER").can_capture_verify(16)
    with caplog.at_level("INFO", logger=verify_graphs.__name__):
        assert verify_graphs.setup_verify_graphs(decode, flash_attn, llm.engine.config) is None
        assert "captures decode steps only" in caplog.text
        (builder, *_) = runner.builders.values()
        monkeypatch.setattr(builder, "verify_graph_reason", lambda: "a declining layer")
        assert verify_graphs.setup_verify_graphs(decode, triton, llm.engine.config) is None
        assert "verify steps run eagerly: a declining layer" in caplog.text
        monkeypatch.undo()
        config = llm.engine.config
        monkeypatch.setattr(config.speculative, "num_speculative_tokens", 16)
        assert verify_graphs.setup_verify_graphs(decode, triton, config) is None
        assert "17 tokens a request exceed the block size 16" in caplog.text
        monkeypatch.setattr(config.speculative, "num_speculative_tokens", K)

        def fail(self, *args, **kwargs):
            raise RuntimeError("graph replay differs")

        monkeypatch.setattr(DecodeGraphs, "capture_all", lambda self, pool=None: None)
        monkeypatch.setattr(DecodeGraphs, "check_against_eager", fail)
        assert verify_graphs.setup_verify_graphs(decode, triton, config) is None
        assert "verify steps failed, they run eagerly (decode graphs stay)" in caplog.text
    assert decode.verify is None


@pytest.mark.gpu
def test_cuda_verify_graphs_replay_and_match_eager(tiny64_path, make_llm):
    """On CUDA with TRITON in float32: the engine captures verify graphs (q = 1+K) beside the
    decode graphs, replays them (one prompt at a time, three greedy sequences: uniform verify
    steps of 3 requests, padded to 4), and its greedy tokens and logprobs equal those of the
    plain engine and of the eager engine with the same speculation."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, n=3, max_tokens=24, ignore_eos=True, logprobs=2)
    kwargs = dict(device="cuda", attention_backend="TRITON", engine_core_process=False,
                  max_num_seqs=4)
    # Each engine's budget is the device's fraction less what the process holds already.
    want, _ = _run(make_llm, tiny64_path, prompts, params, None, gpu_memory_utilization=0.05,
                   **kwargs)
    eager, _ = _run(make_llm, tiny64_path, prompts, params, NGRAM, gpu_memory_utilization=0.05,
                    enforce_eager=True, **kwargs)
    llm = make_llm(model=tiny64_path, dtype="float32", speculative_config=NGRAM,
                   gpu_memory_utilization=0.05, **kwargs)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.verify is not None, "verify graphs were not captured"
    assert graphs.verify.query_len == Q and sorted(graphs.verify.graphs) == graphs.verify.sizes
    got = [_outputs(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False))[0]
           for p in prompts]
    _assert_same(got, want)
    _assert_same(got, eager)
    assert graphs.verify.replays[4] > 0, f"no verify step replayed a graph: {graphs.verify.replays}"
    assert graphs.replays[4] > 0
    del llm, graphs
    gc.collect()


@pytest.mark.gpu
def test_cuda_flashinfer_verify_graphs_replay_and_match_eager(tiny64_path, make_llm):
    """On CUDA with FLASHINFER in bf16 (head size 64): the verify graphs (graph-mode prefill
    wrappers, one per padded size) are captured and replayed, and the greedy tokens equal the
    eager engine's with the same speculation (one prompt at a time, three greedy sequences:
    uniform verify steps of 3 requests padded to 4)."""
    pytest.importorskip("flashinfer")
    prompts = _prompts()
    params = SamplingParams(temperature=0, n=3, max_tokens=24, ignore_eos=True)
    kwargs = dict(model=tiny64_path, dtype="bfloat16", device="cuda", max_num_seqs=4,
                  attention_backend="FLASHINFER", engine_core_process=False,
                  speculative_config=NGRAM)

    def tokens(llm):
        return [[c.token_ids for c in llm.generate([{"prompt_token_ids": p}], params,
                                                   use_tqdm=False)[0].outputs]
                for p in prompts]

    eager_llm = make_llm(enforce_eager=True, gpu_memory_utilization=0.05, **kwargs)
    want = tokens(eager_llm)
    del eager_llm
    gc.collect()
    llm = make_llm(gpu_memory_utilization=0.05, **kwargs)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.verify is not None, "verify graphs were not captured"
    assert graphs.verify.query_len == Q and sorted(graphs.verify.graphs) == graphs.verify.sizes
    assert tokens(llm) == want
    assert graphs.verify.replays[4] > 0, f"no verify step replayed a graph: {graphs.verify.replays}"
    del llm, graphs
    gc.collect()
