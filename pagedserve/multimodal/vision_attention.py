"""Attention inside a vision tower: bidirectional within each packed sequence (an image, or a
window of one), through the attention backend's encoder-only path (attention/encoder.py).

A tower's layers are not the decoder's `Attention` layers: they keep no cache, read no step
metadata, and their sequences (images, windows of patches) are the tower's own, given as
cu_seqlens at each call. The runner binds the step backend's encoder impl and builder to them
(`bind_vision_attention`); unbound (a model built outside an engine, as in tests) they run
the plain-torch varlen reference, which is also what the CPU backend runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.attention.encoder import ENCODER_ONLY, EncoderMetadata, torch_varlen_attention


class VisionAttention(nn.Module):
    """The attention step of a vision block: packed q, k, v [N, H, D] -> [N, H, D]."""

    def __init__(self, num_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.impl: Any = None
        self.builder: Any = None

    def layer_config(self, dtype: torch.dtype) -> Any:
        from pagedserve.attention import AttentionLayerConfig

        return AttentionLayerConfig(self.num_heads, self.num_heads, self.head_size, dtype,
                                    None, None, "auto", self.scale, attn_type=ENCODER_ONLY)

    def bind(self, impl: Any, builder: Any) -> None:
        self.impl, self.builder = impl, builder

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                seqs: VisionSeqs) -> torch.Tensor:
        md = seqs.metadata(self.builder)
        if self.impl is None:
            return torch_varlen_attention(query, key, value, md, self.scale)
        return self.impl.forward_encoder(query, key, value, md)


class VisionSeqs:
    """A tower call's packing of patches into sequences (cu_seqlens on the host), and the
    backend metadata built from it once per builder (every layer of a kind shares it)."""

    def __init__(self, cu_seqlens: np.ndarray, device: torch.device) -> None:
        self.cu_seqlens_cpu = cu_seqlens.astype(np.int32)
        self.device = device
        self._built: dict[int, Any] = {}

    def metadata(self, builder: Any) -> Any:
        key = id(builder)
        if key not in self._built:
            self._built[key] = (self._varlen() if builder is None
                                else builder.build_encoder(_CommonView(self)))
        return self._built[key]

    def _varlen(self) -> EncoderMetadata:
        cu = self.cu_seqlens_cpu
        lengths = np.diff(cu)
        return EncoderMetadata(torch.from_numpy(cu).to(self.device), cu,
                               int(lengths.max()) if len(lengths) else 0, len(lengths),
                               int(cu[-1]))


class _CommonView:
    """What a builder's `build_encoder` reads of a step's common metadata, for a tower's
    sequences: every sequence whole, nothing cached."""

    def __init__(self, seqs: VisionSeqs) -> None:
        cu = seqs.cu_seqlens_cpu
        self.num_reqs = len(cu) - 1
        self.query_start_loc_cpu = cu
        self.query_start_loc = torch.from_numpy(cu).to(seqs.device)
        self.max_query_len = int(np.diff(cu).max()) if self.num_reqs else 0
        self.num_actual_tokens = int(cu[-1])
        self.context_lens_cpu = np.zeros(self.num_reqs, dtype=np.int32)


def bind_vision_attention(model: nn.Module, backend: Any, builder_config: Any,
                          dtype: torch.dtype) -> int:
    """Bind every VisionAttention under `model` to `backend`'s encoder impl (one impl and one
    builder per layer configuration). Returns how many were bound; a backend without
    encoder-only attention is refused by name."""
    layers = [m for m in model.modules() if isinstance(m, VisionAttention)]
    if layers and not backend.get_impl_cls().supports_encoder_only:
        raise ValueError(f"attention backend {backend.get_name()} has no encoder-only "
                         "attention, which the model's vision tower needs")
    made: dict[Any, tuple[Any, Any]] = {}
    for layer in layers:
        config = layer.layer_config(dtype)
        if config not in made:
            made[config] = (backend.get_impl_cls()(config),
                            backend.get_builder_cls()(builder_config(config)))
        layer.bind(*made[config])
    return len(layers)
