"""The attention layer a model uses: it declares what cache it needs and calls the backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.backend import AttentionImpl, AttentionLayerConfig
from pagedserve.attention.encoder import DECODER, ENCODER_ONLY, check_attn_type
from pagedserve.attention.forward_context import get_forward_context


class Attention(nn.Module):
    """query [T, H*D], key [T, Hkv*D], value [T, Hkv*D_v] in; [T, H*D_v] out. The model runner
    binds an impl of the selected backend (`bind`) and sets the step's metadata and caches
    around forward.

    has_sinks: the layer owns learned per-head sink logits `sinks` [H] (gpt-oss), a checkpoint
    weight that follows the model's dtype; `bind` hands them to the impl.
    head_size_v: the values' head size D_v when it differs from head_size (DeepSeek's expanded
    MLA prefill, MiMo-V2-Flash); None: D_v = head_size.
    attn_type: DECODER (causal, K/V into the paged cache) or ENCODER_ONLY (bidirectional over
    the request's own tokens; no cache: attention/encoder.py).
    bidirectional_spans: the model's image tokens attend to each other both ways (Gemma 3; set
    by the model after construction): only backends that honour the step's `attend_limit` run
    the layer."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 layer_idx: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, has_sinks: bool = False,
                 head_size_v: int | None = None, attn_type: str = DECODER) -> None:
        super().__init__()
        check_attn_type(attn_type)
        self.attn_type = attn_type
        self.num_heads = num_heads
        self.head_size = head_size
        self.head_size_v = head_size if head_size_v is None else head_size_v
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks: nn.Parameter | None = (nn.Parameter(torch.zeros(num_heads)) if has_sinks
                                           else None)
        # An fp8 cache's per-tensor K/V scales, from the checkpoint where it carries them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.impl: AttentionImpl | None = None
        self.layer_config: AttentionLayerConfig | None = None
        # Where the layer finds its metadata in the forward context: its configuration, or
        # (cache group, configuration) when the model's layers form several KV cache groups.
        self.metadata_key: object = None
        self.bidirectional_spans = False

    def config(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> AttentionLayerConfig:
        return AttentionLayerConfig(self.num_heads, self.num_kv_heads, self.head_size, dtype,
                                    self.sliding_window, self.logits_soft_cap, kv_cache_dtype,
                                    self.scale, has_sinks=self.sinks is not None,
                                    head_size_v=self.head_size_v, attn_type=self.attn_type,
                                    bidirectional_spans=self.bidirectional_spans)

    def bind(self, impl: AttentionImpl, layer_config: AttentionLayerConfig,
             metadata_key: object = None) -> None:
        if self.sinks is not None:
            # The parameter itself: weights loaded into it in place stay visible to the impl.
            impl.bind_sinks(self.sinks)
        impl.bind_kv_scales(self.k_scale, self.v_scale)
        self.impl = impl
        self.layer_config = layer_config
        self.metadata_key = layer_config if metadata_key is None else metadata_key

    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """A checkpoint's `k_scale` or `v_scale` (one value for the layer: the cache holds
        K / k_scale); a per-head scale is refused by name rather than averaged."""
        if tensor.numel() != 1:
            raise ValueError(f"layer {self.layer_idx}: {which} has shape {tuple(tensor.shape)}; "
                             "only per-tensor KV-cache scales are supported")
        setattr(self, which, float(tensor.float().item()))
        if self.impl is not None:
            self.impl.bind_kv_scales(self.k_scale, self.v_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.impl is None:
            raise RuntimeError("attention layer has no backend bound")
        ctx = get_forward_context()
        if ctx.attention_hook is not None:  # a piecewise graph's split point
            return ctx.attention_hook(self, query, key, value)
        t = query.shape[0]
        if self.attn_type == ENCODER_ONLY:  # no cache: the layer has none
            out = self.impl.forward_encoder(
                query.view(t, self.num_heads, self.head_size),
                key.view(t, self.num_kv_heads, self.head_size),
                value.view(t, self.num_kv_heads, self.head_size_v),
                ctx.attn_metadata[self.metadata_key])
            return out.reshape(t, self.num_heads * self.head_size_v)
        out = self.impl.forward(
            query.view(t, self.num_heads, self.head_size),
            key.view(t, self.num_kv_heads, self.head_size),
            value.view(t, self.num_kv_heads, self.head_size_v),
            ctx.kv_caches[self.layer_idx],
            ctx.attn_metadata[self.metadata_key],
        )
        return out.reshape(t, self.num_heads * self.head_size_v)
