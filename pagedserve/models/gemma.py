"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP inside "sandwich" norms (each
sub-block's output is normed before it joins the residual stream), the embedding scaled by
sqrt(hidden_size), GeGLU, RMSNorm weights stored as weight - 1, and alternating local
(sliding-window) and global layers. Gemma 2 soft-caps attention logits and final logits; Gemma 3
norms each head's query and key and gives local and global layers their own rope.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.layers import GemmaRMSNorm, RotaryEmbedding
from pagedserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    window_by_layer_type,
)
from pagedserve.models.parallel import VocabParallelEmbedding, gather_vocab


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int,
                 family: type[Gemma2ForCausalLM]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, layer_idx, family.qkv_bias(config), family.o_bias(config),
            family.sliding_window_for_layer(config, layer_idx), family.qk_norm(config),
            norm_cls=GemmaRMSNorm, scale=config.query_pre_attn_scalar ** -0.5,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None))
        self.mlp = LlamaMLP(config, act=config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, family: type[Gemma2ForCausalLM]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, family)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        rope_types = [family.rope_layer_type(config, i) for i in range(len(self.layers))]
        self.rotary_embs = nn.ModuleDict(
            {str(kind): RotaryEmbedding(config, head_dim, kind) for kind in set(rope_types)})
        self._rope_of_layer = [str(kind) for kind in rope_types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, scaled; as transformers, the scale is rounded to the model
        dtype first."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` [T, hidden]: the step's embeddings with image rows written over
        some of them (Gemma 3's vision model: the ids are then not embedded)."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer, rope in zip(self.layers, self._rope_of_layer, strict=True):
            hidden = layer(positions, hidden, self.rotary_embs[rope])
        return self.norm(hidden)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel

    sliding_window_for_layer = staticmethod(window_by_layer_type)

    @staticmethod
    def rope_layer_type(config: PretrainedConfig, layer_idx: int) -> str | None:
        """Which rope settings a layer rotates with: one for every layer here."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits soft-capped (cap * tanh(logits / cap)) in the model dtype, as
        transformers does, then float32. Under tensor parallelism the cap applies to the
        gathered logits (it is per element, so before or after the gather is the same)."""
        if self.lm_head is None:  # tied: this rank's vocabulary rows, gathered
            logits = gather_vocab(F.linear(hidden, self.model.embed_tokens.weight),
                                  self.config.vocab_size)
        else:
            logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder: five local layers to one global by default (`layer_types`),
    each kind with its own rope base (and scaling on the global layers), q/k norms."""

    @staticmethod
    def qk_norm(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def rope_layer_type(config: PretrainedConfig, layer_idx: int) -> str | None:
        return config.layer_types[layer_idx]
