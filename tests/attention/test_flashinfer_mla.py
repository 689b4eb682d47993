"""FLASHINFER_MLA. On the CPU: availability and refusals, and the builder + impl plumbing (the
CSR plan arguments, the absorbed query pair, the padded CUDA-graph plan, the fallback of a step
FlashInfer refuses to TRITON_MLA's expanded prefill) against a stand-in for `flashinfer.mla`
that computes the wrapper's documented semantics in torch; compared with CPU_MLA in float32.

On a CUDA GPU with flashinfer (the `gpu` tests): the real kernels against CPU_MLA (torch on the
GPU, expanded) and TRITON_MLA in bf16 and fp16 over decode, prefill, chunked and mixed steps at
DeepSeek's latent widths (512 + 64); float32 is refused (FlashInfer's MLA kernels take fp16 and
bf16 only), so there is no float32 GPU case; a captured decode graph replayed on new data; and
the decode shape of the issue (64 x 4,096, 128 heads).
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from pagedserve.attention import get_backend_cls
from pagedserve.attention.backend import BuilderConfig
from pagedserve.attention.backends import flashinfer_mla as fim
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.mla import MLALayerConfig
from pagedserve.engine.input_batch import BlockTable
from tests.attention.test_triton_mla import DEVICE, Step
from tests.utils.conformance import BATCHES

FLASHINFER_MLA = get_backend_cls("FLASHINFER_MLA")
CPU_MLA = get_backend_cls("CPU_MLA")
TRITON_MLA = get_backend_cls("TRITON_MLA")
CPU = torch.device("cpu")


# ---- a stand-in for flashinfer.mla (CPU) ------------------------------------------------------

class _CSR:
    def __init__(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        self.qo_indptr, self.kv_indptr = qo_indptr, kv_indptr
        self.kv_indices, self.kv_len_arr = kv_indices, kv_len_arr


class FakeMLAWrapper:
    """BatchMLAPagedAttentionWrapper's contract as its docstrings state it: plan(CSR metadata,
    widths, page size, causal, sm_scale, dtypes); run(query=(q_nope, q_pe), kv_cache=packed
    [pages, page_size, ckv + kpe], out=[T, H, ckv]) is softmax((q_nope . ckv + q_pe . kpe) *
    sm_scale) @ ckv per request over its CSR pages, causal with the queries at the sequence end.
    With use_cuda_graph the metadata goes into the reserved buffers, whose shapes must match."""

    refuse_prefills = False  # stands for FlashInfer refusing a step's shape
    plans: list[dict] = []

    def __init__(self, workspace, use_cuda_graph=False, backend="auto", qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None):
        assert backend == "auto"
        self.graph = use_cuda_graph
        self.reserved = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        assert use_cuda_graph == all(t is not None for t in self.reserved)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout):
        csr = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
               metadata.kv_len_arr)
        for t in csr:
            assert t.dtype == torch.int32 and t.device.type == "cpu" and t.dim() == 1
        qo, kv, indices, kv_len = csr
        b = kv_len.numel()
        assert qo.numel() == kv.numel() == b + 1 and int(qo[0]) == int(kv[0]) == 0
        assert int(kv[-1]) == indices.numel()
        pages = torch.diff(kv)
        assert torch.equal(pages, (kv_len + page_size - 1) // page_size)
        if self.refuse_prefills and int(torch.diff(qo).max()) > 1:
            raise ValueError("stand-in refusal of a prefill shape")
        assert (query_layout, kv_cache_layout) == ("split", "packed") and causal
        if self.graph:  # reserved shapes as FlashInfer checks them; the copy goes in
            for buf, src in zip(self.reserved, csr, strict=True):
                assert buf is not None
                if buf is self.reserved[2]:
                    assert buf.numel() >= src.numel()
                else:
                    assert buf.shape == src.shape, (buf.shape, src.shape)
                buf[:src.numel()].copy_(src)
            csr = tuple(buf[:src.numel()] for buf, src in zip(self.reserved, csr, strict=True))
        self.csr = [t.clone() for t in csr]
        self.args = dict(num_heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe,
                         page_size=page_size, sm_scale=sm_scale, dtype=q_data_type)
        assert kv_data_type == q_data_type
        FakeMLAWrapper.plans.append(self.args)

    def run(self, *, query, kv_cache, out):
        q_nope, q_pe = query
        qo, kv, indices, kv_len = (t.tolist() for t in self.csr)
        a = self.args
        assert q_nope.shape == (qo[-1], a["num_heads"], a["ckv"]) == out.shape
        assert kv_cache.shape[1:] == (a["page_size"], a["ckv"] + a["kpe"])
        for i in range(len(kv_len)):
            rows = kv_cache[indices[kv[i]:kv[i + 1]]].flatten(0, 1)[:kv_len[i]].float()
            c, pe = rows.split([a["ckv"], a["kpe"]], dim=-1)
            qn, qp = q_nope[qo[i]:qo[i + 1]].float(), q_pe[qo[i]:qo[i + 1]].float()
            scores = (qn @ c.T + qp @ pe.T) * a["sm_scale"]  # [q, H, n]
            q_pos = kv_len[i] - (qo[i + 1] - qo[i]) + torch.arange(qo[i + 1] - qo[i])
            seen = torch.arange(kv_len[i])[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
            out[qo[i]:qo[i + 1]] = (torch.softmax(scores, -1) @ c).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    mla.MLAPlanMetadata = types.SimpleNamespace(csr=_CSR)
    module = types.ModuleType("flashinfer")
    module.mla = mla
    module.__version__ = "stand-in"
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(fim, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(FakeMLAWrapper, "refuse_prefills", False)
    monkeypatch.setattr(FakeMLAWrapper, "plans", [])
    return module


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_plumbing_matches_cpu_mla(fake_flashinfer, kind, block_size):
    step = Step(BATCHES[kind], block_size, torch.float32, CPU, seed=1)
    got, got_cache = step.run(FLASHINFER_MLA)
    assert step.metadata.prefill is None and step.metadata.token_start == 0
    plan = FakeMLAWrapper.plans[-1]
    layer = step.layer
    assert plan == dict(num_heads=layer.num_heads, ckv=layer.kv_lora_rank,
                        kpe=layer.qk_rope_head_dim, page_size=block_size,
                        sm_scale=layer.softmax_scale, dtype=torch.float32)
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)


@pytest.mark.skipif(not TRITON_MLA.is_available()[0], reason="needs Triton (or its interpreter)")
def test_refused_step_runs_prefills_expanded(fake_flashinfer):
    """FlashInfer refusing a step's shape: its prefills go through TRITON_MLA's expanded path,
    its decodes (planned alone, CSR rebased) through FlashInfer."""
    FakeMLAWrapper.refuse_prefills = True
    step = Step(BATCHES["mixed"], 4, torch.float32, DEVICE, seed=2)
    got, _ = step.run(FLASHINFER_MLA)
    md = step.metadata
    assert md.prefill is not None and md.token_start == step.common.num_prefill_tokens
    assert md.wrapper is not None and md.wrapper.csr[3].tolist() == [31 + 1, 32 + 1, 63 + 1,
                                                                       5 + 1]
    ref, _ = step.run(CPU_MLA)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # A step of prefills only then runs nothing through FlashInfer.
    step = Step(BATCHES["prefill"], 4, torch.float32, DEVICE, seed=2)
    got, _ = step.run(FLASHINFER_MLA)
    assert step.metadata.wrapper is None and step.metadata.prefill is not None
    ref, _ = step.run(CPU_MLA)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cudagraph_plan_pads_and_is_reused(fake_flashinfer):
    """A decode step of 3 padded to 5: the size's graph wrapper is planned from the padded
    step (reserved buffers of exactly its shape), the same metadata object comes back for
    the size, and the real rows equal the unpadded step's."""
    batch = BATCHES["decode"][:3]
    step = Step(batch, 4, torch.float32, CPU, seed=3)
    eager, _ = step.run(CPU_MLA)
    b, size, bs = len(batch), 5, 4
    common_builder = CommonMetadataBuilder(8, 8, step.max_blocks, bs, CPU)
    table = BlockTable(8, step.max_blocks)
    for row in range(b):
        n = math.ceil(sum(batch[row]) / bs)
        table.add_row(row, step.common.block_table[row, :n].tolist())
    common = common_builder.build(np.arange(b), np.array([c for c, _ in batch], np.int32),
                                  np.ones(b, np.int32), 0, table.table)
    padded = common_builder.pad_decode(common, size)
    config = BuilderConfig.for_layer(step.layer, bs, 8, 8, step.max_blocks, CPU)
    builder = FLASHINFER_MLA.get_builder_cls()(config)
    md = builder.build_for_cudagraph(common, size, padded)
    assert md.wrapper.graph and md.num_tokens == size
    assert md.slot_mapping.tolist()[b:] == [-1] * (size - b)
    assert md.wrapper.csr[3].tolist() == [c + 1 for c, _ in batch] + [1] * (size - b)
    impl = FLASHINFER_MLA.get_impl_cls()(step.layer)
    impl.bind_kv_b_proj(step.kv_b_proj)
    query = torch.cat([step.query, step.query[:size - b]])
    latent = torch.cat([step.latent, step.latent[:size - b]])
    cache = step.kv_cache.clone()
    out = impl.forward(query, latent, None, cache, md)
    torch.testing.assert_close(out[:b], eager, rtol=1e-5, atol=1e-5)
    assert builder.build_for_cudagraph(common, size, padded) is md
    with pytest.raises(ValueError, match="padded decode step"):
        builder.build_for_cudagraph(common, size, None)


def test_availability_and_refusals(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # an import of it fails
    ok, why = FLASHINFER_MLA.is_available()
    if not torch.cuda.is_available():
        assert not ok and "CUDA GPU" in why
    layer = MLALayerConfig(16, 1, 576, torch.bfloat16, scale=0.1, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cuda = torch.device("cuda")
    assert FLASHINFER_MLA.validate_configuration(layer, 16, cuda) == []
    small = MLALayerConfig(4, 1, 40, torch.bfloat16, scale=0.1, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    assert any("multiples of 128 / 64" in r
               for r in FLASHINFER_MLA.validate_configuration(small, 16, cuda))
    fp32 = MLALayerConfig(16, 1, 576, torch.float32, scale=0.1, kv_lora_rank=512,
                          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert "dtype torch.float32 not supported" in FLASHINFER_MLA.validate_configuration(
        fp32, 16, cuda)
    assert any("CUDA devices" in r for r in FLASHINFER_MLA.validate_configuration(layer, 16,
                                                                                  CPU))
    assert "mla" in FLASHINFER_MLA.features() and "cuda-graphs" in FLASHINFER_MLA.features()


# ---- the real kernels (GPU) -------------------------------------------------------------------

def _require_flashinfer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ok, why = FLASHINFER_MLA.is_available()
    if not ok:
        pytest.skip(f"FLASHINFER_MLA: {why}")


DEEPSEEK_DIMS = dict(lora=512, rope=64, nope=128, v=128)


def _compare(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 2e-2) -> None:
    diff = (got.float() - ref.float()).abs()
    worst = diff.flatten().argmax().item()
    torch.testing.assert_close(
        got.float(), ref.float(), rtol=tol, atol=tol,
        msg=lambda m: f"{what}: max abs diff {diff.max().item():.3g} at flat index {worst} "
                      f"(token {worst // (got.shape[1] * got.shape[2])}); {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_matches_cpu_mla_and_triton_mla(kind, heads, dtype):
    _require_flashinfer()
    step = Step(BATCHES[kind], 16, dtype, DEVICE, seed=4, heads=heads, **DEEPSEEK_DIMS)
    got, got_cache = step.run(FLASHINFER_MLA)
    assert step.metadata.prefill is None, "FlashInfer refused this step's shape"
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)
    _compare(got, ref, f"FLASHINFER_MLA vs CPU_MLA, {kind}, {heads} heads, {dtype}")
    triton_out, _ = step.run(TRITON_MLA)
    _compare(got, triton_out, f"FLASHINFER_MLA vs TRITON_MLA, {kind}, {heads} heads, {dtype}")


@pytest.mark.gpu
def test_gpu_decode_shape_bf16():
    """The issue's decode shape: 64 sequences x 4,096 context, 128 heads, page 64."""
    _require_flashinfer()
    step = Step([(4095, 1)] * 64, 64, torch.bfloat16, DEVICE, seed=9, heads=128,
                **DEEPSEEK_DIMS)
    got, got_cache = step.run(FLASHINFER_MLA)
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)
    _compare(got, ref, "FLASHINFER_MLA vs CPU_MLA, 64 x 4,096 decode")


@pytest.mark.gpu
def test_gpu_captured_decode_graph_replays_new_steps():
    """A size-8 graph captured on one decode step of 5 requests, replayed after re-planning for
    other contexts and queries: the real rows equal an eager run of the same step."""
    _require_flashinfer()
    bs, size, max_blocks = 16, 8, 8
    layer_step = Step([(40, 1)] * 5, bs, torch.bfloat16, DEVICE, seed=5, heads=16,
                      **DEEPSEEK_DIMS)
    layer = layer_step.layer
    num_blocks = 64
    cache = torch.randn(num_blocks, bs, 576, device=DEVICE).to(torch.bfloat16)
    common_builder = CommonMetadataBuilder(size, size, max_blocks, bs, DEVICE)
    config = BuilderConfig.for_layer(layer, bs, size, size, max_blocks, DEVICE)
    builder = FLASHINFER_MLA.get_builder_cls()(config)
    impl = FLASHINFER_MLA.get_impl_cls()(layer)
    impl.bind_kv_b_proj(layer_step.kv_b_proj)
    query = torch.zeros(size, 16, 192, device=DEVICE, dtype=torch.bfloat16)
    latent = torch.zeros(size, 1, 576, device=DEVICE, dtype=torch.bfloat16)
    rng = np.random.default_rng(0)

    def step(contexts: list[int]):
        b = len(contexts)
        table = np.full((size, max_blocks), -1, np.int32)
        ids = rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks)
        table[:b] = ids
        common = common_builder.build(np.arange(b), np.array(contexts, np.int32),
                                      np.ones(b, np.int32), 0, table)
        padded = common_builder.pad_decode(common, size)
        query.normal_()
        latent.normal_()
        return common, builder.build_for_cudagraph(common, size, padded)

    _, md = step([40, 7, 100, 33, 64])
    impl.forward(query, latent, None, cache, md)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, latent, None, cache, md)
    for contexts in ([12, 90, 3], [100, 1, 50, 77, 20, 8, 64]):
        common, md2 = step(contexts)
        assert md2 is md
        before = cache.clone()
        graph.replay()
        b = len(contexts)
        eager_md = builder.build(common)
        eager = impl.forward(query[:b], latent[:b], None, before, eager_md)
        _compare(out[:b], eager, f"graph replay vs eager, contexts {contexts}", tol=1e-2)
        torch.testing.assert_close(cache, before, rtol=0, atol=0)
