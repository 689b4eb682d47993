"""LFM2 (`Lfm2ForCausalLM` checkpoints): a hybrid of short-convolution and attention layers, as
`config.layer_types` lists them ("conv" / "full_attention").

A conv layer projects its input to B, C, x, convolves B * x causally over a short window (the
SHORT_CONV backend's state slot holds the last L - 1 inputs), gates the result by C and
projects it out. An attention layer is Qwen3's (RMSNorm of each head's q and k, rotary, paged
attention). Every layer has a pre-norm SwiGLU MLP; the final norm is called `embedding_norm`.
Attention layers are numbered among themselves and conv layers among themselves (their caches'
indices). The arithmetic follows transformers' modeling code, so float32 greedy outputs agree.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.layer import Attention
from pagedserve.attention.mamba.short_conv import ShortConvLayer
from pagedserve.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from pagedserve.models.llama import _FUSED, LlamaAttention, LlamaForCausalLM


def _intermediate_size(config: PretrainedConfig) -> int:
    """transformers' Lfm2MLP width: 2/3 of intermediate_size, times block_ffn_dim_multiplier
    rounded up to block_multiple_of, when block_auto_adjust_ff_dim."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2MLP(nn.Module):
    """w2(silu(w1 x) * w3 x), w1 and w3 fused as gate_up_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = _intermediate_size(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Lfm2ShortConv(nn.Module):
    def __init__(self, config: PretrainedConfig, state_idx: int) -> None:
        super().__init__()
        hidden, length = config.hidden_size, config.conv_L_cache
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=config.conv_bias)
        # Depthwise: weight [hidden, 1, L] as in checkpoints; only its parameters are used.
        self.conv = nn.Conv1d(hidden, hidden, length, groups=hidden, bias=config.conv_bias,
                              padding=length - 1)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.conv_bias)
        self.short_conv = ShortConvLayer(hidden, length, state_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        y = self.short_conv.conv(b * x, self.conv.weight[:, 0], self.conv.bias)
        return self.out_proj(c * y)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int, attn_idx: int,
                 state_idx: int) -> None:
        super().__init__()
        self.is_attention = config.layer_types[index] != "conv"
        if self.is_attention:
            self.self_attn = LlamaAttention(config, attn_idx, qkv_bias=False, o_bias=False,
                                            sliding_window=None, qk_norm=True,
                                            qk_norm_eps=config.norm_eps)
        else:
            self.conv = Lfm2ShortConv(config, state_idx)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added)."""
        if residual is None:
            residual = hidden
            hidden = self.operator_norm(hidden)
        else:
            hidden, residual = self.operator_norm(hidden, residual)
        if self.is_attention:
            hidden = self.self_attn(positions, hidden, rotary)
        else:
            hidden = self.conv(hidden)
        hidden, residual = self.ffn_norm(hidden, residual)
        return self.feed_forward(hidden), residual


class Lfm2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        if len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(f"LFM2 layer_types lists {len(config.layer_types)} layers, "
                             f"num_hidden_layers is {config.num_hidden_layers}")
        unknown = set(config.layer_types) - {"conv", "full_attention"}
        if unknown:
            raise ValueError(f"LFM2 layer types {sorted(unknown)} are not supported "
                             "(conv, full_attention)")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers, num_attn, num_conv = [], 0, 0
        for i, kind in enumerate(config.layer_types):
            layers.append(Lfm2DecoderLayer(config, i, num_attn, num_conv))
            num_attn += kind != "conv"
            num_conv += kind == "conv"
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                         // config.num_attention_heads)
        self.rotary_emb = RotaryEmbedding(config, head_dim)
        # An EAGLE-3 head's taps, as LlamaModel keeps them: the residual stream entering
        # these layers, each step (none unless a head asks).
        self.tap_layers: tuple[int, ...] = ()
        self.tapped: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                self.tapped[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb)
        hidden, _ = self.embedding_norm(hidden, residual)
        return hidden


class Lfm2ForCausalLM(LlamaForCausalLM):
    """Llama's head, tying and loading (fused q/k/v and w1/w3 rows) over LFM2's stack."""

    model_cls = Lfm2Model
    fused_names = {
        **{k: v for k, v in _FUSED.items() if k.startswith(".self_attn.")},
        ".self_attn.out_proj.": (".self_attn.o_proj.", None),
        ".self_attn.q_layernorm.": (".self_attn.q_norm.", None),
        ".self_attn.k_layernorm.": (".self_attn.k_norm.", None),
        ".feed_forward.w1.": (".feed_forward.gate_up_proj.", "gate"),
        ".feed_forward.w3.": (".feed_forward.gate_up_proj.", "up"),
        ".feed_forward.w2.": (".feed_forward.down_proj.", None),
    }

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.is_attention]

    def state_layers(self) -> list[ShortConvLayer]:
        return [layer.conv.short_conv for layer in self.model.layers if not layer.is_attention]
