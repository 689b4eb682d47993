"""CPU_MLA: multi-head latent attention in plain torch over a latent cache, the reference for
MLA backends. Runs on any device.

Cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one row per token (no K/V
pair, no heads). The step's metadata is the CPU backend's (per prefill and decode group: the
page-gather index, the packed-query grid, the causal mask). Each group gathers its requests'
latent rows once, expands them through kv_b_proj into per-head k_nope and v (the form
transformers computes, so float32 results agree), and attends with scores
q_nope . k_nope + q_pe . k_pe in float32.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionLayerConfig
from pagedserve.attention.backends.cpu import (
    AttentionGroup,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from pagedserve.attention.mla import MLAImpl, is_mla


class CPUMLAImpl(MLAImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        common = attn_metadata.common
        n = common.num_actual_tokens
        _write_latents(kv_cache, key[:n, 0], common.slot_mapping[:n])
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.v_head_dim)
        for group in attn_metadata.groups:
            s, e = group.token_start, group.token_end
            output[s:e] = self._attend_group(query[s:e], kv_cache, group)
        return output

    def _attend_group(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      group: AttentionGroup) -> torch.Tensor:
        b = group.page_index.shape[0]
        lq, h = group.max_query_len, self.num_heads
        latent = kv_cache[group.page_index].flatten(1, 2)[:, :group.max_seq_len]  # [B, S, L+R]
        c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self.up_projections()
        k_nope = torch.einsum("bsl,hdl->bshd", c, w_uk)
        v = torch.einsum("bsl,hdl->bshd", c, w_uv)
        q = query.new_zeros(b * lq, h, query.shape[-1])
        q[group.token_index] = query
        q_nope, q_pe = q.view(b, lq, h, -1).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        scores = (torch.einsum("bqhd,bshd->bhqs", q_nope.float(), k_nope.float())
                  + torch.einsum("bqhr,bsr->bhqs", q_pe.float(), k_pe.float())) * self.scale
        scores = scores.masked_fill(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.einsum("bhqs,bshd->bqhd", probs, v).reshape(b * lq, h, self.v_head_dim)
        return out[group.token_index]


def _write_latents(kv_cache: torch.Tensor, latent: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter latent rows [T, L + R] into the cache by slot; slots of -1 (padding) skipped."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, latent = slot_mapping[valid], latent[valid]
    flat.index_copy_(0, slot_mapping, latent.to(flat.dtype))


class CPUMLABackend(AttentionBackend):
    name = "CPU_MLA"
    supports_mla = True
    description = "multi-head latent attention in torch over the latent cache (reference)"

    impl_cls = CPUMLAImpl
    builder_cls = CPUAttentionMetadataBuilder
    metadata_cls = CPUAttentionMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """One latent row per token: no K/V pair and no heads."""
        return (num_blocks, block_size, head_size)

    @staticmethod
    def kv_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent rows stand for both K and V [num_blocks, block_size, 1, L + R]."""
        rows = kv_cache.unsqueeze(2)
        return rows, rows

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, "pure torch; runs on any device"

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        reasons = [] if is_mla(layer) else ["runs multi-head latent attention layers only"]
        return reasons + super().validate_configuration(layer, block_size, device)
