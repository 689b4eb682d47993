"""Llama-family decoders (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) and their Mixture-of-Experts
siblings (Mixtral, Qwen3-MoE) for the paged engine. A family is a subclass that overrides the
hooks its layers are built from (biases, windows, q/k norm, the MLP).

Tokens of every request in the step are flattened into one batch: `input_ids` [T] and
`positions` [T]; attention goes through `Attention`, which reads the step's paged cache from the
forward context. q/k/v and gate/up are fused projections; `load_weights` (`checkpoint_loading`)
takes Hugging Face names and fills the fused rows. The arithmetic follows transformers' modeling
code op for op (logits from the model-dtype matmul); the norms, rotary embedding and SiLU-and-mul
are `models/layers.py`'s (fused Triton kernels on CUDA in 16 bits).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedserve.attention.layer import Attention
from pagedserve.models.checkpoint_loading import _FUSED, CheckpointLoading
from pagedserve.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from pagedserve.models.moe import SparseMoeBlock
from pagedserve.models.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab,
)


class LlamaAttention(nn.Module):
    """q/k/v as one fused projection, an optional RMSNorm of q and k (per head: Qwen3, Gemma 3;
    over the whole projection: OLMo-2), the rotary embedding, paged attention, o_proj. The
    families set the rest: `scale` (default head_dim ** -0.5), a logit soft-cap (Gemma 2),
    learned sinks (gpt-oss), the q/k norm's eps where the config does not call it
    rms_norm_eps (LFM2)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None, qk_norm: bool = False, *,
                 norm_cls: type[nn.Module] = RMSNorm, qk_norm_per_head: bool = True,
                 scale: float | None = None, logits_soft_cap: float | None = None,
                 has_sinks: bool = False, qk_norm_eps: float | None = None) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # With tensor parallelism the heads are split over the ranks: the sizes below are this
        # rank's (the whole layer's at one rank).
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias)
        self.attn = Attention(self.num_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale,
                              self.num_kv_heads, layer_idx, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, has_sinks=has_sinks)
        self.qk_norm_per_head = qk_norm_per_head
        q_dim, k_dim = ((self.head_dim, self.head_dim) if qk_norm_per_head
                        else (self.q_size, self.kv_size))
        eps = config.rms_norm_eps if qk_norm and qk_norm_eps is None else qk_norm_eps
        self.q_norm = norm_cls(q_dim, eps) if qk_norm else None
        self.k_norm = norm_cls(k_dim, eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.qk_norm_per_head:
            # One row per head, so the fused 2-D norm kernel serves on CUDA.
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q.view(t, self.num_heads, self.head_dim),
                      k.view(t, self.num_kv_heads, self.head_dim))
        out = self.attn(q.reshape(t, self.q_size), k.reshape(t, self.kv_size), v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, act: str | None = None) -> None:
        super().__init__()
        act = act or config.hidden_act
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       config.intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=bias)
        self.act_fn = ACT2FN[act]
        self.fused_silu = act == "silu"
        # Set where down_proj reads FP8: SiLU-and-mul then emits it (`fuse_fp8_inputs`).
        self.fp8_group: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fp8_group is not None and gate_up.dim() == 2:
            from pagedserve.quantization.ops.fp8_fused import silu_and_mul_fp8

            width = gate_up.shape[-1] // 2
            return self.down_proj(silu_and_mul_fp8(
                gate_up, None if self.fp8_group == width else self.fp8_group))
        if self.fused_silu:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int,
                 family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        self.self_attn = family.make_attention(config, layer_idx)
        self.mlp = family.make_mlp(config, layer_idx)
        self.input_layernorm = family.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = family.norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): the add is
        fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fuse_fp8_inputs(self) -> int:
        """Where a projection's kernel takes FP8 input, the kernel before it (the norm,
        SiLU-and-mul) emits it: Llama's own layer only, whose norms feed the projections
        directly (a MoE block's router reads the norm's output too). Returns how many."""
        if type(self) is not LlamaDecoderLayer or type(self.self_attn) is not LlamaAttention:
            return 0
        points = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if type(self.mlp) is LlamaMLP and self.mlp.fused_silu:
            points.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        fused = 0
        for norm, proj in points:
            if type(norm) is RMSNorm:
                norm.fp8_group = proj.quant_method.input_group(proj)
                fused += norm.fp8_group is not None
        if len(points) == 2:
            down = self.mlp.down_proj
            self.mlp.fp8_group = down.quant_method.input_group(down)
            fused += self.mlp.fp8_group is not None
        return fused


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, family)
                                    for i in range(config.num_hidden_layers))
        self.norm = family.norm_cls(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(config, head_dim)
        # An EAGLE-3 head's taps: the residual stream entering these layers is kept, each
        # step, in `tapped` by layer (none unless a head asks).
        self.tap_layers: tuple[int, ...] = ()
        self.tapped: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` [T, hidden]: the step's embeddings when a vision-language model
        has written image rows over some of them (the ids are then not embedded)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                self.tapped[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb)
        hidden, _ = self.norm(hidden, residual)
        return hidden




def window_by_layer_type(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The window of a config that lists `layer_types` (Gemma, gpt-oss): sliding_attention
    layers slide over `sliding_window` keys, the others see everything."""
    sliding = config.layer_types[layer_idx] == "sliding_attention"
    return config.sliding_window if sliding else None


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    # The decoder stack; families with another layer layout (Gemma's sandwich norms) swap it.
    model_cls: type[nn.Module] = LlamaModel
    # The decoder's norms (gpt-oss scales in float32 before the cast back).
    norm_cls: type[RMSNorm] = RMSNorm
    # Checkpoint name parts that load into rows of a fused parameter.
    fused_names: dict[str, tuple[str, str]] = _FUSED
    # Quantization methods this family's layers take (`pagedserve.quantization`).
    supports_int8 = True
    supports_quantized_checkpoints = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    # Architecture differences, overridden by the families below (a family is a subclass that
    # changes some of these; its layers are built from them).
    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def o_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def sliding_window_for_layer(config: PretrainedConfig, layer_idx: int) -> int | None:
        return None

    @staticmethod
    def qk_norm(config: PretrainedConfig) -> bool:
        return False

    @staticmethod
    def has_sinks(config: PretrainedConfig) -> bool:
        return False

    @classmethod
    def make_attention(cls, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        """The layer's attention module: LlamaAttention from the hooks above (DeepSeek swaps in
        multi-head latent attention)."""
        return LlamaAttention(config, layer_idx, cls.qkv_bias(config), cls.o_bias(config),
                              cls.sliding_window_for_layer(config, layer_idx),
                              cls.qk_norm(config), has_sinks=cls.has_sinks(config))

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (the matmul in the model dtype, as
        transformers does)."""
        if self.lm_head is None:  # tied
            logits = F.linear(hidden, self.model.embed_tokens.weight)
            return gather_vocab(logits, self.config.vocab_size).float()
        return self.lm_head(hidden).float()

class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window_for_layer(config: PretrainedConfig, layer_idx: int) -> int | None:
        # transformers' Mistral mask keeps keys k with q - window < k <= q: the same convention
        # as Attention(sliding_window=...), so the value passes through unchanged.
        return getattr(config, "sliding_window", None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def o_bias(config: PretrainedConfig) -> bool:
        return False

    @staticmethod
    def sliding_window_for_layer(config: PretrainedConfig, layer_idx: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        if not getattr(config, "use_sliding_window", False) or window is None:
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        return window if layer_idx >= getattr(config, "max_window_layers", 0) else None


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's windows; RMSNorm on each head's query and key; biases only if attention_bias."""

    qkv_bias = staticmethod(LlamaForCausalLM.qkv_bias)
    o_bias = staticmethod(LlamaForCausalLM.o_bias)

    @staticmethod
    def qk_norm(config: PretrainedConfig) -> bool:
        return True


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse MLPs: every `decoder_sparse_step`-th layer not in `mlp_only_layers`
    routes each token to `num_experts_per_tok` of `num_experts` (renormalised when
    norm_topk_prob); a window, when used, covers every layer."""

    @staticmethod
    def sliding_window_for_layer(config: PretrainedConfig, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        sparse = (layer_idx not in config.mlp_only_layers and config.num_experts > 0
                  and (layer_idx + 1) % config.decoder_sparse_step == 0)
        if not sparse:
            return LlamaMLP(config)
        return SparseMoeBlock.softmax_top_k(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, renormalize=config.norm_topk_prob,
            float32_weights=False)


class MixtralForCausalLM(MistralForCausalLM):
    """Mistral with every MLP a Mixture of Experts (softmax top-k, renormalised, the weights
    kept in float32); the checkpoint calls the MLP `block_sparse_moe`."""

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock.softmax_top_k(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size, renormalize=True, float32_weights=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                             for name, tensor in weights)


# The families whose every layer splits over tensor-parallel ranks. Exact classes: a family
# built on these with layers of its own (LFM2's convolutions) is not one until its layers are
# checked and it is added here (gpt-oss, Gemma and DeepSeek, which build on this module, in
# `loader.check_tensor_parallel`).
TENSOR_PARALLEL_FAMILIES = frozenset({
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    Qwen3MoeForCausalLM, MixtralForCausalLM})
