"""TRITON_MLA against CPU_MLA (the expanded torch reference) on the same random paged latent
cache and weights, over decode, prefill, chunked prefill and mixed steps; the kernel alone
against a dense torch computation of the absorbed form; the latent write; selection; a tiny
DeepSeek-V3 through the engine against transformers. On the CPU the kernels run in the Triton
interpreter (small shapes); the `gpu` test runs DeepSeek's decode shape in bf16."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve.attention import BackendSelectionError, get_backend_cls, select_backend
from pagedserve.attention.backend import AttentionLayerConfig, BuilderConfig
from pagedserve.attention.metadata import CommonMetadataBuilder
from pagedserve.attention.mla import MLAImpl, MLALayerConfig
from pagedserve.engine.input_batch import BlockTable
from tests.utils.conformance import BATCHES

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_MLA = get_backend_cls("TRITON_MLA")
CPU_MLA = get_backend_cls("CPU_MLA")
if DEVICE.type == "cpu" and not TRITON_MLA.is_available()[0]:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from pagedserve.attention.ops.mla_decode import (  # noqa: E402
    MLATiles,
    decode_splits,
    default_decode_tiles,
    mla_attention,
    write_latents,
)

# kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, heads
SMALL = dict(lora=32, rope=8, nope=16, v=12, heads=4)


def _layer(lora: int, rope: int, nope: int, v: int, heads: int,
           dtype: torch.dtype) -> MLALayerConfig:
    return MLALayerConfig(heads, 1, lora + rope, dtype, scale=(nope + rope) ** -0.5,
                          kv_lora_rank=lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                          v_head_dim=v)


class Step:
    """A random paged latent cache (shuffled block ids) holding each request's context, the
    step's queries and latents, kv_b_proj, and the common metadata of the step."""

    def __init__(self, batch: list[tuple[int, int]], block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, **shape: int) -> None:
        shape = {**SMALL, **shape}
        gen = torch.Generator().manual_seed(seed)
        self.layer = _layer(**shape, dtype=dtype)
        lora, rope, nope, v, h = (shape[k] for k in ("lora", "rope", "nope", "v", "heads"))
        blocks = [math.ceil((c + q) / block_size) for c, q in batch]
        num_blocks = sum(blocks) + 2
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        table = BlockTable(len(batch), max(blocks))
        pos = 0
        for row, n in enumerate(blocks):
            table.add_row(row, perm[pos:pos + n])
            pos += n
        self.kv_cache = torch.randn(num_blocks, block_size, lora + rope,
                                    generator=gen).to(dtype).to(device)
        t = sum(q for _, q in batch)
        self.query = torch.randn(t, h, nope + rope, generator=gen).to(dtype).to(device)
        self.latent = torch.randn(t, 1, lora + rope, generator=gen).to(dtype).to(device)
        # Scaled so the scores spread over a few units, as a trained model's do.
        self.kv_b_proj = (torch.randn(h * (nope + v), lora, generator=gen)
                          / math.sqrt(lora)).to(dtype).to(device)
        builder = CommonMetadataBuilder(len(batch), t, max(blocks), block_size, device)
        self.common = builder.build(
            rows=np.arange(len(batch)),
            num_computed=np.array([c for c, _ in batch], dtype=np.int32),
            num_scheduled=np.array([q for _, q in batch], dtype=np.int32),
            num_prefills=sum(1 for _, q in batch if q > 1), block_table=table.table)
        self.block_size, self.max_blocks = block_size, max(blocks)

    def run(self, backend, expand_budget_bytes: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [T, H, v], the cache after the step) of `backend` on a copy of the cache.
        expand_budget_bytes: TRITON_MLA's limit on the expanded prefill buffer, if not the
        default."""
        cache = self.kv_cache.clone()
        config = BuilderConfig.for_layer(self.layer, self.block_size, self.common.num_reqs,
                                         self.common.num_actual_tokens, self.max_blocks,
                                         cache.device)
        builder = backend.get_builder_cls()(config)
        if expand_budget_bytes is not None:
            builder.expand_budget_bytes = expand_budget_bytes
        metadata = builder.build(self.common)
        self.metadata = metadata
        impl = backend.get_impl_cls()(self.layer)
        assert isinstance(impl, MLAImpl)
        impl.bind_kv_b_proj(self.kv_b_proj)
        out = impl.forward(self.query, self.latent, None, cache, metadata)
        return out, cache


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_backend_matches_cpu_mla(kind, block_size):
    step = Step(BATCHES[kind], block_size, torch.float32, DEVICE)
    got, got_cache = step.run(TRITON_MLA)
    ref, ref_cache = step.run(CPU_MLA)
    assert got.shape == ref.shape == (step.query.shape[0], SMALL["heads"], SMALL["v"])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)


# A prefill, a chunk continuing a cached context (across a page boundary), a one-page prompt
# and decodes of various contexts, in batch order.
MIXED_CHUNKED = [(0, 13), (33, 19), (7, 2), (40, 1), (0, 1), (15, 1)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [3, 8])
def test_expanded_prefill_and_absorbed_decode_match_cpu_mla(block_size, heads):
    """The prefills run expanded (per-head K of nope + rope, V of v through the unified
    kernel), the decodes absorbed, in one step; against CPU_MLA in float32."""
    step = Step(MIXED_CHUNKED, block_size, torch.float32, DEVICE, seed=6, heads=heads, nope=24,
                v=20)
    got, got_cache = step.run(TRITON_MLA)
    md, common = step.metadata, step.common
    assert md.prefill is not None and md.prefill.num_reqs == common.num_prefills == 3
    assert md.absorbed_token_start == md.prefill.num_tokens == common.num_prefill_tokens == 34
    assert md.num_qblocks == 3  # the decodes alone, one token each
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["chunked_prefill", "mixed"])
def test_prefill_over_budget_runs_absorbed(kind):
    """A step whose expanded buffer would exceed the budget runs its prefills absorbed, and
    agrees with CPU_MLA all the same."""
    step = Step(BATCHES[kind], 4, torch.float32, DEVICE, seed=7)
    got, _ = step.run(TRITON_MLA, expand_budget_bytes=0)
    assert step.metadata.prefill is None and step.metadata.absorbed_token_start == 0
    ref, _ = step.run(CPU_MLA)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_decode_step_plans_no_prefill():
    step = Step(BATCHES["decode"], 16, torch.float32, DEVICE)
    step.run(TRITON_MLA)
    md = step.metadata
    assert md.prefill is None and md.absorbed_token_start == 0
    assert md.tiles.block_q == 1 and md.num_qblocks == len(BATCHES["decode"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backend_half_precision(dtype):
    """The absorbed query and latent output round to the model dtype, where the reference
    expands keys and values instead: the two agree to half-precision tolerance."""
    step = Step(BATCHES["mixed"], 16, dtype, DEVICE, seed=2)
    got, got_cache = step.run(TRITON_MLA)
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)


def _dense_absorbed(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                    table: torch.Tensor, context: int, scale: float) -> torch.Tensor:
    """One request's queries [q, H, L] / [q, H, R] at positions context.. against its pages."""
    n = context + q_lat.shape[0]
    rows = cache[table.long()].flatten(0, 1)[:n].float()
    c, pe = rows.split([q_lat.shape[-1], q_pe.shape[-1]], dim=-1)
    scores = (q_lat.float() @ c.T + q_pe.float() @ pe.T) * scale  # [q, H, n]
    pos = context + torch.arange(q_lat.shape[0], device=cache.device)
    visible = torch.arange(n, device=cache.device)[None, :] <= pos[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ c


def _check_kernel(step: Step, batch: list[tuple[int, int]], tiles: MLATiles, heads: int,
                  scale: float = 0.3, atol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over `step`'s cache with random absorbed queries against _dense_absorbed;
    returns the queries (q_lat, q_pe)."""
    from pagedserve.attention.ops.query_blocks import query_block_map

    common, lora, rope = step.common, step.layer.kv_lora_rank, step.layer.qk_rope_head_dim
    gen = torch.Generator().manual_seed(4)
    t = common.num_actual_tokens
    q_lat = torch.randn(t, heads, lora, generator=gen).to(DEVICE)
    q_pe = torch.randn(t, heads, rope + 3, generator=gen)[..., 3:].to(DEVICE)  # strided view
    req, start = query_block_map(common.query_start_loc_cpu, common.seq_lens_cpu,
                                 tiles.block_q)
    out = torch.full((t, heads, lora), float("nan"), device=DEVICE)
    mla_attention(q_lat, q_pe, step.kv_cache, out, common.block_table, common.query_start_loc,
                  common.seq_lens, torch.from_numpy(req).to(DEVICE),
                  torch.from_numpy(start).to(DEVICE), len(req), scale, tiles)
    qsl = common.query_start_loc_cpu
    for i, (c, _) in enumerate(batch):
        s, e = qsl[i], qsl[i + 1]
        ref = _dense_absorbed(q_lat[s:e], q_pe[s:e], step.kv_cache, common.block_table[i],
                              c, scale)
        torch.testing.assert_close(out[s:e], ref, rtol=1e-5, atol=atol)
    return q_lat, q_pe


@pytest.mark.parametrize("tiles", [MLATiles(block_h=16, block_q=1, block_n=16, num_warps=4,
                                            num_stages=1),
                                   MLATiles(block_h=4, block_q=4, block_n=32, num_warps=4,
                                            num_stages=1),
                                   MLATiles(block_h=4, block_q=1, block_n=16, num_warps=4,
                                            num_stages=1, num_splits=3),
                                   MLATiles(block_h=4, block_q=1, block_n=8, num_warps=4,
                                            num_stages=1, num_splits=2, lazy_rescale=False)],
                         ids=["all_heads", "head_tiles", "split_keys", "split_eager_rescale"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_kernel_matches_dense_reference(kind, tiles):
    """Six heads: two head tiles of four (the second half masked) or one of 16; a decode
    step's keys split two or three ways (some splits past a short sequence's end, merged by
    their log-sum-exp), with lazy and eager rescaling."""
    batch = BATCHES[kind]
    if kind == "mixed" and tiles.num_splits > 1:
        pytest.skip("only decode launches split the keys")
    if kind == "decode" and tiles.block_q > 1:
        tiles = MLATiles(tiles.block_h, 1, tiles.block_n, tiles.num_warps, tiles.num_stages)
    step = Step(batch, 4, torch.float32, DEVICE, seed=3, heads=6)
    _check_kernel(step, batch, tiles, heads=6)


@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_rising_scores_and_padded_latent(lazy, splits, block_size):
    """Keys whose scores climb along the sequence (rows scaled by their position), so the
    running maxima pass LAZY_RESCALE's slack on later tiles, not only the first; a latent
    width of 40 (padded to 64: the masked loads) and ragged sequence ends; 16-key tiles
    across pages of 4 (a page id per row) or inside pages of 32 (one per tile)."""
    batch = [(61, 1), (30, 1), (7, 1)]
    step = Step(batch, block_size, torch.float32, DEVICE, seed=10, lora=40, heads=5)
    common = step.common
    for i, (c, _) in enumerate(batch):
        pos = torch.arange(c + 1)
        pages = common.block_table[i, (pos // block_size).to(DEVICE)].long()
        step.kv_cache[pages, (pos % block_size).to(DEVICE)] *= (1 + pos[:, None].to(DEVICE)) / 4
    tiles = MLATiles(block_h=4, block_q=1, block_n=16, num_warps=4, num_stages=1,
                     num_splits=splits, lazy_rescale=lazy)
    q_lat, q_pe = _check_kernel(step, batch, tiles, heads=5, atol=1e-4)
    # The data does what the test is for: for every head of the longest request, the best
    # score of its last tile passes the best of its first tile by more than the slack (8 in
    # base-2 logits), so the running maxima move after the first tile.
    rows = step.kv_cache[common.block_table[0, :64 // block_size].long()].flatten(0, 1)[:62]
    scores = (q_lat[0] @ rows[:, :40].T + q_pe[0] @ rows[:, 40:].T) * 0.3 / math.log(2)
    assert bool((scores[:, 48:].amax(-1) - scores[:, :16].amax(-1) > 8).all())


def test_decode_launch_defaults():
    """The H200 decode default: 64 heads per program, 64-key tiles (two buffers beside q fit
    227 KB at bf16 DeepSeek widths; 16 at fp32), 8 warps, eager rescaling, 3 stages over pages
    smaller than a tile (2 when a tile lies in one page), and splits only when whole extra
    waves fit (one program per SM), never past the sequence."""
    from pagedserve.attention.ops.mla_decode import gpu_key_tiles, latent_row_bytes

    t = default_decode_tiles(132, 128, 64)
    assert (t.block_h, t.block_q, t.block_n, t.num_warps, t.num_stages, t.num_splits,
            t.lazy_rescale) == (64, 1, 64, 8, 3, 1, False)
    assert default_decode_tiles(132, 128, 64, block_size=64).num_stages == 2
    assert latent_row_bytes(512, 64, torch.bfloat16) == 1152
    assert latent_row_bytes(500, 60, torch.float32) == (512 + 64) * 4
    assert gpu_key_tiles(64, 16, latent_row_bytes(512, 64, torch.float32)) == (16, 2)
    assert gpu_key_tiles(16, 16, latent_row_bytes(512, 64, torch.float32)) == (32, 3)
    assert gpu_key_tiles(64, 128, 1152) == (64, 2)
    assert default_decode_tiles(132, 128, 8).num_splits == 8  # 16 programs: 8 waves
    # One head block of 16: two programs an SM (the H200's 16-head sweep).
    assert default_decode_tiles(132, 16, 32).num_splits == 8
    assert default_decode_tiles(132, 16, 64, block_size=64).num_splits == 4
    assert default_decode_tiles(132, 128, 1).num_splits == 16  # capped
    assert decode_splits(16, 132, max_seq_len=256, block_n=32) == 2  # 4 tiles per split
    assert decode_splits(200, 132, max_seq_len=8192, block_n=32) == 1
    assert decode_splits(0, 132, 8192, 32) == decode_splits(4, 0, 8192, 32) == 1


def test_write_latents_skips_padding_slots():
    cache = torch.zeros(3, 4, 40, device=DEVICE)
    rows = torch.randn(5, 48, device=DEVICE)[:, 4:44]  # strided, as a model's slice
    slots = torch.tensor([7, -1, 0, 11, -1], device=DEVICE)
    write_latents(rows, cache, slots)
    flat = cache.view(-1, 40)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], rows[i])
    assert int((flat.abs().sum(-1) > 0).sum()) == 3


def test_padded_decode_for_cuda_graphs():
    """The padded step (`pad_decode`: requests with seq_len 1, no page and slot -1) runs through
    build_for_cudagraph and leaves the real requests' outputs as the unpadded step's."""
    batch = BATCHES["decode"]
    step = Step(batch, 16, torch.float32, DEVICE, seed=5)
    got, _ = step.run(TRITON_MLA)
    b, size = len(batch), len(batch) + 2
    builder = CommonMetadataBuilder(size, size, step.max_blocks, 16, DEVICE)
    table = BlockTable(size, step.max_blocks)
    for row in range(b):
        n = math.ceil(sum(batch[row]) / 16)
        table.add_row(row, step.common.block_table[row, :n].tolist())
    common = builder.build(np.arange(b), np.array([c for c, _ in batch], np.int32),
                           np.ones(b, np.int32), 0, table.table)
    padded = builder.pad_decode(common, size)
    config = BuilderConfig.for_layer(step.layer, 16, size, size, step.max_blocks, DEVICE)
    metadata = TRITON_MLA.get_builder_cls()(config).build_for_cudagraph(common, size, padded)
    impl = TRITON_MLA.get_impl_cls()(step.layer)
    impl.bind_kv_b_proj(step.kv_b_proj)
    query = torch.cat([step.query, step.query[:2]])
    latent = torch.cat([step.latent, step.latent[:2]])
    cache = step.kv_cache.clone()
    out = impl.forward(query, latent, None, cache, metadata)
    torch.testing.assert_close(out[:b], got, rtol=1e-5, atol=1e-5)


def _mla_layers() -> list[AttentionLayerConfig]:
    return [_layer(**SMALL, dtype=torch.float32)] * 2


def test_selection(monkeypatch):
    cpu = torch.device("cpu")
    # CUDA (or ROCm) devices pick it for these float32 layers (FLASHINFER_MLA, first where
    # available, takes fp16/bf16 only); a CPU never unasked, interpreter or not.
    assert select_backend(None, torch.device("cuda"), _mla_layers(), 16) is TRITON_MLA
    assert select_backend(None, cpu, _mla_layers(), 16).get_name() == "CPU_MLA"
    assert select_backend("TRITON_MLA", cpu, _mla_layers(), 16) is TRITON_MLA
    assert "mla" in TRITON_MLA.features()
    with pytest.raises(BackendSelectionError,
                       match="layer 0: runs multi-head latent attention layers only"):
        select_backend("TRITON_MLA", cpu, [AttentionLayerConfig(4, 2, 64, torch.float32)], 16)
    with pytest.raises(BackendSelectionError, match="multi-head latent attention not supported"):
        select_backend("TRITON", cpu, _mla_layers(), 16)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not TRITON_MLA.is_available()[0]
        with pytest.raises(BackendSelectionError, match="TRITON_MLA is not available"):
            select_backend("TRITON_MLA", cpu, _mla_layers(), 16)
        assert select_backend(None, cpu, _mla_layers(), 16).get_name() == "CPU_MLA"


@pytest.mark.slow  # ~25 s in the interpreter
def test_deepseek_v3_greedy_matches_transformers(tmp_path, make_llm):
    """A tiny DeepSeek-V3 (low-rank query, YaRN, MoE) through the engine on TRITON_MLA, with
    chunked prefill, against transformers' greedy tokens (on the GPU too: float32 there)."""
    from pagedserve import SamplingParams
    from tests.models.test_families import _configs, _save
    from tests.utils.paged import hf_greedy

    hf = _save(_configs()["deepseek_v3"], tmp_path, seed=11)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (3, 17, 25)]
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    llm = make_llm(model=str(tmp_path), dtype="float32", device=DEVICE.type,
                   attention_backend="TRITON_MLA", kv_cache_memory="4MiB",
                   max_num_batched_tokens=16)
    assert llm.engine.runner.backend.get_name() == "TRITON_MLA"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.gpu
def test_deepseek_decode_shape_bf16_matches_cpu_mla():
    """64 sequences x 4,096 context, 128 heads, latent 512 + rope 64, bf16, on the GPU: both
    backends on the same cache (CPU_MLA in torch on the GPU, expanded, fp32 scores)."""
    batch = [(4095, 1)] * 64
    step = Step(batch, 64, torch.bfloat16, DEVICE, seed=9, lora=512, rope=64, nope=128, v=128,
                heads=128)
    got, got_cache = step.run(TRITON_MLA)
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["64/1/64/8/3/1/0", "64/1/64/8/2/1/0", "64/1/32/8/3/1/1",
                                   "64/1/16/8/4/2/1", "64/1/32/16/3/2/1", "32/1/64/4/2/1/1"])
def test_decode_launch_shapes_bf16_match_float32(tiles):
    """The sweep's kinds of launch shape on the GPU (lazy and eager rescaling, 16-64 key
    tiles, 8/16 warps, split keys, 32-head programs) at DeepSeek's widths in bf16, 128 heads,
    page 16, against the dense float32 absorbed form."""
    values = [int(v) for v in tiles.split("/")]
    batch = [(1500, 1), (777, 1), (64, 1), (3, 1)]
    step = Step(batch, 16, torch.bfloat16, DEVICE, seed=13, lora=512, rope=64, nope=128, v=128,
                heads=128)
    _check_kernel(step, batch, MLATiles(*values[:6], bool(values[6])), heads=128, scale=0.07,
                  atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["prefill", "chunked_prefill", "mixed"])
def test_deepseek_widths_expanded_prefill_matches_cpu_mla(kind, dtype):
    """DeepSeek's widths on the GPU (latent 512 + 64, nope/v 128, 16 heads): the prefills
    expanded to 192/128 through the unified kernel's large-head tiles, the decodes absorbed."""
    step = Step(BATCHES[kind], 16, dtype, DEVICE, seed=8, lora=512, rope=64, nope=128, v=128,
                heads=16)
    got, got_cache = step.run(TRITON_MLA)
    assert step.metadata.prefill is not None
    ref, ref_cache = step.run(CPU_MLA)
    torch.testing.assert_close(got_cache, ref_cache, rtol=0, atol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{kind}, {dtype}: {m}")
