"""Attention-backend conformance harness: random paged caches with shuffled block ids, run a
backend's builder + impl, compare with a float32 reference written plainly here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention import AttentionBackend, AttentionLayerConfig, BuilderConfig
from pagedserve.attention.metadata import BidirectionalSpans, CommonMetadataBuilder
from pagedserve.engine.input_batch import BlockTable

# (context_len, query_len) per request; a decode has query_len 1. Prefills come first.
BATCHES = {
    "prefill": [(0, 17), (0, 5), (0, 32), (0, 1 + 16)],
    "chunked_prefill": [(16, 16), (15, 9), (33, 31), (7, 2)],
    "decode": [(15, 1), (16, 1), (31, 1), (32, 1), (0, 1), (47, 1)],
    "mixed": [(0, 20), (17, 15), (31, 1), (32, 1), (63, 1), (5, 1)],
}


@dataclass
class Case:
    batch: list[tuple[int, int]]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    seed: int = 0
    # Per-head sink logits (gpt-oss), drawn as normal * sink_std in the case's dtype: large
    # enough that a backend ignoring them fails (run_case checks that they matter; long contexts
    # spread the softmax over more keys and need a larger sink_std).
    sinks: bool = False
    sink_std: float = 2.0
    # Values of another head size (DeepSeek's expanded MLA prefill: 192 / 128); None: head_size.
    head_size_v: int | None = None
    # "fp8": an e4m3 cache holding K / k_scale and V / v_scale (kv_scales, bound to the impl);
    # the reference attends over the same rounded values times the scales.
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] = (1.0, 1.0)
    # Bidirectional image spans (Gemma 3): per request, (start, end) position ranges whose
    # tokens see each other both ways; the layer is configured with bidirectional_spans.
    spans: list[list[tuple[int, int]]] | None = None

    @property
    def value_head_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    def layer(self, scale: float | None = None) -> AttentionLayerConfig:
        return AttentionLayerConfig(self.num_heads, self.num_kv_heads, self.head_size, self.dtype,
                                    self.sliding_window, self.logits_soft_cap,
                                    self.kv_cache_dtype, scale=scale, has_sinks=self.sinks,
                                    head_size_v=self.head_size_v,
                                    bidirectional_spans=self.spans is not None)


def value_size_kwargs(case: Case) -> dict[str, int]:
    """head_size_v for the layout hooks only when it differs (as the engine passes it): backends
    that refuse such layers keep the equal-size signature."""
    return {} if case.head_size_v is None else {"head_size_v": case.head_size_v}


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                        scale: float, sliding_window: int | None,
                        soft_cap: float | None, sinks: torch.Tensor | None = None,
                        spans: list[tuple[int, int]] = ()) -> torch.Tensor:
    """One request in float32: q [Lq, H, D] for positions context_len.., k [Lk, Hkv, D],
    v [Lk, Hkv, D_v]; returns [Lq, H, D_v]. sinks [H]: each head's softmax gets one more column
    with that logit, dropped after (as transformers' gpt-oss eager attention). spans: position
    ranges [start, end) whose tokens also see each other's later tokens (as transformers'
    Gemma 3 mask: causal or same span, and then the window)."""
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    k = k.float().repeat_interleave(h // hkv, dim=1)
    v = v.float().repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(lq)[:, None] + context_len
    k_pos = torch.arange(lk)[None, :]
    allowed = k_pos <= q_pos
    for start, end in spans:
        allowed |= ((q_pos >= start) & (q_pos < end)) & ((k_pos >= start) & (k_pos < end))
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    sink_column = sinks.float().to(scores.device).view(h, 1, 1).expand(h, lq, 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_case(backend: type[AttentionBackend], case: Case, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d, dv = case.block_size, case.num_kv_heads, case.head_size, case.value_head_size
    batch = case.batch
    blocks_per_req = [math.ceil((c + q) / bs) for c, q in batch]
    num_blocks = sum(blocks_per_req) + 3
    # Shuffled block ids so a backend that assumes contiguous pages fails.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids, pos = [], 0
    for n in blocks_per_req:
        block_ids.append(perm[pos:pos + n])
        pos += n

    cache_dtype = backend.get_kv_cache_dtype(case.kv_cache_dtype, case.dtype)
    value_size = value_size_kwargs(case)
    kv_cache = torch.randn(backend.get_kv_cache_shape(num_blocks, bs, hkv, d, **value_size),
                           generator=gen).to(cache_dtype).to(device)
    # K/V of every token of every request; the context part is written into the cache below.
    full_k = [torch.randn(c + q, hkv, d, generator=gen).to(case.dtype) for c, q in batch]
    full_v = [torch.randn(c + q, hkv, dv, generator=gen).to(case.dtype) for c, q in batch]
    queries = [torch.randn(q, case.num_heads, d, generator=gen).to(case.dtype) for _, q in batch]
    k_scale, v_scale = case.kv_scales
    # What the cache holds for each K/V row, and what attention reads back from it.
    stored_k = [_stored(k, k_scale, cache_dtype) for k in full_k]
    stored_v = [_stored(v, v_scale, cache_dtype) for v in full_v]
    read_k = [_read(k, k_scale, case.dtype) for k in stored_k]
    read_v = [_read(v, v_scale, case.dtype) for v in stored_v]
    k_view, v_view = backend.kv_cache_views(kv_cache, **value_size)
    for ids, (c, _), k, v in zip(block_ids, batch, stored_k, stored_v, strict=True):
        for t in range(c):
            blk, off = ids[t // bs], t % bs
            k_view[blk, off] = k[t].to(device)
            v_view[blk, off] = v[t].to(device)

    num_prefills = sum(1 for _, q in batch if q > 1)
    max_blocks = max(blocks_per_req) + 2
    table = BlockTable(len(batch), max_blocks)
    for row, ids in enumerate(block_ids):
        table.add_row(row, ids)
    # The CSR page indices only for a backend that says it reads them, as in the engine.
    common_builder = CommonMetadataBuilder(len(batch), sum(q for _, q in batch), max_blocks,
                                           bs, device, csr=backend.reads_paged_kv_indices)
    common = common_builder.build(
        rows=np.arange(len(batch)),
        num_computed=np.array([c for c, _ in batch], dtype=np.int32),
        num_scheduled=np.array([q for _, q in batch], dtype=np.int32),
        num_prefills=num_prefills, block_table=table.table, spans=_spans(case))
    if case.spans is not None:
        assert common.attend_limit is not None, "the case's spans change no token's limit"
    scale = d ** -0.5
    layer = case.layer(scale)
    config = BuilderConfig.for_layer(layer, bs, len(batch), common.num_actual_tokens,
                                     max_blocks, device)
    metadata = backend.get_builder_cls()(config).build(common)
    impl = backend.get_impl_cls()(layer)
    impl.bind_kv_scales(k_scale, v_scale)
    # Drawn last, so the other data of a case are the same with and without sinks.
    sinks = None
    if case.sinks:
        sinks = (torch.randn(case.num_heads, generator=gen) * case.sink_std).to(case.dtype)
        impl.bind_sinks(sinks.to(device))
    query = torch.cat(queries).to(device)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, batch, strict=True)]).to(device)
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, batch, strict=True)]).to(device)
    out = impl.forward(query, key, value, kv_cache, metadata)
    assert out.shape == (len(query), case.num_heads, dv)

    tol = 1e-5 if case.dtype == torch.float32 else 2e-2
    start = 0
    sinks_matter = []
    for i, (c, q) in enumerate(batch):
        spans = case.spans[i] if case.spans is not None else ()
        ref = reference_attention(queries[i], read_k[i], read_v[i], c, scale,
                                  case.sliding_window, case.logits_soft_cap, sinks, spans)
        # A span that reaches past one of the request's new tokens must change its output, else
        # a backend that ignored the spans could pass.
        if any(s <= p < e - 1 for s, e in spans for p in range(c, c + q)):
            causal = reference_attention(queries[i], read_k[i], read_v[i], c, scale,
                                         case.sliding_window, case.logits_soft_cap, sinks)
            assert not torch.allclose(causal, ref, rtol=tol, atol=tol), \
                f"request {i}: its spans change nothing: the case proves nothing"
        if sinks is not None:
            sinks_matter.append(_sinks_matter(ref, queries[i], read_k[i], read_v[i], c, scale,
                                              case, tol))
        got = out[start:start + q].float().cpu()
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol,
                                   msg=lambda m, i=i: f"request {i} {batch[i]}: {m}")
        start += q
    # Else a backend that ignored the sinks could pass. In float32 every request must show
    # them; in half precision one is enough: over a long context a sink's share of the softmax
    # can stay below bf16's tolerance.
    if sinks_matter:
        assert (all if case.dtype == torch.float32 else any)(sinks_matter), \
            "the sinks change these requests by less than the tolerance: the case proves nothing"
    # The new tokens' K/V landed in their slots (an fp8 cache's scaled and rounded as torch
    # rounds: to nearest even).
    for ids, (c, q), k, v in zip(block_ids, batch, stored_k, stored_v, strict=True):
        for t in range(c, c + q):
            blk, off = ids[t // bs], t % bs
            torch.testing.assert_close(k_view[blk, off].float().cpu(), k[t].float(),
                                       rtol=0, atol=0)
            torch.testing.assert_close(v_view[blk, off].float().cpu(), v[t].float(),
                                       rtol=0, atol=0)


def _spans(case: Case) -> BidirectionalSpans | None:
    if case.spans is None:
        return None
    flat = [(i, s, e) for i, spans in enumerate(case.spans) for s, e in spans]
    req, start, end = (np.array(col, dtype=np.int64) for col in zip(*flat, strict=True))
    return BidirectionalSpans(req, start, end)


def _stored(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows as a cache of `cache_dtype` holds them: an fp8 cache x / scale, rounded."""
    if cache_dtype == x.dtype:
        return x
    return (x.float() / scale).to(cache_dtype)


def _read(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values attention reads back from `stored` rows, in float32 for the reference."""
    if stored.dtype == dtype:
        return stored
    return stored.float() * scale



def _sinks_matter(ref: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  context_len: int, scale: float, case: Case, tol: float) -> bool:
    without = reference_attention(q, k, v, context_len, scale, case.sliding_window,
                                  case.logits_soft_cap)
    return not torch.allclose(without, ref, rtol=tol, atol=tol)
