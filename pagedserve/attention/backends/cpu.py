"""CPU backend: plain torch over the paged cache.

The builder does the per-step work once for all layers: for the prefill group and the decode
group it builds the page-gather index, the scatter of packed query tokens into a padded
[requests, max_query_len] grid and the boolean mask (causal from each request's cached length,
sequence end, sliding window). Each layer then gathers its K/V pages once per group and calls
`scaled_dot_product_attention` with `enable_gqa`, so repeated K/V heads are never materialised
by us. Decodes form their own group so a long prompt in the same step does not pad them.
SDPA has neither a soft-cap nor a column for attention sinks: layers with either take an exact
float32 path (`_attend_float32`) instead. Values may have their own head size (head_size_v):
both paths take V's last dimension as it comes, and the cache is then the base class's
side-by-side layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from pagedserve.attention.metadata import CommonAttentionMetadata


@dataclass
class AttentionGroup:
    """A contiguous run of requests attended in one padded batch."""

    token_start: int
    token_end: int
    max_query_len: int
    max_seq_len: int
    page_index: torch.Tensor  # [B, P] block ids (padding clamped to block 0)
    token_index: torch.Tensor  # [T] flat index of each new token in the [B * max_query_len] grid
    mask: torch.Tensor  # [B, 1, max_query_len, max_seq_len] bool, True = attend


@dataclass
class CPUAttentionMetadata:
    common: CommonAttentionMetadata
    groups: list[AttentionGroup]


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        groups = []
        if common.num_prefills:
            groups.append(self._group(common, 0, common.num_prefills))
        if common.num_decodes:
            groups.append(self._group(common, common.num_prefills, common.num_reqs))
        return CPUAttentionMetadata(common, groups)

    def _group(self, common: CommonAttentionMetadata, start: int, end: int) -> AttentionGroup:
        bs = common.block_size
        device = common.query_start_loc.device
        qsl = common.query_start_loc[start:end + 1].long()
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = common.seq_lens[start:end].long()
        ctx_lens = common.context_lens[start:end].long()
        qsl_cpu = common.query_start_loc_cpu[start:end + 1]
        max_q = int((qsl_cpu[1:] - qsl_cpu[:-1]).max())
        max_k = int(common.seq_lens_cpu[start:end].max())
        num_pages = -(-max_k // bs)
        page_index = common.block_table[start:end, :num_pages].clamp(min=0).long()

        token_start, token_end = int(qsl_cpu[0]), int(qsl_cpu[-1])
        req_of_token = torch.repeat_interleave(torch.arange(end - start, device=device), q_lens)
        offset = torch.arange(token_start, token_end, device=device) - qsl[req_of_token]
        token_index = req_of_token * max_q + offset

        q_pos = ctx_lens[:, None] + torch.arange(max_q, device=device)  # [B, max_q]
        k_pos = torch.arange(max_k, device=device)
        mask = (k_pos <= q_pos[:, :, None]) & (k_pos < seq_lens[:, None, None])
        if self.config.sliding_window is not None:
            mask &= k_pos > q_pos[:, :, None] - self.config.sliding_window
        # Padding query rows see key 0 so softmax stays finite; their outputs are dropped.
        mask[:, :, 0] |= (torch.arange(max_q, device=device) >= q_lens[:, None])
        return AttentionGroup(token_start, token_end, max_q, max_k, page_index, token_index,
                              mask[:, None])


class CPUAttentionImpl(AttentionImpl):
    supports_sinks = True
    supports_diff_kv = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata,
                output: torch.Tensor | None = None) -> torch.Tensor:
        common = attn_metadata.common
        n = common.num_actual_tokens
        k_cache, v_cache = CPUAttentionBackend.kv_cache_views(kv_cache, self.layer.head_size_v)
        write_kv(k_cache, v_cache, key[:n], value[:n], common.slot_mapping[:n])
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        sinks = self.bound_sinks()
        for group in attn_metadata.groups:
            s, e = group.token_start, group.token_end
            output[s:e] = self._attend_group(query[s:e], k_cache, v_cache, group, sinks)
        return output

    def _attend_group(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      group: AttentionGroup, sinks: torch.Tensor | None) -> torch.Tensor:
        b, _ = group.page_index.shape
        h, d, hkv = self.num_heads, self.head_size, self.num_kv_heads
        dv = self.value_head_size
        # [B, P, bs, Hkv, D] -> [B, Hkv, max_k, D]
        k = k_cache[group.page_index].flatten(1, 2)[:, :group.max_seq_len].transpose(1, 2)
        v = v_cache[group.page_index].flatten(1, 2)[:, :group.max_seq_len].transpose(1, 2)
        decode = group.max_query_len == 1  # one token per request: already the grid
        if decode:
            q = query.view(b, 1, h, d).transpose(1, 2)
        else:
            q = query.new_zeros(b * group.max_query_len, h, d)
            q[group.token_index] = query
            q = q.view(b, group.max_query_len, h, d).transpose(1, 2)
        if self.logits_soft_cap is None and sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale,
                                                 enable_gqa=hkv != h)
        else:
            out = self._attend_float32(q, k, v, group.mask, sinks)
        out = out.transpose(1, 2).reshape(b * group.max_query_len, h, dv)
        return out if decode else out[group.token_index]

    def _attend_float32(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Scores in float32, soft-capped and with the sink column as the layer asks."""
        b, h, lq, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        qg = q.view(b, hkv, h // hkv, lq, d)
        scores = torch.matmul(qg.float(), k.float()[:, :, None].transpose(-1, -2)) * self.scale
        if self.logits_soft_cap is not None:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = _softmax_with_sinks(scores, sinks)
        out = torch.matmul(probs, v.float()[:, :, None])
        return out.view(b, h, lq, dv).to(q.dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] with the sink's column dropped, for scores [B, Hkv, H / Hkv,
    Lq, Lk] and sinks [H]: each probability is exp(s - lse) where lse also counts exp(sink), so
    no column is concatenated."""
    hkv = scores.shape[1]
    # Query head h is member h % qpk of KV group h // qpk: [H] -> [1, Hkv, qpk, 1, 1].
    sink = sinks.detach().float().view(1, hkv, -1, 1, 1)
    lse = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)
    return torch.exp(scores - lse)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K [T, Hkv, D] and V [T, Hkv, D_v] into [num_blocks, block_size, Hkv, D] and
    [..., D_v] caches (views of any strides whose first two dims merge) by slot; slots of -1
    (padding) are skipped."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


class CPUAttentionBackend(AttentionBackend):
    name = "CPU"
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True
    supports_diff_kv = True
    description = "torch scaled_dot_product_attention over gathered pages"

    impl_cls = CPUAttentionImpl
    builder_cls = CPUAttentionMetadataBuilder
    metadata_cls = CPUAttentionMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, "pure torch; runs on any device"
