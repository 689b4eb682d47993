"""FLASHINFER on a CUDA GPU against float32 references: the conformance grid (bf16), fp16, head
size 256, soft-cap, long prompts (FlashInfer's fa3 prefill kernel), an fp8 KV cache with
scales, the JIT warm-up, and a captured decode CUDA graph replayed on new data.

FlashInfer compiles each kernel variant (dtype, head size, window on/off, soft-cap on/off) on its
first use: a fresh machine spends minutes here the first time; `-m "gpu and not slow"` leaves out
the tests that compile the fa3 (SM90) prefill kernels, about 90 s each.
"""

import math

import numpy as np
import pytest
import torch

from pagedserve.attention import BuilderConfig
from pagedserve.scheduler.metadata import BlockTable, CommonMetadataBuilder
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from pagedserve.attention.backends.flashinfer import FlashInferBackend  # noqa: E402

CUDA = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_grid_bf16(batch, block_size, ratio, head_size, window):
    run_case(FlashInferBackend, Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, BF16,
                                     window), CUDA)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fp16(batch, head_size):
    run_case(FlashInferBackend, Case(BATCHES[batch], 16, 8, 2, head_size, FP16), CUDA)


@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill", "decode"])
def test_head_size_256(batch):
    run_case(FlashInferBackend, Case(BATCHES[batch], 16, 8, 2, 256, BF16), CUDA)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_soft_cap(batch, window):
    run_case(FlashInferBackend, Case(BATCHES[batch], 16, 8, 2, 64, BF16, window, 5.0), CUDA)


# Queries over 64 tokens take FlashInfer's fa3 prefill kernel on SM90 (shorter ones fa2).
LONG = [(0, 200), (100, 130), (7, 90), (50, 1), (300, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 64])
def test_long_prompts(window):
    run_case(FlashInferBackend, Case(LONG, 16, 32, 8, 128, BF16, window), CUDA)


@pytest.mark.slow
def test_warmup_compiles_and_runs(caplog):
    config = BuilderConfig(32, 8, 128, BF16, 16, 4, 128, 8, CUDA)
    with caplog.at_level("INFO"):
        FlashInferBackend.get_builder_cls()(config).warmup()
    assert "compiling kernels for head_dim=128" in caplog.text


# ---- fp8 KV cache ----------------------------------------------------------------------------

def _paged_batch(batch, block_size, num_blocks_extra, gen):
    blocks = [math.ceil((c + q) / block_size) for c, q in batch]
    perm = torch.randperm(sum(blocks) + num_blocks_extra, generator=gen).tolist()
    ids, pos = [], 0
    for n in blocks:
        ids.append(perm[pos:pos + n])
        pos += n
    return ids, len(perm), max(blocks)


def _common(common_builder, block_ids, batch, max_blocks):
    table = BlockTable(len(batch), max_blocks)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    num_prefills = sum(1 for _, q in batch if q > 1)
    return common_builder.build(np.arange(len(batch)), np.array([c for c, _ in batch], np.int32),
                                np.array([q for _, q in batch], np.int32), num_prefills, table)


def _fill_context(kv_cache, block_ids, batch, full_k, full_v, k_scale, v_scale):
    k_view, v_view = FlashInferBackend.kv_cache_views(kv_cache)
    bs = kv_cache.shape[2]
    for ids, (c, _), k, v in zip(block_ids, batch, full_k, full_v, strict=True):
        for t in range(c):
            k_view[ids[t // bs], t % bs] = (k[t] / k_scale).to(CUDA, kv_cache.dtype)
            v_view[ids[t // bs], t % bs] = (v[t] / v_scale).to(CUDA, kv_cache.dtype)


@pytest.mark.parametrize("head_size,window", [(128, None), (64, 8)])
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill", "decode"])
def test_fp8_kv_cache_with_scales(batch, head_size, window):
    """The cache stores K / k_scale and V / v_scale in e4m3. The reference attends over the same
    rounded values times the scales, so the quantisation error is not in the comparison; what
    remains is bf16 rounding (2e-2, as everywhere) plus one bf16 multiply of the output by
    v_scale, hence 3e-2."""
    batch_spec = BATCHES[batch]
    gen = torch.Generator().manual_seed(3)
    bs, h, hkv, k_scale, v_scale = 16, 8, 2, 0.5, 2.0
    fp8 = FlashInferBackend.get_kv_cache_dtype("fp8", BF16)
    block_ids, num_blocks, max_blocks = _paged_batch(batch_spec, bs, 3, gen)
    full_k = [torch.randn(c + q, hkv, head_size, generator=gen).to(BF16) for c, q in batch_spec]
    full_v = [torch.randn(c + q, hkv, head_size, generator=gen).to(BF16) for c, q in batch_spec]
    queries = [torch.randn(q, h, head_size, generator=gen).to(BF16) for _, q in batch_spec]
    kv_cache = torch.randn(FlashInferBackend.get_kv_cache_shape(num_blocks, bs, hkv, head_size),
                           generator=gen).to(fp8).to(CUDA)
    _fill_context(kv_cache, block_ids, batch_spec, full_k, full_v, k_scale, v_scale)

    t = sum(q for _, q in batch_spec)
    common = _common(CommonMetadataBuilder(len(batch_spec), t, max_blocks, bs, CUDA), block_ids,
                     batch_spec, max_blocks)
    config = BuilderConfig(h, hkv, head_size, BF16, bs, len(batch_spec), t, max_blocks, CUDA,
                           window, None, "fp8")
    metadata = FlashInferBackend.get_builder_cls()(config).build(common)
    impl = FlashInferBackend.get_impl_cls()(h, head_size, head_size ** -0.5, hkv, window, None,
                                            "fp8")
    impl.k_scale, impl.v_scale = k_scale, v_scale
    new = [(k[c:], v[c:]) for k, v, (c, _) in zip(full_k, full_v, batch_spec, strict=True)]
    out = impl.forward(torch.cat(queries).to(CUDA), torch.cat([k for k, _ in new]).to(CUDA),
                       torch.cat([v for _, v in new]).to(CUDA), kv_cache, metadata)

    def rounded(x, scale):
        return (x.float() / scale).to(fp8).float() * scale

    start = 0
    for i, (c, q) in enumerate(batch_spec):
        ref = reference_attention(queries[i], rounded(full_k[i], k_scale),
                                  rounded(full_v[i], v_scale), c, head_size ** -0.5, window, None)
        torch.testing.assert_close(out[start:start + q].float().cpu(), ref, rtol=3e-2, atol=3e-2)
        start += q
    k_view, v_view = FlashInferBackend.kv_cache_views(kv_cache)
    for ids, (c, q), k, v in zip(block_ids, batch_spec, full_k, full_v, strict=True):
        for tok in range(c, c + q):
            blk, off = ids[tok // bs], tok % bs
            assert torch.equal(k_view[blk, off].cpu().view(torch.uint8),
                               (k[tok].float() / k_scale).to(fp8).view(torch.uint8))
            assert torch.equal(v_view[blk, off].cpu().view(torch.uint8),
                               (v[tok].float() / v_scale).to(fp8).view(torch.uint8))


# ---- CUDA-graph decode -----------------------------------------------------------------------

def test_cudagraph_decode_replays_new_data():
    """Capture a padded decode step through build_for_cudagraph, then replay it for a different
    batch (fewer requests, longer contexts, other blocks): the real rows match an eager run and
    the float32 reference, and the cache ends up exactly as the eager run leaves it (padding
    wrote nothing)."""
    bs, h, hkv, d, padded = 16, 8, 2, 128, 4
    num_blocks, max_blocks = 64, 16
    gen = torch.Generator().manual_seed(11)
    config = BuilderConfig(h, hkv, d, BF16, bs, 8, 64, max_blocks, CUDA)
    builder = FlashInferBackend.get_builder_cls()(config)
    impl = FlashInferBackend.get_impl_cls()(h, d, d ** -0.5, hkv)
    common_builder = CommonMetadataBuilder(8, 64, max_blocks, bs, CUDA)
    kv_cache = torch.randn(FlashInferBackend.get_kv_cache_shape(num_blocks, bs, hkv, d),
                           generator=gen).to(BF16).to(CUDA)
    static = {name: torch.zeros(padded, n, d, dtype=BF16, device=CUDA)
              for name, n in (("q", h), ("k", hkv), ("v", hkv))}
    out = torch.zeros(padded, h, d, dtype=BF16, device=CUDA)
    perm = torch.randperm(num_blocks, generator=gen).tolist()

    def step(contexts, first_block):
        torch.cuda.synchronize()  # as the engine's steps do: host buffers are reused
        batch = [(c, 1) for c in contexts]
        sizes = [math.ceil((c + 1) / bs) for c in contexts]
        ids = [perm[first_block + sum(sizes[:i]):first_block + sum(sizes[:i + 1])]
               for i in range(len(sizes))]
        full_k = [torch.randn(c + 1, hkv, d, generator=gen).to(BF16) for c in contexts]
        full_v = [torch.randn(c + 1, hkv, d, generator=gen).to(BF16) for c in contexts]
        q = torch.randn(len(contexts), h, d, generator=gen).to(BF16)
        _fill_context(kv_cache, ids, batch, full_k, full_v, 1.0, 1.0)
        common = _common(common_builder, ids, batch, max_blocks)
        n = len(contexts)
        for name, x in (("q", q), ("k", torch.stack([k[-1] for k in full_k])),
                        ("v", torch.stack([v[-1] for v in full_v]))):
            static[name][:n] = x.to(CUDA)
            static[name][n:] = 50 * torch.randn(padded - n, *x.shape[1:], generator=gen).to(
                CUDA, BF16)
        return common, q, full_k, full_v

    common, *_ = step([5, 40, 17], 0)
    metadata = builder.build_for_cudagraph(common, padded)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up before capture, as CUDA graphs want
        impl.forward(static["q"], static["k"], static["v"], kv_cache, metadata, output=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(static["q"], static["k"], static["v"], kv_cache, metadata, output=out)

    contexts = [150, 33]
    common, q, full_k, full_v = step(contexts, 20)
    assert builder.build_for_cudagraph(common, padded) is metadata
    eager_cache = kv_cache.clone()
    eager = impl.forward(static["q"][:2].clone(), static["k"][:2].clone(),
                         static["v"][:2].clone(), eager_cache, builder.build(common))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:2], eager, rtol=1e-2, atol=1e-2)
    assert torch.equal(kv_cache, eager_cache)
    for i, c in enumerate(contexts):
        ref = reference_attention(q[i:i + 1], full_k[i], full_v[i], c, d ** -0.5, None, None)
        torch.testing.assert_close(out[i:i + 1].float().cpu(), ref, rtol=2e-2, atol=2e-2)
