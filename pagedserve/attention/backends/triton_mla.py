"""TRITON_MLA: multi-head latent attention with Triton kernels over the paged latent cache.

A step splits where the batch order does (prefills first, then decodes):

- **Decodes** run in the weight-absorbed form (ops/mla_decode.py): q_lat = q_nope @ W_UK (one
  batched matmul over the heads), one attention launch over the latents themselves, then
  output = out_lat @ W_UV^T. Each page is read once for all heads of a token.
- **Prefills** (requests with more than one new token, chunked or not) expand their latents
  into per-head keys and values instead: the pages of the step's prefill requests (context
  and new tokens, already written into the cache) are gathered in one index_select, one GEMM
  through kv_b_proj gives k_nope and v, the shared rotated k_pe is joined to every head's
  k_nope, and TRITON's unified attention kernel runs causal varlen attention over that
  buffer with keys of nope + rope channels and values of v_head_dim (DiffKV: 192 / 128 for
  DeepSeek). Absorbing costs heads x L per key and query in the score and the output;
  expanding costs nope + rope and v, a third of it at DeepSeek's shapes, plus the expansion
  GEMM once per key, which a prefill (many queries per key) earns back.
  The gathered buffer is laid out as a paged cache of the prefill pages in order (request
  i's j-th page is buffer page indptr[i] + j), so the kernel needs only a block table of
  those offsets; the tail of a request's last page is expanded too and never read.
  Its size is pages x block_size x heads x (nope + rope + v) elements (about twice that at
  the peak, with the GEMM's output): a step whose prefill buffer would exceed
  `EXPAND_BUDGET_BYTES` runs its prefills absorbed instead (exact too, only slower), so a
  long context chunked at a small budget cannot run out of memory here.

Per step the builder plans both parts on the host (query-block maps in persistent buffers, the
prefill block table from the step's page CSR); a decode-only step does no device work in the
builder and its forward no host sync, so decode steps are captured in CUDA graphs (the prefill
path never is: graph steps have no prefills). Cache layout: CPU_MLA's
[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve import envs
from pagedserve.attention.backend import (
    AttentionLayerConfig,
    AttentionMetadataBuilder,
    BuilderConfig,
)
from pagedserve.attention.backends.cpu_mla import CPUMLABackend
from pagedserve.attention.backends.triton_attn import MAX_BLOCK_SIZE, TritonAttentionBackend
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.mla import MLAImpl
from pagedserve.attention.ops.query_blocks import QueryBlockMap

# Largest expanded prefill buffer (keys and values of every head) a step may build.
EXPAND_BUDGET_BYTES = 1 << 30


@dataclass
class ExpandedPrefill:
    """The step's prefill requests [0, num_reqs) as per-head K/V attention: which cache pages
    to gather and the kernel's plan over the gathered buffer."""

    num_reqs: int
    num_tokens: int  # the prefills' new tokens: the step's tokens [0, num_tokens)
    pages: torch.Tensor  # [num_pages] int32, the prefill requests' pages in order
    block_table: torch.Tensor  # [num_reqs, max_pages] int32, pages of the gathered buffer
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (the step's, a view)
    seq_lens: torch.Tensor  # [num_reqs] int32 (the step's, a view)
    qblock_req: torch.Tensor
    qblock_start: torch.Tensor
    num_qblocks: int
    block_q: int
    block_m: int
    tiles: object  # ops.unified_attention.TileConfig


@dataclass
class TritonMLAMetadata:
    common: CommonAttentionMetadata
    # The absorbed kernel's part of the step: tokens [absorbed_token_start, T) (the decodes
    # when the prefills are expanded, else every token).
    qblock_req: torch.Tensor  # [num_qblocks] int32, request of each query block
    qblock_start: torch.Tensor  # [num_qblocks] int32, its first token within the request
    num_qblocks: int
    tiles: object  # ops.mla_decode.MLATiles
    absorbed_token_start: int = 0
    prefill: ExpandedPrefill | None = None


def expanded_prefill_bytes(common: CommonAttentionMetadata, config: BuilderConfig) -> int:
    """Bytes of the step's expanded prefill buffer: every page of its prefill requests x
    block_size x heads x (nope + rope + v) in the model dtype."""
    assert config.mla_dims is not None
    _, nope, rope, v = config.mla_dims
    pages = int(common.paged_kv_indptr_cpu[common.num_prefills])
    elem = torch.empty((), dtype=config.dtype).element_size()
    return pages * common.block_size * config.num_heads * (nope + rope + v) * elem


class ExpandedPrefillPlanner:
    """Plans `ExpandedPrefill` for a builder: its query-block map in persistent buffers and a
    page-offset row for the block table (both allocated once)."""

    def __init__(self, config: BuilderConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.query_blocks = QueryBlockMap(config.max_num_tokens, device)
        self._page_offsets = torch.arange(max(config.max_blocks_per_seq, 1), dtype=torch.int32,
                                          device=device)

    def plan(self, common: CommonAttentionMetadata) -> ExpandedPrefill:
        """The step's prefills [0, num_prefills), attention of keys with nope + rope channels:
        the unified kernel's prefill tiles, one KV head per query head."""
        from pagedserve.attention.ops.unified_attention import query_block_shape, select_tiles

        assert self.config.mla_dims is not None
        _, nope, rope, _ = self.config.mla_dims
        p = common.num_prefills
        indptr = common.paged_kv_indptr_cpu[:p + 1]
        tiles = select_tiles(self.device, nope + rope, self.config.dtype, decode_only=False)
        block_q, block_m = query_block_shape(1, tiles, decode_only=False)
        num_qblocks = self.query_blocks.fill(common, block_q, 0, p)
        width = int(np.diff(indptr).max())
        # Request i's j-th page sits at page indptr[i] + j of the gathered buffer; columns past
        # a request's pages point at the next request's and are never read (keys < seq_len).
        table = common.paged_kv_indptr[:p, None] + self._page_offsets[None, :width]
        return ExpandedPrefill(
            num_reqs=p, num_tokens=common.num_prefill_tokens,
            pages=common.paged_kv_indices[:int(indptr[p])], block_table=table,
            query_start_loc=common.query_start_loc[:p + 1], seq_lens=common.seq_lens[:p],
            qblock_req=self.query_blocks.req, qblock_start=self.query_blocks.start,
            num_qblocks=num_qblocks, block_q=block_q, block_m=block_m, tiles=tiles)


def run_expanded_prefill(impl: MLAImpl, query: torch.Tensor, kv_cache: torch.Tensor,
                         output: torch.Tensor, plan: ExpandedPrefill) -> None:
    """query [Tp, H, nope + rope] of the prefill tokens -> output [Tp, H, v]: the prefill
    requests' latents gathered from the cache, expanded through kv_b_proj, attended causally
    by the unified kernel (keys nope + rope, values v)."""
    from pagedserve.attention.ops.unified_attention import unified_attention

    h, nope, rope, v = (impl.num_heads, impl.qk_nope_head_dim, impl.qk_rope_head_dim,
                        impl.v_head_dim)
    assert impl._kv_b_proj is not None, "MLA layer run before its kv_b_proj was bound"
    rows = kv_cache.index_select(0, plan.pages)  # [pages, block_size, L + R]
    num_pages, block_size = rows.shape[0], rows.shape[1]
    rows = rows.view(num_pages * block_size, -1)
    c, k_pe = rows.split([impl.kv_lora_rank, rope], dim=-1)
    n = rows.shape[0]
    kv = (c @ impl._kv_b_proj.to(c.dtype).T).view(n, h, nope + v)  # one GEMM, every head
    k_nope, values = kv.split([nope, v], dim=-1)
    # Keys [k_nope | k_pe] (the query's [q_nope | q_pe] order), values beside them: the
    # side-by-side DiffKV layout whose K and V views share strides.
    buf = torch.cat([k_nope, k_pe[:, None, :].expand(n, h, rope), values], dim=-1)
    buf = buf.view(num_pages, block_size, h, nope + rope + v)
    k_cache, v_cache = buf[..., :nope + rope], buf[..., nope + rope:]
    unified_attention(query, k_cache, v_cache, output, plan.block_table, plan.query_start_loc,
                      plan.seq_lens, plan.qblock_req, plan.qblock_start, plan.num_qblocks,
                      plan.block_q, plan.block_m, impl.scale, plan.tiles)


class TritonMLAMetadataBuilder(AttentionMetadataBuilder):
    """Outputs are views of the common metadata and of this builder's persistent maps (a
    decode-only step builds no device tensor), so the default `build_for_cudagraph` (build the
    padded step) is graph-safe."""

    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        self.device = torch.device(config.device)
        self.query_blocks = QueryBlockMap(config.max_num_tokens, self.device)
        self.prefill_planner = ExpandedPrefillPlanner(config, self.device)
        self.expand_budget_bytes = EXPAND_BUDGET_BYTES

    def build(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        from pagedserve.attention.ops.mla_decode import latent_row_bytes, select_mla_tiles

        p, b = common.num_prefills, common.num_reqs
        prefill = None
        if p and expanded_prefill_bytes(common, self.config) <= self.expand_budget_bytes:
            prefill = self.prefill_planner.plan(common)
        first = p if prefill is not None else 0
        decode_only = common.max_query_len <= 1 or prefill is not None
        assert self.config.mla_dims is not None
        lora, _, rope, _ = self.config.mla_dims
        tiles = select_mla_tiles(self.device, self.config.num_heads, decode_only,
                                 num_reqs=b - first, block_size=self.config.block_size,
                                 row_bytes=latent_row_bytes(lora, rope, self.config.dtype))
        num_qblocks = self.query_blocks.fill(common, tiles.block_q, first, b)
        return TritonMLAMetadata(
            common=common, qblock_req=self.query_blocks.req,
            qblock_start=self.query_blocks.start, num_qblocks=num_qblocks, tiles=tiles,
            absorbed_token_start=common.num_prefill_tokens if prefill is not None else 0,
            prefill=prefill)


class TritonMLAImpl(MLAImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: TritonMLAMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        from pagedserve.attention.ops.mla_decode import write_latents

        md = attn_metadata
        common = md.common
        n = common.num_actual_tokens
        # First, so the prefills' gather and the absorbed kernel read the step's own latents
        # from the pages like any other.
        write_latents(key[:n, 0], kv_cache, common.slot_mapping[:n])
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.v_head_dim)
        if md.prefill is not None:
            tp = md.prefill.num_tokens
            run_expanded_prefill(self, query[:tp], kv_cache, output[:tp], md.prefill)
        if md.num_qblocks:
            s = md.absorbed_token_start
            self._absorbed(query[s:], kv_cache, output[s:], md)
        return output

    def _absorbed(self, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                  md: TritonMLAMetadata) -> None:
        """The step's tokens from md.absorbed_token_start on, in the weight-absorbed form."""
        from pagedserve.attention.ops.mla_decode import mla_attention

        common = md.common
        w_uk, w_uv = self.up_projections()
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # [H, T, nope] @ [H, nope, L]: every head's absorbed query in one batched matmul.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(query.dtype)).transpose(0, 1)
        out_lat = query.new_empty(query.shape[0], self.num_heads, self.kv_lora_rank)
        mla_attention(q_lat, q_pe, kv_cache, out_lat, common.block_table,
                      common.query_start_loc, common.seq_lens, md.qblock_req, md.qblock_start,
                      md.num_qblocks, self.scale, md.tiles, token_base=md.absorbed_token_start)
        # [H, T, L] @ [H, L, v]: back from latent space to each head's values.
        out = torch.bmm(out_lat.transpose(0, 1), w_uv.to(query.dtype).transpose(1, 2))
        output.copy_(out.transpose(0, 1))


class TritonMLABackend(CPUMLABackend):
    """CPU_MLA's cache layout and layer checks; Triton kernels instead of torch."""

    name = "TRITON_MLA"
    reads_paged_kv_indices = True
    supports_cuda_graphs = True
    description = ("Triton multi-head latent attention: absorbed decode over the latent cache, "
                   "prefill expanded to per-head K/V (unified kernel, DiffKV)")

    impl_cls = TritonMLAImpl
    builder_cls = TritonMLAMetadataBuilder
    metadata_cls = TritonMLAMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return TritonAttentionBackend.is_available()  # the same kernels' requirements

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = super().validate_configuration(layer, block_size, device)
        if not reasons and not 1 <= block_size <= MAX_BLOCK_SIZE:
            reasons.append(f"block size {block_size} not in 1..{MAX_BLOCK_SIZE}")
        if not reasons and device.type == "cpu" and not envs.TRITON_INTERPRET:
            reasons.append("CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)")
        return reasons
