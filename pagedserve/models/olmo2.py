"""OLMo-2: Llama's attention and MLP with the norms moved after them (each sub-block's output
is normed, then added to the residual stream; no norm before), and q/k RMSNorm over the whole
projection rather than per head. Its norms scale in float32 before the cast back.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.layers import Float32ScaledRMSNorm, RotaryEmbedding
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int,
                 family: type[Olmo2ForCausalLM]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, layer_idx, family.qkv_bias(config), family.o_bias(config), None,
            qk_norm=True, norm_cls=Float32ScaledRMSNorm, qk_norm_per_head=False)
        self.mlp = LlamaMLP(config)
        eps = config.rms_norm_eps
        self.post_attention_layernorm = Float32ScaledRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Float32ScaledRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, rotary))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, family: type[Olmo2ForCausalLM]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i, family)
                                    for i in range(config.num_hidden_layers))
        self.norm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, self.layers[0].self_attn.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, self.rotary_emb)
        return self.norm(hidden)


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
