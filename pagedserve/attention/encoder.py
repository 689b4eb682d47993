"""Encoder-only attention: a layer's type, and the varlen metadata and torch reference its
backends share.

An attention layer declares its type (`AttentionLayerConfig.attn_type`):

- `DECODER` (the default): causal over the request's cached and new tokens, its K/V written
  into the paged cache;
- `ENCODER_ONLY`: bidirectional over the request's own tokens of this step, which are all of
  its tokens (an encoder request runs whole, in one step), and no cache is read or written: the
  K/V is dropped after the layer. A `sliding_window` w on such a layer is two-sided: a query
  sees the keys within w - 1 positions of it on either side (ModernBERT's local layers,
  `local_attention` 128: w = 65), on backends with `supports_encoder_window`.

An encoder-only layer's metadata is built by its builder's `build_encoder` (default:
`EncoderMetadata`, the step's cu_seqlens and longest sequence), and its impl runs
`forward_encoder` on the packed [T, H, D] query, key and value. A backend that runs it sets
`supports_encoder_only`; the others refuse such layers at start-up by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DECODER = "decoder"
ENCODER_ONLY = "encoder_only"
ATTN_TYPES = (DECODER, ENCODER_ONLY)


def check_attn_type(attn_type: str) -> None:
    if attn_type not in ATTN_TYPES:
        raise ValueError(f"attn_type must be one of {', '.join(ATTN_TYPES)}, got {attn_type!r}")


@dataclass
class EncoderMetadata:
    """A step of encoder-only requests, packed: request i's tokens are rows
    cu_seqlens[i]..cu_seqlens[i+1]-1 of the step, and each attends to all of its own."""

    cu_seqlens: torch.Tensor  # [B+1] int32 on the device (the step's query_start_loc)
    cu_seqlens_cpu: np.ndarray  # [B+1] int32 host mirror
    max_seqlen: int
    num_reqs: int
    num_tokens: int
    causal: bool = False  # the layer's type as the kernels read it: never causal here

    @classmethod
    def from_common(cls, common: object) -> EncoderMetadata:
        """From CommonAttentionMetadata; an encoder request has nothing cached, so its query
        is its whole sequence."""
        if common.num_reqs and int(common.context_lens_cpu[:common.num_reqs].max()) > 0:
            raise ValueError("an encoder-only step has cached tokens: encoder requests run "
                             "whole, in one step")
        return cls(common.query_start_loc, common.query_start_loc_cpu, common.max_query_len,
                   common.num_reqs, common.num_actual_tokens)


def padded_grid_index(cu_seqlens: torch.Tensor, num_tokens: int, max_seqlen: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat index of each packed token in a [B * max_seqlen] grid, [B, max_seqlen] bool key
    validity), computed on the device without a host loop."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    b = len(lengths)
    owner = torch.repeat_interleave(torch.arange(b, device=cu_seqlens.device), lengths,
                                    output_size=num_tokens)
    offset = torch.arange(num_tokens, device=cu_seqlens.device) - starts[owner]
    valid = torch.arange(max_seqlen, device=cu_seqlens.device) < lengths[:, None]
    return owner * max_seqlen + offset, valid


def torch_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           md: EncoderMetadata, scale: float,
                           output: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """Bidirectional attention within each request of a packed batch, in plain torch: the
    tokens scattered into a [B, L] grid (L the longest request), two batched matmuls around a
    float32 softmax with padding keys masked. GQA groups the query heads of a KV head as rows
    of one product. query [T, H, D], key [T, Hkv, D], value [T, Hkv, Dv] -> [T, H, Dv]."""
    t, h, d = query.shape
    hkv, dv = key.shape[1], value.shape[2]
    g = h // hkv
    if output is None:
        output = query.new_empty(t, h, dv)
    if md.num_tokens == 0:
        return output
    b, lmax = md.num_reqs, md.max_seqlen
    n = md.num_tokens
    index, valid = padded_grid_index(md.cu_seqlens[:b + 1], n, lmax)

    def grid(x: torch.Tensor) -> torch.Tensor:  # [n, heads, dim] -> [B, heads, L, dim] float32
        out = x.new_zeros(b * lmax, x.shape[1], x.shape[2], dtype=torch.float32)
        out[index] = x[:n].float()
        return out.view(b, lmax, x.shape[1], x.shape[2]).transpose(1, 2)

    q = grid(query).reshape(b, hkv, g * lmax, d)  # query head kv * g + j: rows (j, position)
    k, v = grid(key), grid(value)  # [B, Hkv, L, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, G * L, L]
    visible = valid[:, None, None, :]  # [B, 1, 1, L]
    if window is not None:  # two-sided: |query - key| <= window - 1
        pos = torch.arange(lmax, device=scores.device)
        near = (pos[:, None] - pos[None, :]).abs() < window  # [L, L]
        visible = visible & near.repeat(g, 1)[None, None]  # rows (j, position)
    scores.masked_fill_(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, Hkv, G * L, Dv]
    out = out.view(b, h, lmax, dv).transpose(1, 2).reshape(b * lmax, h, dv)
    output[:n] = out[index].to(output.dtype)
    return output
