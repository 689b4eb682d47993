"""CPU backend: plain torch over the paged cache.

The builder does the per-step work once for all layers: for the prefill group and the decode
group it builds the page-gather index, the scatter of packed query tokens into a padded
[requests, max_query_len] grid and the boolean mask (causal from each request's cached length,
or to the end of a query's image span where the step has `attend_limit`; sequence end, sliding
window). Decodes form their own group so a long prompt in the same step does not pad them.
Values may have their own head size (head_size_v): the cache is then the base class's
side-by-side layout.

Each layer gathers its K/V pages once per group as one matrix per request and KV head
([B * Hkv, keys, D]), and attends with two batched matmuls around a float32 softmax: the
query heads
that share a KV head are the rows of one product, so GQA never repeats K/V. Soft-caps and
sinks (a column in the softmax's sum) fit in the same pass.

Batch invariance: a query's output is the same bits whatever else the step holds. Each
(request, KV head) pair is its own matrix product, padding keys add exact zeros, and the
softmax reads each row alone. What is left are kernels chosen by size: the BLAS's products
of few rows differ from each other and from those of more rows, which agree whatever the key
count from 8 keys up. Where that starts depends on the CPU: on an Intel AVX-512 machine from
three rows, on an AMD EPYC (AVX-512, BF16) from four (products of one to three rows differed
there, and the batch-invariance test failed), so every product gets at least `MIN_ROWS` = 4
rows; products over fewer keys, and a softmax row shorter than a
vector register (16 floats), sum in other orders, so every group attends to at least
`MIN_KEYS` keys (masked zero keys past its longest sequence).
tests/engine/test_batch_invariance.py holds the engine to it. SDPA's CPU kernel, which this
replaced, splits keys and queries into blocks sized from the batch's longest sequence and
query, so its outputs moved by a few bits with the batch, and the int8 default's bfloat16
products (quantization/int8_cpu.py) turned those into other greedy tokens.
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
from pagedserve.attention.encoder import EncoderMetadata, torch_varlen_attention
from pagedserve.attention.metadata import CommonAttentionMetadata

# Rows every query product gets (zero rows added below it) and keys every softmax row reads
# (masked columns added after it): see the module's docstring.
MIN_ROWS = 4
MIN_KEYS = 32


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
        limit = q_pos  # the last key each query sees: itself, or its image span's end
        if common.attend_limit is not None:
            limit = q_pos.clone()
            limit.view(-1)[token_index] = common.attend_limit[token_start:token_end].long()
        mask = (k_pos <= limit[:, :, None]) & (k_pos < seq_lens[:, None, None])
        if self.config.sliding_window is not None:
            mask &= k_pos > q_pos[:, :, None] - self.config.sliding_window
        # Padding query rows see key 0 so softmax stays finite; their outputs are dropped.
        mask[:, :, 0] |= (torch.arange(max_q, device=device) >= q_lens[:, None])
        return AttentionGroup(token_start, token_end, max_q, max_k, page_index, token_index,
                              mask[:, None])


class CPUAttentionImpl(AttentionImpl):
    supports_sinks = True
    supports_diff_kv = True
    supports_encoder_only = True

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_metadata: EncoderMetadata,
                        output: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder-only layers: the padded-grid torch form (float32 softmax)."""
        return torch_varlen_attention(query, key, value, attn_metadata, self.scale, output,
                                      self.sliding_window)

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
        b, lq = group.page_index.shape[0], group.max_query_len
        h, hkv = self.num_heads, self.num_kv_heads
        g = h // hkv
        k = _gather_pages(k_cache, group.page_index, group.max_seq_len)
        v = _gather_pages(v_cache, group.page_index, group.max_seq_len)
        k, v, mask = _min_keys(k, v, group.mask)
        if lq == 1:  # decodes: one token per request, already the grid
            q = query.reshape(b * hkv, g, -1)
        else:
            grid = query.new_zeros(b * lq, h, self.head_size)
            grid[group.token_index] = query
            # [B * Lq, Hkv * G, D] -> [B * Hkv, Lq * G, D]: the rows that share a KV head.
            q = grid.view(b, lq, hkv, g, -1).transpose(1, 2).reshape(b * hkv, lq * g, -1)
        rows = q.shape[1]
        scores = torch.bmm(_min_rows(q.float()), k.float().transpose(1, 2))[:, :rows]
        scores.mul_(self.scale)
        if self.logits_soft_cap is not None:
            scores = torch.tanh(scores / self.logits_soft_cap).mul_(self.logits_soft_cap)
        # [B, 1, Lq, N] mask -> [B, 1 (Hkv), Lq, 1 (G), N].
        scores = scores.view(b, hkv, lq, g, -1).masked_fill_(~mask[:, :, :, None], float("-inf"))
        probs = (torch.softmax(scores, dim=-1) if sinks is None
                 else _softmax_with_sinks(scores, sinks))
        probs = probs.view(b * hkv, rows, -1)
        out = torch.bmm(_min_rows(probs), v.float())[:, :rows].to(query.dtype)
        if lq == 1:
            return out.reshape(b, h, -1)
        out = out.view(b, hkv, lq, g, -1).transpose(1, 2).reshape(b * lq, h, -1)
        return out[group.token_index]


def _min_rows(x: torch.Tensor) -> torch.Tensor:
    """[batch, rows, n] with zero rows appended up to MIN_ROWS (their products are dropped)."""
    if x.shape[1] >= MIN_ROWS:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], MIN_ROWS - x.shape[1], x.shape[2])], dim=1)


def _min_keys(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V [batch, keys, D] with zero keys appended up to MIN_KEYS, and the mask [B, 1,
    Lq, keys] with them masked out."""
    missing = MIN_KEYS - k.shape[1]
    if missing <= 0:
        return k, v, mask
    hidden = mask.new_zeros(*mask.shape[:-1], missing)
    return (F.pad(k, (0, 0, 0, missing)), F.pad(v, (0, 0, 0, missing)),
            torch.cat([mask, hidden], dim=-1))


def _gather_pages(cache: torch.Tensor, page_index: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] cache, [B, P] page ids -> [B * Hkv, num_keys, D]: each
    (request, KV head) pair's keys one contiguous matrix, so the products take them as they
    are."""
    b, p = page_index.shape
    _, block_size, hkv, d = cache.shape
    pages = cache[page_index].view(b, p * block_size, hkv, d)[:, :num_keys]
    return pages.transpose(1, 2).reshape(b * hkv, num_keys, d)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] with the sink's column dropped, for scores [B, Hkv, Lq,
    H / Hkv, Lk] and sinks [H]: each probability is exp(s - lse) where lse also counts
    exp(sink), so no column is concatenated."""
    hkv = scores.shape[1]
    # Query head h is member h % qpk of KV group h // qpk: [H] -> [1, Hkv, 1, qpk, 1].
    sink = sinks.detach().float().view(1, hkv, 1, -1, 1)
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
    supports_encoder_only = True
    supports_encoder_window = True
    supports_bidirectional_spans = True
    description = "batched torch matmuls over gathered pages (batch-invariant)"

    impl_cls = CPUAttentionImpl
    builder_cls = CPUAttentionMetadataBuilder
    metadata_cls = CPUAttentionMetadata

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, "pure torch; runs on any device"
