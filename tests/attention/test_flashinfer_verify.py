"""FLASHINFER's graph metadata of uniform verify steps (every request q = 1+K tokens, padded to a
captured size; attention/backends/flashinfer_verify.py). On the CPU: the padded step's CSR
against hand-computed arrays, and the builder + impl against the torch stand-in for `flashinfer`
(test_flashinfer.py's, with the prefill wrapper's CUDA-graph constructor). On a CUDA GPU with
flashinfer (`gpu`): the real graph prefill wrapper captured at a padded size and replayed on
another step, against the eager build of the unpadded step and a float32 reference."""

import math
import sys

import numpy as np
import pytest
import torch

from pagedserve.attention import AttentionLayerConfig, BuilderConfig
from pagedserve.attention.backends.flashinfer import FlashInferBackend
from pagedserve.attention.backends.flashinfer_verify import SINK_REASON, uniform_csr
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable
from tests.attention.test_flashinfer import _FakePrefill, fake_flashinfer, needs_flashinfer
from tests.utils.conformance import reference_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
_ = fake_flashinfer  # the fixture, used by name below


def test_uniform_csr_of_a_padded_verify_step():
    """3 requests of q = 3 tokens over contexts 5, 9, 2 (block size 4: 8, 12 and 5 tokens, 2,
    3 and 2 pages) padded to 5: each padding request owns page 0 with q tokens in it."""
    cb = CommonMetadataBuilder(8, 32, 4, 4, CPU)
    table = np.array([[7, 3, -1, -1], [1, 4, 6, -1], [2, 5, -1, -1]], dtype=np.int32)
    common = cb.build(np.arange(3), np.array([5, 9, 2], np.int32), np.full(3, 3, np.int32), 3,
                      table)
    padded = cb.pad_decode(common, 5)
    csr = uniform_csr(padded, 5)
    assert csr.qo_indptr.tolist() == [0, 3, 6, 9, 12, 15]
    assert csr.kv_indptr.tolist() == [0, 2, 5, 7, 8, 9]
    assert csr.kv_last_page_len.tolist() == [4, 4, 1, 3, 3]
    assert csr.num_pages == 9
    assert padded.paged_kv_indices[:9].tolist() == [7, 3, 1, 4, 6, 2, 5, 0, 0]
    assert padded.slot_mapping[9:].tolist() == [-1] * 6
    with pytest.raises(ValueError, match="5 requests of 3 tokens"):
        uniform_csr(common, 5)  # not padded


class _FakeGraphPrefill(_FakePrefill):
    """FlashInfer's prefill wrapper with its CUDA-graph constructor: the buffers fix the batch
    size, plan() copies the CSR into them (never more rows than its first plan) and run()
    reads them, so a buffer left stale would show."""

    def __init__(self, workspace, kv_layout, use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None):
        super().__init__(workspace, kv_layout)
        self.graph_mode = use_cuda_graph
        self.gbufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                      paged_kv_last_page_len_buf)
        if use_cuda_graph:
            assert len(paged_kv_indptr_buf) == len(qo_indptr_buf)
            assert len(paged_kv_last_page_len_buf) == len(qo_indptr_buf) - 1
        self.max_rows = None
        self.uniform_q_len = None

    def plan(self, qo_indptr, indptr, indices, last, *args, uniform_q_len=None, **kwargs):
        if not self.graph_mode:
            return super().plan(qo_indptr, indptr, indices, last, *args, **kwargs)
        # FlashInfer checks the hint against qo_indptr on the host (and drops it if wrong).
        self.uniform_q_len = uniform_q_len
        assert uniform_q_len is None or set(np.diff(qo_indptr.numpy())) == {uniform_q_len}
        assert qo_indptr.device.type == "cpu"
        assert len(qo_indptr) == len(self.gbufs[0]), "the batch size is fixed in graph mode"
        rows = int(qo_indptr[-1])
        self.max_rows = self.max_rows or rows
        assert rows <= self.max_rows
        qo, kv, idx, lp = self.gbufs
        qo.copy_(qo_indptr)
        kv.copy_(indptr)
        idx[:len(indices)].copy_(indices)
        lp.copy_(last)
        self._plan(qo, kv.cpu(), idx, lp.cpu(), *args, **kwargs)


@pytest.fixture
def fake_graph_flashinfer(fake_flashinfer):
    sys.modules["flashinfer"].BatchPrefillWithPagedKVCacheWrapper = _FakeGraphPrefill


def _fill(kv_cache, ids, c, k, v):
    bs = kv_cache.shape[2]
    for t in range(c):
        kv_cache[ids[t // bs], 0, t % bs] = k[t].to(kv_cache.device, kv_cache.dtype)
        kv_cache[ids[t // bs], 1, t % bs] = v[t].to(kv_cache.device, kv_cache.dtype)


class _Verify:
    """Uniform steps of q tokens a request over one cache, padded to `bp` requests; the
    graph's static inputs and output (bp * q rows)."""

    def __init__(self, device, dtype, q, head_size, bp=4, bs=16, h=8, hkv=2, seed=0):
        self.device, self.dtype, self.q, self.d, self.bp, self.h, self.hkv = (
            device, dtype, q, head_size, bp, h, hkv)
        self.gen = torch.Generator().manual_seed(seed)
        self.max_blocks, num_blocks = 16, 64
        config = BuilderConfig(h, hkv, head_size, dtype, bs, 8, 8 * q, self.max_blocks, device)
        self.builder = FlashInferBackend.get_builder_cls()(config)
        self.impl = FlashInferBackend.get_impl_cls()(AttentionLayerConfig(h, hkv, head_size,
                                                                          dtype))
        self.common_builder = CommonMetadataBuilder(8, 8 * q, self.max_blocks, bs, device)
        self.kv_cache = torch.randn(FlashInferBackend.get_kv_cache_shape(
            num_blocks, bs, hkv, head_size), generator=self.gen).to(dtype).to(device)
        t = bp * q
        self.static = {name: torch.zeros(t, n, head_size, dtype=dtype, device=device)
                       for name, n in (("q", h), ("k", hkv), ("v", hkv))}
        self.out = torch.zeros(t, h, head_size, dtype=dtype, device=device)
        self.perm = torch.randperm(num_blocks, generator=self.gen).tolist()

    def step(self, contexts, first_block):
        """A step of len(contexts) requests: (common, padded, queries, full K, full V); the
        static inputs hold its new tokens, then padding rows far from the data."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # as the engine's steps do: host buffers are reused
        q, bs, d, n = self.q, self.kv_cache.shape[2], self.d, len(contexts)
        sizes = [math.ceil((c + q) / bs) for c in contexts]
        ids = [self.perm[first_block + sum(sizes[:i]):first_block + sum(sizes[:i + 1])]
               for i in range(n)]
        full_k = [torch.randn(c + q, self.hkv, d, generator=self.gen).to(self.dtype)
                  for c in contexts]
        full_v = [torch.randn(c + q, self.hkv, d, generator=self.gen).to(self.dtype)
                  for c in contexts]
        queries = torch.randn(n * q, self.h, d, generator=self.gen).to(self.dtype)
        for i, c in enumerate(contexts):
            _fill(self.kv_cache, ids[i], c, full_k[i], full_v[i])
        table = BlockTable(n, self.max_blocks)
        for row, row_ids in enumerate(ids):
            table.add_row(row, row_ids)
        common = self.common_builder.build(np.arange(n), np.array(contexts, np.int32),
                                           np.full(n, q, np.int32), n, table.table)
        padded = self.common_builder.pad_decode(common, self.bp)
        new_k = torch.cat([k[c:] for k, c in zip(full_k, contexts, strict=True)])
        new_v = torch.cat([v[c:] for v, c in zip(full_v, contexts, strict=True)])
        for name, x in (("q", queries), ("k", new_k), ("v", new_v)):
            self.static[name][:n * q] = x.to(self.device)
            self.static[name][n * q:] = 50 * torch.randn(
                self.bp * q - n * q, *x.shape[1:], generator=self.gen).to(self.device, self.dtype)
        return common, padded, queries, full_k, full_v

    def forward(self, metadata):
        s = self.static
        return self.impl.forward(s["q"], s["k"], s["v"], self.kv_cache, metadata,
                                 output=self.out)

    def check(self, common, contexts, queries, full_k, full_v, run, tol):
        """`run()` (the graph path) against the eager build of the unpadded step (the same
        rows, the same cache after) and the float32 reference."""
        n, q, d = len(contexts), self.q, self.d
        eager_cache = self.kv_cache.clone()
        eager = self.impl.forward(*(self.static[k][:n * q].clone() for k in "qkv"), eager_cache,
                                  self.builder.build(common))
        run()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        torch.testing.assert_close(self.out[:n * q], eager, rtol=tol, atol=tol)
        assert torch.equal(self.kv_cache, eager_cache)  # the padding wrote nothing
        for i, c in enumerate(contexts):
            ref = reference_attention(queries[i * q:(i + 1) * q], full_k[i], full_v[i], c,
                                      d ** -0.5, None, None)
            torch.testing.assert_close(self.out[i * q:(i + 1) * q].float().cpu(), ref,
                                       rtol=2 * tol, atol=2 * tol)


@pytest.mark.parametrize("q", [2, 5])
def test_verify_graph_metadata_against_eager_and_reference(fake_graph_flashinfer, q):
    """Two steps through one padded size (3 then 2 requests of q tokens, ragged contexts): the
    graph path's real rows equal the eager build of the unpadded step and the float32
    reference, padding writes nothing, and the size's one wrapper is planned again."""
    v = _Verify(CPU, torch.float32, q, 16, seed=q)
    for contexts, first in (([5, 40, 17], 0), ([150, 33], 20)):
        common, padded, queries, full_k, full_v = v.step(contexts, first)
        md = v.builder.build_for_cudagraph(common, v.bp, padded)
        assert (md.num_prefill_tokens, md.num_decode_tokens, md.decode) == (v.bp * q, 0, None)
        v.check(common, contexts, queries, full_k, full_v, lambda md=md: v.forward(md), 1e-5)
    (wrapper,) = v.builder._verify_graphs.values()
    assert wrapper.graph_mode and wrapper.plans == 2 and wrapper.planned["causal"]
    assert wrapper.uniform_q_len == q  # its tiles sized for q rows a request


def test_sink_layers_decline_verify_graphs(fake_graph_flashinfer):
    config = BuilderConfig(4, 2, 16, torch.float32, 16, 4, 16, 4, CPU, has_sinks=True)
    builder = FlashInferBackend.get_builder_cls()(config)
    assert builder.verify_graph_reason() == SINK_REASON
    plain = FlashInferBackend.get_builder_cls()(BuilderConfig(4, 2, 16, torch.float32, 16, 4,
                                                              16, 4, CPU))
    assert plain.verify_graph_reason() is None
    assert FlashInferBackend.can_capture_verify(16)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("head_size", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("q", [2, 3, 4, 5])
def test_cuda_verify_graph_replays_new_data(q, head_size):
    """Capture a padded verify step (3 requests of q tokens padded to 4) through
    build_for_cudagraph, then replay it for another step (2 requests, longer contexts, other
    blocks): the real rows match the eager build of the unpadded step and the float32
    reference, and the cache ends up exactly as the eager run leaves it."""
    v = _Verify(CUDA, torch.bfloat16, q, head_size, seed=10 + q)
    common, padded, *_ = v.step([5, 40, 17], 0)
    metadata = v.builder.build_for_cudagraph(common, v.bp, padded)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up before capture, as CUDA graphs want
        v.forward(metadata)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        v.forward(metadata)
    contexts = [150, 33]
    common, padded, queries, full_k, full_v = v.step(contexts, 20)
    again = v.builder.build_for_cudagraph(common, v.bp, padded)
    assert again.prefill is metadata.prefill
    v.check(common, contexts, queries, full_k, full_v, graph.replay, 1e-2)
