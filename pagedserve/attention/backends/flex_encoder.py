"""FLEX_ATTENTION's encoder-only layers (attention/encoder.py): one flex call with batch 1
over the step's packed tokens, with a document mask (a query sees every key of its own
request, none of another's). The builder plans the mask once per step (`encoder_metadata`);
the impl (`encoder_forward`) hands flex the new Q/K/V as they are, no cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.encoder import EncoderMetadata

_TILE = 128


@dataclass
class FlexEncoderMetadata(EncoderMetadata):
    token_req: torch.Tensor | None = None  # [T] int64, each packed token's request
    block_mask: Any = None


def encoder_metadata(common: Any, flex: Any, window: int | None = None) -> FlexEncoderMetadata:
    base = EncoderMetadata.from_common(common)
    n, b = base.num_tokens, base.num_reqs
    device = base.cu_seqlens.device
    lengths = base.cu_seqlens[1:b + 1].long() - base.cu_seqlens[:b].long()
    token_req = torch.repeat_interleave(torch.arange(b, device=device), lengths, output_size=n)
    md = FlexEncoderMetadata(base.cu_seqlens, base.cu_seqlens_cpu, base.max_seqlen, b, n,
                             token_req=token_req)
    if n == 0:
        return md
    mask = document_mask(md, window)
    if device.type != "cpu":
        md.block_mask = flex.create_block_mask(mask, None, None, n, n, device=device,
                                               BLOCK_SIZE=_TILE)
    else:  # eager flex applies the mask_mod to every pair: list every tile
        tiles = -(-n // _TILE)
        num = torch.full((1, 1, tiles), tiles, dtype=torch.int32)
        idx = torch.arange(tiles, dtype=torch.int32).expand(1, 1, tiles, tiles)
        md.block_mask = flex.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=_TILE,
                                                      mask_mod=mask, seq_lengths=(n, n),
                                                      compute_q_blocks=False)
    return md


def document_mask(md: FlexEncoderMetadata, window: int | None
                  ) -> Callable[..., torch.Tensor]:
    """Same request; with a window, within window - 1 tokens either side (a request's tokens
    are contiguous, so packed distance is position distance)."""
    def same_request(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
        return md.token_req[q_idx] == md.token_req[kv_idx]

    def windowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return same_request(b, h, q_idx, kv_idx) & ((q_idx - kv_idx).abs() < window)

    return same_request if window is None else windowed


def encoder_forward(attend: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    md: FlexEncoderMetadata, output: torch.Tensor) -> torch.Tensor:
    """`attend`: the impl's flex call (q, k, v, block_mask, kernel_options, enable_gqa)."""
    n = md.num_tokens
    if n == 0:
        return output
    q = query[:n].transpose(0, 1)[None]  # [1, H, n, D]
    k = key[:n].transpose(0, 1)[None]
    v = value[:n].transpose(0, 1)[None]
    out, _ = attend(q, k, v, md.block_mask, None, enable_gqa=q.shape[1] != k.shape[1])
    output[:n] = out[0].transpose(0, 1)
    return output
