"""TRITON_MLA: multi-head latent attention with our Triton kernel over the paged latent cache
(ops/mla_decode.py), in the weight-absorbed form for every token.

Per layer and step: q_lat = q_nope @ W_UK (one batched matmul over the heads), the step's
latent rows into the cache (one small launch), one attention launch over the latents for all
requests (decodes, prefills and chunked prefills alike: prefills take a causal mask over
several query rows per program), then output = out_lat @ W_UV^T (one batched matmul). The
absorbed form is exact for prefill too, only heavier in compute than expanding the latents
into per-head keys and values; a prefill path of its own is future work.

Per step the builder plans the query-block map on the host (as TRITON's does) into persistent
device buffers; forward does no host sync, so decode steps can be captured in CUDA graphs.
Cache layout: CPU_MLA's [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class TritonMLAMetadata:
    common: CommonAttentionMetadata
    qblock_req: torch.Tensor  # [num_qblocks] int32, request of each query block
    qblock_start: torch.Tensor  # [num_qblocks] int32, its first token within the request
    num_qblocks: int
    tiles: object  # ops.mla_decode.MLATiles


class TritonMLAMetadataBuilder(AttentionMetadataBuilder):
    """Outputs are views of the common metadata and of this builder's persistent map, so the
    default `build_for_cudagraph` (build the padded step) is graph-safe."""

    def __init__(self, config: BuilderConfig) -> None:
        super().__init__(config)
        self.device = torch.device(config.device)
        self.query_blocks = QueryBlockMap(config.max_num_tokens, self.device)

    def build(self, common: CommonAttentionMetadata) -> TritonMLAMetadata:
        from pagedserve.attention.ops.mla_decode import select_mla_tiles

        tiles = select_mla_tiles(self.device, self.config.num_heads, common.max_query_len <= 1)
        num_qblocks = self.query_blocks.fill(common, tiles.block_q)
        return TritonMLAMetadata(common=common, qblock_req=self.query_blocks.req,
                                 qblock_start=self.query_blocks.start,
                                 num_qblocks=num_qblocks, tiles=tiles)


class TritonMLAImpl(MLAImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: TritonMLAMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        from pagedserve.attention.ops.mla_decode import mla_attention, write_latents

        md = attn_metadata
        common = md.common
        n = common.num_actual_tokens
        write_latents(key[:n, 0], kv_cache, common.slot_mapping[:n])
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.v_head_dim)
        if md.num_qblocks == 0:
            return output
        w_uk, w_uv = self.up_projections()
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # [H, T, nope] @ [H, nope, L]: every head's absorbed query in one batched matmul.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(query.dtype)).transpose(0, 1)
        out_lat = query.new_empty(query.shape[0], self.num_heads, self.kv_lora_rank)
        mla_attention(q_lat, q_pe, kv_cache, out_lat, common.block_table,
                      common.query_start_loc, common.seq_lens, md.qblock_req, md.qblock_start,
                      md.num_qblocks, self.scale, md.tiles)
        # [H, T, L] @ [H, L, v]: back from latent space to each head's values.
        out = torch.bmm(out_lat.transpose(0, 1), w_uv.to(query.dtype).transpose(1, 2))
        output.copy_(out.transpose(0, 1))
        return output


class TritonMLABackend(CPUMLABackend):
    """CPU_MLA's cache layout and layer checks; Triton kernels instead of torch."""

    name = "TRITON_MLA"
    supports_cuda_graphs = True
    description = "Triton multi-head latent attention, weight-absorbed, over the latent cache"

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
