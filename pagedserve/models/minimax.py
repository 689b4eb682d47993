"""MiniMax-Text-01 (`MiniMaxForCausalLM` checkpoints): a hybrid of lightning-attention and
softmax-attention layers, as `config.layer_types` lists them ("linear_attention" /
"full_attention"), every layer's MLP a Mixture of Experts.

A lightning layer projects to q, k, v (one projection, per head [q | k | v], SiLU on all
three), runs linear attention with a per-head decay (the LINEAR_ATTN backend's state slot holds
the float32 kv state [H, D, D]; the decay rate comes from the layer's depth, `slope_rate`),
normalises the heads' outputs together (RMSNorm, eps 1e-6), gates them by sigmoid(output_gate
of the layer's input) and projects out. A full attention layer is Mistral's (rotary, optional
window). The decoder layer keeps the normed input as its residual and mixes the two with
per-kind factors: h = alpha * norm(x) + beta * mixer(norm(x)) (`*_alpha_factor`,
`*_beta_factor`), the same for the MLP, a Mixtral-style block (softmax top-k, renormalised).
Attention layers are numbered among themselves and lightning layers among themselves (their
caches' indices). The arithmetic follows transformers' modeling code, so float32 greedy
outputs agree.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.layer import Attention
from pagedserve.attention.linear.lightning_layer import LightningAttentionLayer
from pagedserve.models.layers import RMSNorm, RotaryEmbedding
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.models.moe import SparseMoeBlock

# Persistent buffers of transformers' lightning layer, derived from the config: recomputed
# here, not loaded.
_DERIVED_BUFFERS = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class MiniMaxLightningAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int, state_idx: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, _head_dim(config)
        width = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * width, bias=False)
        self.output_gate = nn.Linear(config.hidden_size, width, bias=False)
        self.out_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.norm = RMSNorm(width, 1e-6)  # transformers' default: the config sets no eps here
        self.lightning = LightningAttentionLayer(self.num_heads, self.head_dim, index,
                                                 config.num_hidden_layers, state_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = F.silu(self.qkv_proj(hidden)).view(t, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        out = self.norm(self.lightning(q, k, v).reshape(t, -1))
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * out)


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int, attn_idx: int,
                 state_idx: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.self_attn = MiniMaxLightningAttention(config, index, state_idx)
            self.attn_alpha = config.linear_attn_alpha_factor
            self.attn_beta = config.linear_attn_beta_factor
        else:
            self.self_attn = LlamaAttention(config, attn_idx, qkv_bias=False, o_bias=False,
                                            sliding_window=getattr(config, "sliding_window",
                                                                   None))
            self.attn_alpha = config.full_attn_alpha_factor
            self.attn_beta = config.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor
        self.mlp = SparseMoeBlock.softmax_top_k(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size, renormalize=True, float32_weights=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        # The residual is the normed input (transformers' MiniMax), so no fused add-and-norm.
        hidden = self.input_layernorm(hidden)
        if self.is_linear:
            mixed = self.self_attn(hidden)
        else:
            mixed = self.self_attn(positions, hidden, rotary)
        hidden = self.post_attention_layernorm(hidden * self.attn_alpha
                                               + mixed * self.attn_beta)
        return hidden * self.mlp_alpha + self.mlp(hidden) * self.mlp_beta


class MiniMaxModel(nn.Module):
    def __init__(self, config: PretrainedConfig, family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        if len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(f"MiniMax layer_types lists {len(config.layer_types)} layers, "
                             f"num_hidden_layers is {config.num_hidden_layers}")
        unknown = set(config.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"MiniMax layer types {sorted(unknown)} are not supported "
                             "(linear_attention, full_attention)")
        if config.hidden_act != "silu":
            raise ValueError(f"MiniMax hidden_act {config.hidden_act!r}: only silu")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers, num_attn, num_linear = [], 0, 0
        for i, kind in enumerate(config.layer_types):
            layers.append(MiniMaxDecoderLayer(config, i, num_attn, num_linear))
            num_linear += kind == "linear_attention"
            num_attn += kind != "linear_attention"
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, _head_dim(config))
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
        return self.norm(hidden)


class MiniMaxForCausalLM(LlamaForCausalLM):
    """Llama's head and loading (fused q/k/v rows, stacked or per-expert MoE weights) over
    MiniMax's stack; the lightning layers' decay rates are recomputed after loading."""

    model_cls = MiniMaxModel

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def state_layers(self) -> list[LightningAttentionLayer]:
        return [layer.self_attn.lightning for layer in self.model.layers if layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                             for name, tensor in weights if not name.endswith(_DERIVED_BUFFERS))
        device = self.model.embed_tokens.weight.device
        for layer in self.state_layers():
            layer.reset_slope(device)

    def _coverage_keys(self, name: str) -> list[str]:
        # A lightning layer's qkv_proj is one checkpoint tensor, not fused q/k/v shards.
        owner = name.rpartition(".qkv_proj.")[0]
        if owner and isinstance(self.get_submodule(owner), MiniMaxLightningAttention):
            return [name]
        return super()._coverage_keys(name)
