"""DeepSeek-V2 and V3: Llama's pre-norm decoder with multi-head latent attention and, after the
first `first_k_dense_replace` dense layers, Mixture-of-Experts MLPs with grouped routing and
shared experts (`moe.SparseMoeBlock.deepseek`).

Attention: the query comes from q_proj, or through a low-rank q_a_proj -> RMSNorm -> q_b_proj
(q_lora_rank); kv_a_proj_with_mqa gives the latent c (normed) and the shared rope key k_pe,
which is all the cache keeps (`attention.mla`). The rope part of q and k rotates interleaved
pairs (DeepSeek's layout): we gather the even then the odd channels and rotate halves, which
gives the same dot products as transformers' interleaved rotation. YaRN's mscale enters the
softmax scale as in transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.mla import MLAAttention
from pagedserve.distributed import tp_world_size
from pagedserve.models.layers import RMSNorm, RotaryEmbedding, rope_parameters
from pagedserve.models.llama import _FUSED, LlamaForCausalLM, LlamaMLP
from pagedserve.models.moe import SparseMoeBlock
from pagedserve.models.parallel import ColumnParallelLinear, RowParallelLinear, divide

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _softmax_scale(config: PretrainedConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): rotate-half layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekAttention(nn.Module):
    """Under tensor parallelism each rank holds its share of the query heads: q_proj / q_b_proj
    and kv_b_proj split by heads, o_proj by its inputs (one all-reduce). The latent
    projections (q_a_proj, kv_a_proj_with_mqa) are whole on every rank, and so is the cache:
    every head reads the same latent, as in vLLM."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.num_heads = divide(heads, tp_world_size(), "attention heads")  # this rank's
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.head_dim = self.rope  # what the rotary embedding rotates
        v_dim = config.v_head_dim
        q_dim = heads * (self.nope + self.rope)
        bias = bool(getattr(config, "attention_bias", False))
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, q_dim)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
            # transformers builds the two latent norms with their default eps, not the config's.
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_dim)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.rope,
                                            bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.o_proj = RowParallelLinear(heads * v_dim, config.hidden_size, bias=bias)
        # V2 always rotates interleaved pairs; V3 unless its config says otherwise.
        self.interleaved = getattr(config, "rope_interleave", True)
        kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + v_dim))
        self.attn = MLAAttention(self.num_heads, self.nope, self.rope, v_dim, self.kv_lora_rank,
                                 _softmax_scale(config), layer_idx, kv_b_proj)

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        t = hidden.shape[0]
        q_nope, q_pe = self._query(hidden).view(t, self.num_heads, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = rotary(positions, q_pe.contiguous(),
                            k_pe.reshape(t, 1, self.rope).contiguous())
        query = torch.cat([q_nope, q_pe], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_pe.view(t, self.rope)], dim=-1)
        return self.o_proj(self.attn(query, latent))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    # The CPU int8 path does not cover multi-head latent attention (its absorbed kv_b_proj).
    supports_int8 = False
    # Gate and up (dense and shared experts) load into one fused projection; q/k/v are not
    # fused here (`q_proj` is the whole query).
    fused_names = {
        **{hf: ours for hf, ours in _FUSED.items() if ".mlp." in hf},
        ".mlp.shared_experts.gate_proj.": (".mlp.shared_experts.gate_up_proj.", "gate"),
        ".mlp.shared_experts.up_proj.": (".mlp.shared_experts.gate_up_proj.", "up"),
    }

    @classmethod
    def make_attention(cls, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return DeepseekAttention(config, layer_idx)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return LlamaMLP(config)
        return SparseMoeBlock.deepseek(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._our_names(weights))

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= num_layers:
                continue  # the multi-token-prediction layers after the decoder: not served
            # The latent up-projection belongs to the MLA layer, which hands it to its backend.
            yield name.replace(".self_attn.kv_b_proj.", ".self_attn.attn.kv_b_proj."), tensor

    def hf_names(self, prefix: str) -> list[str]:
        return super().hf_names(prefix.replace(".self_attn.attn.kv_b_proj",
                                               ".self_attn.kv_b_proj"))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """V2: softmax routing, greedy or group-limited (`moe.SparseMoeBlock.deepseek` reads
    `topk_method`); the same latent attention."""
