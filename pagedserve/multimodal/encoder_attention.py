"""Attention inside a vision tower: bidirectional within each image (or window), packed
varlen over the step's images, no KV cache. It runs through an attention backend's encoder
path (`forward_encoder`, attention/encoder.py), the decoder's backend when that one has it.

`EncoderAttention` is not the decoder's `Attention` module on purpose: the model runner binds
every `Attention` to the KV cache and the step's metadata, while a tower runs between steps
on metadata of its own, built here from the images' lengths (`EncoderAttentionBinding`)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import AttentionLayerConfig, BuilderConfig
from pagedserve.attention.encoder import ENCODER_ONLY
from pagedserve.device import to_device_async

logger = logging.getLogger(__name__)


class _PackedSequences:
    """The fields of CommonAttentionMetadata an encoder metadata builder reads
    (`EncoderMetadata.from_common`), for sequences with nothing cached."""

    def __init__(self, seq_lens: np.ndarray, device: torch.device) -> None:
        cu = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=cu[1:])
        self.query_start_loc_cpu = cu
        self.query_start_loc = to_device_async(torch.from_numpy(cu), device)
        self.num_reqs = len(seq_lens)
        self.num_actual_tokens = int(cu[-1])
        self.max_query_len = int(seq_lens.max()) if len(seq_lens) else 0
        self.context_lens_cpu = np.zeros(len(seq_lens), dtype=np.int32)


class EncoderAttentionBinding:
    """One backend's encoder path for a tower's layers: the impl per layer configuration and
    the builder that turns sequence lengths into its metadata."""

    def __init__(self, backend: Any, layer: AttentionLayerConfig, device: torch.device,
                 max_tokens: int) -> None:
        self.backend = backend
        self.device = device
        self.impl = backend.get_impl_cls()(layer)
        # Block size, requests and blocks per request size a builder's paged buffers, which
        # an encoder layer never reads: the least each may be.
        self.builder = backend.get_builder_cls()(BuilderConfig.for_layer(
            layer, 16, 1, max_tokens, 1, device))

    def metadata(self, seq_lens: list[int] | np.ndarray) -> Any:
        """Metadata for packed sequences of these lengths, each attending only to itself."""
        lens = np.asarray(seq_lens, dtype=np.int32)
        return self.builder.build_encoder(_PackedSequences(lens, self.device))


class EncoderAttention(nn.Module):
    """query [T, H*D], key and value [T, H*D] of packed sequences -> [T, H*D]; `md` from
    `EncoderAttentionBinding.metadata` (the tower builds it once per call, every layer reads
    it)."""

    def __init__(self, num_heads: int, head_size: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.binding: EncoderAttentionBinding | None = None

    def layer_config(self, dtype: torch.dtype) -> AttentionLayerConfig:
        return AttentionLayerConfig(self.num_heads, self.num_heads, self.head_size, dtype,
                                    scale=self.scale, attn_type=ENCODER_ONLY)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                md: Any) -> torch.Tensor:
        if self.binding is None:
            raise RuntimeError("encoder attention has no backend bound (bind_encoder_attention)")
        t, h, d = query.shape[0], self.num_heads, self.head_size
        out = self.binding.impl.forward_encoder(query.view(t, h, d), key.view(t, h, d),
                                                value.view(t, h, d), md)
        return out.reshape(t, h * d)


def bind_encoder_attention(model: nn.Module, decoder_backend: Any, device: torch.device,
                           dtype: torch.dtype, max_tokens: int) -> Any | None:
    """Bind every EncoderAttention of `model`: through the decoder's backend when it can run
    them, else through the backend the selector picks for these layers (logged).
    Returns the backend used (None: the model has no such layers)."""
    from pagedserve.attention.registry import select_backend

    layers = [m for m in model.modules() if isinstance(m, EncoderAttention)]
    if not layers:
        return None
    configs = [m.layer_config(dtype) for m in layers]
    backend = decoder_backend
    # The decoder's backend when it runs these layers (an encoder path, the tower's head
    # size: Qwen3-VL's 72 is not among TRITON's), else the selector's choice for them.
    problems = sorted({r for c in set(configs)
                       for r in backend.validate_configuration(c, 16, device)})
    if problems:
        backend = select_backend(None, device, configs, 16)
        logger.info("vision encoder attention: backend %s (%s: %s)", backend.get_name(),
                    decoder_backend.get_name(), "; ".join(problems))
    bindings: dict[AttentionLayerConfig, EncoderAttentionBinding] = {}
    for module, config in zip(layers, configs, strict=True):
        if config not in bindings:
            bindings[config] = EncoderAttentionBinding(backend, config, device, max_tokens)
        module.binding = bindings[config]
    return backend
