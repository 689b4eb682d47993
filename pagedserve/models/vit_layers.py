"""The pre-norm ViT encoder that CLIP's and SigLIP's vision towers share (LLaVA's and Gemma 3's
towers): x + attn(LN(x)), then x + mlp(LN(x)), with the checkpoints' own names (`layers.N`,
`self_attn.{q,k,v,out}_proj`, `mlp.fc1/fc2`, `layer_norm1/2`). Attention is bidirectional
within each image, through the attention backend's encoder path
(multimodal/encoder_attention.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedserve.multimodal.encoder_attention import EncoderAttention


class ViTAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        head = h // heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)
        self.attn = EncoderAttention(heads, head, head ** -0.5)

    def forward(self, x: torch.Tensor, md: Any) -> torch.Tensor:
        return self.out_proj(self.attn(self.q_proj(x), self.k_proj(x), self.v_proj(x), md))


class ViTMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]  # CLIP's quick_gelu, SigLIP's tanh GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTEncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = ViTAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = ViTMLP(config)

    def forward(self, x: torch.Tensor, md: Any) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), md)
        return x + self.mlp(self.layer_norm2(x))


class ViTEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViTEncoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
