"""gpt-oss: a pre-norm decoder with biased q/k/v/o, learned attention sinks (a per-head logit
in every softmax denominator), alternating sliding-window and full layers, YaRN rope, and a
Mixture of Experts in every layer: a biased router whose softmax runs over the top-k logits,
experts with biases and a clamped SwiGLU. Norms scale in float32 before the cast back.

transformers stores the experts transposed with gate and up interleaved column by column
(gate_up_proj [E, H, 2I], down_proj [E, I, H]); `load_weights` turns them into our stacked
row layout ([E, 2I, H] gate rows then up rows, [E, H, I]). The MXFP4 checkpoints OpenAI
publishes (`*_blocks`/`*_scales`) are not read: dequantise them to bf16 first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.layers import Float32ScaledRMSNorm
from pagedserve.models.llama import LlamaForCausalLM, window_by_layer_type
from pagedserve.models.moe import ExpertActivation, FusedMoE, SparseMoeBlock, TopKSoftmaxRouter


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate, up alternating -> [..., 2I] gate half then up half."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


class GptOssForCausalLM(LlamaForCausalLM):
    norm_cls = Float32ScaledRMSNorm

    sliding_window_for_layer = staticmethod(window_by_layer_type)

    @staticmethod
    def has_sinks(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_idx: int) -> nn.Module:
        # Older transformers (5.17) keep alpha in the experts, not in the config.
        activation = ExpertActivation("swiglu_clamped", getattr(config, "swiglu_alpha", 1.702),
                                      config.swiglu_limit)
        experts = FusedMoE(config.num_local_experts, config.hidden_size,
                           config.intermediate_size, activation, bias=True)
        router = TopKSoftmaxRouter(config.hidden_size, config.num_local_experts,
                                   config.num_experts_per_tok)
        return SparseMoeBlock(router, experts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._our_layout(weights))

    @staticmethod
    def _our_layout(weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(("_blocks", "_scales")):
                raise ValueError(f"checkpoint tensor {name!r} is MXFP4-quantised; pagedserve "
                                 f"reads gpt-oss in bf16 or float32 (dequantise it first)")
            name = name.replace(".mlp.router.", ".mlp.gate.")
            name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
            if name.endswith(".experts.gate_up_proj"):
                tensor = _deinterleave(tensor).transpose(1, 2)
            elif name.endswith(".experts.gate_up_proj_bias"):
                tensor = _deinterleave(tensor)
            elif name.endswith(".experts.down_proj"):
                tensor = tensor.transpose(1, 2)
            yield name, tensor
