"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): Qwen2.5-VL's plan with another tower and
DeepStack, on the Qwen3 decoder with interleaved M-RoPE.

The tower, as transformers' Qwen3VLVisionModel: patch embedding (the Conv3d as a linear, with
bias), a learned square table of position embeddings resampled bilinearly (align_corners) to
each image's grid, blocks of LayerNorm / the 2D-rotary attention of Qwen2.5-VL (full
attention over each image, no windows) / a GELU MLP, and the merger. DeepStack: after the
blocks in `deepstack_visual_indexes` a merger of its own (normed after the 2x2 shuffle) gives
a second, third, ... row per image token, added to the decoder's residual stream after its
first, second, ... layer at that token.

The runner moves one row per image token (multimodal/runner.py), so `embed_multimodal`
returns the merger's row and the DeepStack rows side by side ([n, (1 + k) * hidden]) and
`embed_input_ids` pads text tokens with zeros to that width: a step with images hands the
decoder [T, (1 + k) * hidden] embeddings, which it splits. Steps without images (decodes,
CUDA graphs) carry the plain [T, hidden] or none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedserve.device import to_device_async
from pagedserve.models.llama import LlamaModel, Qwen3ForCausalLM
from pagedserve.models.mrope_rotary import MRotaryEmbedding
from pagedserve.models.qwen2_5_vl import (
    QwenVisionHooks,
    VisionSelfAttention,
    image_cu_seqlens,
    patch_coordinates,
    tie_head,
    tower_metadata,
    vision_rotary,
)

_EPS = 1e-6  # the tower's LayerNorms


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.LayerNorm(dim, eps=_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=_EPS)
        self.attn = VisionSelfAttention(config)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(dim, config.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(config.intermediate_size, dim)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                md: Any) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, md)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (over one patch, or over the 2x2 shuffle for DeepStack's), the 2x2 patches
    side by side, Linear-GELU-Linear."""

    def __init__(self, config: PretrainedConfig, norm_after_shuffle: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_shuffle = norm_after_shuffle
        self.norm = nn.LayerNorm(self.width if norm_after_shuffle else config.hidden_size,
                                 eps=_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (self.norm(x.view(-1, self.width)) if self.norm_after_shuffle
             else self.norm(x).view(-1, self.width))
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        dim = config.hidden_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, dim)  # the Conv3d, flattened
        self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
        self.side = int(config.num_position_embeddings ** 0.5)
        self.head_dim = dim // config.num_heads
        self.rope_theta = (config.rope_parameters or {}).get("rope_theta", 10000.0)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, norm_after_shuffle=False)
        self.deepstack_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, norm_after_shuffle=True) for _ in self.deepstack_indexes)

    def forward(self, pixel_values: torch.Tensor, grids: np.ndarray) -> torch.Tensor:
        """pixel_values [patches, C*2*p*p] -> [patches / 4, (1 + k) * out_hidden_size]: the
        merger's rows, then each DeepStack merger's."""
        device = pixel_values.device
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(weight.dtype))
        rows, cols = (to_device_async(torch.from_numpy(a), device)
                      for a in patch_coordinates(grids, self.merge))
        x = x + self._position_embeddings(rows, cols, grids).to(x.dtype)
        cos_sin = vision_rotary(rows, cols, self.head_dim, self.rope_theta)
        md = tower_metadata(self.blocks, image_cu_seqlens(grids))
        stacked = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, md)
            if i in self.deepstack_indexes:
                stacked.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *stacked], dim=-1)

    def _position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor,
                             grids: np.ndarray) -> torch.Tensor:
        """The learned side x side table resampled bilinearly (align_corners) at each patch:
        four taps, weights in float32 as transformers computes them."""
        sizes = grids.prod(axis=1)
        heights = to_device_async(torch.from_numpy(np.repeat(grids[:, 1], sizes)), rows.device)
        widths = to_device_async(torch.from_numpy(np.repeat(grids[:, 2], sizes)), rows.device)
        h_taps, h_weights = self._axis(rows, heights)
        w_taps, w_weights = self._axis(cols, widths)
        taps = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(taps) * weights[:, :, None]).sum(1)

    def _axis(self, index: torch.Tensor, size: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (self.side - 1) / torch.clamp(size - 1, min=1)
        floor = torch.floor(src)
        offsets = torch.arange(2, device=index.device)
        taps = (floor.long()[:, None] + offsets).clamp(0, self.side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights


class Qwen3VLTextModel(LlamaModel):
    """The Qwen3 stack; `inputs_embeds` wider than the model carries DeepStack rows, added to
    the residual stream after the first layers."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        width = self.embed_tokens.weight.shape[1]
        stacked = None
        if inputs_embeds is None:
            hidden = self.embed_tokens(input_ids)
        else:
            hidden = inputs_embeds
            if inputs_embeds.shape[1] > width:  # contiguous rows for the fused kernels
                hidden = inputs_embeds[:, :width].contiguous()
                stacked = inputs_embeds[:, width:].unflatten(1, (-1, width))  # [T, k, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:  # an EAGLE-3 head's taps (LlamaModel's)
                self.tapped[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb)
            if stacked is not None and i < stacked.shape[1]:
                # The stream, then the rows added, as transformers rounds; the next norm
                # then starts from it (no residual pending).
                hidden, residual = hidden + residual + stacked[:, i], None
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3VLForConditionalGeneration(QwenVisionHooks, Qwen3ForCausalLM):
    model_cls = Qwen3VLTextModel
    supports_int8 = False
    supports_quantized_checkpoints = False

    def __init__(self, config: PretrainedConfig) -> None:
        text = config.text_config
        super().__init__(text)
        self.hf_config = config
        tie_head(self, config)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.model.rotary_emb = MRotaryEmbedding(text, head_dim, interleaved=True)
        self.visual = Qwen3VisionTransformer(config.vision_config)
        self.num_stacked = len(self.visual.deepstack_indexes)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, (1 + k) * hidden]: the token embeddings, zeros where DeepStack rows go."""
        embeds = self.model.embed_tokens(input_ids)
        return torch.cat([embeds, embeds.new_zeros(embeds.shape[0],
                                                   self.num_stacked * embeds.shape[1])], 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)
