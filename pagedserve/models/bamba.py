"""Bamba (`BambaForCausalLM` checkpoints): a decoder whose layers are Mamba-2 mixers except those
`attn_layer_indices` names, which are grouped-query attention with a partial rotary embedding
(transformers fixes `partial_rotary_factor` at 0.5: the first half of each head turns). Every
layer: pre-norm mixer or attention, residual add, pre-norm SwiGLU MLP (`feed_forward`), residual
add, all in the model dtype as transformers does.

The attention layers are `Attention` layers indexed 0..Na-1 among themselves (paged K/V), the
mixers `Mamba2Layer`s indexed 0..Ns-1 (state slots, the MAMBA2 backend); the runner binds both.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.layers import RMSNorm, RotaryEmbedding, build_rope_caches
from pagedserve.models.llama import LlamaAttention, LlamaMLP
from pagedserve.models.mamba2 import Mamba2Mixer, check_activation, copy_weights


def attention_layer_ids(config: PretrainedConfig) -> set[int]:
    return set(getattr(config, "attn_layer_indices", None) or [])


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_idx: int | None, state_idx: int | None
                 ) -> None:
        """One of `attn_idx` (this layer's index among the attention layers) and `state_idx`
        (among the Mamba-2 mixers)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = LlamaMLP(config)
        self.self_attn = self.mamba = None
        if attn_idx is not None:
            bias = bool(getattr(config, "attention_bias", False))
            self.self_attn = LlamaAttention(config, attn_idx, bias, bias, None)
        else:
            self.mamba = Mamba2Mixer(
                config.hidden_size, config.mamba_n_heads, config.mamba_d_head,
                config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                config.mamba_chunk_size, tuple(config.time_step_limit),
                config.mamba_proj_bias, config.mamba_conv_bias, config.rms_norm_eps, state_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.self_attn is not None:
            hidden = hidden + self.self_attn(positions, normed, rotary)
        else:
            hidden = hidden + self.mamba(normed)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class BambaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        attn = attention_layer_ids(config)
        layers, num_attn, num_state = [], 0, 0
        for i in range(config.num_hidden_layers):
            if i in attn:
                layers.append(BambaDecoderLayer(config, num_attn, None))
                num_attn += 1
            else:
                layers.append(BambaDecoderLayer(config, None, num_state))
                num_state += 1
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, getattr(config, "head_dim", None) or head_dim)
        # An EAGLE-3 head's taps, as LlamaModel keeps them: the stream entering these layers,
        # each step (none unless a head asks).
        self.tap_layers: tuple[int, ...] = ()
        self.tapped: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                self.tapped[i] = hidden
            hidden = layer(positions, hidden, self.rotary_emb)
        return self.final_layernorm(hidden)


# Hugging Face parameter -> (our fused parameter, its rows).
_FUSED = {".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
          ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
          ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
          ".feed_forward.gate_proj.": (".feed_forward.gate_up_proj.", "gate"),
          ".feed_forward.up_proj.": (".feed_forward.gate_up_proj.", "up")}


class BambaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_activation(config)
        self.config = config
        self.model = BambaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names; q/k/v and gate/up go into the rows of their fused projection.
        Every parameter (each fused part) must be covered."""
        fused: dict[str, dict[str, torch.Tensor]] = {}
        plain = []
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            part = next((p for p in _FUSED if p in name), None)
            if part is None:
                plain.append((name, tensor))
                continue
            ours, shard = _FUSED[part]
            fused.setdefault(name.replace(part, ours), {})[shard] = tensor
        for target, shards in fused.items():
            order = ("q", "k", "v") if ".qkv_proj." in target else ("gate", "up")
            missing = [s for s in order if s not in shards]
            if missing:
                raise ValueError(f"checkpoint lacks the {', '.join(missing)} part of {target!r}")
            plain.append((target, torch.cat([shards[s] for s in order])))
        copy_weights(self, plain, skip_head=self.lm_head is None)
        for layer in self.model.layers:
            if layer.mamba is not None:
                layer.mamba.finish_loading()
        emb = self.model.embed_tokens.weight
        build_rope_caches(self, emb.device, emb.dtype)
