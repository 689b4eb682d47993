"""Piecewise graphs (engine/piecewise_graphs.py) on the CPU, with capture off: every step runs
the model over its padded token count with attention on the real rows only, between the pieces;
tokens and logprobs equal the plain eager engine's over mixed batches (chunked prefill, a
prefix-cache hit, decodes beside prefills, async scheduling), for a dense Llama and a
Qwen3-MoE. Declined configurations run eagerly and say why."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

from pagedserve import SamplingParams
from pagedserve.engine.piecewise_graphs import (
    PiecewiseGraphs,
    decline_reason,
    non_owning_view,
    piecewise_sizes,
)

VOCAB = 173
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    configs = {
        "llama": transformers.LlamaConfig(**COMMON),
        # Layer 0 routes 4 experts top-2, layer 1 is dense.
        "qwen3_moe": transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=64,
                                                 norm_topk_prob=True, mlp_only_layers=[1],
                                                 decoder_sparse_step=1),
    }
    paths = {}
    for name, config in configs.items():
        path = tmp_path_factory.mktemp(f"piecewise_{name}")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[name] = str(path)
    return paths


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 29, 11, 40, 7, 18]
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]
    return prompts + [prompts[3] + [5, 6, 7, 8], prompts[3][:33]]  # prefix-cache hits


def _generate(llm) -> list:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (4, 9, 2, 12, 6, 3, 8, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _assert_same(got: list, want: list) -> None:
    """Same tokens and logprob keys, logprobs within 1e-4 (a GEMM over more rows may round a
    row's sums apart in float32)."""
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lp_got), (_, lp_want) in zip(got, want, strict=True):
        for pos_got, pos_want in zip(lp_got, lp_want, strict=True):
            assert pos_got.keys() == pos_want.keys()
            assert all(abs(pos_got[t] - pos_want[t]) < 1e-4 for t in pos_want)


ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB", block_size=4,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.mark.parametrize("family,async_scheduling", [
    ("llama", False), ("llama", True), ("qwen3_moe", False),
    pytest.param("qwen3_moe", True, marks=pytest.mark.slow),
], ids=["llama-sync", "llama-async", "qwen3_moe-sync", "qwen3_moe-async"])
def test_padded_pieces_match_eager(model_paths, make_llm, family, async_scheduling):
    want = _generate(make_llm(model=model_paths[family], async_scheduling=async_scheduling,
                              **ENGINE))
    llm = make_llm(model=model_paths[family], async_scheduling=async_scheduling, **ENGINE)
    runner = llm.engine.runner
    assert runner.piecewise is None  # not configured (and never captured on the CPU)
    graphs = PiecewiseGraphs(runner.graph_inputs(), [8, 16, 32], capture=False)
    runner.piecewise = graphs
    _assert_same(_generate(llm), want)
    # Prefill chunks (32 tokens), mixed steps and decode batches of 8 or fewer all ran padded.
    assert graphs.replays[32] > 0 and graphs.replays[8] > 0, graphs.replays


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_start_up_check_on_a_mixed_step(model_paths, make_llm, family):
    """The start-up check's mixed step (a prefill over cached context, a prefill, a decode)
    padded to the next size: its real rows equal the unpadded forward's."""
    llm = make_llm(model=model_paths[family], **ENGINE)
    runner = llm.engine.runner
    graphs = PiecewiseGraphs(runner.graph_inputs(), [8, 32], capture=False)
    commons, t = graphs.dummy_mixed_step()
    assert commons[0].num_prefills == 2 and commons[0].num_decodes == 1
    assert int(commons[0].context_lens_cpu[0]) > 0 and t < 32
    assert graphs.check_against_eager(unpadded_rtol=1e-4) <= 1e-6
    assert not graphs.replays  # the check's replay is not counted


def test_sizes():
    sizes = piecewise_sizes(8192)
    assert sizes[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 768]
    assert 4096 in sizes and 4352 not in sizes and sizes[-3:] == [7168, 7680, 8192]
    assert piecewise_sizes(2000) == [*range(64, 513, 64), *range(768, 1793, 256), 2000]
    assert piecewise_sizes(100, [16, 200, 50]) == [16, 50]


def test_non_owning_view_reads_and_writes_the_same_memory():
    base = torch.arange(60, dtype=torch.float32).view(6, 10).to(torch.bfloat16)
    strided = base[1:, 2:8]  # not contiguous, an offset
    view = non_owning_view(strided)
    assert view.shape == strided.shape and view.stride() == strided.stride()
    assert view.data_ptr() == strided.data_ptr()
    torch.testing.assert_close(view, strided, rtol=0, atol=0)
    view[0, 0] = -1.0
    assert base[1, 2] == -1.0
    # A storage of its own, starting at the view's first element (a view of `base` shares
    # base's storage, which starts at base's); the view's memory is the caller's to keep.
    assert view.untyped_storage().data_ptr() == strided.data_ptr() != base.data_ptr()


def _runner(**overrides) -> SimpleNamespace:
    runner = dict(config=SimpleNamespace(enforce_eager=False), tp_size=1, lora=None,
                  speculator=None, state_layers=[], multimodal=None, pooler=None,
                  attn_layers=[object()], device=torch.device("cuda"))
    return SimpleNamespace(**{**runner, **overrides})


@pytest.mark.parametrize("overrides,reason", [
    (dict(), None),
    (dict(config=SimpleNamespace(enforce_eager=True)), "enforce_eager"),
    (dict(tp_size=2), "tensor parallelism"),
    (dict(lora=object()), "LoRA"),
    (dict(speculator=object()), "speculative decoding"),
    (dict(state_layers=[object()]), "state layers"),
    (dict(multimodal=object()), "multimodal"),
    (dict(pooler=object()), "pooling"),
    (dict(device=torch.device("cpu")), "CUDA"),
])
def test_decline_reasons(overrides, reason):
    got = decline_reason(_runner(**overrides))
    assert (got is None) if reason is None else (reason in got)


def test_mla_is_declined_by_name():
    from pagedserve.attention.mla import MLAAttention

    layer = MLAAttention.__new__(MLAAttention)
    assert "MLA" in decline_reason(_runner(attn_layers=[layer]))


@pytest.mark.parametrize("extra,reason", [
    (dict(), "need CUDA"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative decoding"),
])
def test_declined_engines_run_eagerly_and_say_why(model_paths, make_llm, caplog, extra,
                                                  reason):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.piecewise_graphs"):
        llm = make_llm(model=model_paths["llama"], piecewise_cuda_graphs=True,
                       piecewise_graph_sizes=[16, 32], **ENGINE, **extra)
    assert llm.engine.runner.piecewise is None
    assert any("piecewise CUDA graphs off" in r.message and reason in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_padding_rows_never_reach_real_rows(model_paths, make_llm):
    """Garbage ids in the padding rows (any valid id) leave the real rows' hidden states as
    they were: every op outside attention is row-wise."""
    llm = make_llm(model=model_paths["qwen3_moe"], **ENGINE)
    runner = llm.engine.runner
    graphs = PiecewiseGraphs(runner.graph_inputs(), [32], capture=False)
    commons, t = graphs.dummy_mixed_step()
    metadata = graphs.inputs.group_metadata(commons, lambda b, c: b.build_step(c))
    outs = []
    for seed in (0, 1):
        ids = torch.randint(0, VOCAB, (32,), generator=torch.Generator().manual_seed(seed))
        ids[:t] = torch.arange(t) + 3
        runner.input_ids.device[:32].copy_(ids)
        runner.common_builder.dev["positions"][t:32] = torch.from_numpy(
            np.random.default_rng(seed).integers(0, 200, 32 - t))
        with torch.inference_mode():
            outs.append(graphs.run(metadata, t).clone())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_memory_profile_reserves_the_pool():
    """The profile's peak grows by the largest size's activations when the graphs will be
    captured (scaled from a profile over fewer tokens), by nothing otherwise."""
    from pagedserve.engine.kv_cache_setup import piecewise_reserve

    def runner(on: bool, **overrides):
        r = _runner(**overrides)
        r.config.piecewise_cuda_graphs = on
        r.max_num_tokens = 8192
        return r

    assert piecewise_reserve(runner(True), 1000, 8192) == 1000
    assert piecewise_reserve(runner(True), 1000, 4096) == 2000  # max_model_len 4,096
    assert piecewise_reserve(runner(False), 1000, 8192) == 0
    assert piecewise_reserve(runner(True, lora=object()), 1000, 8192) == 0


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: records its capture's begin and end."""

    events: list = []

    def capture_begin(self, pool=None):
        assert pool == "pool"  # every piece of every size in the one pool
        self.events.append(("begin", self))

    def capture_end(self):
        assert self.events[-1] == ("begin", self)  # pieces never overlap
        self.events.append(("end", self))


def test_capture_splits_at_every_attention_layer(model_paths, make_llm, monkeypatch):
    """The capture's bookkeeping with CUDA's graph calls stubbed: per size one piece per
    attention layer and one more, captured back to back into one pool, largest size first,
    each layer's call recorded in order with its tensors' shapes ([N, heads, head size])."""
    import contextlib

    llm = make_llm(model=model_paths["qwen3_moe"], **ENGINE)
    runner = llm.engine.runner
    _FakeGraph.events = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs = PiecewiseGraphs(runner.graph_inputs(), [16, 32])
    graphs.capture_all()
    layers = runner.attn_layers
    assert graphs.num_pieces == {16: len(layers) + 1, 32: len(layers) + 1}
    assert len(_FakeGraph.events) == 2 * 2 * (len(layers) + 1)
    assert _FakeGraph.events[0][1] is graphs.pieces[32][0]  # largest first
    for size in (16, 32):
        assert [c.layer for c in graphs.calls[size]] == layers
        for call in graphs.calls[size]:
            layer = call.layer
            assert call.query.shape == (size, layer.num_heads, layer.head_size)
            assert call.key.shape == (size, layer.num_kv_heads, layer.head_size)
            assert call.value.shape == (size, layer.num_kv_heads, layer.head_size_v)
            assert call.out.shape == (size, layer.num_heads, layer.head_size_v)
            assert call.kv_cache is runner.kv_caches[layer.layer_idx]
        assert graphs.outputs[size].shape[0] == size
