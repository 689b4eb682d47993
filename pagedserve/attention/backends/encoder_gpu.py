"""The encoder-only layers (attention/encoder.py) of FLASH_ATTN and FLASHINFER: the non-causal
varlen calls of their kernels over the step's packed Q/K/V, no cache. The kernels are imported
lazily, inside the calls (a CPU install lists every backend). Not run in CI (no GPU): their
tests are marked gpu and compare with the float32 torch reference."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.encoder import EncoderMetadata


def flash_attn_encoder(implementation: str, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, md: EncoderMetadata, scale: float,
                       output: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """FlashAttention's varlen forward with causal=False, cu_seqlens for both Q and K; a
    window as (w - 1, w - 1). Without `output`, the kernel's own output is returned when it
    covers every row (a pooling step's: no padding), not copied into a new tensor: a pass over
    [T, H, D] less a layer."""
    n = md.num_tokens
    if output is None and (n == 0 or n != query.shape[0]):
        output = torch.empty_like(query)
    if n == 0:
        return output
    q, k, v = query[:n], key[:n], value[:n]
    cu, longest = md.cu_seqlens[:md.num_reqs + 1], md.max_seqlen
    if implementation == "torch":
        extra = {} if window is None else {"window_size_left": window - 1,
                                           "window_size_right": window - 1}
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0,
                                                      False, False, scale=scale, **extra)[0]
    else:
        module = {"fa3": "flash_attn_interface", "fa2": "flash_attn",
                  "fa4": "flash_attn.cute"}[implementation]
        fn = importlib.import_module(module).flash_attn_varlen_func
        extra = {} if window is None else {"window_size": (window - 1, window - 1)}
        out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                 max_seqlen_k=longest, softmax_scale=scale, causal=False, **extra)
        out = out[0] if isinstance(out, tuple) else out
    if output is None:
        return out
    output[:n].copy_(out)
    return output


@dataclass
class RaggedEncoderMetadata(EncoderMetadata):
    wrapper: Any = None  # FlashInfer's ragged prefill wrapper, planned for this step


class FlashInferEncoderBuilder:
    """Mixed into FlashInfer's builder: its encoder-only steps plan FlashInfer's ragged
    prefill wrapper (Q and K/V packed alike by cu_seqlens) with causal=False, once per step."""

    def build_encoder(self, common: Any) -> RaggedEncoderMetadata:
        base = EncoderMetadata.from_common(common)
        c = self.config
        if getattr(self, "_ragged", None) is None:
            self._ragged = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, "NHD")
        indptr = torch.from_numpy(base.cu_seqlens_cpu[:base.num_reqs + 1].copy())
        self._ragged.plan(indptr, indptr, c.num_heads, c.num_kv_heads, c.head_size,
                          causal=False, sm_scale=c.softmax_scale, q_data_type=c.dtype,
                          kv_data_type=c.dtype)
        return RaggedEncoderMetadata(base.cu_seqlens, base.cu_seqlens_cpu, base.max_seqlen,
                                     base.num_reqs, base.num_tokens, wrapper=self._ragged)


class FlashInferEncoderImpl:
    """Mixed into FlashInfer's impl: the planned ragged wrapper's run over the packed tokens."""

    supports_encoder_only = True

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_metadata: RaggedEncoderMetadata,
                        output: torch.Tensor | None = None) -> torch.Tensor:
        n = attn_metadata.num_tokens
        if output is None and n and n == query.shape[0]:  # every row: the kernel's own output
            return attn_metadata.wrapper.run(query, key, value)
        if output is None:
            output = query.new_empty(query.shape[0], self.num_heads, self.value_head_size)
        if n:
            output[:n] = attn_metadata.wrapper.run(query[:n], key[:n], value[:n])
        return output
