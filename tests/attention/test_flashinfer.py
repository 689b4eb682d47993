"""FLASHINFER. On the CPU: the host-side CSR split, the NHD cache layout and K/V write,
availability and selection errors, and the builder + impl plumbing run against a stand-in for
the `flashinfer` module that implements its documented paged-attention semantics in torch.

On a CUDA GPU (the `gpu` tests, which also need flashinfer installed), the real kernels against
float32 references: the conformance grid (bf16), fp16, head size 256, soft-cap, long prompts
(FlashInfer's fa3 prefill kernel), an fp8 KV cache with scales, the JIT warm-up, a captured
decode CUDA graph replayed on new data, and attention sinks through FlashInfer's sink variant
(gpt-oss's shape, the fp8 cache and the captured graph).

FlashInfer compiles each kernel variant (dtype, head size, window on/off, soft-cap on/off) on its
first use: a fresh machine spends minutes in the `gpu` tests the first time; `-m "gpu and not
slow"` leaves out the tests that compile the fa3 (SM90) prefill kernels, about 90 s each.
"""

import math
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
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

CPU = torch.device("cpu")


def _common(*args):
    """The step's common metadata over a block table of the requests' blocks: the host tests
    pass (block_ids, computed, scheduled, num_prefills, block_size) and get it built on the CPU,
    the `gpu` tests their CUDA builder first: (common_builder, block_ids, batch, max_blocks)."""
    if isinstance(args[0], CommonMetadataBuilder):
        return _cuda_common(*args)
    return _host_common(*args)


def _host_common(block_ids, computed, scheduled, num_prefills, block_size):
    table = BlockTable(len(block_ids), max(len(b) for b in block_ids) + 1)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    builder = CommonMetadataBuilder(len(block_ids), int(sum(scheduled)),
                                    table.max_blocks_per_seq, block_size, CPU)
    return builder.build(np.arange(len(block_ids)), np.asarray(computed, dtype=np.int32),
                         np.asarray(scheduled, dtype=np.int32), num_prefills, table.table)


def _indices(common, part):
    return common.paged_kv_indices[part.page_start:part.page_end].tolist()


def test_split_architecture_worked_example():
    # docs/architecture.md's worked example: block_table [[0,1,3],[2,5],[4,6,7,8]], seq_lens
    # [40,25,50], block size 16; request 0 is a whole 40-token prompt, requests 1 and 2 decode.
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

def _paged_attention(q, kv_cache, qo_indptr, kv_indptr, indices, last, plan, k_scale, v_scale,
                     sinks=None, sm_scale=None):
    """FlashInfer's documented semantics: NHD pages, causal mask aligned to the end of the KV,
    window_left keys besides the query, soft-cap on scaled logits, k_scale folded into the
    softmax scale and v_scale applied to the output. The attention-sink variant takes the
    softmax scale itself and adds one column of logit sinks[head] to each softmax."""
    page = kv_cache.shape[2]
    if sm_scale is None:
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
        if sinks is not None:
            s = torch.cat([s, sinks.view(-1, 1, 1).expand(-1, s.shape[1], 1)], dim=-1)
        p = s.softmax(-1)[..., :n_kv]
        o = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(group, 1))
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


class _FakeSinkVariant:
    """FlashInfer's attention-sink wrappers: the JIT variant is fixed at construction (dtypes,
    head dims, window), run() takes (sinks float32 [H], sm_scale) after the cache, and there is
    no soft-cap."""

    def _init_variant(self, q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left):
        assert head_dim_qk == head_dim_vo
        self.variant = dict(dtypes=(q_data_type, kv_data_type), head_dim=head_dim_qk,
                            window_left=window_left)

    def plan(self, *args, **kwargs):
        super().plan(*args, **kwargs)
        assert self.planned["logits_soft_cap"] is None
        assert all(self.planned[k] == v for k, v in self.variant.items())

    def run(self, q, kv_cache, sinks, sm_scale, out=None, v_scale=None):
        assert (q.dtype, kv_cache.dtype) == self.planned["dtypes"]
        assert sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],)
        o = _paged_attention(q, kv_cache, *self.csr, self.planned, None, v_scale, sinks,
                             sm_scale)
        out.copy_(o)
        return out


class _FakeSinkPrefill(_FakeSinkVariant, _FakePrefill):
    def __init__(self, workspace, kv_layout, use_cuda_graph=False, q_data_type=None,
                 kv_data_type=None, head_dim_qk=128, head_dim_vo=128, window_left=-1):
        super().__init__(workspace, kv_layout, use_cuda_graph)
        self._init_variant(q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left)


class _FakeSinkDecode(_FakeSinkVariant, _FakeDecode):
    def __init__(self, workspace, kv_layout, q_data_type=None, kv_data_type=None,
                 head_dim_qk=128, head_dim_vo=128, window_left=-1, **kwargs):
        super().__init__(workspace, kv_layout, use_tensor_cores=True, **kwargs)
        self._init_variant(q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    module.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    module.BatchAttentionWithAttentionSinkWrapper = _FakeSinkPrefill
    module.BatchDecodeWithAttentionSinkWrapper = _FakeSinkDecode
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi_backend, "WORKSPACE_BYTES", 1024)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("block_size,ratio,window,cap", [
    (16, 4, None, None), (1, 3, 8, None), (32, 1, None, 5.0), (16, 2, 8, 5.0)])
def test_builder_and_impl_match_reference(fake_flashinfer, batch, block_size, ratio, window,
                                          cap):
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, 64, torch.float32, window, cap)
    run_case(FlashInferBackend, case, CPU)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("block_size,ratio,window", [(16, 4, None), (1, 3, 8), (32, 1, 8)])
def test_sink_layers_plan_the_sink_variant(fake_flashinfer, batch, block_size, ratio, window):
    case = Case(BATCHES[batch], block_size, 2 * ratio, 2, 64, torch.float32, window, sinks=True)
    run_case(FlashInferBackend, case, CPU)


def test_sink_plumbing_refuses_mismatches(fake_flashinfer):
    sink_layer = AttentionLayerConfig(4, 2, 16, torch.float32, has_sinks=True)
    capped = AttentionLayerConfig(4, 2, 16, torch.bfloat16, None, 5.0, has_sinks=True)
    assert any("soft-cap" in r for r in FlashInferBackend.validate_configuration(
        capped, 16, torch.device("cuda")))
    common = _common([[0, 1]], [3], [2], 1, 4)
    plain_md = FlashInferBackend.get_builder_cls()(
        BuilderConfig(4, 2, 16, torch.float32, 4, 1, 2, 3, CPU)).build(common)
    impl = FlashInferImpl(sink_layer)
    impl.bind_sinks(torch.randn(4).to(torch.bfloat16))
    q, kv = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cache = torch.zeros(FlashInferBackend.get_kv_cache_shape(3, 4, 2, 16))
    with pytest.raises(ValueError, match="planned without sinks"):
        impl.forward(q, kv, kv, cache, plain_md)
    # A bf16 parameter reaches the kernel as one float32 copy, made once.
    first = impl._float32_sinks()
    assert first.dtype == torch.float32 and impl._float32_sinks() is first
    assert torch.equal(first, impl.sinks.float())


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


@pytest.mark.parametrize("with_sinks", [False, True])
def test_cudagraph_metadata_pads_and_is_reused(fake_flashinfer, with_sinks):
    """The graph path on padded inputs: the real requests match the reference, padding writes
    change nothing, and a second step reuses the same metadata and buffers."""
    bs, bp, num_blocks = 4, 4, 16
    config = BuilderConfig(4, 2, 16, torch.float32, bs, 8, 8, 6, CPU, has_sinks=with_sinks)
    builder = FlashInferBackend.get_builder_cls()(config)
    impl = FlashInferImpl(AttentionLayerConfig(4, 2, 16, torch.float32, has_sinks=with_sinks))
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5)) * 2 if with_sinks else None
    if with_sinks:
        impl.bind_sinks(sinks)
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
            ref = reference_attention(q[i:i + 1], full_k[i], full_v[i], c, 16 ** -0.5, None, None,
                                      sinks)
            torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)
        changed = (kv != before).flatten(3).any(-1)  # [block, K/V, offset]
        expected = torch.zeros_like(changed)
        for ids, c in zip(block_ids, computed, strict=True):
            expected[ids[c // bs], :, c % bs] = True
        assert torch.equal(changed, expected)
    assert builder._graphs[bp].wrapper.plans == 2
    assert isinstance(builder._graphs[bp].wrapper, _FakeSinkDecode) == with_sinks


def test_cudagraph_build_refuses_prefills_and_overflow(fake_flashinfer):
    config = BuilderConfig(4, 2, 16, torch.float32, 4, 8, 64, 6, CPU)
    builder = FlashInferBackend.get_builder_cls()(config)
    with pytest.raises(ValueError):
        builder.build_for_cudagraph(_common([[0, 1], [2]], [0, 2], [5, 1], 1, 4), 4)
    with pytest.raises(ValueError):
        builder.build_for_cudagraph(_common([[0], [1], [2]], [1, 1, 1], [1, 1, 1], 0, 4), 2)


# ---- the real kernels on a CUDA GPU ----------------------------------------------------------

CUDA = torch.device("cuda")
BF16, FP16 = torch.bfloat16, torch.float16


def _flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


# The `gpu` tests run FlashInfer's own kernels: skipped without the package as without CUDA.
needs_flashinfer = pytest.mark.skipif(not _flashinfer_importable(),
                                      reason="could not import 'flashinfer'")


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("head_size", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_grid_bf16(batch, block_size, ratio, head_size, window):
    run_case(FlashInferBackend, Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, BF16,
                                     window), CUDA)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("head_size", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fp16(batch, head_size):
    run_case(FlashInferBackend, Case(BATCHES[batch], 16, 8, 2, head_size, FP16), CUDA)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill", "decode"])
def test_head_size_256(batch):
    run_case(FlashInferBackend, Case(BATCHES[batch], 16, 8, 2, 256, BF16), CUDA)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_soft_cap(batch, window):
    run_case(FlashInferBackend, Case(BATCHES[batch], 16, 8, 2, 64, BF16, window, 5.0), CUDA)


# Queries over 64 tokens take FlashInfer's fa3 prefill kernel on SM90 (shorter ones fa2).
LONG = [(0, 200), (100, 130), (7, 90), (50, 1), (300, 1)]


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 64])
def test_long_prompts(window):
    run_case(FlashInferBackend, Case(LONG, 16, 32, 8, 128, BF16, window), CUDA)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_gpt_oss_shape(window):
    """gpt-oss's attention (64 query heads over 8 KV heads of 64 channels, a window of 128 on
    alternate layers, learned sinks) through FlashInfer's sink variant: long prompts, chunks
    and decodes in one step. Sinks of std 4, so that they show against hundreds of keys."""
    case = Case(LONG, 16, 64, 8, 64, BF16, window, sinks=True, sink_std=4.0)
    run_case(FlashInferBackend, case, CUDA)


@pytest.mark.gpu
@needs_flashinfer
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


def _cuda_common(common_builder, block_ids, batch, max_blocks):
    table = BlockTable(len(batch), max_blocks)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    num_prefills = sum(1 for _, q in batch if q > 1)
    return common_builder.build(np.arange(len(batch)), np.array([c for c, _ in batch], np.int32),
                                np.array([q for _, q in batch], np.int32), num_prefills,
                                table.table)


def _fill_context(kv_cache, block_ids, batch, full_k, full_v, k_scale, v_scale):
    k_view, v_view = FlashInferBackend.kv_cache_views(kv_cache)
    bs = kv_cache.shape[2]
    for ids, (c, _), k, v in zip(block_ids, batch, full_k, full_v, strict=True):
        for t in range(c):
            k_view[ids[t // bs], t % bs] = (k[t] / k_scale).to(CUDA, kv_cache.dtype)
            v_view[ids[t // bs], t % bs] = (v[t] / v_scale).to(CUDA, kv_cache.dtype)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("head_size,window,with_sinks", [
    (128, None, False), (64, 8, False), (64, 8, True)], ids=["d128", "d64-w8", "d64-w8-sinks"])
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill", "decode"])
def test_fp8_kv_cache_with_scales(batch, head_size, window, with_sinks):
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
                           window, None, "fp8", has_sinks=with_sinks)
    metadata = FlashInferBackend.get_builder_cls()(config).build(common)
    impl = FlashInferBackend.get_impl_cls()(AttentionLayerConfig(
        h, hkv, head_size, BF16, window, None, "fp8", has_sinks=with_sinks))
    impl.k_scale, impl.v_scale = k_scale, v_scale
    sinks = (torch.randn(h, generator=gen) * 2).to(BF16) if with_sinks else None
    if sinks is not None:
        impl.bind_sinks(sinks.to(CUDA))
    new = [(k[c:], v[c:]) for k, v, (c, _) in zip(full_k, full_v, batch_spec, strict=True)]
    out = impl.forward(torch.cat(queries).to(CUDA), torch.cat([k for k, _ in new]).to(CUDA),
                       torch.cat([v for _, v in new]).to(CUDA), kv_cache, metadata)

    def rounded(x, scale):
        return (x.float() / scale).to(fp8).float() * scale

    start = 0
    for i, (c, q) in enumerate(batch_spec):
        ref = reference_attention(queries[i], rounded(full_k[i], k_scale),
                                  rounded(full_v[i], v_scale), c, head_size ** -0.5, window, None,
                                  sinks)
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

@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_cudagraph_decode_replays_new_data(with_sinks):
    """Capture a padded decode step through build_for_cudagraph, then replay it for a different
    batch (fewer requests, longer contexts, other blocks): the real rows match an eager run and
    the float32 reference, and the cache ends up exactly as the eager run leaves it (padding
    wrote nothing)."""
    bs, h, hkv, d, padded = 16, 8, 2, 128, 4
    num_blocks, max_blocks = 64, 16
    gen = torch.Generator().manual_seed(11)
    config = BuilderConfig(h, hkv, d, BF16, bs, 8, 64, max_blocks, CUDA, has_sinks=with_sinks)
    builder = FlashInferBackend.get_builder_cls()(config)
    impl = FlashInferBackend.get_impl_cls()(AttentionLayerConfig(h, hkv, d, BF16,
                                                                 has_sinks=with_sinks))
    sinks = None
    if with_sinks:
        sinks = (torch.randn(h, generator=torch.Generator().manual_seed(12)) * 2).to(BF16)
        impl.bind_sinks(sinks.to(CUDA))
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
        ref = reference_attention(q[i:i + 1], full_k[i], full_v[i], c, d ** -0.5, None, None,
                                  sinks)
        torch.testing.assert_close(out[i:i + 1].float().cpu(), ref, rtol=2e-2, atol=2e-2)
