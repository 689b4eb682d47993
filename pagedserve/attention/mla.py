"""Multi-head latent attention (DeepSeek-V2/V3, Kimi): the layer a model calls, and what it asks
of a backend.

A token's cache entry is one vector, not per-head K and V: the normed latent c (kv_lora_rank) and
the rotated shared key part k_pe (qk_rope_head_dim), e.g. 512 + 64 values where a GQA layer of the
same width would hold 2 x heads x head_size. Keys and values are recovered through the layer's
up-projection kv_b_proj [heads * (nope + v), kv_lora_rank]: per head, k_nope = W_UK c and
v = W_UV c, and the score is q_nope . k_nope + q_pe . k_pe. A backend either expands the cached
latents into per-head keys and values (prefill; the reference) or absorbs W_UK into the query
and W_UV into the output, attending over the latents themselves (decode).

The layer owns kv_b_proj (loaded under the attention module's Hugging Face name by the model),
so the backend's impl gets it at bind time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.attention.backend import AttentionImpl, AttentionLayerConfig
from pagedserve.attention.forward_context import get_forward_context
from pagedserve.attention.layer import Attention


@dataclass(frozen=True)
class MLALayerConfig(AttentionLayerConfig):
    """An MLA layer: the cache holds one row of `head_size` = kv_lora_rank + qk_rope_head_dim
    values per token (num_kv_heads 1); queries have num_heads heads of nope + rope, outputs
    num_heads heads of v_head_dim."""

    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def mla_dims(self) -> tuple[int, int, int, int]:
        """(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), for builders."""
        return (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                self.v_head_dim)


def is_mla(layer: AttentionLayerConfig) -> bool:
    return isinstance(layer, MLALayerConfig)


class MLAAttention(Attention):
    """query [T, H, nope + rope] (rope part rotated), latent [T, kv_lora_rank + rope] (the
    normed c and the rotated k_pe) in; [T, H * v_head_dim] out."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float, layer_idx: int,
                 kv_b_proj: nn.Linear | None = None) -> None:
        """num_heads: this layer's (under tensor parallelism, this rank's) query heads;
        kv_b_proj: their rows of the up-projection (a model passes its column-parallel split),
        by default a plain linear of num_heads * (nope + v) rows."""
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, 1, layer_idx)
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        rows = num_heads * (qk_nope_head_dim + v_head_dim)
        if kv_b_proj is None:
            kv_b_proj = nn.Linear(kv_lora_rank, rows, bias=False)
        if (kv_b_proj.in_features, kv_b_proj.out_features) != (kv_lora_rank, rows):
            raise ValueError(f"kv_b_proj is [{kv_b_proj.out_features}, "
                             f"{kv_b_proj.in_features}]; {num_heads} heads of latent rank "
                             f"{kv_lora_rank} need [{rows}, {kv_lora_rank}]")
        self.kv_b_proj = kv_b_proj

    def config(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> MLALayerConfig:
        return MLALayerConfig(self.num_heads, 1, self.head_size, dtype, None, None,
                              kv_cache_dtype, self.scale, kv_lora_rank=self.kv_lora_rank,
                              qk_nope_head_dim=self.qk_nope_head_dim,
                              qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)

    def bind(self, impl: AttentionImpl, layer_config: AttentionLayerConfig,
             metadata_key: object = None) -> None:
        if not isinstance(impl, MLAImpl):
            raise TypeError(f"{type(impl).__name__} cannot run multi-head latent attention")
        impl.bind_kv_b_proj(self.kv_b_proj.weight)
        super().bind(impl, layer_config, metadata_key)

    def forward(self, query: torch.Tensor, latent: torch.Tensor,  # type: ignore[override]
                value: torch.Tensor | None = None) -> torch.Tensor:
        if self.impl is None:
            raise RuntimeError("attention layer has no backend bound")
        ctx = get_forward_context()
        t = query.shape[0]
        out = self.impl.forward(query, latent.view(t, 1, self.head_size), None,
                                ctx.kv_caches[self.layer_idx], ctx.attn_metadata[self.metadata_key])
        return out.reshape(t, self.num_heads * self.v_head_dim)


class MLAImpl(AttentionImpl):
    """An impl of MLA layers: `forward(query [T, H, nope + rope], latent [T, 1, L + R], None,
    cache, metadata) -> [T, H, v_head_dim]` writes the latents into the cache through the slot
    mapping, then attends."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        super().__init__(layer)  # refuses what no impl of this class runs (sinks, ...)
        if not isinstance(layer, MLALayerConfig):
            raise ValueError(f"{type(self).__name__} runs multi-head latent attention layers "
                             "only")
        self.kv_lora_rank = layer.kv_lora_rank
        self.qk_nope_head_dim = layer.qk_nope_head_dim
        self.qk_rope_head_dim = layer.qk_rope_head_dim
        self.v_head_dim = layer.v_head_dim
        self._kv_b_proj: torch.Tensor | None = None

    def bind_kv_b_proj(self, weight: torch.Tensor) -> None:
        """The layer's up-projection [H * (nope + v), kv_lora_rank], the parameter itself (so
        weights loaded into it later are seen)."""
        self._kv_b_proj = weight

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]) as views of kv_b_proj."""
        if self._kv_b_proj is None:
            raise RuntimeError("MLA layer run before its kv_b_proj was bound")
        w = self._kv_b_proj.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                 self.kv_lora_rank)
        return w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
