"""FLASHINFER backend on the CPU: the host-side CSR split, the NHD cache layout and K/V write,
availability and selection errors, and the builder + impl plumbing run against a stand-in for
the `flashinfer` module that implements its documented paged-attention semantics in torch (the
real kernels are covered by test_flashinfer_gpu.py)."""

import sys
import types

import numpy as np
import pytest
import torch

from pagedserve.attention import (
    AttentionLayerConfig,
    BackendSelectionError,
    BuilderConfig,
    select_backend,
)
from pagedserve.attention.backends import flashinfer as fi_backend
from pagedserve.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    pad_decode_csr,
    split_prefill_decode,
    write_kv,
)
from pagedserve.scheduler.metadata import BlockTable, CommonMetadataBuilder
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

CPU = torch.device("cpu")


def _common(block_ids, computed, scheduled, num_prefills, block_size):
    table = BlockTable(len(block_ids), max(len(b) for b in block_ids) + 1)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    builder = CommonMetadataBuilder(len(block_ids), int(sum(scheduled)),
                                    table.max_blocks_per_seq, block_size, CPU)
    return builder.build(np.arange(len(block_ids)), np.asarray(computed, dtype=np.int32),
                         np.asarray(scheduled, dtype=np.int32), num_prefills, table)


def _indices(common, part):
    return common.paged_kv_indices[part.page_start:part.page_end].tolist()


def test_split_design_worked_example():
    # DESIGN.md: block_table [[0,1,3],[2,5],[4,6,7,8]], seq_lens [40,25,50], block size 16;
    # request 0 is a whole 40-token prompt, requests 1 and 2 decode.
    common = _common([[0, 1, 3], [2, 5], [4, 6, 7, 8]], [0, 24, 49], [40, 1, 1], 1, 16)
    prefill, decode = split_prefill_decode(common)
    assert prefill.qo_indptr.tolist() == [0, 40]
    assert prefill.kv_indptr.tolist() == [0, 3]
    assert _indices(common, prefill) == [0, 1, 3]
    assert prefill.kv_last_page_len.tolist() == [8]
    assert (prefill.token_start, prefill.token_end) == (0, 40)
    assert decode.qo_indptr.tolist() == [0, 1, 2]
    assert decode.kv_indptr.tolist() == [0, 2, 6]  # rebased from [3, 5, 9]
    assert _indices(common, decode) == [2, 5, 4, 6, 7, 8]
    assert decode.kv_last_page_len.tolist() == [9, 2]
    assert (decode.token_start, decode.token_end) == (40, 42)
    assert (decode.req_start, decode.req_end) == (1, 3)


def test_split_pure_batches_and_chunked_prefill():
    ids = [[0, 1, 3], [2, 5], [4, 6, 7, 8]]
    prefill, decode = split_prefill_decode(_common(ids, [39, 24, 49], [1, 1, 1], 0, 16))
    assert prefill is None and decode.kv_indptr.tolist() == [0, 3, 5, 9]
    # Chunks of prompts with cached context: the query is the tail of each sequence.
    common = _common(ids, [30, 0, 20], [10, 25, 30], 3, 16)
    prefill, decode = split_prefill_decode(common)
    assert decode is None
    assert prefill.qo_indptr.tolist() == [0, 10, 35, 65]
    assert prefill.kv_indptr.tolist() == [0, 3, 5, 9]
    assert prefill.kv_last_page_len.tolist() == [8, 9, 2]


def test_split_random_batch_against_block_table():
    rng = np.random.default_rng(7)
    bs, b = 4, 9
    lens = rng.integers(1, 40, size=b)
    new = np.where(np.arange(b) < 4, rng.integers(2, 9, size=b), 1)
    new = np.minimum(new, lens)
    perm = rng.permutation(200).tolist()
    ids, pos = [], 0
    for n in -(-lens // bs):
        ids.append(perm[pos:pos + n])
        pos += n
    common = _common(ids, lens - new, new, 4, bs)
    qo_out = np.full(b + 1, -7, dtype=np.int32)
    kv_out = np.full(b + 1, -7, dtype=np.int32)
    prefill, decode = split_prefill_decode(common, qo_out, kv_out)
    for part in (prefill, decode):
        reqs = range(part.req_start, part.req_end)
        pages = [-(-int(lens[r]) // bs) for r in reqs]
        assert part.kv_indptr.tolist() == [0, *np.cumsum(pages).tolist()]
        assert part.qo_indptr.tolist() == [0, *np.cumsum(new[part.req_start:part.req_end])]
        assert _indices(common, part) == [i for r in reqs for i in ids[r]]
        assert part.kv_last_page_len.tolist() == [int(lens[r]) - (p - 1) * bs
                                                  for r, p in zip(reqs, pages, strict=True)]
        assert part.token_start == int(new[:part.req_start].sum())
    # The rebased decode indptrs live in the persistent buffers handed in.
    assert np.shares_memory(decode.kv_indptr, kv_out) and np.shares_memory(decode.qo_indptr,
                                                                           qo_out)


def test_pad_decode_csr_gives_each_padding_request_one_page():
    common = _common([[0, 1, 3], [2, 5], [4, 6, 7, 8]], [39, 24, 49], [1, 1, 1], 0, 16)
    _, decode = split_prefill_decode(common)
    indptr, last = pad_decode_csr(decode, 5, np.zeros(9, np.int32), np.zeros(8, np.int32))
    assert indptr.tolist() == [0, 3, 5, 9, 10, 11]
    assert last.tolist() == [8, 9, 2, 1, 1]


def test_kv_cache_views_are_the_nhd_halves():
    shape = FlashInferBackend.get_kv_cache_shape(5, 4, 2, 8)
    assert shape == (5, 2, 4, 2, 8)
    kv = torch.randn(shape)
    k, v = FlashInferBackend.kv_cache_views(kv)
    assert k.shape == v.shape == (5, 4, 2, 8)
    k[3, 1] = 1.5
    v[3, 1] = -2.5
    assert torch.all(kv[3, 0, 1] == 1.5) and torch.all(kv[3, 1, 1] == -2.5)
    assert k.data_ptr() == kv.data_ptr() and v.data_ptr() == kv[:, 1].data_ptr()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_write_kv_lands_in_the_slots_and_nowhere_else(cache_dtype):
    bs, hkv, d = 4, 2, 8
    kv = torch.randn(FlashInferBackend.get_kv_cache_shape(6, bs, hkv, d)).to(cache_dtype)
    before = kv.float().clone()
    slots = torch.tensor([5, 0, 23, -1, 12, 13])  # blocks 1, 0, 5, (padding), 3, 3
    key, value = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    k_scale, v_scale = (0.5, 2.0) if cache_dtype != torch.float32 else (1.0, 1.0)
    write_kv(kv, key, value, slots, k_scale, v_scale)
    k_view, v_view = FlashInferBackend.kv_cache_views(kv)
    written = torch.zeros(6, bs, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        written[blk, off] = True
        assert torch.equal(k_view[blk, off].float(), (key[i] / k_scale).to(cache_dtype).float())
        assert torch.equal(v_view[blk, off].float(), (value[i] / v_scale).to(cache_dtype).float())
    untouched = ~written[:, None, :].expand(6, 2, bs)
    assert torch.equal(kv.float()[untouched], before[untouched])


def test_unavailable_here_with_install_hint():
    ok, why = FlashInferBackend.is_available()
    if ok:
        pytest.skip("flashinfer and CUDA are both present")
    assert "pip install flashinfer-python" in why or "CUDA" in why
    if not torch.cuda.is_available():
        assert "CUDA" in why


def test_selecting_flashinfer_on_cpu_lists_the_available_backends():
    layer = AttentionLayerConfig(8, 2, 64, torch.bfloat16)
    with pytest.raises(BackendSelectionError) as err:
        select_backend("FLASHINFER", CPU, [layer], 16)
    msg = str(err.value)
    assert "FLASHINFER" in msg and "available here:" in msg and "CPU" in msg


def test_kv_cache_dtypes_and_validation():
    assert FlashInferBackend.get_kv_cache_dtype("auto", torch.float16) == torch.float16
    assert FlashInferBackend.get_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError):
        FlashInferBackend.get_kv_cache_dtype("int4", torch.bfloat16)
    ok = AttentionLayerConfig(32, 8, 128, torch.bfloat16, 4096, 30.0, "fp8")
    assert FlashInferBackend.validate_configuration(ok, 16, torch.device("cuda")) == []
    bad = AttentionLayerConfig(32, 8, 96, torch.float32, kv_cache_dtype="int4")
    reasons = FlashInferBackend.validate_configuration(bad, 16, CPU)
    assert len(reasons) == 4  # head size, dtype, kv dtype, device
    assert "cuda-graphs" in FlashInferBackend.features()


# ---- builder and impl against a torch stand-in for flashinfer -------------------------------

def _paged_attention(q, kv_cache, qo_indptr, kv_indptr, indices, last, plan, k_scale, v_scale):
    """FlashInfer's documented semantics: NHD pages, causal mask aligned to the end of the KV,
    window_left keys besides the query, soft-cap on scaled logits, k_scale folded into the
    softmax scale and v_scale applied to the output."""
    page = kv_cache.shape[2]
    sm_scale = plan["head_dim"] ** -0.5 * k_scale
    cap, window = plan["logits_soft_cap"] or 0.0, plan["window_left"]
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(len(last)):
        pages = indices[int(kv_indptr[i]):int(kv_indptr[i + 1])].long()
        n_kv = (len(pages) - 1) * page + int(last[i])
        k = kv_cache[pages, 0].flatten(0, 1)[:n_kv].float()
        v = kv_cache[pages, 1].flatten(0, 1)[:n_kv].float()
        qi = q[int(qo_indptr[i]):int(qo_indptr[i + 1])].float()
        group = qi.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", qi, k.repeat_interleave(group, 1)) * sm_scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        q_pos = n_kv - len(qi) + torch.arange(len(qi))[:, None]
        k_pos = torch.arange(n_kv)[None]
        allowed = k_pos <= q_pos if plan["causal"] else torch.ones_like(k_pos <= q_pos)
        if window >= 0:
            allowed &= k_pos >= q_pos - window
        s = s.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(group, 1))
        out[int(qo_indptr[i]):int(qo_indptr[i + 1])] = o
    return out * v_scale


class _FakeWrapper:
    def __init__(self, workspace, kv_layout, use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                     paged_kv_last_page_len_buffer)
        self.plans = 0

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=False,
              window_left=-1, logits_soft_cap=None, q_data_type=None, kv_data_type=None):
        assert indptr.device.type == last.device.type == "cpu"  # the host copies
        self.plans += 1
        if self.graph:  # like FlashInfer: copy into the persistent buffers, run from them
            assert len(last) == len(self.bufs[2])
            self.bufs[0].copy_(indptr)
            self.bufs[1][:len(indices)].copy_(indices)
            self.bufs[2].copy_(last)
            indptr, indices, last = self.bufs
        self.csr = (qo_indptr, indptr, indices, last)
        self.planned = dict(head_dim=d, causal=causal, window_left=window_left,
                         logits_soft_cap=logits_soft_cap, dtypes=(q_data_type, kv_data_type))

    def run(self, q, kv_cache, out=None, k_scale=None, v_scale=None):
        assert (q.dtype, kv_cache.dtype) == self.planned["dtypes"]
        o = _paged_attention(q, kv_cache, *self.csr, self.planned, k_scale, v_scale)
        out.copy_(o)
        return out


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, *args, **kwargs):
        self._plan(qo_indptr, *args, **kwargs)


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, *args, **kwargs):
        self._plan(torch.arange(len(indptr)), indptr, *args, **kwargs)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    module.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi_backend, "WORKSPACE_BYTES", 1024)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("block_size,ratio,window,cap", [
    (16, 4, None, None), (1, 3, 8, None), (32, 1, None, 5.0), (16, 2, 8, 5.0)])
def test_builder_and_impl_match_reference(fake_flashinfer, batch, block_size, ratio, window,
                                          cap):
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, 64, torch.float32, window, cap)
    run_case(FlashInferBackend, case, CPU)


def _step(block_ids, computed, bs, seed):
    gen = torch.Generator().manual_seed(seed)
    common = _common(block_ids, computed, [1] * len(block_ids), 0, bs)
    n = len(block_ids)
    full_k = [torch.randn(c + 1, 2, 16, generator=gen) for c in computed]
    full_v = [torch.randn(c + 1, 2, 16, generator=gen) for c in computed]
    q = torch.randn(n, 4, 16, generator=gen)
    return common, full_k, full_v, q


def _pad(x, rows):
    """Padding rows far from the data, so that any of them leaking into a result shows."""
    return torch.cat([x, 100 + torch.randn(rows - len(x), *x.shape[1:])])


def test_cudagraph_metadata_pads_and_is_reused(fake_flashinfer):
    """The graph path on padded inputs: the real requests match the reference, padding writes
    change nothing, and a second step reuses the same metadata and buffers."""
    bs, bp, num_blocks = 4, 4, 16
    config = BuilderConfig(4, 2, 16, torch.float32, bs, 8, 8, 6, CPU)
    builder = FlashInferBackend.get_builder_cls()(config)
    impl = FlashInferImpl(4, 16, 16 ** -0.5, 2)
    kv = torch.randn(FlashInferBackend.get_kv_cache_shape(num_blocks, bs, 2, 16))
    seen = None
    for seed, block_ids, computed in [(0, [[3, 9], [0], [12, 5, 7]], [6, 2, 9]),
                                      (1, [[1, 2, 4, 6, 8], [11]], [17, 3])]:
        common, full_k, full_v, q = _step(block_ids, computed, bs, seed)
        for ids, c, k, v in zip(block_ids, computed, full_k, full_v, strict=True):
            for t in range(c):
                kv[ids[t // bs], 0, t % bs] = k[t]
                kv[ids[t // bs], 1, t % bs] = v[t]
        before = kv.clone()
        md = builder.build_for_cudagraph(common, bp)
        assert seen is None or md is seen
        seen = md
        new_k = torch.stack([k[c] for k, c in zip(full_k, computed, strict=True)])
        new_v = torch.stack([v[c] for v, c in zip(full_v, computed, strict=True)])
        out = impl.forward(_pad(q, bp), _pad(new_k, bp), _pad(new_v, bp), kv, md)
        assert out.shape[0] == bp
        for i, c in enumerate(computed):
            ref = reference_attention(q[i:i + 1], full_k[i], full_v[i], c, 16 ** -0.5, None, None)
            torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)
        changed = (kv != before).flatten(3).any(-1)  # [block, K/V, offset]
        expected = torch.zeros_like(changed)
        for ids, c in zip(block_ids, computed, strict=True):
            expected[ids[c // bs], :, c % bs] = True
        assert torch.equal(changed, expected)
    assert builder._graphs[bp].wrapper.plans == 2


def test_cudagraph_build_refuses_prefills_and_overflow(fake_flashinfer):
    config = BuilderConfig(4, 2, 16, torch.float32, 4, 8, 64, 6, CPU)
    builder = FlashInferBackend.get_builder_cls()(config)
    with pytest.raises(ValueError):
        builder.build_for_cudagraph(_common([[0, 1], [2]], [0, 2], [5, 1], 1, 4), 4)
    with pytest.raises(ValueError):
        builder.build_for_cudagraph(_common([[0], [1], [2]], [1, 1, 1], [1, 1, 1], 0, 4), 2)
