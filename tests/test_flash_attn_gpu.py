"""FLASH_ATTN on a GPU, for every implementation installed (fa3, fa2, fa4, torch): the conformance
grid against the float32 reference, half precision, head size 256, soft-cap, long contexts,
page 128, the torch path's request groups, and a decode step captured in a CUDA graph and
replayed with new metadata. An implementation that is not installed is skipped with why.

    PAGEDSERVE_FLASH_ATTN_IMPL is set per test; run with `pytest -q tests/test_flash_attn_gpu.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig
from pagedserve.attention.backends import flash_attn as fa
from pagedserve.attention.backends.flash_attn import FlashAttentionBackend
from pagedserve.scheduler.metadata import BlockTable, CommonMetadataBuilder
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
IMPLS = ("fa3", "fa2", "fa4", "torch")
LONG = [(0, 700), (1000, 1), (517, 1), (2000, 100), (4099, 1), (130, 129)]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    monkeypatch.setenv(fa.IMPL_ENV_VAR, request.param)
    ok, why = FlashAttentionBackend.is_available()
    if not ok:
        pytest.skip(why)
    return request.param


def _run(case: Case) -> None:
    layer = AttentionLayerConfig(case.num_heads, case.num_kv_heads, case.head_size, case.dtype,
                                 case.sliding_window, case.logits_soft_cap)
    reasons = FlashAttentionBackend.validate_configuration(layer, case.block_size, DEVICE)
    if reasons:
        pytest.skip("; ".join(reasons))
    run_case(FlashAttentionBackend, case, DEVICE)


def _grid():
    for batch in BATCHES:
        for block_size in (1, 16, 32, 256):
            for ratio in (1, 3, 4):
                for head_size in (64, 128):
                    for window in (None, 8):
                        yield pytest.param(batch, block_size, ratio, head_size, window,
                                           id=f"{batch}-bs{block_size}-gqa{ratio}-d{head_size}"
                                              f"-w{window}")


@pytest.mark.parametrize("batch,block_size,ratio,head_size,window", list(_grid()))
def test_grid_bf16(impl, batch, block_size, ratio, head_size, window):
    if block_size == 256 and impl != "fa2":
        pytest.skip("page 256 is only needed by fa2 (the others run 1/16/32)")
    _run(Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, torch.bfloat16, window))


@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill", "decode"])
@pytest.mark.parametrize("window", [None, 8])
def test_fp16(impl, batch, window):
    block_size = 256 if impl == "fa2" else 16
    _run(Case(BATCHES[batch], block_size, 8, 2, 128, torch.float16, window, seed=1))


@pytest.mark.parametrize("window", [None, 8])
def test_head_size_256(impl, window):
    block_size = 256 if impl == "fa2" else 16
    _run(Case(BATCHES["mixed"], block_size, 4, 2, 256, torch.bfloat16, window, seed=2))


def test_soft_cap(impl):
    block_size = 256 if impl == "fa2" else 16
    case = Case(BATCHES["mixed"], block_size, 4, 2, 64, torch.bfloat16, None, 5.0, seed=3)
    if impl == "torch":
        layer = AttentionLayerConfig(4, 2, 64, torch.bfloat16, logits_soft_cap=5.0)
        assert FlashAttentionBackend.validate_configuration(layer, 16, DEVICE)
        pytest.skip("torch's kernel has no soft-cap (refused, as checked)")
    _run(case)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_contexts(impl, window, dtype):
    # Several kernel tiles per sequence, chunked prefill against a long context.
    block_size = 256 if impl == "fa2" else 16
    _run(Case(LONG, block_size, 32, 8, 128, dtype, window, seed=4))


@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_page_128(impl, batch):
    # FA4 loads 128-token pages by TMA; the cache rows past each sequence are finite here.
    _run(Case(BATCHES[batch] + [(300, 1), (129, 200)], 128, 8, 2, 128, torch.bfloat16))


def test_torch_path_groups(monkeypatch):
    monkeypatch.setenv(fa.IMPL_ENV_VAR, "torch")
    monkeypatch.setenv(fa.GATHER_TOKENS_ENV_VAR, "1")  # one request's worth: many groups
    ok, why = FlashAttentionBackend.is_available()
    if not ok:
        pytest.skip(why)
    _run(Case(BATCHES["mixed"], 16, 8, 2, 128, torch.bfloat16, 8))
    _run(Case(LONG, 16, 8, 2, 64, torch.bfloat16))


def test_decode_cuda_graph_replay(impl):
    """Capture one decode step (write K/V + attend) with fixed launch bounds, then replay it
    after the builders rewrote their persistent buffers for longer contexts."""
    torch.manual_seed(0)
    b, h, hkv, d, bs, dtype = 4, 8, 2, 128, 256 if impl == "fa2" else 16, torch.bfloat16
    max_blocks = -(-300 // bs)
    num_blocks = b * max_blocks + 3
    cache = torch.randn(2, num_blocks, bs, hkv, d, dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks).tolist()
    table = BlockTable(b, max_blocks)
    for row in range(b):
        table.add_row(row, perm[row * max_blocks:(row + 1) * max_blocks])
    common_builder = CommonMetadataBuilder(b, b, max_blocks, bs, DEVICE)
    builder = fa.FlashAttentionMetadataBuilder(
        BuilderConfig(h, hkv, d, dtype, bs, b, b, max_blocks, DEVICE))
    builder.capture_max_seq_len = max_blocks * bs
    layer = fa.FlashAttentionImpl(h, d, d ** -0.5, hkv)
    query = torch.zeros(b, h, d, dtype=dtype, device=DEVICE)
    key = torch.zeros(b, hkv, d, dtype=dtype, device=DEVICE)
    value = torch.zeros_like(key)
    out = torch.zeros_like(query)

    def step(context_lens):
        common = common_builder.build(np.arange(b), np.array(context_lens, dtype=np.int32),
                                      np.ones(b, dtype=np.int32), 0, table)
        return builder.build(common)

    md = step([5, 16, 100, 31])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / first-call work outside the capture
        layer.forward(query, key, value, cache, md, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward(query, key, value, cache, md, out)

    for contexts in ([6, 17, 101, 32], [250, 0, 15, 299]):
        new = step(contexts)
        assert new.query_start_loc.data_ptr() == md.query_start_loc.data_ptr()
        assert new.slot_mapping.data_ptr() == md.slot_mapping.data_ptr()
        query.copy_(torch.randn_like(query))
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
        graph.replay()
        torch.cuda.synchronize()
        rows = table.table
        for r, ctx in enumerate(contexts):
            pages = torch.tensor(rows[r, :-(-(ctx + 1) // bs)], device=DEVICE).long()
            k_all = cache[0][pages].flatten(0, 1)[:ctx + 1]
            v_all = cache[1][pages].flatten(0, 1)[:ctx + 1]
            assert torch.equal(k_all[ctx], key[r]) and torch.equal(v_all[ctx], value[r])
            ref = reference_attention(query[r:r + 1].cpu(), k_all.cpu(), v_all.cpu(), ctx,
                                      d ** -0.5, None, None)
            torch.testing.assert_close(out[r:r + 1].float().cpu(), ref, rtol=2e-2, atol=2e-2)
