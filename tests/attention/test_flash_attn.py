"""FLASH_ATTN. On the CPU: implementation choice, layout, refusals, the paged-gather Triton
kernel (interpreted) and the torch path's per-step plumbing (builder, gather groups,
sliding-window trimming, cache writes) with a plain float32 stand-in for torch's CUDA-only varlen
kernel.

On a GPU (the `gpu` tests), for every implementation installed (fa3, fa2, fa4, torch): the
conformance grid against the float32 reference, half precision, head size 256, soft-cap, long
contexts, page 128, the torch path's request groups, and a decode step captured in a CUDA graph
and replayed with new metadata. An implementation that is not installed is skipped with why.

    PAGEDSERVE_FLASH_ATTN_IMPL is set per test; run the GPU tests with
    `pytest -q -m gpu tests/attention/test_flash_attn.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
import torch

import pagedserve.attention.backends.flash_attn as fa
from pagedserve.attention import (
    AttentionLayerConfig,
    BackendSelectionError,
    BuilderConfig,
    select_backend,
)
from pagedserve.attention.backends.flash_attn import FlashAttentionBackend
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.ops.paged_gather import paged_gather
from pagedserve.engine.input_batch import BlockTable
from tests.utils.conformance import BATCHES, Case, reference_attention, run_case

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
# Triton kernels on CPU tensors need the interpreter (tests/conftest.py sets it without CUDA).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="launches Triton on CPU tensors (interpreter only)")
GATHER_DEVICE = CPU if os.environ.get("TRITON_INTERPRET") == "1" else CUDA


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a GPU is here; `fake_gpu(fa4=True, torch=True)` says which implementations
    can run (the others report 'not installed')."""
    monkeypatch.delenv(fa.IMPL_ENV_VAR, raising=False)
    monkeypatch.setattr(fa, "_device_problem", lambda: None)
    monkeypatch.setattr(fa, "_logged_choices", set())

    def install(**runnable: bool) -> None:
        for name in fa.PROBES:
            ok = runnable.get(name, False)
            monkeypatch.setitem(fa.PROBES, name,
                                lambda ok=ok, name=name: (ok, f"{name} ok" if ok
                                                          else f"{name} not installed"))
    return install


# ---- choosing the implementation ---------------------------------------------------------

@no_cuda
def test_unavailable_without_cuda():
    ok, why = FlashAttentionBackend.is_available()
    assert not ok
    assert "no CUDA device" in why


@no_cuda
def test_selector_refuses_flash_attn_on_cpu():
    layer = AttentionLayerConfig(4, 2, 64, torch.float32)
    with pytest.raises(BackendSelectionError, match="FLASH_ATTN is not available.*no CUDA"):
        select_backend("FLASH_ATTN", CPU, [layer], 16)


@no_cuda
def test_impl_and_builder_refuse_to_start_without_cuda():
    with pytest.raises(RuntimeError, match="FLASH_ATTN cannot run: no CUDA"):
        fa.FlashAttentionImpl(AttentionLayerConfig(4, 2, 64, torch.bfloat16, scale=0.125))


@pytest.mark.parametrize("runnable,expected", [
    ({"fa3": True, "fa2": True, "fa4": True, "torch": True}, "fa3"),
    ({"fa2": True, "fa4": True, "torch": True}, "fa2"),
    ({"fa4": True, "torch": True}, "fa4"),
    ({"torch": True}, "torch"),
])
def test_auto_order(fake_gpu, runnable, expected):
    fake_gpu(**runnable)
    ok, why = FlashAttentionBackend.is_available()
    assert ok and why.startswith(f"{expected}: ")
    assert fa.choose_implementation().name == expected


def test_nothing_runnable_lists_every_reason(fake_gpu):
    fake_gpu()
    ok, why = FlashAttentionBackend.is_available()
    assert not ok
    for name in ("fa3", "fa2", "fa4", "torch"):
        assert f"{name} not installed" in why


def test_env_var_forces_an_implementation(fake_gpu, monkeypatch):
    fake_gpu(fa4=True, torch=True)
    monkeypatch.setenv(fa.IMPL_ENV_VAR, "torch")
    ok, why = FlashAttentionBackend.is_available()
    assert ok and why.startswith("torch (forced by PAGEDSERVE_FLASH_ATTN_IMPL)")
    monkeypatch.setenv(fa.IMPL_ENV_VAR, "FA4")
    assert fa.choose_implementation().name == "fa4"


def test_forced_unavailable_implementation_is_an_error(fake_gpu, monkeypatch):
    fake_gpu(fa4=True, torch=True)
    monkeypatch.setenv(fa.IMPL_ENV_VAR, "fa3")
    ok, why = FlashAttentionBackend.is_available()
    assert not ok
    assert "PAGEDSERVE_FLASH_ATTN_IMPL=fa3 cannot run: fa3 not installed" in why
    with pytest.raises(RuntimeError, match="fa3 not installed"):
        fa.FlashAttentionImpl(AttentionLayerConfig(4, 2, 64, torch.bfloat16, scale=0.125))
    layer = AttentionLayerConfig(4, 2, 64, torch.bfloat16)
    assert any("fa3 not installed" in r
               for r in FlashAttentionBackend.validate_configuration(layer, 16, CUDA))


def test_unknown_forced_name_lists_valid_ones(fake_gpu, monkeypatch):
    fake_gpu(torch=True)
    monkeypatch.setenv(fa.IMPL_ENV_VAR, "fa9")
    ok, why = FlashAttentionBackend.is_available()
    assert not ok and "'fa9' is not one of fa3, fa2, fa4, torch" in why


@pytest.mark.parametrize("runnable,block_size,graphs", [
    (dict(fa4=True), 16, True),
    (dict(fa3=True), 16, True),
    (dict(fa2=True), 256, True),  # FA2's paged kernel
    (dict(fa2=True), 16, False),  # FA2 over gathered pages
    (dict(torch=True), 16, False),
    ({}, 16, False),
])
def test_cuda_graphs_only_for_paged_kernels(fake_gpu, runnable, block_size, graphs):
    fake_gpu(**runnable)
    assert FlashAttentionBackend.can_capture_cuda_graphs(block_size) is graphs


def test_choice_is_logged_once(fake_gpu, caplog):
    fake_gpu(fa4=True)
    with caplog.at_level(logging.INFO, logger=fa.__name__):
        fa.choose_implementation()
        fa.choose_implementation()
    logged = [r.getMessage() for r in caplog.records if "FLASH_ATTN implementation" in
              r.getMessage()]
    assert logged == ["FLASH_ATTN implementation: fa4: fa4 ok"]


def test_real_probes_report_a_reason():
    # Whatever is installed here, each probe answers (ok, reason) without raising.
    if fa._device_problem() is not None:
        pytest.skip("probes need a CUDA device")
    for probe in fa.PROBES.values():
        ok, why = probe()
        assert isinstance(ok, bool) and why


# ---- layout and refusals ------------------------------------------------------------------

def test_kv_cache_layout_is_kv_outermost():
    shape = FlashAttentionBackend.get_kv_cache_shape(7, 16, 3, 64)
    assert shape == (2, 7, 16, 3, 64)
    cache = torch.arange(np.prod(shape), dtype=torch.float32).view(shape)
    k, v = FlashAttentionBackend.kv_cache_views(cache)
    assert k.shape == v.shape == (7, 16, 3, 64)
    assert torch.equal(k, cache[0]) and torch.equal(v, cache[1])
    assert k.is_contiguous() and v.is_contiguous()


def _problems(layer: AttentionLayerConfig, block_size: int = 16, device=CUDA) -> list[str]:
    return FlashAttentionBackend.validate_configuration(layer, block_size, device)


def test_torch_path_refuses_soft_cap(fake_gpu):
    fake_gpu(torch=True)
    layer = AttentionLayerConfig(8, 2, 128, torch.bfloat16, logits_soft_cap=30.0)
    reasons = _problems(layer)
    assert len(reasons) == 1 and "soft-cap" in reasons[0] and "torch" in reasons[0]
    with pytest.raises(ValueError, match="soft-cap"):
        fa.FlashAttentionImpl(AttentionLayerConfig(8, 2, 128, torch.bfloat16, logits_soft_cap=30.0,
                                                 scale=0.1))


def test_paged_kernels_accept_soft_cap_and_window(fake_gpu):
    fake_gpu(fa4=True)
    layer = AttentionLayerConfig(8, 2, 128, torch.bfloat16, sliding_window=64,
                                 logits_soft_cap=30.0)
    assert _problems(layer, block_size=1) == []


@pytest.mark.parametrize("head_size,dtype,expect", [
    (96, torch.bfloat16, "head size 96"),
    (64, torch.float32, "dtype torch.float32 not supported"),
    (256, torch.float16, None),
])
def test_head_size_and_dtype_refusals(fake_gpu, head_size, dtype, expect):
    fake_gpu(torch=True)
    reasons = _problems(AttentionLayerConfig(4, 4, head_size, dtype))
    if expect is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and expect in reasons[0]


def test_fa2_pages_only_blocks_of_256_and_gathers_otherwise(fake_gpu):
    fake_gpu(fa2=True)
    layer = AttentionLayerConfig(4, 2, 64, torch.float16, logits_soft_cap=5.0)
    assert _problems(layer, block_size=16) == [] and _problems(layer, block_size=256) == []
    assert fa.gathers_pages("fa2", 16) and not fa.gathers_pages("fa2", 512)
    assert fa.gathers_pages("torch", 256) and not fa.gathers_pages("fa4", 16)


def test_refuses_cpu_device_and_quantized_cache(fake_gpu):
    fake_gpu(torch=True)
    layer = AttentionLayerConfig(4, 2, 64, torch.float16, kv_cache_dtype="fp8")
    reasons = _problems(layer, device=CPU)
    assert any("CUDA devices" in r for r in reasons)
    assert any("kv_cache_dtype" in r for r in reasons)


# ---- the paged-gather Triton kernel (interpreted here) ------------------------------------

def _paged_cache(seq_lens, block_size, hkv, d, dtype, seed, spare=3):
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(pages) + 2), -1, dtype=torch.int32)
    start = 0
    for r, p in enumerate(pages):
        table[r, :p] = perm[start:start + p].int()
        start += p
    return cache, table


def _torch_gather(cache_part, table_row, first_token, seq_len):
    pages = -(-seq_len // cache_part.shape[1])
    return cache_part[table_row[:pages].long()].flatten(0, 1)[first_token:seq_len]


@pytest.mark.parametrize("block_size,hkv,d,dtype,page_start", [
    (16, 3, 64, torch.float16, [0, 0, 1, 2, 0]),
    (1, 2, 64, torch.float32, [0, 3, 10, 0, 20]),
    (5, 1, 32, torch.float32, [0, 1, 0, 6, 2]),  # block size not a power of two
    (32, 4, 128, torch.bfloat16, None),  # bf16 is only moved, never computed on
])
def test_paged_gather_matches_torch(block_size, hkv, d, dtype, page_start):
    seq_lens = [17, 9, 40, 33, 47]
    cache, table = _paged_cache(seq_lens, block_size, hkv, d, dtype, seed=block_size)
    starts = page_start or [0] * len(seq_lens)
    kv_lens = [n - p * block_size for n, p in zip(seq_lens, starts, strict=True)]
    cu = torch.tensor([0] + np.cumsum(kv_lens).tolist(), dtype=torch.int32)
    rows = int(cu[-1]) + 4
    k_out = torch.full((rows, hkv, d), 7.0, dtype=dtype, device=GATHER_DEVICE)
    v_out = torch.full((rows, hkv, d), 7.0, dtype=dtype, device=GATHER_DEVICE)
    max_pages = max(-(-n // block_size) for n in kv_lens) + 1  # a loose bound is fine
    on = dict(device=GATHER_DEVICE)
    paged_gather(cache[0].to(**on), cache[1].to(**on), k_out, v_out, table.to(**on),
                 torch.tensor(seq_lens, dtype=torch.int32, **on), cu.to(**on), max_pages,
                 None if page_start is None else torch.tensor(starts, dtype=torch.int32, **on))
    k_out, v_out = k_out.cpu(), v_out.cpu()
    for r, n in enumerate(seq_lens):
        first = starts[r] * block_size
        rows_r = slice(int(cu[r]), int(cu[r + 1]))
        assert torch.equal(k_out[rows_r], _torch_gather(cache[0], table[r], first, n))
        assert torch.equal(v_out[rows_r], _torch_gather(cache[1], table[r], first, n))
    assert (k_out[int(cu[-1]):] == 7).all() and (v_out[int(cu[-1]):] == 7).all()


def test_paged_gather_rejects_strided_rows():
    cache = torch.zeros(2, 4, 16, 2, 64)
    out = torch.zeros(64, 2, 128)[..., :64]
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        paged_gather(cache[0], cache[1], out, out, one.view(1, 1), one,
                     torch.tensor([0, 1], dtype=torch.int32), 1)


# ---- the torch path end to end, with a float32 stand-in for the CUDA kernel ---------------

def reference_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale, window_size_left=None,
                            window_size_right=None):
    """What aten._flash_attention_forward computes, plainly: per sequence, causal aligned to
    the end of its K, window [i - left, i] around the aligned position."""
    assert dropout_p == 0.0 and is_causal and not return_debug_mask
    out = torch.zeros_like(q)
    hq, hk = q.shape[1], k.shape[1]
    for i in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert qe - qs <= max_q and ke - ks <= max_k
        qi = q[qs:qe].float()
        ki = k[ks:ke].float().repeat_interleave(hq // hk, 1)
        vi = v[ks:ke].float().repeat_interleave(hq // hk, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        aligned = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
        key = torch.arange(ke - ks)[None, :]
        allowed = key <= aligned
        if window_size_left is not None and window_size_left >= 0:
            allowed &= key >= aligned - window_size_left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi).to(q.dtype)
    return out, None, None, None, None


@pytest.fixture
def torch_path(fake_gpu, monkeypatch):
    fake_gpu(torch=True)
    real_load = fa._load_kernel
    monkeypatch.setattr(fa, "_load_kernel", lambda impl: reference_varlen_kernel
                        if impl == "torch" else real_load(impl))


def _torch_path_params():
    for batch in BATCHES:
        for block_size in (1, 16):
            for ratio in (1, 3):
                for window in (None, 8):
                    if block_size == 1 and (ratio == 3 or window is None):
                        continue
                    yield pytest.param(batch, block_size, ratio, window,
                                       id=f"{batch}-bs{block_size}-gqa{ratio}-w{window}")


@interpreted
@pytest.mark.parametrize("batch,block_size,ratio,window", list(_torch_path_params()))
def test_torch_path_matches_reference(torch_path, batch, block_size, ratio, window):
    run_case(FlashAttentionBackend,
             Case(BATCHES[batch], block_size, 2 * ratio, 2, 64, torch.float32, window), CPU)


@interpreted
def test_torch_path_half_precision(torch_path):
    run_case(FlashAttentionBackend,
             Case(BATCHES["mixed"], 16, 8, 2, 64, torch.float16, 8, seed=3), CPU)


@interpreted
def test_torch_path_splits_a_large_step_into_groups(torch_path, monkeypatch):
    # The smallest capacity (one request's worst case) forces several groups in "mixed".
    monkeypatch.setenv(fa.GATHER_TOKENS_ENV_VAR, "1")
    run_case(FlashAttentionBackend, Case(BATCHES["mixed"], 16, 4, 2, 64, torch.float32), CPU)
    run_case(FlashAttentionBackend, Case(BATCHES["chunked_prefill"], 16, 4, 2, 64,
                                         torch.float32, 8), CPU)


def _step(batch, block_size, max_num_reqs=None):
    """CommonAttentionMetadata for `batch` [(context, query)] on consecutive blocks."""
    pages = [-(-(c + q) // block_size) for c, q in batch]
    table = BlockTable(max_num_reqs or len(batch), max(pages))
    start = 0
    for row, p in enumerate(pages):
        table.add_row(row, list(range(start, start + p)))
        start += p
    builder = CommonMetadataBuilder(max_num_reqs or len(batch), sum(q for _, q in batch),
                                    max(pages), block_size, CPU)
    common = builder.build(np.arange(len(batch)), np.array([c for c, _ in batch], np.int32),
                           np.array([q for _, q in batch], np.int32),
                           sum(1 for _, q in batch if q > 1), table.table)
    return common, sum(pages), max(pages)


def _builder(common, max_blocks, block_size, window=None, hkv=2, d=64):
    config = BuilderConfig(4, hkv, d, torch.float32, block_size, common.num_reqs,
                           common.slot_mapping.shape[0], max_blocks, CPU, window)
    return fa.FlashAttentionMetadataBuilder(config)


def test_sliding_window_gathers_only_visible_pages(torch_path):
    batch = [(0, 20), (40, 8), (63, 1), (5, 1)]
    common, _, max_blocks = _step(batch, 16)
    md = _builder(common, max_blocks, 16, window=8).build(common)
    # First key a request's new tokens can see: context - 7; its page: // 16.
    assert md.page_start.tolist() == [0, 2, 3, 0]
    (group,) = md.groups
    assert group.cu_seqlens_k.tolist() == [0, 20, 20 + 16, 20 + 16 + 16, 20 + 16 + 16 + 6]
    assert group.cu_seqlens_q.tolist() == [0, 20, 28, 29, 30]
    assert (group.max_query_len, group.max_kv_len, group.max_pages) == (20, 20, 2)


def test_capture_bound_fixes_launch_sizes(torch_path):
    common, _, max_blocks = _step([(15, 1), (40, 1)], 16)
    builder = _builder(common, max_blocks, 16)
    builder.capture_max_seq_len = 48
    md = builder.build(common)
    (group,) = md.groups
    assert md.max_seq_len == 48 and group.max_kv_len == 48 and group.max_pages == 3


def test_padded_step_writes_without_stray_slots(torch_path):
    """A step padded for a CUDA graph (slot -1 past the real tokens) writes the real tokens
    only."""
    batch = [(3, 4), (9, 1)]
    common, num_blocks, max_blocks = _step(batch, 4)
    n = common.num_actual_tokens
    padded = dataclasses.replace(common, slot_mapping=torch.cat(
        [common.slot_mapping, torch.full((3,), -1, dtype=torch.int64)]))
    md = _builder(padded, max_blocks, 4).build(padded)
    assert md.slot_mapping.tolist()[n:] == [-1, -1, -1]

    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n + 3, 2, 64, generator=gen)
    value = torch.randn(n + 3, 2, 64, generator=gen)
    cache = torch.zeros(2, num_blocks, 4, 2, 64)
    fa.write_kv(cache[0], cache[1], key, value, md)
    expected = torch.zeros_like(cache)
    slots = common.slot_mapping
    expected[0].view(-1, 2, 64)[slots] = key[:n]
    expected[1].view(-1, 2, 64)[slots] = value[:n]
    assert torch.equal(cache, expected)


def test_reference_kernel_agrees_with_conformance_reference():
    # The stand-in above must itself be right: check it against conformance's reference.
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 32, generator=gen)
    k = torch.randn(12, 2, 32, generator=gen)
    v = torch.randn(12, 2, 32, generator=gen)
    cu_q, cu_k = torch.tensor([0, 5]), torch.tensor([0, 12])
    got = reference_varlen_kernel(q, k, v, cu_q, cu_k, 5, 12, 0.0, True, False, scale=0.2,
                                  window_size_left=3, window_size_right=0)[0]
    torch.testing.assert_close(got, reference_attention(q, k, v, 7, 0.2, 4, None))


# ---- the paged implementations' call sites, with float32 stand-ins -------------------------
# Each stand-in takes exactly the arguments (names, keyword-only where the real API allows)
# that the real function documents, so a misnamed or misplaced argument fails here.

def _reference(q, cu_q, keys_values, scale, window_left, softcap):
    """float32 attention per sequence over its (K, V) [n, Hkv, D]; causal aligned to the end."""
    out = torch.zeros_like(q)
    hq = q.shape[1]
    for i, (k, v) in enumerate(keys_values):
        qs, qe, n = int(cu_q[i]), int(cu_q[i + 1]), k.shape[0]
        k = k.float().repeat_interleave(hq // k.shape[1], 1)
        v = v.float().repeat_interleave(hq // v.shape[1], 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        aligned = torch.arange(qe - qs)[:, None] + n - (qe - qs)
        key = torch.arange(n)[None, :]
        allowed = key <= aligned
        if window_left is not None and window_left >= 0:
            allowed &= key >= aligned - window_left
        out[qs:qe] = torch.einsum("hqk,khd->qhd",
                                  scores.masked_fill(~allowed, float("-inf")).softmax(-1),
                                  v).to(q.dtype)
    return out


def _pages(k_cache, v_cache, table, kv_lens):
    return [(_torch_gather(k_cache, table[i], 0, int(n)), _torch_gather(v_cache, table[i], 0,
                                                                         int(n)))
            for i, n in enumerate(kv_lens)]


def fa3_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q,
                     max_seqlen_q, softmax_scale, causal, window_size, softcap):
    assert causal and int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
    return _reference(q, cu_seqlens_q, _pages(k_cache, v_cache, page_table, cache_seqlens),
                      softmax_scale, window_size[0], softcap)


def fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               softmax_scale, causal, window_size, softcap, block_table=None):
    kv_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    assert causal and max(kv_lens) <= max_seqlen_k
    assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
    if block_table is not None:
        keys_values = _pages(k, v, block_table, kv_lens)
    else:  # contiguous varlen K/V (gathered pages)
        starts = cu_seqlens_k[:-1].tolist()
        keys_values = [(k[s:s + n], v[s:s + n]) for s, n in zip(starts, kv_lens, strict=True)]
    return _reference(q, cu_seqlens_q, keys_values, softmax_scale, window_size[0], softcap)


def fa4_varlen(q, k, v, *, cu_seqlens_q, seqused_k, max_seqlen_q, page_table, softmax_scale,
               causal, num_splits, window_size=(None, None), softcap=0.0):
    assert causal and num_splits == 1 and page_table.dtype == torch.int32
    return _reference(q, cu_seqlens_q, _pages(k, v, page_table, seqused_k), softmax_scale,
                      window_size[0], softcap), None


@pytest.mark.parametrize("impl,kernel,block_size", [
    ("fa3", fa3_with_kvcache, 16),
    ("fa2", fa2_varlen, 256),  # paged
    pytest.param("fa2", fa2_varlen, 16, marks=interpreted),  # gathered pages
    ("fa4", fa4_varlen, 16),
])
@pytest.mark.parametrize("batch,window,soft_cap", [("mixed", None, None),
                                                   ("chunked_prefill", 8, 5.0),
                                                   ("decode", 8, None)])
def test_call_sites(fake_gpu, monkeypatch, impl, kernel, block_size, batch, window, soft_cap):
    fake_gpu(**{impl: True})
    monkeypatch.setattr(fa, "_load_kernel", lambda name: kernel)
    run_case(FlashAttentionBackend,
             Case(BATCHES[batch], block_size, 6, 2, 64, torch.float32, window, soft_cap), CPU)


# ---- on a GPU: every implementation installed ---------------------------------------------

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


@pytest.mark.gpu
@pytest.mark.parametrize("batch,block_size,ratio,head_size,window", list(_grid()))
def test_grid_bf16(impl, batch, block_size, ratio, head_size, window):
    if block_size == 256 and impl != "fa2":
        pytest.skip("page 256 is only needed by fa2 (the others run 1/16/32)")
    _run(Case(BATCHES[batch], block_size, 2 * ratio, 2, head_size, torch.bfloat16, window))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["mixed", "chunked_prefill", "decode"])
@pytest.mark.parametrize("window", [None, 8])
def test_fp16(impl, batch, window):
    block_size = 256 if impl == "fa2" else 16
    _run(Case(BATCHES[batch], block_size, 8, 2, 128, torch.float16, window, seed=1))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 8])
def test_head_size_256(impl, window):
    block_size = 256 if impl == "fa2" else 16
    _run(Case(BATCHES["mixed"], block_size, 4, 2, 256, torch.bfloat16, window, seed=2))


@pytest.mark.gpu
def test_soft_cap(impl):
    block_size = 256 if impl == "fa2" else 16
    case = Case(BATCHES["mixed"], block_size, 4, 2, 64, torch.bfloat16, None, 5.0, seed=3)
    if impl == "torch":
        layer = AttentionLayerConfig(4, 2, 64, torch.bfloat16, logits_soft_cap=5.0)
        assert FlashAttentionBackend.validate_configuration(layer, 16, DEVICE)
        pytest.skip("torch's kernel has no soft-cap (refused, as checked)")
    _run(case)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_contexts(impl, window, dtype):
    # Several kernel tiles per sequence, chunked prefill against a long context.
    block_size = 256 if impl == "fa2" else 16
    _run(Case(LONG, block_size, 32, 8, 128, dtype, window, seed=4))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_page_128(impl, batch):
    # FA4 loads 128-token pages by TMA; the cache rows past each sequence are finite here.
    _run(Case(BATCHES[batch] + [(300, 1), (129, 200)], 128, 8, 2, 128, torch.bfloat16))


@pytest.mark.gpu
def test_torch_path_groups(monkeypatch):
    monkeypatch.setenv(fa.IMPL_ENV_VAR, "torch")
    monkeypatch.setenv(fa.GATHER_TOKENS_ENV_VAR, "1")  # one request's worth: many groups
    ok, why = FlashAttentionBackend.is_available()
    if not ok:
        pytest.skip(why)
    _run(Case(BATCHES["mixed"], 16, 8, 2, 128, torch.bfloat16, 8))
    _run(Case(LONG, 16, 8, 2, 64, torch.bfloat16))


@pytest.mark.gpu
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
    layer = fa.FlashAttentionImpl(AttentionLayerConfig(h, hkv, d, dtype))
    query = torch.zeros(b, h, d, dtype=dtype, device=DEVICE)
    key = torch.zeros(b, hkv, d, dtype=dtype, device=DEVICE)
    value = torch.zeros_like(key)
    out = torch.zeros_like(query)

    def step(context_lens):
        common = common_builder.build(np.arange(b), np.array(context_lens, dtype=np.int32),
                                      np.ones(b, dtype=np.int32), 0, table.table)
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
